//! The f32 forward matrix product `y = x·Wᵀ` as a batch-invariant dot-product kernel.
//!
//! Both operands are contiguous along the reduced dimension (`x` rows and `W` rows, torch's
//! `[out, in]` layout), so every output is one dot product with no packing; that is what makes a
//! one-token decode step cheap (a packed GEMM copies the whole weight matrix per call). Every
//! output element is computed by the same instruction sequence whatever the number of rows, the
//! tile it falls in or the thread that runs it: 8-lane FMA accumulation in `k` order, a fixed
//! horizontal sum, then the `k mod 8` tail with scalar FMAs. A request's logits are therefore
//! bit-identical alone or in any batch, which the batch-invariance test relies on.
//!
//! Without AVX2+FMA the product falls back to matrixmultiply, whose per-element arithmetic also
//! does not depend on the number of rows.
//!
//! [`matmul_nt_bf16`] is the same product with bf16 weights (engines that store their weights
//! in bf16): each 8-lane load widens eight bf16 values to f32 in registers (a 16-bit shift,
//! exact), and everything else is the f32 kernel's instruction sequence, so its result is
//! bit-identical to [`matmul_nt_f32`] on the widened weights, and batch-invariant the same way.
//! [`matmul_nt_f16`] does the same for f16 weights, widened by F16C's `vcvtph2ps` (also exact).

use half::{bf16, f16};
use rayon::prelude::*;

/// Rows per tile.
const TR: usize = 4;
/// Rows per block of the threaded product: the block's `x` rows (256 KB at din = 1,024) stay in
/// cache while every column block streams its weights past them.
const RB: usize = 64;
/// Output columns per block (one parallel task): `CB` weight rows (192 KB at din = 1,024) stay
/// in cache while the tiles of all `RB` rows reuse them, so each weight is read from memory
/// once per row block instead of once per 4-row tile. That matters most for decoding, where
/// the whole product is one row block and weight traffic is the cost.
const CB: usize = 48;
/// Output columns per tile.
const TC: usize = 3;
/// Below this many multiply-adds a product runs on the calling thread (rayon's fork/join costs
/// a few microseconds).
const PAR_MIN_FMA: usize = 1 << 16;

/// The instruction set a product runs on. One is chosen per process ([`Isa::detected`]), so
/// every product of a run takes the same path and every element one fixed instruction
/// sequence; tests call the others directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F: 16-lane FMA accumulation, tiles of 4 rows × 4 columns.
    Avx512,
    /// AVX2 + FMA (+ F16C for f16 weights): 8-lane FMA accumulation, tiles of 4 × 3 (12 independent accumulators: two FMA units of 4-cycle latency need 8).
    Avx2,
    /// matrixmultiply's GEMM (weights widened to f32 first).
    Fallback,
}

impl Isa {
    /// The path every product of this process takes, decided once: AVX2 where the CPU has it
    /// (AVX-512 CPUs included), else the fallback. `ROLLOUTPIPE_AVX512=1` takes the AVX-512
    /// kernels where the CPU has them. AVX2 is the default so that AVX2 and AVX-512 machines
    /// compute the same bits: a rounding-level change to the forward products is enough to
    /// send the default job's SFT warm start somewhere else (docs/performance.md).
    pub fn detected() -> Isa {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            let want512 = std::env::var_os("ROLLOUTPIPE_AVX512").is_some_and(|v| v == "1");
            Isa::available()
                .into_iter()
                .find(|i| want512 || *i != Isa::Avx512)
                .unwrap_or(Isa::Fallback)
        })
    }

    /// Every path this CPU can run, best first (the fallback always).
    pub fn available() -> Vec<Isa> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            if avx2 && has!("avx512f") {
                v.push(Isa::Avx512);
            }
            if avx2 {
                v.push(Isa::Avx2);
            }
        }
        v.push(Isa::Fallback);
        v
    }
}

