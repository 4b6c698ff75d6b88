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
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, ensure};

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
        let t0 = ms[0].elapsed_s - ms[0].rollout_to_train_end_s - ms[0].sync_s;
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

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The baseline's mean start accuracy; an error when it has no runs.
pub fn baseline_start(curves: &[Curve], baseline: &str) -> anyhow::Result<f64> {
    let starts: Vec<f64> = curves
        .iter()
        .filter(|c| c.policy == baseline)
        .map(|c| c.start)
        .collect();
    ensure!(
        !starts.is_empty(),
        "no runs of the baseline policy {baseline:?}"
    );
    Ok(starts.iter().sum::<f64>() / starts.len() as f64)
}

/// The report's table (Markdown, CSV) for `curves` at `target`.
///
/// `target` must be above the baseline's mean start accuracy: a target at or below the start
/// is "reached" at 0 rollouts, and every ratio would be 0/0. A run that starts at or above the
/// target is excluded (with its seed's pair) and listed under the table.
pub fn report(curves: &[Curve], baseline: &str, target: f64) -> anyhow::Result<(String, String)> {
    ensure!(!curves.is_empty(), "no runs to report");
    ensure!(
        target.is_finite(),
        "the target accuracy {target} is not finite"
    );
    for c in curves {
        c.check()?;
    }
    let base_start = baseline_start(curves, baseline)?;
    ensure!(
        target > base_start,
        "the target accuracy {target:.3} is not above the {baseline} runs' mean start accuracy {base_start:.3}: every run would reach it at 0 rollouts; choose a higher --target"
    );
    let (kept, excluded): (Vec<&Curve>, Vec<&Curve>) =
        curves.iter().partition(|c| c.start < target);
    let mut by_policy: BTreeMap<&str, Vec<&Curve>> = BTreeMap::new();
    for c in curves {
        by_policy.entry(&c.policy).or_default();
    }
    for c in kept.iter().copied() {
        by_policy.entry(&c.policy).or_default().push(c);
    }
    let base_r2t: BTreeMap<u64, Option<f64>> = by_policy[baseline]
        .iter()
        .map(|c| (c.seed, c.to_target(target, 0)))
        .collect();
    let mut md = format!(
        "Target held-out accuracy: {target:.3} (the {baseline} runs' mean start: {base_start:.3})\n\n\
         Ratio = {baseline}'s rollouts to target over the policy's, paired by seed (above 1: fewer rollouts than {baseline}); \
         `-` = not reached within the run. Zero-variance share = groups whose first-scored rewards were all equal, over groups scored.\n\n\
         | policy | seeds | start (mean) | rollouts/step | zero-variance share | best acc (mean ± sd) | reached | rollouts to target (mean ± sd) | ratio vs {baseline} per seed | ratio (median; mean ± sd) | ratio min..max | s to target (mean) |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n"
    );
    let mut csv = String::from(
        "policy,seed,start,rollouts_per_step,zero_variance_share,best,rollouts_to_target,s_to_target,ratio_vs_baseline\n",
    );
    let f = |v: Option<f64>| v.map_or("not reached".to_owned(), |x| format!("{x:.3}"));
    for (policy, cs) in &by_policy {
        if cs.is_empty() {
            let _ = writeln!(
                md,
                "| {policy} | 0 | - | - | - | - | - | - | - | - | - | - |"
            );
            continue;
        }
        let mut r2t = Vec::new();
        let mut s2t = Vec::new();
        let mut ratios = Vec::new();
        let mut per_seed = Vec::new();
        for c in cs {
            let r = c.to_target(target, 0);
            let s = c.to_target(target, 1);
            let b = base_r2t.get(&c.seed).copied().flatten();
            let ratio = match (b, r) {
                (Some(b), Some(r)) if r > 0.0 => Some(b / r),
                _ => None,
            };
            r2t.extend(r);
            s2t.extend(s);
            ratios.extend(ratio);
            per_seed.push(match (base_r2t.get(&c.seed), b, r) {
                (None, _, _) => format!("s{}: unpaired", c.seed),
                (_, None, Some(_)) => format!("s{}: {baseline} -", c.seed),
                (_, _, None) => format!("s{}: -", c.seed),
                _ => format!("s{}: {:.2}", c.seed, ratio.unwrap_or(f64::NAN)),
            });
            let _ = writeln!(
                csv,
                "{policy},{},{:.4},{:.1},{:.4},{:.4},{},{},{}",
                c.seed,
                c.start,
                c.rollouts_per_step,
                c.zero_variance_share(),
                c.best(),
                f(r),
                f(s),
                f(ratio)
            );
        }
        let n = cs.len() as f64;
        let (bm, bs) = mean_sd(&cs.iter().map(|c| c.best()).collect::<Vec<_>>());
        let (rm, rs) = mean_sd(&r2t);
        let (qm, qs) = mean_sd(&ratios);
        let (sm, _) = mean_sd(&s2t);
        let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let rps = cs.iter().map(|c| c.rollouts_per_step).sum::<f64>() / n;
        let zv: u64 = cs.iter().map(|c| c.zero_variance_groups).sum();
        let sg: u64 = cs.iter().map(|c| c.scored_groups).sum();
        let start = cs.iter().map(|c| c.start).sum::<f64>() / n;
        let dash = |ok: bool, s: String| if ok { s } else { "-".into() };
        let _ = writeln!(
            md,
            "| {policy} | {} | {start:.3} | {rps:.0} | {} | {bm:.3} ± {bs:.3} | {}/{} | {} | {} | {} | {} | {} |",
            cs.len(),
            dash(sg > 0, format!("{:.3}", zv as f64 / sg.max(1) as f64)),
            r2t.len(),
            cs.len(),
            dash(!r2t.is_empty(), format!("{rm:.0} ± {rs:.0}")),
            per_seed.join(", "),
            dash(
                !ratios.is_empty(),
                format!("{:.2}; {qm:.2} ± {qs:.2}", median(&ratios))
            ),
            dash(!ratios.is_empty(), format!("{lo:.2}..{hi:.2}")),
            dash(!s2t.is_empty(), format!("{sm:.1}")),
        );
    }
    if !excluded.is_empty() {
        let names: Vec<String> = excluded
            .iter()
            .map(|c| format!("{}-s{} (start {:.3})", c.policy, c.seed, c.start))
            .collect();
        let _ = writeln!(
            md,
            "\nExcluded, starting at or above the target: {}.",
            names.join(", ")
        );
        for c in &excluded {
            let _ = writeln!(
                csv,
                "{},{},{:.4},{:.1},{:.4},{:.4},excluded: starts at or above the target,,",
                c.policy,
                c.seed,
                c.start,
                c.rollouts_per_step,
                c.zero_variance_share(),
                c.best()
            );
        }
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

    fn curve(policy: &str, seed: u64, pts: &[(f64, f64)]) -> Curve {
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
    fn rollouts_to_target_interpolates_and_ratios_pair_seeds() {
        let g = curve("grpo", 1, &[(0.0, 0.5), (1000.0, 0.6), (2000.0, 0.7)]);
        assert!((g.to_target(0.65, 0).unwrap() - 1500.0).abs() < 1e-9);
        assert_eq!(g.to_target(0.5, 0), Some(0.0));
        assert_eq!(g.to_target(0.8, 0), None);
        let v = curve("vigor", 1, &[(0.0, 0.5), (500.0, 0.7)]);
        assert!((v.to_target(0.65, 0).unwrap() - 375.0).abs() < 1e-9);
        let (md, csv) = report(&[g, v], "grpo", 0.65).unwrap();
        // 1500 / 375 = 4.
        assert!(md.contains("| vigor | 1 | 0.500 | 100 | 0.250 |"), "{md}");
        assert!(
            md.contains("s1: 4.00 | 4.00; 4.00 ± 0.00 | 4.00..4.00"),
            "{md}"
        );
        assert!(
            csv.contains("vigor,1,0.5000,100.0,0.2500,0.7000,375.000,3.750,4.000"),
            "{csv}"
        );
    }

    #[test]
    fn a_target_not_above_the_baselines_start_is_refused() {
        let g = curve("grpo", 1, &[(0.0, 0.5), (1000.0, 0.7)]);
        let v = curve("vigor", 1, &[(0.0, 0.5), (500.0, 0.7)]);
        for t in [0.5, 0.4] {
            let e = report(&[g.clone(), v.clone()], "grpo", t)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("is not above the grpo runs' mean start accuracy 0.500"),
                "{e}"
            );
            assert!(!e.contains('\n'), "{e}");
        }
        let e = report(&[g, v], "grpo", f64::NAN).unwrap_err().to_string();
        assert!(e.contains("is not finite"), "{e}");
    }

    #[test]
    fn runs_starting_at_or_above_the_target_are_excluded_and_listed() {
        let g1 = curve("grpo", 1, &[(0.0, 0.5), (1000.0, 0.7)]);
        let g2 = curve("grpo", 2, &[(0.0, 0.66), (1000.0, 0.8)]);
        let v1 = curve("vigor", 1, &[(0.0, 0.5), (500.0, 0.7)]);
        let v2 = curve("vigor", 2, &[(0.0, 0.55), (500.0, 0.7)]);
        let (md, csv) = report(&[g1, g2, v1, v2], "grpo", 0.65).unwrap();
        assert!(
            md.contains("Excluded, starting at or above the target: grpo-s2 (start 0.660)."),
            "{md}"
        );
        // grpo-s2 reached the target at 0 rollouts; it counts for nothing, and vigor-s2 has no
        // pair left.
        assert!(md.contains("| grpo | 1 |"), "{md}");
        assert!(md.contains("s1: 2.00, s2: unpaired"), "{md}");
        assert!(
            csv.contains("grpo,2,0.6600,100.0,0.2500,0.8000,excluded"),
            "{csv}"
        );
    }

    #[test]
    fn degenerate_inputs_are_one_line_errors() {
        let one_line = |r: anyhow::Result<(String, String)>| {
            let e = format!("{:#}", r.unwrap_err());
            assert!(!e.contains('\n'), "{e}");
            e
        };
        assert_eq!(one_line(report(&[], "grpo", 0.5)), "no runs to report");
        let v = curve("vigor", 1, &[(0.0, 0.5), (500.0, 0.7)]);
        assert_eq!(
            one_line(report(std::slice::from_ref(&v), "grpo", 0.6)),
            "no runs of the baseline policy \"grpo\""
        );
        let g = curve("grpo", 1, &[(0.0, 0.5), (1000.0, f64::NAN)]);
        let e = one_line(report(&[g, v.clone()], "grpo", 0.6));
        assert!(e.starts_with("grpo-s1: evaluation 1 has"), "{e}");
        let mut g = curve("grpo", 1, &[(0.0, 0.5), (1000.0, 0.7)]);
        g.start = f64::NAN;
        let e = one_line(report(&[g, v.clone()], "grpo", 0.6));
        assert_eq!(e, "grpo-s1: start accuracy NaN is not within [0, 1]");
        // A policy without a seed the baseline has (and the reverse) is reported, not a panic.
        let g1 = curve("grpo", 1, &[(0.0, 0.5), (1000.0, 0.7)]);
        let g2 = curve("grpo", 2, &[(0.0, 0.5), (1000.0, 0.7)]);
        let v3 = curve("vigor", 3, &[(0.0, 0.5), (500.0, 0.7)]);
        let (md, _) = report(&[g1, g2, v3], "grpo", 0.6).unwrap();
        assert!(md.contains("s3: unpaired"), "{md}");
        // Nobody reaches the target: dashes, no NaN in the table.
        let g = curve("grpo", 1, &[(0.0, 0.5), (1000.0, 0.55)]);
        let (md, _) = report(&[g, v], "grpo", 0.9).unwrap();
        assert!(!md.contains("NaN") && !md.contains("inf"), "{md}");
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
                rollout_to_train_end_s: 1.0,
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
