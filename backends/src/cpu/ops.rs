//! The plain reference ops: one `*_fwd` / `*_bwd` pair per operation, llm.c style.
//!
//! Slices in, slices out, row-major, no allocation, no threads (the model parallelises across
//! sequences; matrix products go through `matrixmultiply`, split into row bands on the
//! current rayon pool). Every op is
//! generic over [`Float`] so that the very code the backend runs in f32 is checked against finite
//! differences in f64. Backward ops **accumulate** (`+=`) into their gradient outputs, so that
//! residual branches and tied weights add up without extra buffers; callers zero them.
//!
//! The names are the workspace's op names (WGSL entry points and `Kernel::` variants use the
//! same ones). Shapes use `n` rows (tokens), `d`/`din`/`dout` widths, `h` query heads, `kvh`
//! key/value heads, `hd` head width, `v` vocabulary.

use crate::model::AdamScalars;
pub use crate::model::real::Real;
/// The table the RoPE ops read.
pub use crate::model::rope::RopeTable;
use half::{bf16, f16};

/// The float types the reference runs in: f32 (the backend) and f64 (gradient checks), with
/// the matrix products each runs on.
pub trait Float: Real {
    /// `out[n, dout] = x[n, din]·wᵀ` (the forward product; f32 uses the batch-invariant SIMD
    /// kernel of `cpu::kernel`, f64 the GEMM).
    fn matmul_nt(out: &mut [Self], x: &[Self], w: &[Self], n: usize, din: usize, dout: usize);
    /// The same product with bf16 weights, bit-identical to [`Float::matmul_nt`] on the
    /// weights widened to `Self` (f32: `cpu::kernel::matmul_nt_bf16`).
    fn matmul_nt_bf16(out: &mut [Self], x: &[Self], w: &[bf16], n: usize, din: usize, dout: usize);
    /// The same with f16 weights (f32: `cpu::kernel::matmul_nt_f16`).
    fn matmul_nt_f16(out: &mut [Self], x: &[Self], w: &[f16], n: usize, din: usize, dout: usize);
    /// `C ← α·A·B + β·C` with element strides, as `matrixmultiply::{s,d}gemm`.
    ///
    /// # Safety
    /// Every index `i·rs + j·cs` for `i < rows`, `j < cols` of each operand must be in bounds of
    /// its allocation, and `c` must not alias `a` or `b`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm_raw(
        m: usize,
        k: usize,
        n: usize,
        alpha: Self,
        a: *const Self,
        rsa: isize,
        csa: isize,
        b: *const Self,
        rsb: isize,
        csb: isize,
        beta: Self,
        c: *mut Self,
        rsc: isize,
        csc: isize,
    );
}

macro_rules! impl_float {
    ($t:ty, $gemm:path, $nt:path, $nt16:path, $ntf16:path) => {
        impl Float for $t {
            fn matmul_nt_f16(
                out: &mut [Self],
                x: &[Self],
                w: &[f16],
                n: usize,
                din: usize,
                dout: usize,
            ) {
                $ntf16(out, x, w, n, din, dout)
            }
            fn matmul_nt_bf16(
                out: &mut [Self],
                x: &[Self],
                w: &[bf16],
                n: usize,
                din: usize,
                dout: usize,
            ) {
                $nt16(out, x, w, n, din, dout)
            }
            fn matmul_nt(
                out: &mut [Self],
                x: &[Self],
                w: &[Self],
                n: usize,
                din: usize,
                dout: usize,
            ) {
                $nt(out, x, w, n, din, dout)
            }
            unsafe fn gemm_raw(
                m: usize,
                k: usize,
                n: usize,
                alpha: Self,
                a: *const Self,
                rsa: isize,
                csa: isize,
                b: *const Self,
                rsb: isize,
                csb: isize,
                beta: Self,
                c: *mut Self,
                rsc: isize,
                csc: isize,
            ) {
                // SAFETY: the caller upholds the bounds and aliasing contract of this method,
                // which is exactly matrixmultiply's.
                unsafe { $gemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc) }
            }
        }
    };
}
impl_float!(
    f32,
    matrixmultiply::sgemm,
    crate::cpu::kernel::matmul_nt_f32,
    crate::cpu::kernel::matmul_nt_bf16,
    crate::cpu::kernel::matmul_nt_f16
);
impl_float!(
    f64,
    matrixmultiply::dgemm,
    gemm_nt_fallback,
    widened_nt_fallback,
    widened_nt_fallback
);

/// `out = x·widen(w)ᵀ` for bf16 or f16 weights through the GEMM (f64 models).
fn widened_nt_fallback<T: Float, H: Copy + Into<f64>>(
    out: &mut [T],
    x: &[T],
    w: &[H],
    n: usize,
    din: usize,
    dout: usize,
) {
    let wide: Vec<T> = w[..dout * din]
        .iter()
        .map(|&v| T::from_f64(v.into()))
        .collect();
    gemm_nt_fallback(out, x, &wide, n, din, dout);
}

/// A weight matrix (or a tensor the forward reads) in the compute type, bf16 or f16: engines
/// store their weights in 16 bits and the kernel widens them in registers (exact).
#[derive(Debug, Clone, Copy)]
pub enum Mat<'a, T> {
    /// Values in the compute type.
    Full(&'a [T]),
    /// bf16 values.
    Bf16(&'a [bf16]),
    /// f16 values.
    F16(&'a [f16]),
}

impl<'a, T> Mat<'a, T> {
    /// The elements `r`.
    pub fn slice(self, r: std::ops::Range<usize>) -> Self {
        match self {
            Mat::Full(w) => Mat::Full(&w[r]),
            Mat::Bf16(w) => Mat::Bf16(&w[r]),
            Mat::F16(w) => Mat::F16(&w[r]),
        }
    }
}

impl<'a, T> From<&'a [T]> for Mat<'a, T> {
    fn from(w: &'a [T]) -> Self {
        Mat::Full(w)
    }
}

impl<'a, T> From<&'a Vec<T>> for Mat<'a, T> {
    fn from(w: &'a Vec<T>) -> Self {
        Mat::Full(w)
    }
}

