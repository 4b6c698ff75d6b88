//! Checks of user-given numbers before any work: finite, in range, and sizes that fit in the
//! machine's memory, so that a typo is a one-line error instead of an allocation failure
//! (which aborts the process with a backtrace-like message) minutes later.
use anyhow::bail;
use rolloutpipe_backends::ModelConfig;

/// Memory this process may plan to use, bytes: `MemAvailable` of `/proc/meminfo` where there
/// is one, else 16 GiB (a conservative laptop-sized guess).
pub fn available_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb.saturating_mul(1024))
        .unwrap_or(16 << 30)
}

/// `bytes` in a readable unit.
pub fn human(bytes: u128) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut x = bytes as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < units.len() {
        x /= 1024.0;
        u += 1;
    }
    if u + 1 == units.len() && x >= 1024.0 {
        return format!("{x:.3e} {}", units[u]);
    }
    format!("{x:.1} {}", units[u])
}

/// Refuses `setting` when `count` items of `bytes_each` would not fit in available memory.
pub fn check_fits(setting: &str, count: u128, bytes_each: u128) -> anyhow::Result<()> {
    check_fits_in(setting, count, bytes_each, u128::from(available_memory()))
}

/// [`check_fits`] against a given budget (tests).
pub fn check_fits_in(
    setting: &str,
    count: u128,
    bytes_each: u128,
    budget: u128,
) -> anyhow::Result<()> {
    let need = count.saturating_mul(bytes_each);
    if need > budget {
        bail!(
            "{setting} = {count} would need about {} of memory, more than the {} available; lower it",
            human(need),
            human(budget)
        );
    }
    Ok(())
}

/// Parameters of a model of shape `c`, saturating instead of overflowing on absurd shapes.
pub fn model_parameters(c: &ModelConfig) -> u128 {
    let u = |x: usize| x as u128;
    let (h, hd) = (u(c.hidden_size), u(c.head_dim));
    let q = h
        .saturating_mul(u(c.num_attention_heads))
        .saturating_mul(hd);
    let kv = h
        .saturating_mul(u(c.num_key_value_heads))
        .saturating_mul(hd);
    let mlp = h.saturating_mul(u(c.intermediate_size)).saturating_mul(3);
    let layer = q
        .saturating_mul(2)
        .saturating_add(kv.saturating_mul(2))
        .saturating_add(mlp)
        .saturating_add(h.saturating_mul(2));
    let embed = u(c.vocab_size).saturating_mul(h).saturating_mul(2);
    layer
        .saturating_mul(u(c.num_hidden_layers))
        .saturating_add(embed)
}

/// Refuses a model shape whose `copies` f32 copies (weights, gradients, optimizer moments, one
/// per backend), plus its per-position tables, would not fit; `what` names the settings.
pub fn check_model_fits(c: &ModelConfig, copies: u128, what: &str) -> anyhow::Result<()> {
    check_fits(
        &format!("{what} ({} parameters)", model_parameters(c)),
        model_parameters(c),
        copies.saturating_mul(4),
    )?;
    // RoPE tables and per-position buffers grow with the position limit.
    check_fits(
        "max_position_embeddings",
        c.max_position_embeddings as u128,
        (c.head_dim as u128).saturating_mul(16).max(16),
    )
}

/// Refuses a number that is NaN, infinite or negative, naming the setting.
pub fn finite_nonneg(setting: &str, x: f64) -> anyhow::Result<()> {
    if !(x.is_finite() && x >= 0.0) {
        bail!("{setting} must be a finite number >= 0, got {x}");
    }
    Ok(())
}

/// Refuses a number that is not finite and > 0, naming the setting.
pub fn finite_positive(setting: &str, x: f64) -> anyhow::Result<()> {
    if !(x.is_finite() && x > 0.0) {
        bail!("{setting} must be a finite number > 0, got {x}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_over_the_budget_are_refused_naming_the_setting() {
        check_fits_in("sft.batch", 1000, 1000, 1 << 30).unwrap();
        let e = check_fits_in("sft.batch", 1 << 40, 1 << 20, 1 << 30)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sft.batch = 1099511627776"), "{e}");
        assert!(e.contains("1.0 EiB"), "{e}");
        assert!(e.contains("1.0 GiB"), "{e}");
        // Saturates instead of overflowing.
        assert!(check_fits_in("x", u128::MAX, u128::MAX, 1).is_err());
        assert!(available_memory() > 0);
    }

    #[test]
    fn non_finite_and_negative_numbers_are_refused() {
        finite_nonneg("rl.lr", 0.0).unwrap();
        finite_positive("rl.lr", 1e-3).unwrap();
        for bad in [f64::NAN, f64::INFINITY, -1.0] {
            assert!(
                finite_nonneg("--clip", bad)
                    .unwrap_err()
                    .to_string()
                    .contains("--clip")
            );
        }
        assert!(finite_positive("--lr", 0.0).is_err());
    }
}
