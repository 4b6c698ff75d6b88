//! Launch geometry and host-side planning of the CUDA backend, all without a device: grid
//! and block sizes per PTX entry (each file's **Layout** section), the strides of the
//! strided f32 GEMM for the three products of a linear layer, the f64-derived scalars of
//! AdamW and the loss, the sampling row, the grad-norm partial ranges and the vocabulary
//! chunks of the fused lm_head. Every function here is what a launch would compute, so the
//! unit tests below check it on the CPU (the strides against the products written out,
//! through a host emulation of the kernel's indexing).

use crate::error::{BackendError, Result};
use crate::model::Loss;

/// Largest `gridDim.x` the driver accepts.
pub const MAX_GRID_X: u64 = (1 << 31) - 1;
/// Largest `gridDim.y` and `gridDim.z`.
pub const MAX_GRID_YZ: u64 = 65_535;
/// Blocks of the grid-stride kernels (residual, SwiGLU, AdamW, loss backward, cast): any
/// grid is correct; this many blocks of 256 threads fill an H200 (132 SMs x 8) several times.
pub const GRID_STRIDE_BLOCKS: u64 = 4096;
/// Head dims the attention kernels support (lane `l` owns dims `l, l+32, l+64, l+96`).
pub const ATTENTION_HEAD_DIMS: [usize; 4] = [32, 64, 96, 128];
/// Most partial sums `grad_norm` writes for one tensor.
pub const GRAD_NORM_MAX_PARTIALS: usize = 1024;

/// A kernel launch's grid and block, in threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchDims {
    /// `gridDim`.
    pub grid: (u32, u32, u32),
    /// `blockDim`.
    pub block: (u32, u32, u32),
}

impl LaunchDims {
    /// A grid of `(x, y)` blocks of `threads`; refuses a grid past the driver's limits and
    /// an empty one (callers skip launches over zero elements).
    pub fn new(x: u64, y: u64, threads: u32, entry: &str) -> Result<Self> {
        if x == 0 || y == 0 {
            return Err(BackendError::Device(format!(
                "`{entry}` launched over an empty grid"
            )));
        }
        if x > MAX_GRID_X || y > MAX_GRID_YZ {
            return Err(BackendError::invalid(
                entry,
                format!("grid {x} x {y} exceeds the CUDA limit ({MAX_GRID_X} x {MAX_GRID_YZ})"),
            ));
        }
        Ok(Self {
            grid: (x as u32, y as u32, 1),
            block: (threads, 1, 1),
        })
    }

    /// One block of `threads` per row (`embedding_fwd`, `rmsnorm_*`, `rope_*`,
    /// `logprob_fwd`, `sample`).
    pub fn per_row(rows: usize, threads: u32, entry: &str) -> Result<Self> {
        Self::new(rows as u64, 1, threads, entry)
    }

    /// One thread per element, `threads` per block (`embedding_bwd` and `rmsnorm_bwd_dw`
    /// over columns, `logprob_fwd_finish` over rows).
    pub fn per_thread(n: usize, threads: u32, entry: &str) -> Result<Self> {
        Self::new((n as u64).div_ceil(threads as u64), 1, threads, entry)
    }

    /// A grid-stride kernel over `n` elements: blocks of 256, at most
    /// [`GRID_STRIDE_BLOCKS`].
    pub fn grid_stride(n: usize, entry: &str) -> Result<Self> {
        let blocks = (n as u64).div_ceil(256).min(GRID_STRIDE_BLOCKS);
        Self::new(blocks, 1, 256, entry)
    }

    /// One warp per pair, four per block of 128 (`attention_*`).
    pub fn warp_per_pair(pairs: usize, entry: &str) -> Result<Self> {
        Self::new((pairs as u64).div_ceil(4), 1, 128, entry)
    }

    /// 64x64 output tiles over `cols` x `rows` (the GEMMs): grid `(ceil(cols/64),
    /// ceil(rows/64))`.
    pub fn tiles(cols: usize, rows: usize, threads: u32, entry: &str) -> Result<Self> {
        Self::new(
            (cols as u64).div_ceil(64),
            (rows as u64).div_ceil(64),
            threads,
            entry,
        )
    }