/// Highest element index + 1 that a `rows × cols` operand with these strides touches.
fn extent(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

/// Safe GEMM: `C[m×n] ← A[m×k]·B[k×n] + β·C` with (row, column) strides per operand.
#[allow(clippy::too_many_arguments)]
fn gemm<T: Float>(
    m: usize,
    k: usize,
    n: usize,
    a: &[T],
    (rsa, csa): (usize, usize),
    b: &[T],
    (rsb, csb): (usize, usize),
    beta: T,
    c: &mut [T],
    (rsc, csc): (usize, usize),
) {
    // Internal invariant: the model sizes its buffers from the validated config, so a failure
    // here is a bug in this crate, never a consequence of user input.
    assert!(
        extent(m, k, rsa, csa) <= a.len()
            && extent(k, n, rsb, csb) <= b.len()
            && extent(m, n, rsc, csc) <= c.len(),
        "gemm operand out of bounds (m={m}, k={k}, n={n})"
    );
    if m == 0 || n == 0 {
        return;
    }
    // Row bands of C on the current rayon pool (the backend's threads): a band is the same
    // GEMM on fewer rows, and matrixmultiply's per-element arithmetic (the k blocking and the
    // micro-kernel's order) does not depend on the rows around it, so the bits are those of
    // one call whatever the thread count.
    let threads = rayon::current_num_threads();
    // Bands need rows of C that do not overlap (a row-major C: every caller's).
    let disjoint_rows = extent(1, n, rsc, csc) <= rsc;
    let band = if threads > 1 && disjoint_rows && m * k * n >= GEMM_PAR_MIN_FMA {
        m.div_ceil(2 * threads).next_multiple_of(16)
    } else {
        m
    };
    let (a, c) = (BandPtr(a.as_ptr()), BandPtr(c.as_mut_ptr()));
    let run = |i0: usize| {
        let rows = band.min(m - i0);
        // SAFETY: the assert above keeps every index of rows i0..i0 + rows inside each slice;
        // bands cover disjoint rows of `c` (checked above whenever there is more than one),
        // which is a unique borrow and so aliases neither `a` nor `b`. Strides are below
        // isize::MAX because they index into existing allocations.
        unsafe {
            T::gemm_raw(
                rows,
                k,
                n,
                T::ONE,
                a.get().add(i0 * rsa),
                rsa as isize,
                csa as isize,
                b.as_ptr(),
                rsb as isize,
                csb as isize,
                beta,
                c.get().add(i0 * rsc),
                rsc as isize,
                csc as isize,
            )
        }
    };
    if band >= m {
        run(0);
    } else {
        use rayon::prelude::*;
        (0..m).into_par_iter().step_by(band).for_each(run);
    }
}

/// Below this many multiply-adds a GEMM runs on the calling thread.
const GEMM_PAR_MIN_FMA: usize = 1 << 20;

/// A raw operand pointer the GEMM bands of one [`gemm`] call share across threads: `a` is
/// only read, and each band writes only its own rows of `c`, while the call's borrows live.
#[derive(Clone, Copy)]
struct BandPtr<P>(P);
// SAFETY: see the type's doc; the pointee types are `Float`s (Send + Sync).
unsafe impl<P> Send for BandPtr<P> {}
// SAFETY: as above.
unsafe impl<P> Sync for BandPtr<P> {}
impl<P: Copy> BandPtr<P> {
    fn get(self) -> P {
        self.0
    }
}

/// Dot product with 8 independent partial sums (lane `i mod 8`), added in a fixed tree: the
/// compiler keeps the lanes in one vector register instead of a serial dependency chain, and the
/// order is fixed, so results are deterministic.
#[inline]
fn dot<T: Float>(a: &[T], b: &[T]) -> T {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [T::ZERO; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    for (i, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[i] += *x * *y;
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// `out[n, d] = table[ids[t], :]`. `table` is `[vocab, d]`; ids must be below vocab.
pub fn embedding_fwd<'a, T: Float>(
    out: &mut [T],
    ids: &[u32],
    table: impl Into<Mat<'a, T>>,
    d: usize,
) {
    let table = table.into();
    for (row, &id) in out.chunks_exact_mut(d).zip(ids) {
        let id = id as usize;
        match table {
            Mat::Full(t) => row.copy_from_slice(&t[id * d..(id + 1) * d]),
            Mat::Bf16(t) => {
                for (o, x) in row.iter_mut().zip(&t[id * d..(id + 1) * d]) {
                    *o = T::from_f64(x.to_f64());
                }
            }
            Mat::F16(t) => {
                for (o, x) in row.iter_mut().zip(&t[id * d..(id + 1) * d]) {
                    *o = T::from_f64(x.to_f64());
                }
            }
        }
    }
}

/// `dtable[ids[t], :] += dout[t, :]`. `dout` is `[n, d]`, `dtable` `[vocab, d]`.
pub fn embedding_bwd<T: Float>(dtable: &mut [T], dout: &[T], ids: &[u32], d: usize) {
    for (row, &id) in dout.chunks_exact(d).zip(ids) {
        let id = id as usize;
        for (g, x) in dtable[id * d..(id + 1) * d].iter_mut().zip(row) {
            *g += *x;
        }
    }
}

/// RMSNorm over rows of width `d`: `out = w · x / sqrt(mean(x²) + eps)`; `x`, `out` are
/// `[rows, d]`, `w` is `[d]`, `rstd[rows]` keeps `1/sqrt(mean(x²)+eps)` for the backward.
/// Also used per head for `q_norm`/`k_norm` with `rows = tokens × heads`, `d = head_dim`.
pub fn rmsnorm_fwd<T: Float>(out: &mut [T], rstd: &mut [T], x: &[T], w: &[T], d: usize, eps: f64) {
    let inv_d = T::from_f64(1.0 / d as f64);
    let eps = T::from_f64(eps);
    for ((o, r), xr) in out
        .chunks_exact_mut(d)
        .zip(rstd.iter_mut())
        .zip(x.chunks_exact(d))
    {
        let ms = dot(xr, xr) * inv_d;
        let s = T::ONE / (ms + eps).sqrt();
        *r = s;
        for ((oi, xi), wi) in o.iter_mut().zip(xr).zip(w) {
            *oi = *wi * (*xi * s);
        }
    }
}

/// Backward of [`rmsnorm_fwd`]: `dx += r·(g − x·r²·mean(g·x))` with `g = dout·w`, and
/// `dw += Σ_rows dout·x·r`. Shapes as the forward.
pub fn rmsnorm_bwd<T: Float>(
    dx: &mut [T],
    dw: &mut [T],
    dout: &[T],
    x: &[T],
    w: &[T],
    rstd: &[T],
    d: usize,
) {
    let inv_d = T::from_f64(1.0 / d as f64);
    for (((dxr, dor), xr), &r) in dx
        .chunks_exact_mut(d)
        .zip(dout.chunks_exact(d))
        .zip(x.chunks_exact(d))
        .zip(rstd)
    {
        let mut gx = T::ZERO;
        for i in 0..d {
            gx += dor[i] * w[i] * xr[i];
        }
        let c = r * r * r * gx * inv_d;
        for i in 0..d {
            dxr[i] += r * dor[i] * w[i] - c * xr[i];
            dw[i] += dor[i] * xr[i] * r;
        }
    }
}

/// `out[n, dout] = x[n, din] · wᵀ` with `w` stored `[dout, din]` (torch's Linear, no bias).
/// In f32 each output element's bits do not depend on `n` (see `cpu::kernel`); bf16 and f16
/// weights give the bits of their f32 widening.
pub fn matmul_fwd<'a, T: Float>(
    out: &mut [T],
    x: &[T],
    w: impl Into<Mat<'a, T>>,
    n: usize,
    din: usize,
    dout: usize,
) {
    match w.into() {
        Mat::Full(w) => T::matmul_nt(out, x, w, n, din, dout),
        Mat::Bf16(w) => T::matmul_nt_bf16(out, x, w, n, din, dout),
        Mat::F16(w) => T::matmul_nt_f16(out, x, w, n, din, dout),
    }
}

/// `out = x·wᵀ` through matrixmultiply (f64, and f32 without AVX2+FMA).
pub(crate) fn gemm_nt_fallback<T: Float>(
    out: &mut [T],
    x: &[T],
    w: &[T],
    n: usize,
    din: usize,
    dout: usize,
) {
    gemm(
        n,
        din,
        dout,
        x,
        (din, 1),
        w,
        (1, din),
        T::ZERO,
        out,
        (dout, 1),
    );
}

/// Backward of [`matmul_fwd`]: `dx[n, din] += dy·w` (skipped when `None`, e.g. below the
/// embedding) and `dw[dout, din] += dyᵀ·x`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_bwd<T: Float>(
    dx: Option<&mut [T]>,
    dw: &mut [T],
    dy: &[T],
    x: &[T],
    w: &[T],
    n: usize,
    din: usize,
    dout: usize,
) {
    if let Some(dx) = dx {
        gemm(
            n,
            dout,
            din,
            dy,
            (dout, 1),
            w,
            (din, 1),
            T::ONE,
            dx,
            (din, 1),
        );
    }
    gemm(
        dout,
        n,
        din,
        dy,
        (1, dout),
        x,
        (din, 1),
        T::ONE,
        dw,
        (din, 1),
    );
}

/// Rotate-half RoPE in place: for each row `t` at position `pos[t]` and each of the `heads` heads
/// of width `hd = 2·half`, pair `i` with `i + half`:
/// `(x₁, x₂) ← (x₁·c − x₂·s, x₂·c + x₁·s)`. `x` is `[n, heads·hd]`.
pub fn rope_fwd<T: Float>(x: &mut [T], pos: &[u32], heads: usize, table: &RopeTable<T>) {
    rope_apply(x, pos, heads, table, false);
}

/// Backward of [`rope_fwd`], in place on the gradient: the transposed rotation
/// `(g₁, g₂) ← (g₁·c + g₂·s, g₂·c − g₁·s)`.
pub fn rope_bwd<T: Float>(dx: &mut [T], pos: &[u32], heads: usize, table: &RopeTable<T>) {
    rope_apply(dx, pos, heads, table, true);
}

fn rope_apply<T: Float>(
    x: &mut [T],
    pos: &[u32],
    heads: usize,
    table: &RopeTable<T>,
    inverse: bool,
) {
    let half = table.half;
    let hd = 2 * half;
    for (row, &p) in x.chunks_exact_mut(heads * hd).zip(pos) {
        let c = &table.cos[p as usize * half..(p as usize + 1) * half];
        let s = &table.sin[p as usize * half..(p as usize + 1) * half];
        for head in row.chunks_exact_mut(hd) {
            let (x1, x2) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (x1[i], x2[i]);
                let si = if inverse { -s[i] } else { s[i] };
                x1[i] = a * c[i] - b * si;
                x2[i] = b * c[i] + a * si;
            }
        }
    }
}

