//! `rolloutpipe alloc-report --runs DIR`: the allocation measurement's table and plots, from
//! the run directories `DIR/<policy>-s<seed>/` that `scripts/alloc/measure.sh` writes.
//!
//! For each run it reads `metrics.jsonl` (held-out accuracy at each evaluation step, cumulative
//! rollouts, elapsed time) and `summary.json` (accuracy at the start of RL). The target
//! accuracy is fixed from the baseline alone, before the other policies are looked at:
//! `start + frac × (best − start)`, with `start` and `best` the baseline runs' mean start and mean
//! best held-out accuracy (`--target` overrides it). A run's rollouts-to-target is the cumulative
//! rollout count at which its held-out accuracy first reaches the target, interpolated linearly
//! between evaluation points. Ratios are paired by seed: baseline rollouts-to-target over the
//! policy's (above 1 = fewer rollouts than the baseline). Writes `alloc_report.md`,
//! `alloc_report.csv`, `acc_vs_rollouts.svg` and `acc_vs_time.svg`.
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail, ensure};

use crate::plot::{self, Series};
use crate::train::read_metrics;

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
            .with_context(|| format!("{}: summary.json has no accuracy_start", run.display()))?;
        let ms = read_metrics(&run)?;
        ensure!(!ms.is_empty(), "{}: metrics.jsonl is empty", run.display());
        let mut points = vec![(0.0, 0.0, start)];
        let t0 = ms[0].elapsed_s - ms[0].rollout_to_train_end_s - ms[0].sync_s;
        for m in &ms {
            if let Some(a) = m.heldout_accuracy {
                points.push((m.rollouts_cum as f64, m.elapsed_s - t0.max(0.0), a));
            }
        }
        let rollouts_per_step = ms.iter().map(|m| m.rollouts as f64).sum::<f64>() / ms.len() as f64;
        out.push(Curve {
            policy: policy.to_owned(),
            seed,
            start,
            points,
            rollouts_per_step,
        });
    }
    Ok(out)
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let m = v.iter().sum::<f64>() / n;
    let var = if v.len() > 1 {
        v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (m, var.sqrt())
}