    /// `logprob_bwd`: `(rows, ceil(chunk/256))` blocks of 256.
    pub fn row_chunks(rows: usize, chunk: usize, entry: &str) -> Result<Self> {
        Self::new(rows as u64, (chunk as u64).div_ceil(256), 256, entry)
    }
}

/// One launch of the strided f32 GEMM `matmul_fwd_f32`: `C[m, n] (=|+=) A[m, k] . B[k, n]`
/// with `A[i, k] = a[i*rsa + k*csa]`, `B[k, j] = b[k*rsb + j*csb]` and row-major `C`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmF32 {
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// Reduction length.
    pub k: usize,
    /// Row stride of A.
    pub rsa: usize,
    /// Column stride of A.
    pub csa: usize,
    /// Row stride of B.
    pub rsb: usize,
    /// Column stride of B.
    pub csb: usize,
    /// Add into C instead of overwriting it.
    pub accumulate: bool,
}

impl GemmF32 {
    /// `y[rows, dout] = x[rows, din] . w[dout, din]^T` (the linear layer's forward):
    /// A = x, B[k, j] = w[j, k].
    pub fn fwd(rows: usize, din: usize, dout: usize) -> Self {
        Self {
            m: rows,
            n: dout,
            k: din,
            rsa: din,
            csa: 1,
            rsb: 1,
            csb: din,
            accumulate: false,
        }
    }

    /// `dx[rows, din] += dy[rows, dout] . w[dout, din]`.
    pub fn bwd_dx(rows: usize, din: usize, dout: usize) -> Self {
        Self {
            m: rows,
            n: din,
            k: dout,
            rsa: dout,
            csa: 1,
            rsb: din,
            csb: 1,
            accumulate: true,
        }
    }

    /// `dw[dout, din] += dy^T . x` (the sum over rows): A[i, k] = dy[k, i], B = x.
    pub fn bwd_dw(rows: usize, din: usize, dout: usize) -> Self {
        Self {
            m: dout,
            n: din,
            k: rows,
            rsa: 1,
            csa: dout,
            rsb: din,
            csb: 1,
            accumulate: true,
        }
    }

    /// The launch: 64x64 tiles of 256 threads (16x16 threads x 4x4 outputs).
    pub fn dims(&self) -> Result<LaunchDims> {
        LaunchDims::tiles(self.n, self.m, 256, "matmul_fwd_f32")
    }

    /// Elements of `a` and `b` the kernel reads (the largest index + 1), for bounds checks
    /// against the buffers before a launch.
    pub fn extents(&self) -> (usize, usize) {
        if self.m == 0 || self.n == 0 || self.k == 0 {
            return (0, 0);
        }
        (
            (self.m - 1) * self.rsa + (self.k - 1) * self.csa + 1,
            (self.k - 1) * self.rsb + (self.n - 1) * self.csb + 1,
        )
    }
}

/// The tensor-core GEMMs (`matmul_fwd`, `matmul_bwd_dx`, `matmul_bwd_dw`) stage 16-byte
/// chunks of bf16 rows: the row widths of both operands (the reduction `k` and, for the
/// backward, the output width `n`) must be multiples of 8. Qwen3's widths are multiples of
/// 128; the f32 path takes any shape.
pub fn check_tensor_core(entry: &str, widths: &[usize]) -> Result<()> {
    for &w in widths {
        if w == 0 || w % 8 != 0 {
            return Err(BackendError::invalid(
                entry,
                format!("row width {w} is not a positive multiple of 8 (16-byte bf16 chunks)"),
            ));
        }
    }
    Ok(())
}

/// Refuses a head dim the attention kernels cannot run.
pub fn check_head_dim(hd: usize) -> Result<()> {
    if ATTENTION_HEAD_DIMS.contains(&hd) {
        Ok(())
    } else {
        Err(BackendError::config(
            "head_dim",
            format!("{hd} is not one the CUDA attention kernels support ({ATTENTION_HEAD_DIMS:?})"),
        ))
    }
}

/// The smallest supported head dim `>= hd` (to run a smaller head zero-padded: zeros add
/// nothing to the dot products, and the scale is passed separately), or `None` above 128.
pub fn padded_head_dim(hd: usize) -> Option<usize> {
    ATTENTION_HEAD_DIMS.iter().copied().find(|&p| p >= hd)
}