/// Causal grouped-query attention of one sequence (or one request's chunk against its KV cache).
///
/// `q` is `[nq, h·hd]`, `k`, `v` are `[nk, kvh·hd]`, `out` is `[nq, h·hd]`, `att` (saved softmax
/// probabilities) is `[h, nq, nk]`. Query row `i` sits at position `nk − nq + i` and attends to
/// keys `0..=nk − nq + i`; query head `hh` reads kv head `hh / (h / kvh)`; scores are scaled by
/// `hd^-½`. `nq ≤ nk`.
#[allow(clippy::too_many_arguments)]
pub fn attention_fwd<T: Float>(
    out: &mut [T],
    att: &mut [T],
    q: &[T],
    k: &[T],
    v: &[T],
    nq: usize,
    nk: usize,
    h: usize,
    kvh: usize,
    hd: usize,
) {
    let kd = kvh * hd;
    let (k, v) = (Contiguous { x: k, kd }, Contiguous { x: v, kd });
    attention_fwd_rows(out, att, q, &k, &v, nq, nk, h, kvh, hd);
}

/// Where the key (or value) row of each position lives: a contiguous `[nk, kv_dim]` slice
/// ([`Contiguous`]) or rows of a paged KV pool ([`PagedRows`]).
pub trait KvRows<T> {
    /// Position `j`'s `kv_dim` values.
    fn at(&self, j: usize) -> &[T];
}

/// Rows of `kd` values one after another.
#[derive(Debug, Clone, Copy)]
pub struct Contiguous<'a, T> {
    /// The rows.
    pub x: &'a [T],
    /// Values per row.
    pub kd: usize,
}

impl<T> KvRows<T> for Contiguous<'_, T> {
    #[inline]
    fn at(&self, j: usize) -> &[T] {
        &self.x[j * self.kd..(j + 1) * self.kd]
    }
}

/// A request's rows in a paged pool: position `j` is pool row
/// `table[j / page_rows] * page_rows + j % page_rows`.
#[derive(Debug, Clone, Copy)]
pub struct PagedRows<'a, T> {
    /// The pool, `[rows, kd]`.
    pub pool: &'a [T],
    /// The request's page table.
    pub table: &'a [u32],
    /// Positions per page.
    pub page_rows: usize,
    /// Values per row.
    pub kd: usize,
}

impl<T> PagedRows<'_, T> {
    /// The pool row of position `j`.
    #[inline]
    pub fn row(&self, j: usize) -> usize {
        self.table[j / self.page_rows] as usize * self.page_rows + j % self.page_rows
    }
}

impl<T> KvRows<T> for PagedRows<'_, T> {
    #[inline]
    fn at(&self, j: usize) -> &[T] {
        let r = self.row(j);
        &self.pool[r * self.kd..(r + 1) * self.kd]
    }
}

/// [`attention_fwd`] with the keys and values wherever `k` and `v` find them (a decode
/// chunk against its request's pages); the same arithmetic, so the same bits.
#[allow(clippy::too_many_arguments)]
pub fn attention_fwd_rows<T: Float>(
    out: &mut [T],
    att: &mut [T],
    q: &[T],
    k: &impl KvRows<T>,
    v: &impl KvRows<T>,
    nq: usize,
    nk: usize,
    h: usize,
    kvh: usize,
    hd: usize,
) {
    let qd = h * hd;
    out[..nq * qd].fill(T::ZERO);
    for hh in 0..h {
        for i in 0..nq {
            let row = &mut att[(hh * nq + i) * nk..(hh * nq + i + 1) * nk];
            let o = &mut out[i * qd + hh * hd..i * qd + (hh + 1) * hd];
            attention_row(o, row, q, k, v, i, hh, nq, nk, h, kvh, hd);
        }
    }
}

/// [`attention_fwd`] without the probabilities: keeps only each row's log-sum-exp of the scaled
/// scores, `lse[h, nq]`, from which [`attention_bwd_lse`] recomputes them (flash-attention
/// style), so training saves `h·nq` values per sequence and layer instead of `h·nq·nk`. The
/// output has the same bits as [`attention_fwd`]'s (same row code). `scratch` holds `nk` values.
#[allow(clippy::too_many_arguments)]
pub fn attention_fwd_lse<T: Float>(
    out: &mut [T],
    lse: &mut [T],
    scratch: &mut [T],
    q: &[T],
    k: &[T],
    v: &[T],
    nq: usize,
    nk: usize,
    h: usize,
    kvh: usize,
    hd: usize,
) {
    let (qd, kd) = (h * hd, kvh * hd);
    let (k, v) = (&Contiguous { x: k, kd }, &Contiguous { x: v, kd });
    out[..nq * qd].fill(T::ZERO);
    for hh in 0..h {
        for i in 0..nq {
            let o = &mut out[i * qd + hh * hd..i * qd + (hh + 1) * hd];
            lse[hh * nq + i] =
                attention_row(o, &mut scratch[..nk], q, k, v, i, hh, nq, nk, h, kvh, hd);
        }
    }
}

/// One query row of one head: leaves the probabilities in `row[..nk]`, adds `P·V` into `o`
/// (zeroed by the caller) and returns the log-sum-exp of the scaled scores.
#[allow(clippy::too_many_arguments)]
#[inline]
fn attention_row<T: Float>(
    o: &mut [T],
    row: &mut [T],
    q: &[T],
    k: &impl KvRows<T>,
    v: &impl KvRows<T>,
    i: usize,
    hh: usize,
    nq: usize,
    nk: usize,
    h: usize,
    kvh: usize,
    hd: usize,
) -> T {
    let scale = T::from_f64(1.0 / (hd as f64).sqrt());
    let kh = hh / (h / kvh);
    let qd = h * hd;
    let qi = &q[i * qd + hh * hd..i * qd + (hh + 1) * hd];
    let last = nk - nq + i;
    let mut mx = T::from_f64(f64::NEG_INFINITY);
    for (j, r) in row[..=last].iter_mut().enumerate() {
        let s = dot(qi, &k.at(j)[kh * hd..(kh + 1) * hd]) * scale;
        *r = s;
        mx = mx.max(s);
    }
    let mut sum = T::ZERO;
    for r in row[..=last].iter_mut() {
        *r = (*r - mx).exp();
        sum += *r;
    }
    let inv = T::ONE / sum;
    for r in row[..=last].iter_mut() {
        *r *= inv;
    }
    row[last + 1..nk].fill(T::ZERO);
    for (j, &p) in row[..=last].iter().enumerate() {
        let vj = &v.at(j)[kh * hd..(kh + 1) * hd];
        for (oi, vi) in o.iter_mut().zip(vj) {
            *oi += p * *vi;
        }
    }
    mx + sum.ln()
}

/// Backward of [`attention_fwd`]: accumulates `dq`, `dk`, `dv` (shapes of `q`, `k`, `v`) from
/// `dout`, using the saved `att`. `scratch` holds at least `nk` values.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd<T: Float>(
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
    scratch: &mut [T],
    dout: &[T],
    att: &[T],
    q: &[T],
    k: &[T],
    v: &[T],
    nq: usize,
    nk: usize,
    h: usize,
    kvh: usize,
    hd: usize,
) {
    for hh in 0..h {
        for i in 0..nq {
            let row = &att[(hh * nq + i) * nk..(hh * nq + i + 1) * nk];
            attention_row_bwd(
                dq, dk, dv, scratch, dout, row, q, k, v, i, hh, nq, nk, h, kvh, hd,
            );
        }
    }
}

/// Backward of [`attention_fwd_lse`]: recomputes each row's probabilities from the scores and
/// the saved `lse` (`P = exp(s − lse)`), then runs the same row backward as [`attention_bwd`].
/// `scratch` holds at least `2·nk` values.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd_lse<T: Float>(
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
    scratch: &mut [T],
    dout: &[T],
    lse: &[T],
    q: &[T],
    k: &[T],
    v: &[T],
    nq: usize,
    nk: usize,
    h: usize,
    kvh: usize,
    hd: usize,
) {
    let scale = T::from_f64(1.0 / (hd as f64).sqrt());
    let grp = h / kvh;
    let (qd, kd) = (h * hd, kvh * hd);
    let (prow, rest) = scratch[..2 * nk].split_at_mut(nk);
    for hh in 0..h {
        let kh = hh / grp;
        for i in 0..nq {
            let qi = &q[i * qd + hh * hd..i * qd + (hh + 1) * hd];
            let last = nk - nq + i;
            let l = lse[hh * nq + i];
            for j in 0..=last {
                let s = dot(qi, &k[j * kd + kh * hd..j * kd + (kh + 1) * hd]) * scale;
                prow[j] = (s - l).exp();
            }
            attention_row_bwd(
                dq, dk, dv, rest, dout, prow, q, k, v, i, hh, nq, nk, h, kvh, hd,
            );
        }
    }
}

