//! `rolloutpipe simulate --alloc`: the allocation policies side by side under CGP+FGD.
//!
//! For every selected (profile, setting) it simulates mode `rolloutpipe` (CGP+FGD) four times:
//! plain GRPO (fixed G, no over-sampling: `scheduler.max_groups_factor = 1`), a DAPO-style
//! filter (fixed G with the configured over-sampling), VIGOR and Pilot-Commit (both at the
//! fixed-G step's budget of B × G samples unless `alloc.budget` says otherwise, with the
//! configured over-sampling; by default n0 = n_pilot = n_commit = G/2 and increment = G/4 of
//! each setting, `--alloc-unscaled` keeps `[alloc]`'s values). The simulator has no model of learning, so it reports what
//! scheduling decides: time per step, rollouts per step and trained samples per step. The
//! time-to-accuracy column combines those with rollouts-to-target ratios measured by real
//! training runs (`--rollouts-to-target POLICY=RATIO`, each policy's rollouts to the target
//! accuracy over fixed G's): time-to-target = rollouts-to-target × seconds per rollout.
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, bail, ensure};

use crate::alloc::AllocPolicy;
use crate::sim::config::{Mode, SimConfig};
use crate::sim::{RunResult, simulate};

/// The four rows of each setting: (row name, `alloc.policy`, with over-sampling).
pub const POLICIES: [(&str, AllocPolicy, bool); 4] = [
    ("grpo", AllocPolicy::Fixed, false),
    ("dapo", AllocPolicy::Fixed, true),
    ("vigor", AllocPolicy::Vigor, true),
    ("pilot_commit", AllocPolicy::PilotCommit, true),
];

/// One (profile, setting, policy) result.
#[derive(Debug, Clone)]
pub struct AllocRow {
    /// Profile key.
    pub profile: String,
    /// Setting key.
    pub setting: String,
    /// Row name (`grpo`, `dapo`, `vigor`, `pilot_commit`).
    pub policy: String,
    /// The run.
    pub result: RunResult,
}

impl AllocRow {
    /// Mean time per step (train end to train end), s.
    pub fn period(&self) -> f64 {
        self.result.mean_period()
    }

    /// Seconds of step time per rollout.
    pub fn s_per_rollout(&self) -> f64 {
        self.period() / self.result.mean_rollouts().max(1e-9)
    }
}

/// Parses `POLICY=RATIO` pairs.
pub fn parse_ratios(pairs: &[String]) -> anyhow::Result<Vec<(String, f64)>> {
    pairs
        .iter()
        .map(|p| {
            let (k, v) = p
                .split_once('=')
                .with_context(|| format!("--rollouts-to-target {p:?}: expected POLICY=RATIO"))?;
            let k = k.trim();
            ensure!(
                POLICIES.iter().any(|(n, _, _)| *n == k),
                "--rollouts-to-target {p:?}: policy {k:?} is not one of grpo, dapo, vigor, pilot_commit"
            );
            let r: f64 = v
                .trim()
                .parse()
                .with_context(|| format!("--rollouts-to-target {p:?}: {v:?} is not a number"))?;
            ensure!(
                r.is_finite() && r > 0.0,
                "--rollouts-to-target {p:?}: the ratio must be a positive number"
            );
            Ok((k.to_owned(), r))
        })
        .collect()
}

