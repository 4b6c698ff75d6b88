//! Host-side layout of the CUDA backend's batches, planned without a device: the element
//! count of every activation buffer (the memory a batch needs before anything is allocated).

use crate::config::ModelConfig;

/// Floats of the logits scratch of one vocabulary chunk (256 MiB): bounds the chunk width
/// for a batch's scored rows.
pub const LOGITS_BUDGET: usize = 1 << 26;

/// Element counts of every activation buffer for `n` rows and `m` scored rows: the one
/// place the memory of a batch is planned (tests check it without a device).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActSizes {
    /// Per layer: saved forward values.
    pub per_layer: usize,
    /// Whole-batch buffers (inputs, residual stream, final norm, backward scratch).
    pub shared: usize,
    /// The logits scratch of one vocabulary chunk.
    pub logits: usize,
}

impl ActSizes {
    /// Counts for `cap_n` rows and `cap_m` scored rows of model `c`.
    pub fn new(c: &ModelConfig, cap_n: usize, cap_m: usize) -> Self {
        let (n, m) = (cap_n, cap_m);
        let (d, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let (h, kvh) = (c.num_attention_heads, c.num_key_value_heads);
        let (qd, kd) = (c.q_dim(), c.kv_dim());
        let per_layer = n * d * 3 // ln1, x_mid, ln2
            + n * 2 // ln1_rstd, ln2_rstd
            + n * qd * 3 // q_pre, q, att_out
            + n * h // q_rstd
            + n * kd * 3 // k_pre, k, v
            + n * kvh // k_rstd
            + 2 * n * h // att_stats
            + n * f * 3; // gate, up, h
        let shared = n * 3 // ids, pos, rows of qmeta/2
            + 2 * n // qmeta
            + m * 8 // rows, targets, old, ref, adv, w, flags, logp
            + m * 2 // entropy, lse
            + 4 * m // logprob state
            + 4 // loss stats
            + (c.num_hidden_layers + 1) * n * d // residual stream
            + n * d * 2 // tmp, lnf
            + n // lnf_rstd
            + m * d * 2 // hsel, dhsel
            + m // dlogp
            + n * d * 3 // dlnf, dres, dln
            + n * f * 3 // dh, dgate, dup
            + n * qd * 3 // datt, dq, dq_pre
            + n * kd * 3; // dk, dv, dk_pre
        Self {
            per_layer,
            shared,
            logits: logits_len(m, v),
        }
    }

    /// Total bytes (every buffer is 4-byte elements).
    pub fn bytes(&self, layers: usize) -> usize {
        4 * (self.per_layer * layers + self.shared + self.logits)
    }
}

/// The logits scratch for `m` scored rows: whole rows when they fit [`LOGITS_BUDGET`],
/// else the budget (chunks of at least 8 columns).
pub fn logits_len(m: usize, vocab: usize) -> usize {
    (m * vocab).min(LOGITS_BUDGET.max(8 * m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activation_plan_counts_every_buffer() {
        let c = ModelConfig::small();
        let s = ActSizes::new(&c, 64, 64);
        // small: d 128, f 384, h 4, kvh 2, hd 32 -> qd 128, kd 64, vocab 64.
        let per_layer = 64 * 128 * 3
            + 64 * 2
            + 64 * 128 * 3
            + 64 * 4
            + 64 * 64 * 3
            + 64 * 2
            + 2 * 64 * 4
            + 64 * 384 * 3;
        assert_eq!(s.per_layer, per_layer);
        assert_eq!(s.logits, 64 * 64);
        assert_eq!(s.bytes(4), 4 * (4 * per_layer + s.shared + s.logits));
        // Qwen3-0.6B shapes at 4,096 scored rows: the logits scratch is the budget, not
        // 4,096 x 151,936 floats (2.5 GB).
        let mut q = ModelConfig::small();
        q.vocab_size = 151_936;
        assert_eq!(ActSizes::new(&q, 8192, 4096).logits, LOGITS_BUDGET);
        assert_eq!(logits_len(3, 11), 33);
    }
}
