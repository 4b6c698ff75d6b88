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

use rolloutpipe_kernels::WeightFormat;

use super::gpu::Exec;
use super::ops::{self, LogprobBufs, VocabChunk, Window};
use crate::error::Result;
use crate::model::VOCAB_CHUNK;

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

/// The fused lm_head over the weight `w` (`[v, d]`, stored as `format`), split by `plan`;
/// each call takes the chunk scratch of [`LmPlan::scratch_len`] values that holds one chunk's
/// logits (and, in the backward, their gradient).
#[derive(Debug, Clone, Copy)]
pub struct LmHead<'a> {
    /// `lm_head.weight` (the embedding when tied).
    pub w: &'a Buffer,
    /// How `w` is stored.
    pub format: WeightFormat,
    /// How the vocabulary and the rows are split.
    pub plan: LmPlan,
    /// Hidden width.
    pub d: usize,
    /// Vocabulary.
    pub v: usize,
}

impl LmHead<'_> {
    /// Records the fused forward of the `m` rows of `x` (targets `targets`): `out`'s log-probs,
    /// entropies and log-sum-exps at `temperature`.
    #[allow(clippy::too_many_arguments)]
    pub fn logprob_fwd(
        &self,
        ex: &mut Exec,
        scratch: &Buffer,
        out: LogprobBufs<'_>,
        x: &Buffer,
        targets: &Buffer,
        m: usize,
        temperature: f64,
    ) {
        for c in self.plan.tiles(m, self.v) {
            self.chunk_logits(ex, scratch, x, c);
            ops::logprob_fwd(ex, out, scratch, targets, c, c.v0 == 0, temperature);
        }
        ops::logprob_fwd_finish(ex, out, 0, m);
    }

    /// Records the fused backward given `dlogp` and the forward's `lse`: writes `dx` and adds
    /// into `dw` (the lm_head's gradient), chunk by chunk.
    #[allow(clippy::too_many_arguments)]
    pub fn logprob_bwd(
        &self,
        ex: &mut Exec,
        scratch: &Buffer,
        dx: &Buffer,
        dw: &Buffer,
        dlogp: &Buffer,
        lse: &Buffer,
        x: &Buffer,
        targets: &Buffer,
        m: usize,
        temperature: f64,
    ) {
        for c in self.plan.tiles(m, self.v) {
            self.chunk_logits(ex, scratch, x, c);
            ops::logprob_bwd(ex, scratch, dlogp, lse, targets, c, temperature);
            let window = Window {
                first: c.v0,
                rows: c.cols,
            };
            let dy = (scratch, 0, 0);
            let (xr, dxr) = (self.rows_of(x, c), self.rows_of(dx, c));
            // A block's first chunk writes its dx, the later ones add to it.
            let dx = Some((dxr, c.v0 > 0));
            ops::matmul_bwd_window(ex, dx, dw, dy, xr, self.w, window, c.rows, self.d);
        }
    }

    /// The full logits `[m, v]` of the rows of `x`, chunk by chunk through the scratch (one
    /// submission each): for inspection and tests only, nothing else needs them all at once.
    pub fn read_logits(
        &self,
        ex: &mut Exec,
        scratch: &Buffer,
        x: &Buffer,
        m: usize,
    ) -> Result<Vec<f32>> {
        let v = self.v;
        let mut out = vec![0.0f32; m * v];
        for c in self.plan.tiles(m, v) {
            self.chunk_logits(ex, scratch, x, c);
            let t = ex.read_back(scratch, 0, c.rows * c.cols * 4);
            let part = ex.submit()?.get::<f32>(t);
            for (r, z) in part.chunks(c.cols).enumerate() {
                let at = (c.row0 + r) * v + c.v0;
                out[at..at + c.cols].copy_from_slice(z);
            }
        }
        Ok(out)
    }

    /// The logits of chunk `c`'s rows over its vocabulary columns into the scratch.
    fn chunk_logits(&self, ex: &mut Exec, scratch: &Buffer, x: &Buffer, c: VocabChunk) {
        let window = Window {
            first: c.v0,
            rows: c.cols,
        };
        let xr = self.rows_of(x, c);
        let y = (scratch, 0, 0);
        ops::matmul_fwd_window(
            ex,
            y,
            xr,
            self.w,
            self.format,
            window,
            c.rows,
            self.d,
            false,
        );
    }

    /// Chunk `c`'s rows of a `[rows, d]` buffer.
    fn rows_of<'b>(&self, b: &'b Buffer, c: VocabChunk) -> ops::Part<'b> {
        let row = self.d * 4;
        (b, (c.row0 * row) as u64, (c.rows * row) as u64)
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
