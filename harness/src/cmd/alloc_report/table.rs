//! The allocation report's table: per policy, its runs' rollouts to the target accuracy and
//! their ratios against the baseline's, paired by seed (Markdown and CSV).
use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::ensure;

use super::Curve;

/// Mean and sample standard deviation (NaN for no values).
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

/// The median (NaN for no values).
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
    for (policy, cs) in &by_policy {
        policy_rows(&mut md, &mut csv, policy, cs, baseline, target, &base_r2t);
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

/// One policy's row of the table and its runs' CSV lines.
fn policy_rows(
    md: &mut String,
    csv: &mut String,
    policy: &str,
    cs: &[&Curve],
    baseline: &str,
    target: f64,
    base_r2t: &BTreeMap<u64, Option<f64>>,
) {
    let f = |v: Option<f64>| v.map_or("not reached".to_owned(), |x| format!("{x:.3}"));
    if cs.is_empty() {
        let _ = writeln!(
            md,
            "| {policy} | 0 | - | - | - | - | - | - | - | - | - | - |"
        );
        return;
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

#[cfg(test)]
mod tests {
    use super::super::tests::curve;
    use super::*;

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
}
