//! The simulator, fitted on what this machine measured: decode iteration time, trainer
//! throughput, optimizer and sync times, response lengths and pass rates, written in the
//! simulator's own config format (`sim_measured.toml`) and run for every mode. `compare` fits it
//! on the baseline (sync) runs only, so the pipelined modes are a prediction, not a fit.
use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;

use crate::sim::{self, SimConfig};
use crate::train::{Measured, Mode, RunOutcome, StepMetrics, TrainConfig};

/// The simulator's per-step metrics for every mode, from the parameters measured in `fitted`
/// (the baseline mode's runs only).
pub fn simulate_measured(
    out: &Path,
    base: &TrainConfig,
    modes: &[Mode],
    fitted: &[&RunOutcome],
) -> anyhow::Result<Vec<(Mode, Vec<StepMetrics>)>> {
    anyhow::ensure!(
        !fitted.is_empty(),
        "no baseline run to fit the simulator on"
    );
    let mut rows = Vec::new();
    let mut all = Measured::default();
    for o in fitted {
        merge_measured(&mut all, &o.measured);
    }
    let first = &fitted[0].metrics;
    let (mut acc0, mut acc1) = (
        first.first().map(|m| m.train_accuracy).unwrap_or(0.5),
        first.last().map(|m| m.train_accuracy).unwrap_or(0.5),
    );
    // The simulator draws pass/fail rewards from the profile's pass rate, and its timing
    // depends on that rate only through how many groups have mixed rewards (trainable) or
    // equal ones (filtered, replaced by new draws). A task's reward can vary where its pass rate
    // does not (a format penalty tells malformed from wrong answers), so the rate given to the
    // simulator is the one that reproduces the measured share of trainable groups.
    let (trained, scored) = fitted
        .iter()
        .flat_map(|o| o.metrics.iter())
        .fold((0u64, 0u64), |(t, n), m| {
            (t + m.trained as u64, n + (m.trained + m.filtered) as u64)
        });
    if scored > 0 {
        let share = trained as f64 / scored as f64;
        let p = effective_pass_rate(
            share,
            u32::from(base.rl.group_size),
            BETA_K,
            (acc0 + acc1) / 2.0,
        );
        (acc0, acc1) = (p, p);
    }
    let sim_toml = simulator_config(base, &all, acc0, acc1, modes)?;
    let sim_path = out.join("sim_measured.toml");
    std::fs::write(&sim_path, &sim_toml)?;
    let sim_cfg = SimConfig::load(&[(sim_path.display().to_string(), sim_toml)], &[])
        .context("the measured simulator config")?;
    for &mode in modes {
        let s = sim::simulate(&sim_cfg, "measured", "measured", mode, false)?;
        let ms: Vec<StepMetrics> = s
            .result
            .steps
            .iter()
            .map(|st| StepMetrics {
                step: st.step,
                rollout_s: st.rollout(),
                train_busy_s: st.trainer_busy,
                timing: st.timing(),
                ..StepMetrics::default()
            })
            .collect();
        rows.push((mode, ms));
    }
    Ok(rows)
}

fn merge_measured(a: &mut Measured, b: &Measured) {
    a.decode.extend(&b.decode);
    a.verify_s.extend(&b.verify_s);
    a.micro_batches.extend(&b.micro_batches);
    a.opt_s.extend(&b.opt_s);
    a.sync_s.extend(&b.sync_s);
    a.prompt_tokens.extend(&b.prompt_tokens);
    a.response_tokens.extend(&b.response_tokens);
    a.slots = b.slots;
    a.engines = b.engines;
}

/// The profile's Beta concentration (`beta_k`): not measured, the simulator's estimate.
const BETA_K: f64 = 1.5;

/// Share of groups of `g` samples whose pass/fail rewards are not all equal when each prompt's
/// pass probability is drawn from Beta(p·k, (1 − p)·k), as the simulator's workload draws them:
/// `1 − E[θ^g] − E[(1 − θ)^g]`.
fn mixed_share(p: f64, g: u32, k: f64) -> f64 {
    let (a, b) = (p * k, (1.0 - p) * k);
    let moment = |x: f64| {
        (0..g)
            .map(|i| (x + i as f64) / (a + b + i as f64))
            .product::<f64>()
    };
    1.0 - moment(a) - moment(b)
}