/// The report's table (Markdown, CSV) for `curves` at `target`.
pub fn report(curves: &[Curve], baseline: &str, target: f64) -> anyhow::Result<(String, String)> {
    let mut by_policy: BTreeMap<&str, Vec<&Curve>> = BTreeMap::new();
    for c in curves {
        by_policy.entry(&c.policy).or_default().push(c);
    }
    let Some(base) = by_policy.get(baseline) else {
        bail!("no runs of the baseline policy {baseline:?}");
    };
    let base_r2t: BTreeMap<u64, Option<f64>> = base
        .iter()
        .map(|c| (c.seed, c.to_target(target, 0)))
        .collect();
    let mut md = format!(
        "Target held-out accuracy: {target:.3}\n\n| policy | seeds | rollouts/step | best acc (mean ± sd) | reached | rollouts to target (mean ± sd) | ratio vs {baseline} (mean ± sd) | ratio min..max | s to target (mean) |\n|---|---|---|---|---|---|---|---|---|\n"
    );
    let mut csv = String::from(
        "policy,seed,rollouts_per_step,best,rollouts_to_target,s_to_target,ratio_vs_baseline\n",
    );
    for (policy, cs) in &by_policy {
        let mut r2t = Vec::new();
        let mut s2t = Vec::new();
        let mut ratios = Vec::new();
        for c in cs {
            let r = c.to_target(target, 0);
            let s = c.to_target(target, 1);
            let ratio = match (base_r2t.get(&c.seed).copied().flatten(), r) {
                (Some(b), Some(r)) if r > 0.0 => Some(b / r),
                _ => None,
            };
            if let Some(r) = r {
                r2t.push(r);
            }
            if let Some(s) = s {
                s2t.push(s);
            }
            if let Some(x) = ratio {
                ratios.push(x);
            }
            let f = |v: Option<f64>| v.map_or("not reached".to_owned(), |x| format!("{x:.3}"));
            let _ = writeln!(
                csv,
                "{policy},{},{:.1},{:.4},{},{},{}",
                c.seed,
                c.rollouts_per_step,
                c.best(),
                f(r),
                f(s),
                f(ratio)
            );
        }
        let (bm, bs) = mean_sd(&cs.iter().map(|c| c.best()).collect::<Vec<_>>());
        let (rm, rs) = mean_sd(&r2t);
        let (qm, qs) = mean_sd(&ratios);
        let (sm, _) = mean_sd(&s2t);
        let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let rps = cs.iter().map(|c| c.rollouts_per_step).sum::<f64>() / cs.len() as f64;
        let _ = writeln!(
            md,
            "| {policy} | {} | {rps:.0} | {bm:.3} ± {bs:.3} | {}/{} | {} | {} | {} | {} |",
            cs.len(),
            r2t.len(),
            cs.len(),
            if r2t.is_empty() {
                "-".into()
            } else {
                format!("{rm:.0} ± {rs:.0}")
            },
            if ratios.is_empty() {
                "-".into()
            } else {
                format!("{qm:.2} ± {qs:.2}")
            },
            if ratios.is_empty() {
                "-".into()
            } else {
                format!("{lo:.2}..{hi:.2}")
            },
            if s2t.is_empty() {
                "-".into()
            } else {
                format!("{sm:.1}")
            },
        );
    }
    Ok((md, csv))
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
    let base: Vec<&Curve> = curves
        .iter()
        .filter(|c| c.policy == args.baseline)
        .collect();
    ensure!(
        !base.is_empty(),
        "no runs of the baseline policy {:?}",
        args.baseline
    );
    let target = match args.target {
        Some(t) => t,
        None => {
            let start = base.iter().map(|c| c.start).sum::<f64>() / base.len() as f64;
            let best = base.iter().map(|c| c.best()).sum::<f64>() / base.len() as f64;
            start + args.frac * (best - start)
        }
    };
    let (md, csv) = report(&curves, &args.baseline, target)?;
    print!("{md}");
    let out = args.out.unwrap_or_else(|| args.runs.clone());
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    std::fs::write(out.join("alloc_report.md"), &md)?;
    std::fs::write(out.join("alloc_report.csv"), &csv)?;
    let mut policies: Vec<&str> = curves.iter().map(|c| c.policy.as_str()).collect();
    policies.dedup();
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

    fn curve(policy: &str, seed: u64, pts: &[(f64, f64)]) -> Curve {
        Curve {
            policy: policy.into(),
            seed,
            start: pts[0].1,
            points: pts.iter().map(|&(r, a)| (r, r / 100.0, a)).collect(),
            rollouts_per_step: 100.0,
        }
    }

    #[test]
    fn rollouts_to_target_interpolates_and_ratios_pair_seeds() {
        let g = curve("grpo", 1, &[(0.0, 0.5), (1000.0, 0.6), (2000.0, 0.7)]);
        assert!((g.to_target(0.65, 0).unwrap() - 1500.0).abs() < 1e-9);
        assert_eq!(g.to_target(0.5, 0), Some(0.0));
        assert_eq!(g.to_target(0.8, 0), None);
        let v = curve("vigor", 1, &[(0.0, 0.5), (500.0, 0.7)]);
        assert!((v.to_target(0.65, 0).unwrap() - 375.0).abs() < 1e-9);
        let (md, csv) = report(&[g, v], "grpo", 0.65).unwrap();
        // 1500 / 375 = 4.
        assert!(md.contains("| vigor | 1 | 100 |"), "{md}");
        assert!(md.contains("4.00 ± 0.00"), "{md}");
        assert!(
            csv.contains("vigor,1,100.0,0.7000,375.000,3.750,4.000"),
            "{csv}"
        );
        assert!(report(&[], "grpo", 0.5).is_err());
    }
}