/// `out[n, dout] = x[n, din] · w[dout, din]ᵀ`.
pub fn matmul_nt_f32(out: &mut [f32], x: &[f32], w: &[f32], n: usize, din: usize, dout: usize) {
    matmul_nt_f32_on(Isa::detected(), out, x, w, n, din, dout);
}

/// `out[n, dout] = x[n, din] · widen(w[dout, din])ᵀ` with bf16 weights: bit-identical to
/// [`matmul_nt_f32`] on the weights widened to f32.
pub fn matmul_nt_bf16(out: &mut [f32], x: &[f32], w: &[bf16], n: usize, din: usize, dout: usize) {
    matmul_nt_half_on(Isa::detected(), out, x, w, n, din, dout);
}

/// `out[n, dout] = x[n, din] · widen(w[dout, din])ᵀ` with f16 weights: bit-identical to
/// [`matmul_nt_f32`] on the weights widened to f32.
pub fn matmul_nt_f16(out: &mut [f32], x: &[f32], w: &[f16], n: usize, din: usize, dout: usize) {
    matmul_nt_half_on(Isa::detected(), out, x, w, n, din, dout);
}

/// [`matmul_nt_f32`] on a given path; `isa` must be one of [`Isa::available`].
pub fn matmul_nt_f32_on(
    isa: Isa,
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    n: usize,
    din: usize,
    dout: usize,
) {
    check_operands(out, x, w.len(), n, din, dout);
    assert!(
        Isa::available().contains(&isa),
        "{isa:?} is not available on this CPU"
    );
    #[cfg(target_arch = "x86_64")]
    {
        let rows: Option<Rows<f32>> = match isa {
            Isa::Avx512 => Some(avx512::rows_f32),
            Isa::Avx2 => Some(avx::rows_f32),
            Isa::Fallback => None,
        };
        if let Some(rows) = rows {
            // SAFETY: the path's features were detected (asserted above); operands bounded.
            unsafe { dispatch(out, x, w, n, din, dout, rows) };
            return;
        }
    }
    crate::cpu::ops::gemm_nt_fallback(out, x, w, n, din, dout);
}

/// A 16-bit weight type the kernels widen in registers.
pub trait Half: Copy + Sync {
    /// The value as f32 (exact).
    fn widen(self) -> f32;
    /// The AVX-512 and AVX2 tile routines over the bit patterns.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    fn rows() -> [Rows<u16>; 2];
}

impl Half for bf16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    fn rows() -> [Rows<u16>; 2] {
        [avx512::rows_bf16, avx::rows_bf16]
    }
}

impl Half for f16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    fn rows() -> [Rows<u16>; 2] {
        [avx512::rows_f16, avx::rows_f16]
    }
}

/// [`matmul_nt_bf16`] / [`matmul_nt_f16`] on a given path; `isa` must be one of
/// [`Isa::available`].
pub fn matmul_nt_half_on<H: Half>(
    isa: Isa,
    out: &mut [f32],
    x: &[f32],
    w: &[H],
    n: usize,
    din: usize,
    dout: usize,
) {
    check_operands(out, x, w.len(), n, din, dout);
    assert!(
        Isa::available().contains(&isa),
        "{isa:?} is not available on this CPU"
    );
    #[cfg(target_arch = "x86_64")]
    {
        let [r512, r2] = H::rows();
        let rows = match isa {
            Isa::Avx512 => Some(r512),
            Isa::Avx2 => Some(r2),
            Isa::Fallback => None,
        };
        if let Some(rows) = rows {
            // `bf16` and `f16` are transparent `u16`s; the kernels read the bit patterns.
            // SAFETY: same length and alignment as `u16`.
            let w16 = unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u16>(), w.len()) };
            // SAFETY: the path's features were detected (asserted above); operands bounded.
            unsafe { dispatch(out, x, w16, n, din, dout, rows) };
            return;
        }
    }
    let wide: Vec<f32> = w[..dout * din].iter().map(|v| v.widen()).collect();
    crate::cpu::ops::gemm_nt_fallback(out, x, &wide, n, din, dout);
}