/// The pass rate whose [`mixed_share`] is `share`, on the side of 1/2 that `acc` (the measured
/// accuracy) is on. The share grows with p up to p = 1/2, so bisection finds it; a share above
/// what p = 1/2 gives is met as closely as possible, by 1/2.
fn effective_pass_rate(share: f64, g: u32, k: f64, acc: f64) -> f64 {
    let (mut lo, mut hi) = (0.0f64, 0.5f64);
    for _ in 0..60 {
        let mid = (lo + hi) / 2.0;
        if mixed_share(mid, g, k) < share {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let p = (lo + hi) / 2.0;
    if acc > 0.5 { 1.0 - p } else { p }
}

/// Least-squares line `y = a + b x`.
fn fit(points: &[(f64, f64)]) -> (f64, f64) {
    let n = points.len() as f64;
    if points.is_empty() {
        return (0.0, 0.0);
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let b = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    (my - b * mx, b)
}

/// [`fit`] with the intercept held at zero or above: a cost line's fixed part cannot be
/// negative, and clamping a negative intercept to zero afterwards would keep the slope that
/// assumed it, overstating every cost (least squares through the origin instead).
fn fit_nonneg(points: &[(f64, f64)]) -> (f64, f64) {
    let (a, b) = fit(points);
    if a >= 0.0 {
        return (a, b);
    }
    let sxx: f64 = points.iter().map(|p| p.0 * p.0).sum();
    let sxy: f64 = points.iter().map(|p| p.0 * p.1).sum();
    (0.0, if sxx > 0.0 { sxy / sxx } else { 0.0 })
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// What the simulator's config is fitted to: decode iteration time, micro-batch time, and the
/// response and prompt lengths.
struct Fitted {
    base_ms: f64,
    per_seq_ms: f64,
    mb_overhead: f64,
    per_tok: f64,
    mean_len: f64,
    sigma: f64,
    runaway: f64,
    prompt: f64,
}

fn fitted(cfg: &TrainConfig, m: &Measured) -> Fitted {
    let decode: Vec<(f64, f64)> = m.decode.iter().map(|&(r, s)| (r as f64, s * 1e3)).collect();
    let (base_ms, per_seq_ms) = fit_nonneg(&decode);
    let mbs: Vec<(f64, f64)> = m
        .micro_batches
        .iter()
        .map(|&(_, all, s)| (all as f64, s))
        .collect();
    let (mb_overhead, per_tok) = fit_nonneg(&mbs);
    let lens: Vec<f64> = m.response_tokens.iter().map(|&t| t.max(1) as f64).collect();
    let mean_len = mean(&lens).max(1.0);
    let logs: Vec<f64> = lens.iter().map(|l| l.ln()).collect();
    let ml = mean(&logs);
    let sigma =
        (logs.iter().map(|l| (l - ml).powi(2)).sum::<f64>() / logs.len().max(1) as f64).sqrt();
    let cap = cfg.rl.max_new_tokens as f64;
    let runaway = lens.iter().filter(|&&l| l >= cap).count() as f64 / lens.len().max(1) as f64;
    let prompt = mean(
        &m.prompt_tokens
            .iter()
            .map(|&t| t as f64)
            .collect::<Vec<_>>(),
    )
    .round()
    .max(1.0);
    Fitted {
        base_ms,
        per_seq_ms,
        mb_overhead,
        per_tok,
        mean_len,
        sigma,
        runaway,
        prompt,
    }
}

/// The measured parameters in the simulator's config format (docs/simulator.md).
pub fn simulator_config(
    cfg: &TrainConfig,
    m: &Measured,
    acc_start: f64,
    acc_late: f64,
    modes: &[Mode],
) -> anyhow::Result<String> {
    let f = fitted(cfg, m);
    let mut s = String::new();
    write_system(&mut s, cfg, m, &f, modes)?;
    write_workload(&mut s, cfg, &f, acc_start, acc_late)?;
    Ok(s)
}

/// `[run]`, `[rollout]` and `[trainer]`.
fn write_system(
    s: &mut String,
    cfg: &TrainConfig,
    m: &Measured,
    f: &Fitted,
    modes: &[Mode],
) -> std::fmt::Result {
    let Fitted {
        base_ms,
        per_seq_ms,
        ..
    } = *f;
    writeln!(
        s,
        "# Measured by `rolloutpipe compare` on this machine (see docs/training.md)."
    )?;
    writeln!(
        s,
        "# Decode: {} iterations fitted; micro-batches: {}; verifier: {} responses.",
        m.decode.len(),
        m.micro_batches.len(),
        m.verify_s.len()
    )?;
    writeln!(
        s,
        "[run]\nseed = {}\nsteps = {}\nprofiles = [\"measured\"]\nsettings = [\"measured\"]",
        cfg.run.seed, cfg.run.steps
    )?;
    let names: Vec<String> = modes.iter().map(|m| format!("\"{}\"", m.name())).collect();
    writeln!(s, "modes = [{}]\ntrace_step = 0\n", names.join(", "))?;
    writeln!(
        s,
        "[rollout]\nengines = {}\nmax_running = {}",
        cfg.rollout.engines, cfg.rollout.slots
    )?;
    writeln!(
        s,
        "kv_capacity_tokens = 100000000  # the CPU engine has no KV limit that binds"
    )?;
    writeln!(s, "kv_new_token_ratio = 0.0")?;
    writeln!(
        s,
        "decode_base_ms = {:.6}  # fitted: iteration time vs running requests",
        base_ms.max(1e-6)
    )?;
    writeln!(s, "decode_per_seq_ms = {:.6}", per_seq_ms.max(0.0))?;
    writeln!(
        s,
        "decode_per_kilo_kv_ms = 0.0  # not separable from per-sequence cost at these lengths"
    )?;
    writeln!(
        s,
        "prefill_tok_per_s = 1e9  # prefill is inside the measured iteration times"
    )?;
    writeln!(s, "verifier_latency_s = {:.9}", mean(&m.verify_s))?;
    writeln!(
        s,
        "routing = \"central\"  # train's engines pull from the core's one admission queue"
    )?;
    writeln!(
        s,
        "abort_s = 0.0  # train aborts in-process (the core's poll_abort), no server round trip\n"
    )?;
    write_trainer(s, m, f)
}

/// `[trainer]`: the fitted micro-batch cost line, the optimizer step and the weight sync.
fn write_trainer(s: &mut String, m: &Measured, f: &Fitted) -> std::fmt::Result {
    let Fitted {
        mb_overhead,
        per_tok,
        ..
    } = *f;
    writeln!(s, "[trainer]\ngpus = 1")?;
    writeln!(
        s,
        "fwd_bwd_tok_per_s_per_gpu = {:.3}  # fitted: micro-batch time vs prompt+response tokens",
        if per_tok > 0.0 { 1.0 / per_tok } else { 1e9 }
    )?;
    writeln!(
        s,
        "logprob_tok_per_s_per_gpu = 1e9\nlogprob_passes = 0  # log-probs are recomputed inside the same forward pass"
    )?;
    writeln!(s, "micro_batch_overhead_s = {:.6}", mb_overhead.max(0.0))?;
    writeln!(s, "optimizer_step_s = {:.6}", mean(&m.opt_s))?;
    writeln!(s, "weight_sync_s = {:.6}", mean(&m.sync_s))?;
    writeln!(
        s,
        "data_transfer_s_per_mtok = 0.0  # samples reach the trainer in-process, no Ray put\n"
    )?;
    Ok(())
}

/// `[scheduler]`, `[profile.measured]` and `[setting.measured]`.
fn write_workload(
    s: &mut String,
    cfg: &TrainConfig,
    f: &Fitted,
    acc_start: f64,
    acc_late: f64,
) -> std::fmt::Result {
    let Fitted {
        mean_len,
        sigma,
        runaway,
        prompt,
        ..
    } = *f;
    let clampacc = |a: f64| a.clamp(0.01, 0.99);
    let order = &cfg.rollout.submit_order;
    writeln!(
        s,
        "[scheduler]\nfrontier_width = {}\nsubmit_order = \"{order}\"\nmax_attempts = {}\nmax_groups_factor = {}\nexpected_filter = {}\n",
        cfg.rollout.frontier_width,
        cfg.rollout.max_attempts,
        cfg.rollout.max_groups_factor,
        cfg.rollout.expected_filter
    )?;
    writeln!(
        s,
        "[profile.measured]\nlabel = \"{} (measured)\"\nprompt_tokens = {}",
        cfg.task.name, prompt as u32
    )?;
    writeln!(
        s,
        "mean_tokens_start = {mean_len:.3}\nmean_tokens_late = {mean_len:.3}\nsigma = {sigma:.4}\nrunaway = {:.4}",
        runaway.min(0.99)
    )?;
    writeln!(
        s,
        "acc_start = {:.4}  # the pass rate that gives the measured share of trainable groups\nacc_late = {:.4}\nbeta_k = {BETA_K}  # est. (not measured)\nwrong_length_factor = 1.0  # not measured\n",
        clampacc(acc_start),
        clampacc(acc_late)
    )?;
    writeln!(
        s,
        "[setting.measured]\nbatch = {}\ngroup = {}\ncap = {}\nmax_running = {}\nmicro_batch = {}\ndraw_batch = {}\nopt_steps = {}",
        cfg.rl.batch_groups,
        cfg.rl.group_size,
        cfg.rl.max_new_tokens,
        cfg.rollout.slots,
        cfg.rl.micro_batch,
        cfg.rollout.draw_batch,
        cfg.rl.opt_steps
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixed_share_matches_the_beta_bernoulli_moments() {
        // G = 2, p = 1/2, k = 1.5: a = b = 0.75, E[θ²] = 0.75·1.75 / (1.5·2.5) = 0.35,
        // so 1 − 2·0.35 = 0.3 of the groups have mixed rewards.
        assert!((mixed_share(0.5, 2, 1.5) - 0.3).abs() < 1e-12);
        // A sure pass or fail never mixes; more samples mix more often.
        assert!(mixed_share(1e-9, 8, 1.5) < 1e-6);
        assert!(mixed_share(0.3, 8, 1.5) > mixed_share(0.3, 4, 1.5));
    }

    #[test]
    fn effective_pass_rate_inverts_the_mixed_share_on_the_accuracy_side() {
        for p in [0.02, 0.1, 0.3, 0.45] {
            let share = mixed_share(p, 8, BETA_K);
            assert!(
                (effective_pass_rate(share, 8, BETA_K, 0.1) - p).abs() < 1e-9,
                "{p}"
            );
            // the same share above 1/2 when the measured accuracy is there
            assert!((effective_pass_rate(share, 8, BETA_K, 0.9) - (1.0 - p)).abs() < 1e-9);
        }
        // a share above what p = 1/2 can give is met by 1/2
        assert!((effective_pass_rate(0.99, 8, BETA_K, 0.2) - 0.5).abs() < 1e-9);
    }

    #[test]
    fn a_negative_intercept_refits_through_the_origin() {
        // y = 2x exactly: the free fit is exact; shifted data whose free intercept is negative
        // gets the least-squares slope through the origin, Σxy/Σxx.
        let exact = [(1.0, 2.0), (2.0, 4.0), (3.0, 6.0)];
        assert_eq!(fit_nonneg(&exact), fit(&exact));
        let pts = [(1.0, 0.5), (2.0, 2.5), (3.0, 4.5)]; // free fit: y = -1.5 + 2x
        assert!(fit(&pts).0 < 0.0);
        let (a, b) = fit_nonneg(&pts);
        assert_eq!(a, 0.0);
        assert!((b - (0.5 + 5.0 + 13.5) / 14.0).abs() < 1e-12);
    }
}
