//! Robust summaries for `compare`: medians, and percentile-bootstrap 95% confidence intervals
//! for a median, resampled with a seeded generator so a table is reproducible from its inputs.
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Bootstrap resamples per interval.
pub const RESAMPLES: usize = 10_000;

/// A median with its 95% confidence interval (`lo == hi == median` for one value).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Interval {
    /// Median of the values.
    pub median: f64,
    /// 2.5th percentile of the bootstrap medians.
    pub lo: f64,
    /// 97.5th percentile of the bootstrap medians.
    pub hi: f64,
    /// How many values it summarises.
    pub n: usize,
}

impl Interval {
    /// Whether the interval lies strictly on one side of zero.
    pub fn excludes_zero(&self) -> bool {
        self.n > 1 && (self.hi < 0.0 || self.lo > 0.0)
    }
}

/// Median of the finite values (`NaN` when there are none).
pub fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The median of `values` with a percentile-bootstrap 95% interval ([`RESAMPLES`] resamples
/// with replacement, generator seeded with `seed`). With few values the interval is coarse
/// (its ends are sample values); it is what the data supports, not a normal approximation.
pub fn median_ci(values: &[f64], seed: u64) -> Interval {
    let v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    let m = median(&v);
    if v.len() < 2 {
        return Interval {
            median: m,
            lo: m,
            hi: m,
            n: v.len(),
        };
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut meds = Vec::with_capacity(RESAMPLES);
    let mut sample = vec![0.0; v.len()];
    for _ in 0..RESAMPLES {
        for s in sample.iter_mut() {
            *s = v[rng.random_range(0..v.len())];
        }
        meds.push(median(&sample));
    }
    meds.sort_by(f64::total_cmp);
    let at = |q: f64| meds[((q * (RESAMPLES - 1) as f64).round() as usize).min(RESAMPLES - 1)];
    Interval {
        median: m,
        lo: at(0.025),
        hi: at(0.975),
        n: v.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_non_finite() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[f64::NAN, 5.0]), 5.0);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn interval_brackets_the_median_and_is_reproducible() {
        let v = [0.31, 0.28, 0.35, 0.30, 0.29, 0.33, 0.27];
        let a = median_ci(&v, 7);
        assert_eq!(a, median_ci(&v, 7));
        assert_eq!(a.median, 0.30);
        assert!(a.lo <= a.median && a.median <= a.hi, "{a:?}");
        // Ends are sample values, inside the sample's range.
        assert!(v.contains(&a.lo) && v.contains(&a.hi));
        assert!(a.lo >= 0.27 && a.hi <= 0.35);
        assert_eq!(a.n, 7);
    }

    #[test]
    fn zero_is_excluded_only_by_a_one_sided_interval() {
        let cut = median_ci(&[-0.30, -0.25, -0.28, -0.33, -0.27], 1);
        assert!(cut.excludes_zero(), "{cut:?}");
        let noisy = median_ci(&[-0.30, 0.20, -0.05, 0.10, -0.15], 1);
        assert!(!noisy.excludes_zero(), "{noisy:?}");
        let single = median_ci(&[-0.3], 1);
        assert!(!single.excludes_zero());
        assert_eq!((single.lo, single.hi), (-0.3, -0.3));
    }
}