fn check_operands(out: &[f32], x: &[f32], w: usize, n: usize, din: usize, dout: usize) {
    assert!(
        out.len() >= n * dout && x.len() >= n * din && w >= dout * din,
        "matmul_nt operand out of bounds (n={n}, din={din}, dout={dout})"
    );
}

/// A tile routine of `avx` or `avx512` for one weight storage type.
#[cfg(target_arch = "x86_64")]
#[doc(hidden)]
pub type Rows<W> = unsafe fn(&mut [f32], &[f32], &[W], usize, usize, usize, usize, usize);

/// Small products on the calling thread, large ones through [`blocked`].
///
/// # Safety
/// `rows`' instruction set must be available and the operands bounded as `check_operands`
/// asserts.
#[cfg(target_arch = "x86_64")]
unsafe fn dispatch<W: Sync>(
    out: &mut [f32],
    x: &[f32],
    w: &[W],
    n: usize,
    din: usize,
    dout: usize,
    rows: Rows<W>,
) {
    let out = &mut out[..n * dout];
    if n * din * dout >= PAR_MIN_FMA {
        blocked(out, x, w, n, din, dout, rows);
    } else {
        // SAFETY: the caller's contract.
        unsafe { rows(out, x, w, n, din, dout, 0, dout) }
    }
}

/// The threaded product: row blocks in turn, column blocks in parallel, each computed into its
/// own contiguous scratch and then copied to its place. Every element is still one `avx` dot
/// product with the fixed instruction sequence, so blocking changes no bits.
#[cfg(target_arch = "x86_64")]
fn blocked<W: Sync>(
    out: &mut [f32],
    x: &[f32],
    w: &[W],
    n: usize,
    din: usize,
    dout: usize,
    rows_fn: Rows<W>,
) {
    let ncb = dout.div_ceil(CB);
    let mut tmp = vec![0.0f32; RB.min(n) * ncb * CB];
    for r0 in (0..n).step_by(RB) {
        let rows = RB.min(n - r0);
        let xs = &x[r0 * din..(r0 + rows) * din];
        tmp[..rows * ncb * CB]
            .par_chunks_mut(rows * CB)
            .enumerate()
            .for_each(|(b, t)| {
                let (c0, c1) = (b * CB, ((b + 1) * CB).min(dout));
                // SAFETY: only called (through `dispatch`) after AVX2 and FMA were detected
                // and x and w bounded; `t` holds rows × CB ≥ rows × (c1 − c0) values, xs holds
                // `rows` rows of `din`.
                unsafe { rows_fn(t, xs, w, rows, din, dout, c0, c1) }
            });
        for b in 0..ncb {
            let (c0, c1) = (b * CB, ((b + 1) * CB).min(dout));
            let cw = c1 - c0;
            let t = &tmp[b * rows * CB..];
            for r in 0..rows {
                out[(r0 + r) * dout + c0..(r0 + r) * dout + c1]
                    .copy_from_slice(&t[r * cw..(r + 1) * cw]);
            }
        }
    }
}