/// Simulates every selected (profile, setting) under the four policies (on `threads` threads).
/// With `scale`, each setting's policy parameters are set from its G (see the body); without,
/// `cfg.alloc`'s are used as they are.
pub fn run_policies(cfg: &SimConfig, threads: usize, scale: bool) -> anyhow::Result<Vec<AllocRow>> {
    let mut work = Vec::new();
    for p in &cfg.run.profiles {
        for s in &cfg.run.settings {
            for (name, policy, oversample) in POLICIES {
                let mut c = cfg.clone();
                // Only this setting: `validate` checks [alloc] against every setting's B and G.
                c.setting.retain(|k, _| k == s);
                c.run.settings = vec![s.clone()];
                c.alloc.policy = policy;
                if policy == AllocPolicy::Fixed {
                    // Fixed G has no step budget (`[alloc]` refuses one): its rows spend
                    // max_groups × G, whatever `alloc.budget` the other rows use.
                    c.alloc.budget = 0;
                }
                if scale {
                    // The same shape at every G: VIGOR n0 = G/2 then 2 rounds of G/4 (its
                    // budget B x G allows every group both rounds); Pilot-Commit G/2 + G/2.
                    let g = cfg.setting[s].group as u16;
                    c.alloc.n0 = (g / 2).max(2);
                    c.alloc.rounds = 2;
                    c.alloc.increment = (g / 4).max(1);
                    c.alloc.n_pilot = (g / 2).max(2);
                    c.alloc.n_commit = (g / 2).max(2);
                }
                if !oversample {
                    c.scheduler.max_groups_factor = 1.0;
                }
                c.validate()
                    .with_context(|| format!("[alloc] for {name} on {p}/{s}"))?;
                work.push((p.clone(), s.clone(), name, c));
            }
        }
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let slots: Vec<std::sync::Mutex<Option<anyhow::Result<RunResult>>>> =
        work.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|sc| {
        for _ in 0..threads.max(1).min(work.len().max(1)) {
            sc.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some((p, s, _, c)) = work.get(i) else {
                        break;
                    };
                    let r = simulate(c, p, s, Mode::Rolloutpipe, false).map(|s| s.result);
                    if let Ok(mut slot) = slots[i].lock() {
                        *slot = Some(r);
                    }
                }
            });
        }
    });
    let mut rows = Vec::new();
    for ((p, s, name, _), slot) in work.into_iter().zip(slots) {
        let r = slot
            .into_inner()
            .ok()
            .flatten()
            .with_context(|| format!("{p}/{s}/{name}: no result"))?
            .with_context(|| format!("simulating {p}/{s} with policy {name}"))?;
        if !r.conserved {
            bail!("{p}/{s}/{name}: the core's conservation check failed");
        }
        rows.push(AllocRow {
            profile: p,
            setting: s,
            policy: name.to_owned(),
            result: r,
        });
    }
    Ok(rows)
}

/// The table as Markdown and CSV. `ratios` are rollouts-to-target over fixed G's (GRPO's)
/// from real runs; without one, a row's time-to-target column is empty.
pub fn tables(rows: &[AllocRow], ratios: &[(String, f64)]) -> (String, String) {
    let mut md = String::from(
        "| profile/setting | policy | s/step | rollouts/step | trained groups/step | trained samples/step | s per 1k rollouts | time-to-target vs grpo |\n|---|---|---|---|---|---|---|---|\n",
    );
    let mut csv = String::from(
        "profile,setting,policy,s_per_step,rollouts_per_step,trained_groups_per_step,trained_samples_per_step,s_per_rollout,time_to_target_vs_grpo\n",
    );
    for r in rows {
        let base = rows
            .iter()
            .find(|b| b.profile == r.profile && b.setting == r.setting && b.policy == "grpo");
        let ratio = |name: &str| ratios.iter().find(|(n, _)| n == name).map(|(_, v)| *v);
        let tta = match (base, ratio(&r.policy), ratio("grpo").or(Some(1.0))) {
            (Some(b), Some(rp), Some(rb)) => {
                Some((rp / rb) * r.s_per_rollout() / b.s_per_rollout())
            }
            _ => None,
        };
        let steps = r.result.steps.len().max(1) as f64;
        let trained = r.result.totals().1 as f64 / steps;
        let tta_s = tta.map_or(String::new(), |v| format!("{v:.2}"));
        let _ = writeln!(
            md,
            "| {}/{} | {} | {:.1} | {:.0} | {:.1} | {:.0} | {:.2} | {} |",
            r.profile,
            r.setting,
            r.policy,
            r.period(),
            r.result.mean_rollouts(),
            trained,
            r.result.mean_trained_samples(),
            1e3 * r.s_per_rollout(),
            if tta_s.is_empty() { "-" } else { &tta_s },
        );
        let _ = writeln!(
            csv,
            "{},{},{},{:.4},{:.2},{:.3},{:.2},{:.6},{}",
            r.profile,
            r.setting,
            r.policy,
            r.period(),
            r.result.mean_rollouts(),
            trained,
            r.result.mean_trained_samples(),
            r.s_per_rollout(),
            tta_s
        );
    }
    (md, csv)
}

