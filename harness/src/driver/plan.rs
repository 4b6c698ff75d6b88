//! The parts of the core's per-step [`Plan`](rolloutpipe_core::Plan) that `simulate` and
//! `train` derive from their configs by one rule, so that the two cannot drift apart on them.

/// Prompts one step may draw at most, from the batch `batch` (B) and the over-sampling
/// factor: `⌈B · factor⌉`, never below B (a step must be able to draw its batch), saturating
/// at `u32::MAX`. Validation (`factor` finite and ≥ 1) is the configs'; a factor below 1 or
/// a NaN still yields B.
pub fn max_groups(batch: u32, factor: f64) -> u32 {
    let drawn = (f64::from(batch) * factor).ceil();
    // `as` saturates (and maps NaN to 0), so the result is in [B, u32::MAX].
    (drawn as u32).max(batch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_groups_rounds_up_and_never_below_the_batch() {
        // Integer factors: exact (the default configs: train 8 x 3.0, simulate B x 8.0).
        assert_eq!(max_groups(8, 3.0), 24);
        assert_eq!(max_groups(32, 8.0), 256);
        // Non-integer: up, so a step may draw the fractional prompt (train used to floor).
        assert_eq!(max_groups(8, 1.1), 9);
        assert_eq!(max_groups(3, 1.5), 5);
        assert_eq!(max_groups(10, 1.05), 11);
        // Never below B, whatever the factor.
        assert_eq!(max_groups(8, 1.0), 8);
        assert_eq!(max_groups(8, 0.5), 8);
        assert_eq!(max_groups(8, f64::NAN), 8);
        // Saturates instead of wrapping.
        assert_eq!(max_groups(u32::MAX, 2.0), u32::MAX);
        assert_eq!(max_groups(4, f64::INFINITY), u32::MAX);
    }
}