/// The kernels' shared body, instantiated per vector width by `avx` and `avx512`.
#[cfg(target_arch = "x86_64")]
macro_rules! dot_kernels {
    (
        $one:ident, $rows:ident, $W:ty, $load:ident, $get:ident, $feat:literal,
        $V:ty, $L:literal, $TC:ident, $zero:ident, $loadx:ident, $fma:ident, $hsum:ident
    ) => {
        /// One output element, with exactly the operations of a tile element.
        #[inline]
        #[target_feature(enable = $feat)]
        fn $one(x: &[f32], w: &[$W], din: usize) -> f32 {
            let k8 = din / $L * $L;
            let mut acc = $zero();
            let mut k = 0;
            while k < k8 {
                // SAFETY: k + L <= k8 <= din <= len of both rows (callers pass full rows).
                let (a, b) = unsafe { ($loadx(x.as_ptr().add(k)), $load(w.as_ptr().add(k))) };
                acc = $fma(a, b, acc);
                k += $L;
            }
            let mut s = $hsum(acc);
            for k in k8..din {
                s = x[k].mul_add($get(w[k]), s);
            }
            s
        }

        /// `out[r, c − c0] = x[r]·w[c]` for `r < rows`, `c0 <= c < c1`; `out` rows have stride
        /// `c1 − c0`.
        ///
        /// # Safety
        /// AVX2 and FMA must be available; `x` holds `rows × din`, `w` holds `c1 × din` values and
        /// `out` holds `rows × (c1 − c0)`.
        #[target_feature(enable = $feat)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn $rows(
            out: &mut [f32],
            x: &[f32],
            w: &[$W],
            rows: usize,
            din: usize,
            _dout: usize,
            c0: usize,
            c1: usize,
        ) {
            let width = c1 - c0;
            let k8 = din / $L * $L;
            let mut r = 0;
            while r + TR <= rows {
                let mut c = c0;
                while c + $TC <= c1 {
                    let mut acc = [[$zero(); $TC]; TR];
                    let xp: [*const f32; TR] = std::array::from_fn(|i| x[(r + i) * din..].as_ptr());
                    let wp: [*const $W; $TC] = std::array::from_fn(|j| w[(c + j) * din..].as_ptr());
                    let mut k = 0;
                    while k < k8 {
                        // SAFETY: each pointer starts a full row of `din` values and k + L <= din.
                        let wv: [$V; $TC] = std::array::from_fn(|j| unsafe { $load(wp[j].add(k)) });
                        for i in 0..TR {
                            // SAFETY: as above for the x rows.
                            let xv = unsafe { $loadx(xp[i].add(k)) };
                            for j in 0..$TC {
                                acc[i][j] = $fma(xv, wv[j], acc[i][j]);
                            }
                        }
                        k += $L;
                    }
                    for i in 0..TR {
                        let xr = &x[(r + i) * din..(r + i + 1) * din];
                        for j in 0..$TC {
                            let wr = &w[(c + j) * din..(c + j + 1) * din];
                            let mut s = $hsum(acc[i][j]);
                            for k in k8..din {
                                s = xr[k].mul_add($get(wr[k]), s);
                            }
                            out[(r + i) * width + (c + j - c0)] = s;
                        }
                    }
                    c += $TC;
                }
                // Leftover columns: the tile's rows side by side, `TR` independent accumulators.
                for c in c..c1 {
                    let mut acc = [$zero(); TR];
                    let xp: [*const f32; TR] = std::array::from_fn(|i| x[(r + i) * din..].as_ptr());
                    let wr = &w[c * din..(c + 1) * din];
                    let mut k = 0;
                    while k < k8 {
                        // SAFETY: each row holds `din` values and k + L <= din.
                        let wv = unsafe { $load(wr.as_ptr().add(k)) };
                        for i in 0..TR {
                            // SAFETY: as above.
                            acc[i] = $fma(unsafe { $loadx(xp[i].add(k)) }, wv, acc[i]);
                        }
                        k += $L;
                    }
                    for i in 0..TR {
                        let xr = &x[(r + i) * din..(r + i + 1) * din];
                        let mut s = $hsum(acc[i]);
                        for k in k8..din {
                            s = xr[k].mul_add($get(wr[k]), s);
                        }
                        out[(r + i) * width + (c - c0)] = s;
                    }
                }
                r += TR;
            }
            for r in r..rows {
                let xr = &x[r * din..(r + 1) * din];
                let mut c = c0;
                // Leftover rows (a one-token decode step has only these): four independent
                // columns at a time hide the FMA latency that one serial accumulator would expose.
                while c + 4 <= c1 {
                    let mut acc = [$zero(); 4];
                    let wp: [*const $W; 4] = std::array::from_fn(|j| w[(c + j) * din..].as_ptr());
                    let mut k = 0;
                    while k < k8 {
                        // SAFETY: xr and each w row hold `din` values and k + L <= din.
                        let xv = unsafe { $loadx(xr.as_ptr().add(k)) };
                        for j in 0..4 {
                            // SAFETY: as above.
                            let wv = unsafe { $load(wp[j].add(k)) };
                            acc[j] = $fma(xv, wv, acc[j]);
                        }
                        k += $L;
                    }
                    for j in 0..4 {
                        let wr = &w[(c + j) * din..(c + j + 1) * din];
                        let mut s = $hsum(acc[j]);
                        for k in k8..din {
                            s = xr[k].mul_add($get(wr[k]), s);
                        }
                        out[r * width + (c + j - c0)] = s;
                    }
                    c += 4;
                }
                for c in c..c1 {
                    out[r * width + (c - c0)] = $one(xr, &w[c * din..(c + 1) * din], din);
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx {
    use std::arch::x86_64::*;

    use super::{TC, TR};

    /// Fixed-order horizontal sum of 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// Eight f32 weights.
    ///
    /// # Safety
    /// AVX2 must be available and `p` must point at 8 readable values.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load_f32(p: *const f32) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe { _mm256_loadu_ps(p) }
    }

    /// Eight bf16 weights (bit patterns) widened to f32: zero-extend to 32 bits, shift into the
    /// high half. Exact.
    ///
    /// # Safety
    /// AVX2 must be available and `p` must point at 8 readable values.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load_bf16(p: *const u16) -> __m256 {
        // SAFETY: the caller's contract (8 × 2 bytes readable).
        let h = unsafe { _mm_loadu_si128(p.cast::<__m128i>()) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }

    #[inline]
    pub(super) fn get_f32(x: f32) -> f32 {
        x
    }

    #[inline]
    pub(super) fn get_bf16(x: u16) -> f32 {
        f32::from_bits((x as u32) << 16)
    }

    /// Eight f16 weights (bit patterns) widened to f32 by F16C (exact).
    ///
    /// # Safety
    /// AVX2 and F16C must be available and `p` must point at 8 readable values.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_f16(p: *const u16) -> __m256 {
        // SAFETY: the caller's contract (8 × 2 bytes readable).
        let h = unsafe { _mm_loadu_si128(p.cast::<__m128i>()) };
        _mm256_cvtph_ps(h)
    }

    #[inline]
    pub(super) fn get_f16(x: u16) -> f32 {
        half::f16::from_bits(x).to_f32()
    }

    dot_kernels!(
        one_f32,
        rows_f32,
        f32,
        load_f32,
        get_f32,
        "avx2,fma",
        __m256,
        8,
        TC,
        _mm256_setzero_ps,
        _mm256_loadu_ps,
        _mm256_fmadd_ps,
        hsum
    );
    dot_kernels!(
        one_bf16,
        rows_bf16,
        u16,
        load_bf16,
        get_bf16,
        "avx2,fma",
        __m256,
        8,
        TC,
        _mm256_setzero_ps,
        _mm256_loadu_ps,
        _mm256_fmadd_ps,
        hsum
    );
    dot_kernels!(
        one_f16,
        rows_f16,
        u16,
        load_f16,
        get_f16,
        "avx2,fma,f16c",
        __m256,
        8,
        TC,
        _mm256_setzero_ps,
        _mm256_loadu_ps,
        _mm256_fmadd_ps,
        hsum
    );
}

/// The same kernels on AVX-512 (16 lanes, tiles of `TR` × 4): twice the multiply-adds per
/// instruction. Within one machine every product takes one path, so every element still has one
/// fixed instruction sequence whatever the batch (the batch-invariance the engines rely on);
/// across machines with and without AVX-512 the last bits differ, as they do from the fallback.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::TR;

    /// Output columns per tile: 4 × 4 accumulators, 4 weight vectors and one `x` vector fit the
    /// 32 vector registers.
    const TC: usize = 4;

    /// Fixed-order horizontal sum of 16 lanes: the two 8-lane halves added, then `avx::hsum`'s
    /// order.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn hsum(v: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        super::avx::hsum(_mm256_add_ps(lo, hi))
    }

    /// Sixteen f32 weights.
    ///
    /// # Safety
    /// AVX-512F must be available and `p` must point at 16 readable values.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_f32(p: *const f32) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe { _mm512_loadu_ps(p) }
    }

    /// Sixteen bf16 weights widened to f32 by a 16-bit shift (exact).
    ///
    /// # Safety
    /// AVX-512F must be available and `p` must point at 16 readable values.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_bf16(p: *const u16) -> __m512 {
        // SAFETY: the caller's contract (16 × 2 bytes readable).
        let h = unsafe { _mm256_loadu_si256(p.cast::<__m256i>()) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }

    /// Sixteen f16 weights widened to f32 (`vcvtph2ps`, exact).
    ///
    /// # Safety
    /// AVX-512F must be available and `p` must point at 16 readable values.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_f16(p: *const u16) -> __m512 {
        // SAFETY: the caller's contract (16 × 2 bytes readable).
        let h = unsafe { _mm256_loadu_si256(p.cast::<__m256i>()) };
        _mm512_cvtph_ps(h)
    }

    use super::avx::{get_bf16, get_f16, get_f32};

    dot_kernels!(
        one_f32,
        rows_f32,
        f32,
        load_f32,
        get_f32,
        "avx512f",
        __m512,
        16,
        TC,
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        _mm512_fmadd_ps,
        hsum
    );
    dot_kernels!(
        one_bf16,
        rows_bf16,
        u16,
        load_bf16,
        get_bf16,
        "avx512f",
        __m512,
        16,
        TC,
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        _mm512_fmadd_ps,
        hsum
    );
    dot_kernels!(
        one_f16,
        rows_f16,
        u16,
        load_f16,
        get_f16,
        "avx512f",
        __m512,
        16,
        TC,
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        _mm512_fmadd_ps,
        hsum
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path this CPU has (AVX-512, AVX2, the fallback) is checked, not only the one a run
    /// takes.
    #[test]
    fn matches_f64_reference_and_is_row_invariant() {
        for isa in Isa::available() {
            matches_f64_reference_and_is_row_invariant_on(isa);
        }
    }

    fn matches_f64_reference_and_is_row_invariant_on(isa: Isa) {
        for (n, din, dout) in [
            (1, 3, 5),
            (7, 19, 11),
            (9, 128, 384),
            (1, 384, 128),
            (33, 64, 64),
            // more than one row block and a ragged last column block
            (70, 64, 200),
        ] {
            let x: Vec<f32> = (0..n * din)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
                .collect();
            let w: Vec<f32> = (0..dout * din)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.011)
                .collect();
            let mut y = vec![0.0f32; n * dout];
            matmul_nt_f32_on(isa, &mut y, &x, &w, n, din, dout);
            for r in 0..n {
                for c in 0..dout {
                    let e: f64 = (0..din)
                        .map(|k| x[r * din + k] as f64 * w[c * din + k] as f64)
                        .sum();
                    // f32 accumulation of `din` products of size ~0.5: a few ulps of the sum.
                    assert!(
                        (y[r * dout + c] as f64 - e).abs()
                            < 1e-5 * (1.0 + e.abs()) * (din as f64).sqrt()
                    );
                }
                // each row alone gives the same bits as inside the batch
                let mut y1 = vec![0.0f32; dout];
                matmul_nt_f32_on(isa, &mut y1, &x[r * din..(r + 1) * din], &w, 1, din, dout);
                assert_eq!(
                    &y1[..],
                    &y[r * dout..(r + 1) * dout],
                    "{isa:?}: row {r} of {n}x{din}x{dout}"
                );
            }
        }
    }

    /// bf16 weights give the f32 kernel's bits on the widened weights, for every path (small,
    /// tiled, leftover rows and columns, threaded blocks), and each row alone the same bits.
    #[test]
    fn bf16_weights_match_f32_kernel_on_widened_weights() {
        for isa in Isa::available() {
            half_weights_match_f32_kernel_on_widened_weights::<bf16>(isa, bf16::from_f32);
        }
    }

    /// f16 weights give the f32 kernel's bits on the widened weights, on every path.
    #[test]
    fn f16_weights_match_f32_kernel_on_widened_weights() {
        for isa in Isa::available() {
            half_weights_match_f32_kernel_on_widened_weights::<f16>(isa, f16::from_f32);
        }
    }

    fn half_weights_match_f32_kernel_on_widened_weights<H: Half>(isa: Isa, from: fn(f32) -> H) {
        for (n, din, dout) in [
            (1, 3, 5),
            (7, 19, 11),
            (9, 128, 384),
            (1, 1024, 200),
            (70, 64, 200),
        ] {
            let x: Vec<f32> = (0..n * din)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
                .collect();
            let w: Vec<H> = (0..dout * din)
                .map(|i| from(((i * 53 % 97) as f32 - 48.0) * 0.0113))
                .collect();
            let wide: Vec<f32> = w.iter().map(|v| v.widen()).collect();
            let (mut a, mut b) = (vec![0.0f32; n * dout], vec![0.0f32; n * dout]);
            matmul_nt_half_on(isa, &mut a, &x, &w, n, din, dout);
            matmul_nt_f32_on(isa, &mut b, &x, &wide, n, din, dout);
            assert_eq!(
                a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                b.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{isa:?}: {n}x{din}x{dout}"
            );
            for r in 0..n {
                let mut y1 = vec![0.0f32; dout];
                matmul_nt_half_on(isa, &mut y1, &x[r * din..(r + 1) * din], &w, 1, din, dout);
                assert_eq!(&y1[..], &a[r * dout..(r + 1) * dout], "{isa:?}: row {r}");
            }
        }
    }

    /// The public entry points take the detected path.
    #[test]
    fn entry_points_take_the_detected_path() {
        let (n, din, dout) = (5, 40, 9);
        let x: Vec<f32> = (0..n * din).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
        let w: Vec<f32> = (0..dout * din)
            .map(|i| (i % 7) as f32 * 0.2 - 0.5)
            .collect();
        let wb: Vec<bf16> = w.iter().map(|v| bf16::from_f32(*v)).collect();
        let (mut a, mut b) = (vec![0.0f32; n * dout], vec![0.0f32; n * dout]);
        matmul_nt_f32(&mut a, &x, &w, n, din, dout);
        matmul_nt_f32_on(Isa::detected(), &mut b, &x, &w, n, din, dout);
        assert_eq!(a, b);
        matmul_nt_bf16(&mut a, &x, &wb, n, din, dout);
        matmul_nt_half_on(Isa::detected(), &mut b, &x, &wb, n, din, dout);
        assert_eq!(a, b);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Any shape: each row computed alone has the same bits as inside the batch.
        #[test]
        fn any_shape_is_row_invariant(n in 1usize..12, din in 1usize..70, dout in 1usize..40, seed in 0u64..1000, pick in 0usize..3) {
            let isas = Isa::available();
            let isa = isas[pick % isas.len()];
            let val = |i: usize| (((i as u64 * 2654435761 + seed) % 1000) as f32 - 500.0) * 0.002;
            let x: Vec<f32> = (0..n * din).map(val).collect();
            let w: Vec<f32> = (0..dout * din).map(|i| val(i + 7919)).collect();
            let mut y = vec![0.0f32; n * dout];
            matmul_nt_f32_on(isa, &mut y, &x, &w, n, din, dout);
            for r in 0..n {
                let mut y1 = vec![0.0f32; dout];
                matmul_nt_f32_on(isa, &mut y1, &x[r * din..(r + 1) * din], &w, 1, din, dout);
                proptest::prop_assert_eq!(&y1[..], &y[r * dout..(r + 1) * dout]);
                for c in 0..dout {
                    let e: f64 = (0..din).map(|k| x[r * din + k] as f64 * w[c * din + k] as f64).sum();
                    proptest::prop_assert!((y[r * dout + c] as f64 - e).abs() < 1e-5);
                }
            }
        }
    }
}