/// Backward of one query row of one head given its probabilities `row[..=last]`.
#[allow(clippy::too_many_arguments)]
#[inline]
fn attention_row_bwd<T: Float>(
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
    scratch: &mut [T],
    dout: &[T],
    row: &[T],
    q: &[T],
    k: &[T],
    v: &[T],
    i: usize,
    hh: usize,
    nq: usize,
    nk: usize,
    h: usize,
    kvh: usize,
    hd: usize,
) {
    let scale = T::from_f64(1.0 / (hd as f64).sqrt());
    let kh = hh / (h / kvh);
    let (qd, kd) = (h * hd, kvh * hd);
    let last = nk - nq + i;
    let go = &dout[i * qd + hh * hd..i * qd + (hh + 1) * hd];
    // dP_j = dout·v_j; dv_j += P_j·dout
    let mut pdp = T::ZERO;
    for j in 0..=last {
        let r = j * kd + kh * hd..j * kd + (kh + 1) * hd;
        let dp = dot(go, &v[r.clone()]);
        scratch[j] = dp;
        pdp += row[j] * dp;
        for (g, o) in dv[r].iter_mut().zip(go) {
            *g += row[j] * *o;
        }
    }
    // softmax backward: dS_j = P_j (dP_j − Σ P·dP), then through the scaled dot product
    let qr = i * qd + hh * hd..i * qd + (hh + 1) * hd;
    let (qi, dqi) = (&q[qr.clone()], &mut dq[qr]);
    for j in 0..=last {
        let ds = row[j] * (scratch[j] - pdp) * scale;
        let kr = j * kd + kh * hd..j * kd + (kh + 1) * hd;
        // zipped slices: no bounds checks in the loop, so it vectorises
        for (g, kv) in dqi.iter_mut().zip(&k[kr.clone()]) {
            *g += ds * *kv;
        }
        for (g, qv) in dk[kr].iter_mut().zip(qi) {
            *g += ds * *qv;
        }
    }
}

#[inline]
fn sigmoid<T: Float>(x: T) -> T {
    T::ONE / (T::ONE + (-x).exp())
}

/// SwiGLU: `out = silu(gate) · up`, all `[n, f]` (flattened).
pub fn swiglu_fwd<T: Float>(out: &mut [T], gate: &[T], up: &[T]) {
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = *g * sigmoid(*g) * *u;
    }
}

/// Backward of [`swiglu_fwd`]: `dup += dout·silu(g)`,
/// `dgate += dout·up·σ(g)(1 + g(1 − σ(g)))`.
pub fn swiglu_bwd<T: Float>(dgate: &mut [T], dup: &mut [T], dout: &[T], gate: &[T], up: &[T]) {
    for i in 0..dout.len() {
        let g = gate[i];
        let s = sigmoid(g);
        dup[i] += dout[i] * g * s;
        dgate[i] += dout[i] * up[i] * s * (T::ONE + g * (T::ONE - s));
    }
}

/// Residual add `out = a + b` (its backward is the identity on both inputs).
pub fn residual_fwd<T: Float>(out: &mut [T], a: &[T], b: &[T]) {
    for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
        *o = *x + *y;
    }
}

/// Log-probs of the sampling distribution: for each row `r` of `logits[rows, v]` (the unfused
/// reference of `cpu::lm_head`, which the model uses),
/// `logp[r] = log_softmax(logits[r]/temperature)[targets[r]]`, `entropy[r]` of that
/// distribution, and `lse[r] = logsumexp(logits[r]/temperature)` kept for the backward.
/// `temperature > 0`.
pub fn logprob_fwd<T: Float>(
    logp: &mut [T],
    entropy: &mut [T],
    lse: &mut [T],
    logits: &[T],
    targets: &[u32],
    v: usize,
    temperature: f64,
) {
    let it = T::from_f64(1.0 / temperature);
    for (r, z) in logits.chunks_exact(v).enumerate() {
        let mut mx = z[0] * it;
        for x in z {
            mx = mx.max(*x * it);
        }
        // The vocabulary sums accumulate in f64: an f32 serial sum over 151,936 terms drifts.
        let mx = mx.to_f64();
        let (mut s, mut sz) = (0.0f64, 0.0f64);
        for x in z {
            let y = (*x * it).to_f64();
            let e = (y - mx).exp();
            s += e;
            sz += e * y;
        }
        let l = mx + s.ln();
        lse[r] = T::from_f64(l);
        logp[r] = T::from_f64((z[targets[r] as usize] * it).to_f64() - l);
        entropy[r] = T::from_f64(l - sz / s);
    }
}

/// Backward of [`logprob_fwd`]: `dlogits[r, j] += dlogp[r]/T · (1[j = target] − p_j)`.
pub fn logprob_bwd<T: Float>(
    dlogits: &mut [T],
    dlogp: &[T],
    logits: &[T],
    targets: &[u32],
    lse: &[T],
    v: usize,
    temperature: f64,
) {
    let it = T::from_f64(1.0 / temperature);
    for (r, (dz, z)) in dlogits
        .chunks_exact_mut(v)
        .zip(logits.chunks_exact(v))
        .enumerate()
    {
        let g = dlogp[r] * it;
        for (d, x) in dz.iter_mut().zip(z) {
            *d -= g * (*x * it - lse[r]).exp();
        }
        dz[targets[r] as usize] += g;
    }
}

/// Hyper-parameters of the per-token GRPO loss (SPEC §6).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GrpoCoefs {
    /// Lower clip range: ρ is clipped at `1 − eps_low`.
    pub eps_low: f64,
    /// Upper clip range: ρ is clipped at `1 + eps_high`.
    pub eps_high: f64,
    /// Weight of the k3 KL term.
    pub beta: f64,
}

/// Per-token GRPO loss: with `ρ = exp(logp − old)`,
/// `loss[t] = w[t]·(−min(ρA, clip(ρ, 1−ε_low, 1+ε_high)·A) + β·KL)`,
/// `KL = exp(ref − logp) − (ref − logp) − 1` (k3; `kl[t]` receives it unweighted), and
/// `clipped[t]` tells whether the clipped branch is the minimum (its gradient is then zero).
/// All slices are per response token; `adv[t]` is the token's sequence advantage.
#[allow(clippy::too_many_arguments)]
pub fn grpo_loss_fwd<T: Float>(
    loss: &mut [T],
    kl: &mut [T],
    clipped: &mut [bool],
    logp: &[T],
    old: &[T],
    refp: &[T],
    adv: &[T],
    w: &[T],
    c: GrpoCoefs,
) {
    let (lo, hi, beta) = (
        T::from_f64(1.0 - c.eps_low),
        T::from_f64(1.0 + c.eps_high),
        T::from_f64(c.beta),
    );
    for t in 0..logp.len() {
        let rho = (logp[t] - old[t]).exp();
        let rc = if rho < lo {
            lo
        } else if rho > hi {
            hi
        } else {
            rho
        };
        let (un, cl) = (rho * adv[t], rc * adv[t]);
        let surr = if un <= cl { un } else { cl };
        clipped[t] = cl < un;
        let dr = refp[t] - logp[t];
        let k = dr.exp() - dr - T::ONE;
        kl[t] = k;
        loss[t] = w[t] * (-surr + beta * k);
    }
}

