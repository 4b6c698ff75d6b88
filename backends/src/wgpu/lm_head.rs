//! The output projection fused with log-softmax and the target's log-prob, in vocabulary
//! chunks: the wgpu twin of the CPU reference's `cpu::lm_head` (and of the CUDA backend's
//! chunked lm_head), so that no `[rows × vocab]` logits or logit gradients are ever stored.
//!
//! Scoring and training need, per scored row, only `logp[target]`, the entropy and the
//! log-sum-exp. The forward walks the vocabulary [`LmPlan::chunk`] rows of `lm_head` at a
//! time: `matmul_fwd` writes the chunk's logits into a `[block × chunk]` scratch and
//! `logprob_fwd` folds them into a per-row running log-sum-exp state; `logprob_fwd_finish`
//! then writes the outputs. The backward recomputes each chunk's logits, `logprob_bwd` turns
//! them into their gradient in place, and `matmul_bwd` adds the chunk's share of `dx` and
//! `dW` before the next chunk overwrites the scratch. Scored rows run in blocks of
//! [`LmPlan::block`] so that the scratch fits one storage binding.
//!
//! The chunk depends only on the device's storage-binding limit, never on the number of
//! rows, so a row is reduced over the same chunks in the same order in any batch, and its
//! log-prob is the same alone as among others (`conformance::wgpu_scoring_is_batch_invariant`).

use wgpu::Buffer;

use super::gpu::Exec;
use super::model::{Acts, DeviceModel};
use super::ops::{self, LogprobBufs, VocabChunk, Window};
use crate::cpu::lm_head::VOCAB_CHUNK;
use crate::error::Result;

/// How the fused lm_head splits its work on a device: vocabulary chunks of `chunk` rows of
/// `lm_head` (the CPU reference's [`VOCAB_CHUNK`], fewer where 64 rows of it would not fit
/// a binding), scored rows in blocks of `block`, so that the `[block × chunk]` scratch fits
/// one binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LmPlan {
    /// Vocabulary rows per chunk: a multiple of 256, so each chunk of W starts on a 256-byte
    /// boundary in any storage format.
    pub chunk: usize,
    /// Scored rows per block: a multiple of 64, so each block of the per-row buffers and of
    /// the hidden states starts on a 256-byte boundary.
    pub block: usize,
}

impl LmPlan {
    /// The plan for storage bindings of at most `limit` bytes.
    pub fn new(limit: usize) -> Self {
        let chunk = ops::rows_per_binding(limit, 64, 256).min(VOCAB_CHUNK);
        let block = ops::rows_per_binding(limit, chunk, 64);
        Self { chunk, block }
    }

    /// Floats of the chunk scratch for up to `m` scored rows.
    pub fn scratch_len(&self, m: usize) -> usize {
        self.block.min(m.max(1)) * self.chunk
    }

    /// Each (block of scored rows, vocabulary chunk) of `m` rows over a `v`-token
    /// vocabulary: blocks in order, and within a block the chunks in order (the reduction
    /// order of every row).
    fn tiles(&self, m: usize, v: usize) -> impl Iterator<Item = VocabChunk> + use<> {
        let (b, c) = (self.block, self.chunk);
        (0..m).step_by(b).flat_map(move |row0| {
            (0..v).step_by(c).map(move |v0| VocabChunk {
                row0,
                rows: b.min(m - row0),
                v0,
                cols: c.min(v - v0),
            })
        })
    }
}

/// Records the fused forward of the `m` scored rows (`a.hsel`, targets `a.targets`):
/// `a.logp`, `a.entropy` and `a.lse` at `temperature`.
pub fn logprob_fwd(ex: &mut Exec, md: &DeviceModel, a: &Acts, m: usize, temperature: f64) {
    let out = bufs(a);
    for c in a.lm.tiles(m, md.cfg.vocab_size) {
        chunk_logits(ex, md, a, c);
        ops::logprob_fwd(
            ex,
            out,
            &a.lm_scratch,
            &a.targets,
            c,
            c.v0 == 0,
            temperature,
        );
    }
    ops::logprob_fwd_finish(ex, out, 0, m);
}