/// The attention scale `head_dim^-1/2`, as the CPU reference rounds it.
pub fn attention_scale(hd: usize) -> f32 {
    (1.0 / (hd as f64).sqrt()) as f32
}

/// The AdamW scalars the `adamw_step` kernel reads.
pub use crate::model::AdamScalars;
/// Per-token flag bits of the loss kernels (shared by every device backend).
pub use crate::model::loss::flags;

/// The loss kernels' scalar arguments: `(objective, lo, hi, beta)`, objective 0 = GRPO,
/// 1 = SFT; `lo = 1 - eps_low` and `hi = 1 + eps_high` in f64, rounded once.
pub fn loss_scalars(loss: Loss) -> (u32, f32, f32, f32) {
    match loss {
        Loss::Grpo {
            eps_low,
            eps_high,
            beta,
        } => (
            0,
            (1.0 - eps_low) as f32,
            (1.0 + eps_high) as f32,
            beta as f32,
        ),
        Loss::Sft => (1, 1.0, 1.0, 0.0),
    }
}

/// Blocks (= partial sums) `grad_norm` uses for an `n`-value tensor: derived from `n` alone,
/// so the sum's order never depends on the batch or the device.
pub fn grad_norm_partials(n: usize) -> usize {
    n.div_ceil(256).clamp(1, GRAD_NORM_MAX_PARTIALS)
}

/// Each tensor's first partial and the total, for tensors of `lens` values: the ranges are
/// disjoint and in tensor order, so one `grad_norm_reduce` sums them in a fixed order.
pub fn grad_norm_bases(lens: &[usize]) -> (Vec<usize>, usize) {
    let mut bases = Vec::with_capacity(lens.len());
    let mut at = 0;
    for &n in lens {
        bases.push(at);
        at += grad_norm_partials(n);
    }
    (bases, at)
}

/// The vocabulary chunks `[v0, v0 + len)` of the fused lm_head for `rows` scored rows
/// under a scratch budget of `budget` floats: each chunk's logits `[rows, len]` fit the
/// budget, `len` is a multiple of 8 (a bf16 lm_head slice then starts on a 16-byte
/// boundary for the tensor-core path) except the last, and at least 8 columns.
pub fn vocab_chunks(rows: usize, vocab: usize, budget: usize) -> Vec<(usize, usize)> {
    let per = (budget / rows.max(1)).max(8);
    let len = if per >= vocab { vocab } else { (per / 8) * 8 };
    let mut out = Vec::with_capacity(vocab.div_ceil(len.max(1)));
    let mut v0 = 0;
    while v0 < vocab {
        let l = len.min(vocab - v0);
        out.push((v0, l));
        v0 += l;
    }
    out
}

/// Capacity for a batch of `n` rows: the next power of two, at least `floor`, so that
/// buffers are reallocated O(log n) times and then reused.
pub fn capacity(n: usize, floor: usize) -> usize {
    n.next_power_of_two().max(floor)
}

