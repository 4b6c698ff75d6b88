//! `rolloutpipe alloc-report --runs DIR`: the allocation measurement's table and plots, from
//! the run directories `DIR/<policy>-s<seed>/` that `scripts/alloc/measure.sh` writes.
//!
//! For each run it reads `metrics.jsonl` (held-out accuracy at each evaluation step, cumulative
//! rollouts, elapsed time, groups trained and filtered) and `summary.json` (accuracy at the start
//! of RL). The target accuracy should be fixed in advance (`--target`; `measure.sh` fixes it from
//! the shared SFT model before any RL run). Without it, it is set from the baseline alone,
//! before the other policies are looked at: `start + frac × (best − start)`, with `start` and
//! `best` the baseline runs' mean start and mean best held-out accuracy. A target that is not
//! above the baseline's mean start is refused (every run would reach it at 0 rollouts), and a
//! run that itself starts at or above the target is excluded and listed. A run's
//! rollouts-to-target is the cumulative rollout count at which its held-out accuracy first
//! reaches the target, interpolated linearly between evaluation points. Ratios are paired by
//! seed: baseline rollouts-to-target over the policy's (above 1 = fewer rollouts than the
//! baseline). Beside them, the share of scored groups with zero reward variance: the waste the
//! allocation policies remove, hence a bound on what they can save. Writes `alloc_report.md`,
//! `alloc_report.csv`, `alloc_curves.json` (every run's curve), `acc_vs_rollouts.svg` and
//! `acc_vs_time.svg`. Bad or degenerate input (no runs, no baseline, a non-finite accuracy) is
//! a one-line error.
use std::path::{Path, PathBuf};

use anyhow::{Context, ensure};

use crate::plot::{self, Series};
use crate::train::read_metrics;

mod table;
pub use table::{baseline_start, report};

/// Arguments of `alloc-report`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Directory holding one run directory per policy and seed, named `<policy>-s<seed>`.
    #[arg(long)]
    pub runs: PathBuf,
    /// The baseline policy's name (the ratios are against it).
    #[arg(long, default_value = "grpo")]
    pub baseline: String,
    /// Target held-out accuracy; default `start + frac × (best − start)` of the baseline.
    #[arg(long)]
    pub target: Option<f64>,
    /// Share of the baseline's mean gain that sets the default target.
    #[arg(long, default_value_t = 0.8)]
    pub frac: f64,
    /// Output directory (default: `--runs`).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// One run's curve.
#[derive(Debug, Clone)]
pub struct Curve {
    /// Policy name.
    pub policy: String,
    /// Seed.
    pub seed: u64,
    /// Held-out accuracy at the start of RL.
    pub start: f64,
    /// (cumulative rollouts, elapsed s, held-out accuracy), starting with (0, 0, start).
    pub points: Vec<(f64, f64, f64)>,
    /// Mean rollouts per step.
    pub rollouts_per_step: f64,
    /// Groups whose rewards were all equal when first scored (so no advantage): the core's
    /// filtered groups, Pilot-Commit's skipped pilots included. Summed over the run's steps.
    pub zero_variance_groups: u64,
    /// Groups scored (trained + filtered), summed over the run's steps; aborted groups (drawn
    /// by over-sampling, then not needed) were never scored and are not counted.
    pub scored_groups: u64,
}

impl Curve {
    /// Cumulative rollouts (`x = 0`) or seconds (`x = 1`) at which the accuracy first reaches
    /// `target`, interpolated linearly between evaluations; `None` if it never does.
    pub fn to_target(&self, target: f64, x: usize) -> Option<f64> {
        let at = |p: &(f64, f64, f64)| if x == 0 { p.0 } else { p.1 };
        let mut prev: Option<&(f64, f64, f64)> = None;
        for p in &self.points {
            if p.2 >= target {
                return Some(match prev {
                    Some(q) if p.2 > q.2 => at(q) + (at(p) - at(q)) * (target - q.2) / (p.2 - q.2),
                    _ => at(p),
                });
            }
            prev = Some(p);
        }
        None
    }

    /// The best held-out accuracy.
    pub fn best(&self) -> f64 {
        self.points
            .iter()
            .map(|p| p.2)
            .fold(f64::NEG_INFINITY, f64::max)
    }

    /// Share of scored groups that had zero reward variance (NaN when none was scored).
    pub fn zero_variance_share(&self) -> f64 {
        if self.scored_groups == 0 {
            return f64::NAN;
        }
        self.zero_variance_groups as f64 / self.scored_groups as f64
    }

