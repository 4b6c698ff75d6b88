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
    let (acc0, acc1) = (
        first.first().map(|m| m.train_accuracy).unwrap_or(0.5),
        first.last().map(|m| m.train_accuracy).unwrap_or(0.5),
    );
    let sim_toml = simulator_config(base, &all, acc0, acc1, modes)?;
    let sim_path = out.join("sim_measured.toml");
    std::fs::write(&sim_path, &sim_toml)?;
    let sim_cfg = SimConfig::load(&[(sim_path.display().to_string(), sim_toml)], &[])
        .context("the measured simulator config")?;
    for &mode in modes {
        let sm = match mode {
            Mode::Sync => sim::Mode::Sync,
            Mode::Cgp => sim::Mode::Cgp,
            Mode::Rolloutpipe => sim::Mode::Rolloutpipe,
            Mode::OneStepOff => sim::Mode::OneStepOff,
        };
        let s = sim::simulate(&sim_cfg, "measured", "measured", sm, false)?;
        let ms: Vec<StepMetrics> = s
            .result
            .steps
            .iter()
            .map(|st| StepMetrics {
                step: st.step,
                rollout_s: st.rollout(),
                rollout_to_train_end_s: st.r2t(),
                trainer_wait_ratio: st.wait_ratio(),
                ideal_s: st.rollout() + st.last_tail,
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

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
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
    let decode: Vec<(f64, f64)> = m.decode.iter().map(|&(r, s)| (r as f64, s * 1e3)).collect();
    let (base_ms, per_seq_ms) = fit(&decode);
    let mbs: Vec<(f64, f64)> = m
        .micro_batches
        .iter()
        .map(|&(_, all, s)| (all as f64, s))
        .collect();
    let (mb_overhead, per_tok) = fit(&mbs);
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
    let clampacc = |a: f64| a.clamp(0.01, 0.99);
    let mut s = String::new();
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
    let order = &cfg.rollout.submit_order;
    writeln!(
        s,
        "[scheduler]\nfrontier_width = {}\nsubmit_order = \"{order}\"\nmax_attempts = {}\nmax_groups_factor = {}\n",
        cfg.rollout.frontier_width, cfg.rollout.max_attempts, cfg.rollout.max_groups_factor
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
        "acc_start = {:.4}\nacc_late = {:.4}\nbeta_k = 1.5  # est. (not measured)\nwrong_length_factor = 1.0  # not measured\n",
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
    Ok(s)
}