/// Records the fused backward given `a.dlogp` (and the forward's `a.lse`): writes `a.dhsel`
/// and adds into `lm_head`'s gradient, chunk by chunk.
pub fn logprob_bwd(ex: &mut Exec, md: &DeviceModel, a: &Acts, m: usize, temperature: f64) {
    let (w, dw) = (&md.params[md.lm_head], &md.grads[md.lm_head]);
    for c in a.lm.tiles(m, md.cfg.vocab_size) {
        chunk_logits(ex, md, a, c);
        ops::logprob_bwd(
            ex,
            &a.lm_scratch,
            &a.dlogp,
            &a.lse,
            &a.targets,
            c,
            temperature,
        );
        let window = Window {
            first: c.v0,
            rows: c.cols,
        };
        let dy = (&a.lm_scratch, 0, 0);
        let (x, dx) = (rows_of(md, &a.hsel, c), rows_of(md, &a.dhsel, c));
        // A block's first chunk writes its dx, the later ones add to it.
        let dx = Some((dx, c.v0 > 0));
        ops::matmul_bwd_window(ex, dx, dw, dy, x, w, window, c.rows, md.cfg.hidden_size);
    }
}

/// The full logits `[m, vocab]` of the scored rows, chunk by chunk through the scratch (one
/// submission each): for inspection and tests only, nothing else needs them all at once.
pub fn read_logits(ex: &mut Exec, md: &DeviceModel, a: &Acts, m: usize) -> Result<Vec<f32>> {
    let v = md.cfg.vocab_size;
    let mut out = vec![0.0f32; m * v];
    for c in a.lm.tiles(m, v) {
        chunk_logits(ex, md, a, c);
        let t = ex.read_back(&a.lm_scratch, 0, c.rows * c.cols * 4);
        let part = ex.submit()?.get::<f32>(t);
        for (r, z) in part.chunks(c.cols).enumerate() {
            let at = (c.row0 + r) * v + c.v0;
            out[at..at + c.cols].copy_from_slice(z);
        }
    }
    Ok(out)
}

/// The logits of chunk `c`'s rows over its vocabulary columns into the scratch.
fn chunk_logits(ex: &mut Exec, md: &DeviceModel, a: &Acts, c: VocabChunk) {
    let window = Window {
        first: c.v0,
        rows: c.cols,
    };
    let w = &md.params[md.lm_head];
    let x = rows_of(md, &a.hsel, c);
    let (y, d) = ((&a.lm_scratch, 0, 0), md.cfg.hidden_size);
    ops::matmul_fwd_window(ex, y, x, w, md.weights, window, c.rows, d, false);
}

/// Chunk `c`'s rows of a `[rows, hidden]` buffer.
fn rows_of<'a>(md: &DeviceModel, b: &'a Buffer, c: VocabChunk) -> ops::Part<'a> {
    let row = md.cfg.hidden_size * 4;
    (b, (c.row0 * row) as u64, (c.rows * row) as u64)
}

fn bufs(a: &Acts) -> LogprobBufs<'_> {
    LogprobBufs {
        state: &a.lm_state,
        logp: &a.logp,
        entropy: &a.entropy,
        lse: &a.lse,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plan keeps the CPU reference's chunk where it fits, and every scratch fits one
    /// binding of the limit (down to the smallest chunk and block).
    #[test]
    fn plan_fits_the_binding_limit() {
        let p = LmPlan::new(128 << 20);
        assert_eq!(
            p,
            LmPlan {
                chunk: VOCAB_CHUNK,
                block: 4096
            }
        );
        for limit in [4096, 1 << 20, 3 << 20, 128 << 20, 2 << 30] {
            let p = LmPlan::new(limit);
            assert!(
                p.chunk.is_multiple_of(256) && p.block.is_multiple_of(64),
                "{limit}"
            );
            assert!(p.chunk <= VOCAB_CHUNK);
            if limit >= 64 * 256 * 4 {
                assert!(p.scratch_len(usize::MAX) * 4 <= limit, "{limit}: {p:?}");
            }
        }
        let chunks: Vec<_> = LmPlan {
            chunk: 256,
            block: 64,
        }
        .tiles(1, 600)
        .map(|c| (c.v0, c.cols))
        .collect();
        assert_eq!(chunks, [(0, 256), (256, 256), (512, 88)]);
    }
}