    /// Every number finite and every accuracy within [0, 1]; one line naming the run otherwise.
    pub fn check(&self) -> anyhow::Result<()> {
        let name = format!("{}-s{}", self.policy, self.seed);
        ensure!(
            self.start.is_finite() && (0.0..=1.0).contains(&self.start),
            "{name}: start accuracy {} is not within [0, 1]",
            self.start
        );
        ensure!(!self.points.is_empty(), "{name}: no evaluation points");
        for (i, &(r, t, a)) in self.points.iter().enumerate() {
            ensure!(
                r.is_finite() && t.is_finite() && a.is_finite() && (0.0..=1.0).contains(&a),
                "{name}: evaluation {i} has rollouts {r}, time {t} s, accuracy {a} (non-finite or out of range)"
            );
        }
        ensure!(
            self.rollouts_per_step.is_finite(),
            "{name}: rollouts per step {} is not finite",
            self.rollouts_per_step
        );
        Ok(())
    }
}

/// Reads every `<policy>-s<seed>` run under `dir`.
pub fn read_curves(dir: &Path) -> anyhow::Result<Vec<Curve>> {
    let mut out = Vec::new();
    let entries = std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?;
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("metrics.jsonl").is_file())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    for name in names {
        let Some((policy, seed)) = name.rsplit_once("-s") else {
            continue;
        };
        let Ok(seed) = seed.parse::<u64>() else {
            continue;
        };
        let run = dir.join(&name);
        let summary: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(run.join("summary.json"))
                .with_context(|| format!("{}: no summary.json", run.display()))?,
        )
        .with_context(|| format!("{}: summary.json", run.display()))?;
        let start = summary
            .get("accuracy_start")
            .and_then(|v| v.as_f64())
            .with_context(|| {
                format!(
                    "{}: summary.json has no numeric accuracy_start",
                    run.display()
                )
            })?;
        let ms = read_metrics(&run)?;
        ensure!(!ms.is_empty(), "{}: metrics.jsonl is empty", run.display());
        let mut points = vec![(0.0, 0.0, start)];
        let t0 = ms[0].elapsed_s - ms[0].timing.rollout_to_train_end_s - ms[0].sync_s;
        for m in &ms {
            if let Some(a) = m.heldout_accuracy {
                points.push((m.rollouts_cum as f64, m.elapsed_s - t0.max(0.0), a));
            }
        }
        let rollouts_per_step = ms.iter().map(|m| m.rollouts as f64).sum::<f64>() / ms.len() as f64;
        let curve = Curve {
            policy: policy.to_owned(),
            seed,
            start,
            points,
            rollouts_per_step,
            zero_variance_groups: ms.iter().map(|m| u64::from(m.filtered)).sum(),
            scored_groups: ms
                .iter()
                .map(|m| u64::from(m.trained) + u64::from(m.filtered))
                .sum(),
        };
        curve
            .check()
            .with_context(|| format!("{}", run.display()))?;
        out.push(curve);
    }
    Ok(out)
}

/// Mean curve of a policy: the i-th evaluation of every seed averaged (x and accuracy).
fn mean_curve(cs: &[&Curve], x: usize) -> Vec<(f64, f64)> {
    let n = cs.iter().map(|c| c.points.len()).min().unwrap_or(0);
    (0..n)
        .map(|i| {
            let k = cs.len() as f64;
            let xs: f64 = cs
                .iter()
                .map(|c| if x == 0 { c.points[i].0 } else { c.points[i].1 })
                .sum();
            let ys: f64 = cs.iter().map(|c| c.points[i].2).sum();
            (xs / k, ys / k)
        })
        .collect()
}