/// Slot geometry of the KV cache for a new request needing `need` positions: `(slots,
/// rows per slot)`, both never below the current ones. Slots start sized for the longest
/// request seen (not the model's position limit, which can be 40k) and double when none
/// is free.
pub fn slot_plan(
    cur_slots: usize,
    cur_rows: usize,
    free: usize,
    need: usize,
    max_pos: usize,
) -> (usize, usize) {
    let rows = if need > cur_rows {
        need.next_power_of_two().clamp(64, max_pos.max(need))
    } else {
        cur_rows
    };
    let slots = if free == 0 {
        (cur_slots * 2).max(16)
    } else {
        cur_slots
    };
    (slots, rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's indexing, on the host: what `matmul_fwd_f32` computes for `g`.
    fn emulate(g: &GemmF32, c: &mut [f32], a: &[f32], b: &[f32]) {
        for i in 0..g.m {
            for j in 0..g.n {
                let mut s = 0.0f32;
                for k in 0..g.k {
                    s += a[i * g.rsa + k * g.csa] * b[k * g.rsb + j * g.csb];
                }
                let o = &mut c[i * g.n + j];
                *o = if g.accumulate { *o + s } else { s };
            }
        }
    }

    fn vals(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    #[test]
    fn gemm_strides_compute_the_linear_layer_products() {
        let (rows, din, dout) = (5, 7, 3);
        let (x, w, dy) = (
            vals(rows * din, 1),
            vals(dout * din, 2),
            vals(rows * dout, 3),
        );
        // The products written out: y = x·wᵀ, dx += dy·w, dw += dyᵀ·x.
        let dot = |a: &mut f32, terms: &mut dyn Iterator<Item = (f32, f32)>| {
            for (p, q) in terms {
                *a += p * q;
            }
        };
        let mut y = vec![0.0; rows * dout];
        for i in 0..rows {
            for j in 0..dout {
                dot(
                    &mut y[i * dout + j],
                    &mut (0..din).map(|k| (x[i * din + k], w[j * din + k])),
                );
            }
        }
        let mut gy = vec![9.0; rows * dout];
        let f = GemmF32::fwd(rows, din, dout);
        assert_eq!(f.extents(), (x.len(), w.len()));
        emulate(&f, &mut gy, &x, &w);
        for (a, b) in gy.iter().zip(&y) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        let (dx0, dw0) = (vals(rows * din, 4), vals(dout * din, 5));
        let (mut dx, mut dw) = (dx0.clone(), dw0.clone());
        for i in 0..rows {
            for k in 0..din {
                dot(
                    &mut dx[i * din + k],
                    &mut (0..dout).map(|j| (dy[i * dout + j], w[j * din + k])),
                );
            }
        }
        for j in 0..dout {
            for k in 0..din {
                dot(
                    &mut dw[j * din + k],
                    &mut (0..rows).map(|i| (dy[i * dout + j], x[i * din + k])),
                );
            }
        }
        let (mut gdx, mut gdw) = (dx0, dw0);
        let bx = GemmF32::bwd_dx(rows, din, dout);
        let bw = GemmF32::bwd_dw(rows, din, dout);
        assert_eq!(bx.extents(), (dy.len(), w.len()));
        assert_eq!(bw.extents(), (dy.len(), x.len()));
        emulate(&bx, &mut gdx, &dy, &w);
        emulate(&bw, &mut gdw, &dy, &x);
        for (a, b) in gdx.iter().zip(&dx).chain(gdw.iter().zip(&dw)) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    #[test]
    fn launch_dims_follow_each_layout_and_refuse_limits() {
        let t = LaunchDims::tiles(200, 65, 128, "matmul_fwd").unwrap();
        assert_eq!((t.grid, t.block), ((4, 2, 1), (128, 1, 1)));
        let g = GemmF32::fwd(1, 8, 151_936).dims().unwrap();
        assert_eq!((g.grid, g.block), ((2374, 1, 1), (256, 1, 1)));
        assert_eq!(
            LaunchDims::warp_per_pair(9, "attention_fwd").unwrap().grid,
            (3, 1, 1)
        );
        assert_eq!(
            LaunchDims::grid_stride(10_000_000, "residual_fwd")
                .unwrap()
                .grid,
            (4096, 1, 1)
        );
        assert_eq!(
            LaunchDims::grid_stride(7, "residual_fwd").unwrap().grid,
            (1, 1, 1)
        );
        assert_eq!(
            LaunchDims::per_thread(130, 128, "rmsnorm_bwd_dw")
                .unwrap()
                .grid,
            (2, 1, 1)
        );
        assert_eq!(
            LaunchDims::row_chunks(3, 513, "logprob_bwd").unwrap().grid,
            (3, 3, 1)
        );
        // 65,536 row tiles = 4M+ rows: past gridDim.y.
        let e = LaunchDims::tiles(64, 64 * 65_536, 256, "matmul_fwd_f32").unwrap_err();
        assert!(e.to_string().contains("exceeds the CUDA limit"), "{e}");
        assert!(LaunchDims::per_row(0, 256, "sample").is_err());
    }

    #[test]
    fn tensor_core_and_head_dim_checks() {
        assert!(check_tensor_core("matmul_fwd", &[1024, 128]).is_ok());
        let e = check_tensor_core("matmul_bwd_dx", &[1024, 12]).unwrap_err();
        assert!(
            e.to_string().contains("12 is not a positive multiple of 8"),
            "{e}"
        );
        assert!(check_head_dim(128).is_ok());
        assert!(
            check_head_dim(4)
                .unwrap_err()
                .to_string()
                .contains("head_dim")
        );
        assert_eq!(padded_head_dim(4), Some(32));
        assert_eq!(padded_head_dim(96), Some(96));
        assert_eq!(padded_head_dim(100), Some(128));
        assert_eq!(padded_head_dim(256), None);
        assert_eq!(attention_scale(128), (1.0 / 128f64.sqrt()) as f32);
    }

    #[test]
    fn adam_kernel_order_is_the_shared_update_bit_for_bit() {
        // Apply the scalars with the kernel's per-element order and compare with the update
        // every backend runs (`AdamScalars::apply`).
        let (lr, b1, b2, eps, wd, gs) = (3e-3, 0.9, 0.95, 1e-8, 0.1, 0.37f32);
        let p0 = vals(257, 9);
        let (mut p, mut m, mut v) = (p0.clone(), vec![0.0; 257], vec![0.0; 257]);
        let (mut kp, mut km, mut kv) = (p0, vec![0.0; 257], vec![0.0; 257]);
        for t in 1..=3 {
            let g = vals(257, 10 + t as u32);
            let s = AdamScalars::new(gs, lr, b1, b2, eps, wd, t);
            for i in 0..257 {
                (m[i], v[i]) = s.apply(g[i], &mut p[i], m[i], v[i]);
                let gi = g[i] * s.grad_scale;
                kp[i] *= s.decay;
                km[i] += s.one_minus_beta1 * (gi - km[i]);
                kv[i] = kv[i] * s.beta2 + s.one_minus_beta2 * gi * gi;
                kp[i] -= s.step_size * (km[i] / (kv[i].sqrt() / s.sqrt_bc2 + s.eps));
            }
        }
        assert_eq!(kp, p);
        assert_eq!(km, m);
        assert_eq!(kv, v);
    }

    #[test]
    fn loss_scalars_round_the_clip_range_once() {
        let grpo = Loss::Grpo {
            eps_low: 0.2,
            eps_high: 0.28,
            beta: 0.05,
        };
        assert_eq!(loss_scalars(grpo), (0, 0.8f32, 1.28f32, 0.05f32));
        assert_eq!(loss_scalars(Loss::Sft).0, 1);
    }

    #[test]
    fn grad_norm_ranges_are_disjoint_and_fixed_by_size() {
        assert_eq!(grad_norm_partials(1), 1);
        assert_eq!(grad_norm_partials(257), 2);
        assert_eq!(grad_norm_partials(100_000_000), GRAD_NORM_MAX_PARTIALS);
        let (bases, total) = grad_norm_bases(&[1, 300, 70_000]);
        assert_eq!(bases, vec![0, 1, 3]);
        assert_eq!(total, 3 + 274);
    }

    #[test]
    fn vocab_chunks_cover_the_vocabulary_within_budget() {
        for &(rows, vocab, budget) in &[
            (7, 151_936, 1 << 20),
            (1, 11, 1 << 20),
            (4096, 151_936, 1 << 22),
            (3, 1000, 10),
        ] {
            let ch = vocab_chunks(rows, vocab, budget);
            let mut at = 0;
            for (i, &(v0, len)) in ch.iter().enumerate() {
                assert_eq!(v0, at);
                assert!(len > 0);
                if i + 1 < ch.len() {
                    assert_eq!(len % 8, 0, "{rows} {vocab} {budget}");
                    assert!(rows * len <= budget.max(8 * rows));
                }
                at += len;
            }
            assert_eq!(at, vocab);
        }
        assert_eq!(vocab_chunks(7, 11, 1 << 20), vec![(0, 11)]);
        assert_eq!(capacity(65, 64), 128);
        assert_eq!(capacity(3, 64), 64);
    }

    #[test]
    fn kv_slots_grow_by_doubling_and_to_the_longest_request() {
        // First request: 16 slots of 64 rows.
        assert_eq!(slot_plan(0, 0, 0, 10, 512), (16, 64));
        // A free slot and a request that fits: nothing changes.
        assert_eq!(slot_plan(16, 64, 3, 64, 512), (16, 64));
        // Longer than a slot: rows to the next power of two, capped at the position limit
        // unless the request itself is longer.
        assert_eq!(slot_plan(16, 64, 3, 65, 512), (16, 128));
        assert_eq!(slot_plan(16, 64, 3, 300, 256), (16, 300));
        // No free slot: double.
        assert_eq!(slot_plan(16, 64, 0, 10, 512), (32, 64));
    }
}