/// `simulate --alloc`: runs, prints and writes `alloc.md` and `alloc.csv` under `out`.
pub fn run(
    cfg: &SimConfig,
    out: &Path,
    threads: usize,
    ratio_args: &[String],
    scale: bool,
) -> anyhow::Result<()> {
    let ratios = parse_ratios(ratio_args)?;
    let rows = run_policies(cfg, threads, scale)?;
    let (md, csv) = tables(&rows, &ratios);
    print!("{md}");
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    std::fs::write(out.join("alloc.md"), &md)?;
    std::fs::write(out.join("alloc.csv"), &csv)?;
    println!("wrote {}", out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_parse_and_refuse_bad_input() {
        let r = parse_ratios(&["vigor=0.8".into()]).unwrap();
        assert_eq!(r, vec![("vigor".to_owned(), 0.8)]);
        let e = parse_ratios(&["greedy=1".into()]).unwrap_err().to_string();
        assert!(e.contains("not one of"), "{e}");
        let e = parse_ratios(&["vigor=-1".into()]).unwrap_err().to_string();
        assert!(e.contains("positive"), "{e}");
        assert!(parse_ratios(&["vigor".into()]).is_err());
    }

    #[test]
    fn every_policy_runs_and_vigor_keeps_the_budget() {
        let mut cfg = SimConfig::defaults().unwrap();
        cfg.run.steps = 2;
        cfg.run.profiles = vec!["gsm8k".into()];
        cfg.run.settings = vec!["R1".into()];
        let rows = run_policies(&cfg, 2, true).unwrap();
        assert_eq!(rows.len(), 4);
        let s = &cfg.setting["R1"];
        let budget = u64::from(s.batch) * u64::from(s.group);
        for r in &rows {
            let steps = &r.result.steps;
            assert_eq!(steps.len(), 2, "{}", r.policy);
            assert!(steps.iter().all(|m| m.rollouts > 0), "{}", r.policy);
            if r.policy == "vigor" || r.policy == "pilot_commit" {
                // The sample budget caps every response created, so rollouts too.
                assert!(
                    steps.iter().all(|m| m.rollouts <= budget),
                    "{}: {:?}",
                    r.policy,
                    steps.iter().map(|m| m.rollouts).collect::<Vec<_>>()
                );
            }
        }
        let vigor = rows.iter().find(|r| r.policy == "vigor").unwrap();
        assert!(vigor.result.steps.iter().any(|m| m.extended > 0));
        let grpo = rows.iter().find(|r| r.policy == "grpo").unwrap();
        assert!(grpo.result.steps.iter().all(|m| m.extended == 0));
        let (md, csv) = tables(&rows, &[("vigor".into(), 0.5)]);
        assert_eq!(md.lines().count(), 2 + 4);
        assert_eq!(csv.lines().count(), 1 + 4);
    }

    #[test]
    fn a_budget_applies_to_vigor_and_pilot_commit_not_to_fixed_g() {
        let mut cfg = SimConfig::defaults().unwrap();
        cfg.run.steps = 2;
        cfg.run.profiles = vec!["gsm8k".into()];
        cfg.run.settings = vec!["R1".into()];
        let s = &cfg.setting["R1"];
        // A budget of 1.5 B × G: fixed G refuses it in [alloc], so its rows drop it.
        cfg.alloc.budget = s.batch * s.group * 3 / 2;
        let e = format!("{:#}", cfg.validate().unwrap_err());
        assert!(e.contains("alloc.budget is"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        let rows = run_policies(&cfg, 2, true).unwrap();
        assert_eq!(rows.len(), 4);
    }
}