/// The per-run curves as JSON (the data behind the plots and the table).
fn curves_json(curves: &[Curve], target: f64) -> serde_json::Value {
    serde_json::json!({
        "target": target,
        "runs": curves.iter().map(|c| serde_json::json!({
            "policy": c.policy,
            "seed": c.seed,
            "start": c.start,
            "rollouts_per_step": c.rollouts_per_step,
            "zero_variance_groups": c.zero_variance_groups,
            "scored_groups": c.scored_groups,
            "rollouts_to_target": c.to_target(target, 0),
            "s_to_target": c.to_target(target, 1),
            "points": c.points.iter().map(|p| serde_json::json!({
                "rollouts_cum": p.0, "elapsed_s": p.1, "heldout_accuracy": p.2
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

/// Runs `alloc-report`.
pub fn run(args: Args) -> anyhow::Result<()> {
    ensure!(
        args.frac > 0.0 && args.frac <= 1.0,
        "--frac must be in (0, 1], got {}",
        args.frac
    );
    let curves = read_curves(&args.runs)?;
    ensure!(
        !curves.is_empty(),
        "{}: no <policy>-s<seed> run directories",
        args.runs.display()
    );
    let base_start = baseline_start(&curves, &args.baseline)?;
    let target = match args.target {
        Some(t) => t,
        None => {
            let base: Vec<&Curve> = curves
                .iter()
                .filter(|c| c.policy == args.baseline)
                .collect();
            let best = base.iter().map(|c| c.best()).sum::<f64>() / base.len() as f64;
            ensure!(
                best > base_start,
                "the {} runs never rose above their mean start accuracy {base_start:.3} (mean best {best:.3}), so there is no default target; pass --target",
                args.baseline
            );
            base_start + args.frac * (best - base_start)
        }
    };
    let (md, csv) = report(&curves, &args.baseline, target)?;
    print!("{md}");
    let out = args.out.unwrap_or_else(|| args.runs.clone());
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    std::fs::write(out.join("alloc_report.md"), &md)?;
    std::fs::write(out.join("alloc_report.csv"), &csv)?;
    std::fs::write(
        out.join("alloc_curves.json"),
        serde_json::to_string_pretty(&curves_json(&curves, target))?,
    )?;
    let policies: std::collections::BTreeSet<&str> =
        curves.iter().map(|c| c.policy.as_str()).collect();
    for (x, file, label) in [
        (0, "acc_vs_rollouts.svg", "cumulative rollouts"),
        (
            1,
            "acc_vs_time.svg",
            "wall time of RL, s (evaluation included)",
        ),
    ] {
        let mut series: Vec<Series<(f64, f64)>> = policies
            .iter()
            .map(|p| {
                let cs: Vec<&Curve> = curves.iter().filter(|c| c.policy == *p).collect();
                Series::new(format!("{p} (mean of {})", cs.len()), mean_curve(&cs, x))
            })
            .collect();
        series.push(Series::new(
            format!("target {target:.3}"),
            vec![
                (0.0, target),
                (
                    curves
                        .iter()
                        .flat_map(|c| c.points.iter().map(|p| if x == 0 { p.0 } else { p.1 }))
                        .fold(0.0, f64::max),
                    target,
                ),
            ],
        ));
        plot::lines(
            &out.join(file),
            &format!("Held-out accuracy vs {label}"),
            label,
            "held-out accuracy",
            &series,
        )?;
    }
    println!("wrote {}", out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn curve(policy: &str, seed: u64, pts: &[(f64, f64)]) -> Curve {
        Curve {
            policy: policy.into(),
            seed,
            start: pts[0].1,
            points: pts.iter().map(|&(r, a)| (r, r / 100.0, a)).collect(),
            rollouts_per_step: 100.0,
            zero_variance_groups: 1,
            scored_groups: 4,
        }
    }

    #[test]
    fn run_refuses_empty_or_unimproved_run_sets() {
        let dir = std::env::temp_dir().join(format!("rp-alloc-report-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let args = |target: Option<f64>| Args {
            runs: dir.clone(),
            baseline: "grpo".into(),
            target,
            frac: 0.8,
            out: None,
        };
        let e = format!("{:#}", run(args(None)).unwrap_err());
        assert!(e.ends_with("no <policy>-s<seed> run directories"), "{e}");
        // One baseline run that never improves: no default target; a NaN line is refused.
        let r = dir.join("grpo-s1");
        std::fs::create_dir_all(&r).unwrap();
        std::fs::write(r.join("summary.json"), r#"{"accuracy_start": 0.5}"#).unwrap();
        let line = |acc: f64| {
            let m = crate::train::StepMetrics {
                heldout_accuracy: Some(acc),
                trained: 3,
                filtered: 1,
                rollouts: 32,
                rollouts_cum: 32,
                elapsed_s: 1.0,
                timing: crate::driver::metrics::Timing {
                    rollout_to_train_end_s: 1.0,
                    ..Default::default()
                },
                ..Default::default()
            };
            serde_json::to_string(&m).unwrap() + "\n"
        };
        std::fs::write(r.join("metrics.jsonl"), line(0.4)).unwrap();
        let e = format!("{:#}", run(args(None)).unwrap_err());
        assert!(
            e.contains("never rose above their mean start accuracy 0.500"),
            "{e}"
        );
        assert!(!e.contains('\n'), "{e}");
        let e = format!("{:#}", run(args(Some(0.5))).unwrap_err());
        assert!(e.contains("is not above the grpo runs' mean start"), "{e}");
        std::fs::write(r.join("metrics.jsonl"), line(1.5)).unwrap();
        let e = format!("{:#}", run(args(Some(0.6))).unwrap_err());
        assert!(e.contains("grpo-s1: evaluation 1 has"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        std::fs::write(r.join("metrics.jsonl"), line(0.7)).unwrap();
        run(args(Some(0.6))).unwrap();
        let md = std::fs::read_to_string(dir.join("alloc_report.md")).unwrap();
        assert!(md.contains("| grpo | 1 | 0.500 | 32 | 0.250 |"), "{md}");
        assert!(dir.join("alloc_curves.json").is_file());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