/// Backward of [`grpo_loss_fwd`] with respect to `logp`, accumulated into `dlogp`:
/// `w·(−ρA·1[unclipped branch is the min] + β·(1 − exp(ref − logp)))`. At a tie (ρ inside the
/// clip range) both branches carry the same gradient, as torch's `min` splits it.
#[allow(clippy::too_many_arguments)]
pub fn grpo_loss_bwd<T: Float>(
    dlogp: &mut [T],
    logp: &[T],
    old: &[T],
    refp: &[T],
    adv: &[T],
    w: &[T],
    c: GrpoCoefs,
) {
    let (lo, hi, beta) = (
        T::from_f64(1.0 - c.eps_low),
        T::from_f64(1.0 + c.eps_high),
        T::from_f64(c.beta),
    );
    for t in 0..logp.len() {
        let rho = (logp[t] - old[t]).exp();
        let rc = if rho < lo {
            lo
        } else if rho > hi {
            hi
        } else {
            rho
        };
        let (un, cl) = (rho * adv[t], rc * adv[t]);
        let dsurr = if un <= cl { un } else { T::ZERO };
        let dkl = T::ONE - (refp[t] - logp[t]).exp();
        dlogp[t] += w[t] * (-dsurr + beta * dkl);
    }
}

/// Sum of squares of `g`, accumulated in f64 (the global norm is its square root over all
/// tensors).
pub fn grad_norm(g: &[f32]) -> f64 {
    use rayon::prelude::*;
    // Fixed chunks summed in f64, then the chunk sums in order: the same bits whatever the
    // number of threads, and the parameter-sized scan runs on all of them.
    let partial: Vec<f64> = g
        .par_chunks(PAR_CHUNK)
        .map(|c| c.iter().map(|x| (*x as f64) * (*x as f64)).sum())
        .collect();
    partial.iter().sum()
}

/// Elements per parallel task of the parameter-sized elementwise passes (grad norm, AdamW,
/// zeroing, finiteness): 256 KiB of f32, large against rayon's per-task cost, small enough to
/// balance over the threads.
pub const PAR_CHUNK: usize = 1 << 16;

/// One AdamW step with `torch.optim.AdamW` semantics (single-tensor path), in place.
///
/// With `g = grad·grad_scale` (the normaliser and the clip factor folded into one scale):
/// `p ← p·(1 − lr·wd)`, `m ← m + (1−β₁)(g − m)` (torch's `lerp`), `v ← β₂v + (1−β₂)g²`,
/// `p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + eps)`. `step` is the 1-based step count `t`.
#[allow(clippy::too_many_arguments)]
pub fn adamw_step(
    p: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    grad_scale: f32,
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    step: u64,
) {
    let c = AdamScalars::new(grad_scale, lr, beta1, beta2, eps, weight_decay, step);
    adamw_chunks::<false>(p, grad, m, v, &c);
}

/// [`adamw_step`] on moments that are all zero (the first step after they were allocated),
/// bit-identical to it, but writing `m` and `v` without reading them: freshly allocated zeroed
/// memory that is read before it is written faults twice per page (the shared zero page on the
/// read, a private page on the write), which at Qwen3-0.6B was 2.3 M of a GRPO step's 3.7 M
/// page faults.
#[allow(clippy::too_many_arguments)]
pub fn adamw_first_step(
    p: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    grad_scale: f32,
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    step: u64,
) {
    let c = AdamScalars::new(grad_scale, lr, beta1, beta2, eps, weight_decay, step);
    adamw_chunks::<true>(p, grad, m, v, &c);
}

/// One AdamW step with precomputed scalars: [`adamw_step`], or [`adamw_first_step`] when
/// `fresh`.
pub fn adamw_apply(
    p: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    s: &AdamScalars,
    fresh: bool,
) {
    if fresh {
        adamw_chunks::<true>(p, grad, m, v, s);
    } else {
        adamw_chunks::<false>(p, grad, m, v, s);
    }
}

/// The elementwise update over chunks on the current thread pool (elementwise, so the
/// split changes no bits); `FRESH` takes the old moments as zero instead of reading them.
fn adamw_chunks<const FRESH: bool>(
    p: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    c: &AdamScalars,
) {
    use rayon::prelude::*;
    p.par_chunks_mut(PAR_CHUNK)
        .zip(grad.par_chunks(PAR_CHUNK))
        .zip(m.par_chunks_mut(PAR_CHUNK).zip(v.par_chunks_mut(PAR_CHUNK)))
        .for_each(|((p, grad), (m, v))| {
            for i in 0..p.len() {
                let (m0, v0) = if FRESH { (0.0, 0.0) } else { (m[i], v[i]) };
                (m[i], v[i]) = c.apply(grad[i], &mut p[i], m0, v0);
            }
        });
}

/// Sampling settings live in the neutral seam module; re-exported for the sampler below.
pub use crate::seam::SamplingParams;

/// Draws one token from `logits[v]` with the uniform draw `u ∈ [0, 1)` and returns it with its
/// log-prob under the sampling distribution `log_softmax(logits / T)` (before top-k/top-p
/// truncation, as SPEC §6 defines the rollout's log-probs).
///
/// Top-k then top-p restrict and renormalise the candidates (transformers' warper order); ties
/// are broken by the lower token id, so the draw is a pure function of `(logits, params, u)`.
/// `scratch` is reused between calls to avoid allocation.
pub fn sample(
    logits: &[f32],
    params: &SamplingParams,
    u: f64,
    scratch: &mut Vec<(f32, u32)>,
) -> (u32, f32) {
    let t = if params.temperature > 0.0 {
        params.temperature as f64
    } else {
        1.0
    };
    let it = 1.0 / t;
    let mut mx = f64::NEG_INFINITY;
    let mut arg = 0usize;
    for (j, z) in logits.iter().enumerate() {
        let s = *z as f64 * it;
        if s > mx {
            mx = s;
            arg = j;
        }
    }
    let total: f64 = logits.iter().map(|z| (*z as f64 * it - mx).exp()).sum();
    let lse = mx + total.ln();
    let logp = |j: usize| (logits[j] as f64 * it - lse) as f32;
    if params.temperature <= 0.0 {
        return (arg as u32, logp(arg));
    }
    let truncate = params.top_k > 0 || params.top_p < 1.0;
    if !truncate {
        // Inverse CDF in token order over unnormalised weights.
        let target = u * total;
        let mut acc = 0.0;
        let mut last_nonzero = arg;
        for (j, z) in logits.iter().enumerate() {
            let e = (*z as f64 * it - mx).exp();
            if e > 0.0 {
                last_nonzero = j;
            }
            acc += e;
            if acc > target {
                return (j as u32, logp(j));
            }
        }
        // Rounding left the target above the running sum: take the last possible token.
        return (last_nonzero as u32, logp(last_nonzero));
    }
    scratch.clear();
    scratch.extend(
        logits
            .iter()
            .enumerate()
            .map(|(j, z)| (((*z as f64 * it - mx).exp()) as f32, j as u32)),
    );
    let keep = truncated_prefix(scratch, params.top_k, params.top_p);
    let kept = &scratch[..keep.max(1)];
    let sum: f64 = kept.iter().map(|x| x.0 as f64).sum();
    let target = u * sum;
    let mut acc = 0.0;
    for (p, j) in kept {
        acc += *p as f64;
        if acc > target {
            return (*j, logp(*j as usize));
        }
    }
    let j = kept[kept.len() - 1].1;
    (j, logp(j as usize))
}

/// Candidate order of the sampler: larger weight first, ties to the lower token id (a strict
/// total order, so any selection algorithm yields the same prefix as a full sort).
fn by_weight(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Puts the top-k / top-p survivors, sorted by [`by_weight`], at the front of `cand` and
/// returns how many there are (at least one).
///
/// Selection instead of a full sort: top-k partitions around the k-th candidate and sorts only
/// those k; top-p sorts a growing prefix (64, 256, … candidates) until its mass reaches `top_p`,
/// which on a peaked distribution is a few hundred of the 151,936 tokens. The survivors are
/// exactly the first ones of the fully sorted list. The only difference from summing in sorted
/// order is that the total mass of an untruncated top-k is summed in token order (f64; relative
/// difference ≲ 1e-16, which could only matter if the running mass hit `top_p` that closely).
fn truncated_prefix(cand: &mut [(f32, u32)], top_k: usize, top_p: f32) -> usize {
    let mut keep = cand.len();
    if top_k > 0 && top_k < keep {
        cand.select_nth_unstable_by(top_k - 1, by_weight);
        keep = top_k;
    }
    if top_p >= 1.0 {
        cand[..keep].sort_unstable_by(by_weight);
        return keep.max(1);
    }
    let sum: f64 = cand[..keep].iter().map(|x| x.0 as f64).sum();
    let mut sorted = 0;
    let mut acc = 0.0;
    let mut want = 64.min(keep);
    loop {
        if want < keep {
            cand[sorted..keep].select_nth_unstable_by(want - sorted - 1, by_weight);
        }
        cand[sorted..want].sort_unstable_by(by_weight);
        for (i, (p, _)) in cand[sorted..want].iter().enumerate() {
            acc += *p as f64 / sum;
            if acc >= top_p as f64 {
                return sorted + i + 1;
            }
        }
        if want == keep {
            return keep.max(1);
        }
        sorted = want;
        want = (want * 4).min(keep);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha8Rng;
    use rand_chacha::rand_core::{Rng, SeedableRng};

    fn rand_vec(rng: &mut ChaCha8Rng, n: usize, scale: f64) -> Vec<f64> {
        (0..n)
            .map(|_| ((rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale)
            .collect()
    }

    /// Central-difference check of `∂(Σ dout·f(x))/∂x` against the analytic gradient, in f64.
    /// The tolerance (1e-6 relative to the largest gradient, plus 1e-8) leaves room for the
    /// O(h²) = 1e-10 truncation error and rounding of a few hundred f64 operations.
    fn check(name: &str, x: &[f64], analytic: &[f64], f: impl Fn(&[f64]) -> f64) {
        let h = 1e-5;
        let scale = analytic
            .iter()
            .fold(0.0f64, |m, g| m.max(g.abs()))
            .max(1e-3);
        let mut xp = x.to_vec();
        for i in 0..x.len() {
            xp[i] = x[i] + h;
            let fp = f(&xp);
            xp[i] = x[i] - h;
            let fm = f(&xp);
            xp[i] = x[i];
            let num = (fp - fm) / (2.0 * h);
            let err = (num - analytic[i]).abs();
            assert!(
                err <= 1e-6 * scale + 1e-8,
                "{name}[{i}]: numeric {num} analytic {} (err {err})",
                analytic[i]
            );
        }
    }

    #[test]
    fn embedding_grad() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let (v, d) = (5, 3);
        let table = rand_vec(&mut rng, v * d, 1.0);
        let ids = [2u32, 0, 2, 4];
        let dout = rand_vec(&mut rng, ids.len() * d, 1.0);
        let mut g = vec![0.0; v * d];
        embedding_bwd(&mut g, &dout, &ids, d);
        check("embedding", &table, &g, |t| {
            let mut o = vec![0.0; ids.len() * d];
            embedding_fwd(&mut o, &ids, t, d);
            dot(&o, &dout)
        });
    }

    #[test]
    fn rmsnorm_grads() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let (rows, d) = (3, 6);
        let x = rand_vec(&mut rng, rows * d, 2.0);
        let w = rand_vec(&mut rng, d, 1.5);
        let dout = rand_vec(&mut rng, rows * d, 1.0);
        let f = |x: &[f64], w: &[f64]| {
            let mut o = vec![0.0; rows * d];
            let mut r = vec![0.0; rows];
            rmsnorm_fwd(&mut o, &mut r, x, w, d, 1e-5);
            dot(&o, &dout)
        };
        let mut o = vec![0.0; rows * d];
        let mut r = vec![0.0; rows];
        rmsnorm_fwd(&mut o, &mut r, &x, &w, d, 1e-5);
        let (mut dx, mut dw) = (vec![0.0; rows * d], vec![0.0; d]);
        rmsnorm_bwd(&mut dx, &mut dw, &dout, &x, &w, &r, d);
        check("rmsnorm dx", &x, &dx, |x| f(x, &w));
        check("rmsnorm dw", &w, &dw, |w| f(&x, w));
    }

    #[test]
    fn matmul_grads_and_values() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let (n, din, dout) = (4, 5, 3);
        let x = rand_vec(&mut rng, n * din, 1.0);
        let w = rand_vec(&mut rng, dout * din, 1.0);
        let dy = rand_vec(&mut rng, n * dout, 1.0);
        let mut y = vec![0.0; n * dout];
        matmul_fwd(&mut y, &x, &w, n, din, dout);
        // y[1,2] by hand
        let y12: f64 = (0..din).map(|k| x[din + k] * w[2 * din + k]).sum();
        assert!((y[dout + 2] - y12).abs() < 1e-12);
        let (mut dx, mut dw) = (vec![0.0; n * din], vec![0.0; dout * din]);
        matmul_bwd(Some(&mut dx), &mut dw, &dy, &x, &w, n, din, dout);
        let f = |x: &[f64], w: &[f64]| {
            let mut y = vec![0.0; n * dout];
            matmul_fwd(&mut y, x, w, n, din, dout);
            dot(&y, &dy)
        };
        check("matmul dx", &x, &dx, |x| f(x, &w));
        check("matmul dw", &w, &dw, |w| f(&x, w));
    }

    #[test]
    fn rope_grad_and_norm_preservation() {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let (n, heads, hd) = (3, 2, 6);
        let table = RopeTable::<f64>::new(hd, 10_000.0, 16);
        let pos = [0u32, 5, 11];
        let x = rand_vec(&mut rng, n * heads * hd, 1.0);
        let mut y = x.clone();
        rope_fwd(&mut y, &pos, heads, &table);
        // position 0 is the identity; rotations keep each head's norm
        assert_eq!(&y[..heads * hd], &x[..heads * hd]);
        for (a, b) in x.chunks(hd).zip(y.chunks(hd)) {
            assert!((dot(a, a) - dot(b, b)).abs() < 1e-12);
        }
        let dy = rand_vec(&mut rng, n * heads * hd, 1.0);
        let mut dx = dy.clone();
        rope_bwd(&mut dx, &pos, heads, &table);
        check("rope", &x, &dx, |x| {
            let mut y = x.to_vec();
            rope_fwd(&mut y, &pos, heads, &table);
            dot(&y, &dy)
        });
    }

    #[test]
    fn attention_grads_gqa_and_cached_chunk() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let (h, kvh, hd) = (4, 2, 3);
        // nq < nk exercises the KV-cache (chunk) form; nq == nk the full causal form.
        for (nq, nk) in [(4, 4), (2, 5)] {
            let q = rand_vec(&mut rng, nq * h * hd, 1.0);
            let k = rand_vec(&mut rng, nk * kvh * hd, 1.0);
            let v = rand_vec(&mut rng, nk * kvh * hd, 1.0);
            let dout = rand_vec(&mut rng, nq * h * hd, 1.0);
            let f = |q: &[f64], k: &[f64], v: &[f64]| {
                let mut o = vec![0.0; nq * h * hd];
                let mut a = vec![0.0; h * nq * nk];
                attention_fwd(&mut o, &mut a, q, k, v, nq, nk, h, kvh, hd);
                dot(&o, &dout)
            };
            let mut o = vec![0.0; nq * h * hd];
            let mut a = vec![0.0; h * nq * nk];
            attention_fwd(&mut o, &mut a, &q, &k, &v, nq, nk, h, kvh, hd);
            // each probability row sums to one over its causal prefix, zero beyond
            for hh in 0..h {
                for i in 0..nq {
                    let row = &a[(hh * nq + i) * nk..(hh * nq + i + 1) * nk];
                    let last = nk - nq + i;
                    assert!((row[..=last].iter().sum::<f64>() - 1.0).abs() < 1e-12);
                    assert!(row[last + 1..].iter().all(|p| *p == 0.0));
                }
            }
            let (mut dq, mut dk, mut dv) =
                (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
            let mut s = vec![0.0; nk];
            attention_bwd(
                &mut dq, &mut dk, &mut dv, &mut s, &dout, &a, &q, &k, &v, nq, nk, h, kvh, hd,
            );
            check("attention dq", &q, &dq, |q| f(q, &k, &v));
            check("attention dk", &k, &dk, |k| f(&q, k, &v));
            check("attention dv", &v, &dv, |v| f(&q, &k, v));
            // The recomputing form: same output bits, and gradients equal to the saved-probability
            // backward up to the rounding of exp(s − lse) against exp(s − max)/Σ (f64 here).
            let mut o2 = vec![0.0; nq * h * hd];
            let mut lse = vec![0.0; h * nq];
            let mut s2 = vec![0.0; 2 * nk];
            attention_fwd_lse(&mut o2, &mut lse, &mut s2, &q, &k, &v, nq, nk, h, kvh, hd);
            assert_eq!(o, o2);
            let (mut dq2, mut dk2, mut dv2) =
                (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
            attention_bwd_lse(
                &mut dq2, &mut dk2, &mut dv2, &mut s2, &dout, &lse, &q, &k, &v, nq, nk, h, kvh, hd,
            );
            for (a, b) in [(&dq, &dq2), (&dk, &dk2), (&dv, &dv2)] {
                for (x, y) in a.iter().zip(b.iter()) {
                    assert!((x - y).abs() < 1e-12, "{x} vs {y}");
                }
            }
        }
    }

    #[test]
    fn swiglu_grads() {
        let mut rng = ChaCha8Rng::seed_from_u64(6);
        let n = 10;
        let g = rand_vec(&mut rng, n, 3.0);
        let u = rand_vec(&mut rng, n, 2.0);
        let dout = rand_vec(&mut rng, n, 1.0);
        let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
        swiglu_bwd(&mut dg, &mut du, &dout, &g, &u);
        let f = |g: &[f64], u: &[f64]| {
            let mut o = vec![0.0; n];
            swiglu_fwd(&mut o, g, u);
            dot(&o, &dout)
        };
        check("swiglu dgate", &g, &dg, |g| f(g, &u));
        check("swiglu dup", &u, &du, |u| f(&g, u));
    }

    #[test]
    fn logprob_values_and_grad() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let (rows, v, temp) = (3, 7, 0.7);
        let z = rand_vec(&mut rng, rows * v, 3.0);
        let targets = [1u32, 6, 0];
        let dlp = rand_vec(&mut rng, rows, 1.0);
        let (mut lp, mut ent, mut lse) = (vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
        logprob_fwd(&mut lp, &mut ent, &mut lse, &z, &targets, v, temp);
        for r in 0..rows {
            let zs: Vec<f64> = z[r * v..(r + 1) * v].iter().map(|x| x / temp).collect();
            let s: f64 = zs.iter().map(|x| x.exp()).sum();
            let p: Vec<f64> = zs.iter().map(|x| x.exp() / s).collect();
            assert!((lp[r] - p[targets[r] as usize].ln()).abs() < 1e-12);
            let h: f64 = -p.iter().map(|p| p * p.ln()).sum::<f64>();
            assert!((ent[r] - h).abs() < 1e-12);
        }
        let mut dz = vec![0.0; rows * v];
        logprob_bwd(&mut dz, &dlp, &z, &targets, &lse, v, temp);
        check("logprob", &z, &dz, |z| {
            let (mut lp, mut e, mut l) = (vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
            logprob_fwd(&mut lp, &mut e, &mut l, z, &targets, v, temp);
            dot(&lp, &dlp)
        });
    }

    #[test]
    fn grpo_loss_values_clipping_and_grad() {
        let c = GrpoCoefs {
            eps_low: 0.2,
            eps_high: 0.28,
            beta: 0.05,
        };
        // ρ = e^0.5 > 1.28 with A > 0: clipped branch (zero surrogate gradient);
        // ρ = e^0.5 with A < 0: unclipped branch is the min; ρ = e^-0.5 < 0.8 with A < 0:
        // clipped; ρ = 1.05 inside the range.
        let old = [0.0, 0.0, 0.0, 0.0];
        let logp = [0.5, 0.5, -0.5, 0.05f64.ln_1p()];
        let adv = [1.0, -1.0, -1.0, 2.0];
        let refp = [0.3, 0.6, -0.2, 0.0];
        let w = [1.0, 0.5, 2.0, 1.0];
        let mut loss = [0.0; 4];
        let mut kl = [0.0; 4];
        let mut clipped = [false; 4];
        grpo_loss_fwd(
            &mut loss,
            &mut kl,
            &mut clipped,
            &logp,
            &old,
            &refp,
            &adv,
            &w,
            c,
        );
        assert_eq!(clipped, [true, false, true, false]);
        let k3 = |r: f64, l: f64| (r - l).exp() - (r - l) - 1.0;
        let expect = [
            1.0 * (-1.28 + 0.05 * k3(0.3, 0.5)),
            0.5 * (0.5f64.exp() + 0.05 * k3(0.6, 0.5)),
            2.0 * (0.8 + 0.05 * k3(-0.2, -0.5)),
            1.0 * (-2.1 + 0.05 * k3(0.0, 0.05f64.ln_1p())),
        ];
        for t in 0..4 {
            assert!(
                (loss[t] - expect[t]).abs() < 1e-12,
                "{t}: {} vs {}",
                loss[t],
                expect[t]
            );
            assert!((kl[t] - k3(refp[t], logp[t])).abs() < 1e-15);
        }
        let mut d = [0.0; 4];
        grpo_loss_bwd(&mut d, &logp, &old, &refp, &adv, &w, c);
        check("grpo_loss", &logp, &d, |lp| {
            let (mut l, mut k, mut cl) = ([0.0; 4], [0.0; 4], [false; 4]);
            grpo_loss_fwd(&mut l, &mut k, &mut cl, lp, &old, &refp, &adv, &w, c);
            l.iter().sum()
        });
    }

    #[test]
    fn adamw_matches_hand_computed_torch_steps() {
        // torch.optim.AdamW(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1) on p = [1.0],
        // grads 0.5 then -0.25, computed by hand with the same formulas in f64.
        let (lr, b1, b2, eps, wd) = (0.1, 0.9, 0.999, 1e-8, 0.1);
        let mut p = [1.0f32];
        let (mut m, mut v) = ([0.0f32], [0.0f32]);
        let (mut pe, mut me, mut ve) = (1.0f64, 0.0f64, 0.0f64);
        for (t, g) in [(1u64, 0.5f64), (2, -0.25)] {
            adamw_step(
                &mut p,
                &[g as f32],
                &mut m,
                &mut v,
                1.0,
                lr,
                b1,
                b2,
                eps,
                wd,
                t,
            );
            pe *= 1.0 - lr * wd;
            me = b1 * me + (1.0 - b1) * g;
            ve = b2 * ve + (1.0 - b2) * g * g;
            let denom = (ve.sqrt() / (1.0 - b2.powi(t as i32)).sqrt()) + eps;
            pe -= lr / (1.0 - b1.powi(t as i32)) * me / denom;
            assert!(
                (p[0] as f64 - pe).abs() < 1e-6,
                "step {t}: {} vs {pe}",
                p[0]
            );
        }
        // First step moves by lr·sign(g) (bias-corrected m/√v = ±1) after decay: 0.99 − 0.1.
        let mut p = [1.0f32];
        adamw_step(
            &mut p,
            &[3.0],
            &mut [0.0],
            &mut [0.0],
            1.0,
            lr,
            b1,
            b2,
            eps,
            wd,
            1,
        );
        assert!((p[0] - 0.89).abs() < 1e-6);
        // grad_scale folds the normaliser in: scaling g by 2 and halving it gives the same step.
        let (mut a, mut b) = ([0.3f32, -0.7], [0.3f32, -0.7]);
        let (mut ma, mut va, mut mb, mut vb) = ([0.0f32; 2], [0.0f32; 2], [0.0f32; 2], [0.0f32; 2]);
        adamw_step(
            &mut a,
            &[0.2, 0.4],
            &mut ma,
            &mut va,
            1.0,
            lr,
            b1,
            b2,
            eps,
            wd,
            1,
        );
        adamw_step(
            &mut b,
            &[0.4, 0.8],
            &mut mb,
            &mut vb,
            0.5,
            lr,
            b1,
            b2,
            eps,
            wd,
            1,
        );
        assert_eq!(a, b);
    }

    /// The first step on fresh moments writes them without reading them, with the same bits
    /// as the general step on zeros: signed zeros, subnormals, large and tiny gradients, and
    /// more than one parallel chunk (a chunk boundary and a ragged last chunk).
    #[test]
    fn adamw_first_step_is_the_general_step_on_zero_moments() {
        let n = 2 * PAR_CHUNK + 17;
        let special = [0.0f32, -0.0, 1e-40, -1e-40, 1e30, -3.5, 7.25e-8];
        let g: Vec<f32> = (0..n)
            .map(|i| {
                special
                    .get(i)
                    .copied()
                    .unwrap_or(((i * 7919 % 1000) as f32 - 500.0) * 1e-3)
            })
            .collect();
        let p0: Vec<f32> = (0..n)
            .map(|i| {
                if i % 5 == 1 {
                    -0.0
                } else {
                    ((i * 104729 % 997) as f32 - 498.0) * 1e-2
                }
            })
            .collect();
        for (scale, wd) in [(1.0f32, 0.0), (0.37, 0.1)] {
            let (mut pa, mut ma, mut va) = (p0.clone(), vec![0.0f32; n], vec![0.0f32; n]);
            let (mut pb, mut mb, mut vb) = (p0.clone(), vec![0.0f32; n], vec![0.0f32; n]);
            adamw_step(
                &mut pa, &g, &mut ma, &mut va, scale, 1e-3, 0.9, 0.999, 1e-8, wd, 1,
            );
            // garbage in the moments: the first step must not read them
            mb.fill(f32::NAN);
            vb.fill(f32::NAN);
            adamw_first_step(
                &mut pb, &g, &mut mb, &mut vb, scale, 1e-3, 0.9, 0.999, 1e-8, wd, 1,
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&pa), bits(&pb), "params, scale {scale}");
            assert_eq!(bits(&ma), bits(&mb), "first moments, scale {scale}");
            assert_eq!(bits(&va), bits(&vb), "second moments, scale {scale}");
        }
    }

    /// The chunked grad-norm reduction: independent of the thread count, and equal to the f64
    /// sum of squares to rounding.
    #[test]
    fn grad_norm_is_thread_count_independent() {
        let g: Vec<f32> = (0..3 * PAR_CHUNK + 5)
            .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) * 1e-3)
            .collect();
        let on = |t: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .unwrap()
                .install(|| grad_norm(&g))
        };
        let one = on(1);
        assert_eq!(one.to_bits(), on(2).to_bits());
        assert_eq!(one.to_bits(), on(3).to_bits());
        let exact: f64 = g.iter().map(|x| (*x as f64).powi(2)).sum();
        assert!((one - exact).abs() <= 1e-12 * exact, "{one} vs {exact}");
    }

    /// The backward products split into row bands on the pool give one call's bits for any
    /// thread count, including ragged last bands, and match the f64 product to rounding.
    #[test]
    fn matmul_bwd_bands_are_thread_count_independent() {
        let (n, din, dout) = (83, 96, 170);
        assert!(
            n * din * dout >= GEMM_PAR_MIN_FMA,
            "large enough to be split"
        );
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        let f = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
        let dy = f(rand_vec(&mut rng, n * dout, 1.0));
        let x = f(rand_vec(&mut rng, n * din, 1.0));
        let w = f(rand_vec(&mut rng, dout * din, 1.0));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let on = |t: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .unwrap()
                .install(|| {
                    let (mut dx, mut dw) = (vec![0.5f32; n * din], vec![0.25f32; dout * din]);
                    matmul_bwd(Some(&mut dx), &mut dw, &dy, &x, &w, n, din, dout);
                    (bits(&dx), bits(&dw))
                })
        };
        let one = on(1);
        assert_eq!(one, on(2));
        assert_eq!(one, on(3));
        let dw = one.1.iter().map(|b| f32::from_bits(*b) as f64);
        for (i, got) in dw.enumerate() {
            let (o, j) = (i / din, i % din);
            let e: f64 = 0.25
                + (0..n)
                    .map(|r| dy[r * dout + o] as f64 * x[r * din + j] as f64)
                    .sum::<f64>();
            assert!((got - e).abs() < 1e-4, "dw[{o},{j}] {got} vs {e}");
        }
    }

    #[test]
    fn sampling_is_pure_and_respects_truncation() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let mut s = Vec::new();
        let greedy = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        let (tok, lp) = sample(&logits, &greedy, 0.99, &mut s);
        assert_eq!(tok, 1, "first maximum wins");
        let lse = logits.iter().map(|z| (*z as f64).exp()).sum::<f64>().ln();
        assert!((lp as f64 - (3.0 - lse)).abs() < 1e-6);
        // top-k 2 keeps the tied tokens 1 and 3 (each 1/2 after renormalising)
        let k2 = SamplingParams {
            top_k: 2,
            ..Default::default()
        };
        assert_eq!(sample(&logits, &k2, 0.25, &mut s).0, 1);
        assert_eq!(sample(&logits, &k2, 0.75, &mut s).0, 3);
        // top-p 0.5 needs the two tied tokens: p(1) = p(3) ≈ 0.41 each
        let p5 = SamplingParams {
            top_p: 0.5,
            ..Default::default()
        };
        for u in [0.0, 0.3, 0.6, 0.999] {
            let t = sample(&logits, &p5, u, &mut s).0;
            assert!(t == 1 || t == 3, "u={u} gave {t}");
        }
        // untruncated: inverse CDF in token order; empirical frequencies follow softmax(z/T)
        let p = SamplingParams {
            temperature: 0.5,
            ..Default::default()
        };
        let mut counts = [0usize; 5];
        let n = 20_000;
        for i in 0..n {
            counts[sample(&logits, &p, (i as f64 + 0.5) / n as f64, &mut s).0 as usize] += 1;
        }
        let zs: Vec<f64> = logits.iter().map(|z| (*z as f64 / 0.5).exp()).collect();
        let tot: f64 = zs.iter().sum();
        for j in 0..5 {
            assert!(
                (counts[j] as f64 / n as f64 - zs[j] / tot).abs() < 1e-3,
                "token {j}"
            );
        }
        // the returned log-prob is of the temperature distribution, not the truncated one
        let (t, lp) = sample(
            &logits,
            &SamplingParams {
                temperature: 0.5,
                top_k: 1,
                ..Default::default()
            },
            0.5,
            &mut s,
        );
        assert_eq!(t, 1);
        assert!((lp as f64 - (zs[1] / tot).ln()).abs() < 1e-5);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Any finite logits and settings give a valid token whose log-prob is that of the
        /// temperature distribution, inside the top-k set, and the argmax when greedy.
        #[test]
        fn sample_is_valid_for_any_settings(
            logits in proptest::collection::vec(-30.0f32..30.0, 1..40),
            temperature in proptest::prop_oneof![proptest::strategy::Just(0.0f32), 0.05f32..3.0],
            top_k in 0usize..8,
            top_p in proptest::prop_oneof![proptest::strategy::Just(1.0f32), 0.01f32..1.0],
            u in 0.0f64..1.0,
        ) {
            let p = SamplingParams { temperature, top_k, top_p, ..Default::default() };
            let mut s = Vec::new();
            let (tok, lp) = sample(&logits, &p, u, &mut s);
            let t = tok as usize;
            proptest::prop_assert!(t < logits.len());
            let temp = if temperature > 0.0 { temperature as f64 } else { 1.0 };
            let mx = logits.iter().fold(f64::NEG_INFINITY, |m, z| m.max(*z as f64 / temp));
            let lse = mx + logits.iter().map(|z| (*z as f64 / temp - mx).exp()).sum::<f64>().ln();
            proptest::prop_assert!((lp as f64 - (logits[t] as f64 / temp - lse)).abs() < 1e-4);
            let better = logits.iter().filter(|z| **z > logits[t]).count();
            if temperature == 0.0 {
                proptest::prop_assert_eq!(better, 0);
            } else if top_k > 0 {
                proptest::prop_assert!(better < top_k, "token ranked below the top {}", top_k);
            }
        }

        /// Selection keeps exactly the candidates the full sort kept (the previous
        /// implementation, inlined here as the reference), in the same order, over vocabularies
        /// large enough for several rounds of the growing top-p prefix and with many ties.
        #[test]
        fn truncation_by_selection_equals_full_sort(
            weights in proptest::collection::vec(
                proptest::prop_oneof![proptest::strategy::Just(0.5f32), 0.0f32..1.0], 1..3000),
            top_k in proptest::prop_oneof![proptest::strategy::Just(0usize), 1usize..200],
            top_p in proptest::prop_oneof![proptest::strategy::Just(1.0f32), 0.01f32..1.0],
        ) {
            let cand: Vec<(f32, u32)> =
                weights.iter().enumerate().map(|(j, w)| (w * w * w, j as u32)).collect();
            let mut full = cand.clone();
            full.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let mut keep = full.len();
            if top_k > 0 {
                keep = keep.min(top_k);
            }
            if top_p < 1.0 {
                let sum: f64 = full[..keep].iter().map(|x| x.0 as f64).sum();
                let mut acc = 0.0;
                for (i, (p, _)) in full[..keep].iter().enumerate() {
                    acc += *p as f64 / sum;
                    if acc >= top_p as f64 {
                        keep = i + 1;
                        break;
                    }
                }
            }
            let mut sel = cand.clone();
            let n = truncated_prefix(&mut sel, top_k, top_p);
            proptest::prop_assert_eq!(&sel[..n], &full[..keep.max(1)]);
        }
    }
}
