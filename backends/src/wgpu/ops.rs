//! One launcher per kernel: binds the op's buffers in the kernel's binding order, fills its
//! `Params` and picks the launch geometry. Names, argument order (outputs first) and shapes
//! follow the CPU reference's `cpu::ops`, so the conformance suite can run each op on both.
//! Launchers only record into an [`Exec`]; nothing runs until `Exec::submit`.
//!
//! Differences from the CPU ops, all deliberate: gradient outputs that the model never needs
//! to accumulate (`swiglu_bwd`, `logprob_bwd`, `attention_bwd`, `grpo_loss_bwd`) are written
//! rather than added to; the log-prob ops take one vocabulary chunk of the logits at a time
//! (the fused lm_head of `lm_head.rs`, as in the CPU reference's `cpu::lm_head`);
//! `attention_*` take packed rows with per-row metadata instead of one sequence per call, and
//! save log-sum-exp instead of the probability matrix.

use rolloutpipe_kernels::{Kernel, MATMUL_BWD_COOP_PARTS, WeightFormat};
use wgpu::Buffer;

use super::gpu::{Exec, Params, groups, linear, padded};

/// Output tile edge of the shared GEMM body (`GEMM_T` in `kernels/wgsl/prelude/gemm.wgsl`).
const GEMM_TILE: usize = 128;

/// Ceil-divided counts of a tensor-core product's `wt` x `wt` output tiles.
fn coop_tiles(cols: usize, rows: usize, wt: usize) -> [u32; 2] {
    [
        cols.div_ceil(wt).max(1) as u32,
        rows.div_ceil(wt).max(1) as u32,
    ]
}

/// Ceil-divided tile counts of the GEMM's 128x128 output tiles.
fn tiles(cols: usize, rows: usize) -> [u32; 2] {
    [
        cols.div_ceil(GEMM_TILE).max(1) as u32,
        rows.div_ceil(GEMM_TILE).max(1) as u32,
    ]
}

/// `dst` = the `n` f32 values of `src` rounded to `format` (bf16 or f16, nearest-even as
/// `cpu::store::round_to_bf16` / `round_to_f16`): packed in pairs as [`pack_half`] writes
/// them when `packed`, else widened back to f32 values. Under f16 a non-finite result sets
/// `overflow[tensor]` (a `u32` per tensor, zeroed by the caller). A tensor above the binding
/// limit runs in chunks of a multiple of 128 values (both bindings start on 256 bytes).
#[allow(clippy::too_many_arguments)]
pub fn weight_cast(
    ex: &mut Exec,
    dst: &Buffer,
    src: &Buffer,
    overflow: &Buffer,
    n: usize,
    format: WeightFormat,
    tensor: usize,
    packed: bool,
) {
    let mode = match format {
        WeightFormat::Bf16 => 0,
        WeightFormat::F16 => 1,
        WeightFormat::F32 => {
            ex.gpu()
                .defer_error("weight_cast: f32 is not a 16-bit format".into());
            return;
        }
    };
    let chunk = (elementwise_chunk(ex.binding_limit(), n) / 128 * 128).max(128);
    let whole = chunk >= n;
    for first in (0..n.max(1)).step_by(chunk) {
        let count = chunk.min(n - first.min(n));
        let p = Params::new().u(count).u(mode).u(tensor);
        let (sb, db) = if whole {
            ((src, 0, 0), (dst, 0, 0))
        } else if packed {
            (
                (src, (first * 4) as u64, (count * 4) as u64),
                (dst, (first * 2) as u64, binding_bytes(count, 2)),
            )
        } else {
            (
                (src, (first * 4) as u64, (count * 4) as u64),
                (dst, (first * 4) as u64, (count * 4) as u64),
            )
        };
        let (entry, threads) = if packed {
            (0, count.div_ceil(2))
        } else {
            (1, count)
        };
        ex.dispatch_ranges(
            Kernel::WeightCast,
            entry,
            &[sb, db, (overflow, 0, 0)],
            p,
            linear(threads, 256),
        );
    }
}

/// `out[n, d] = table[ids[t], :]` (also a row gather: `table` any `[rows, d]` buffer).
pub fn embedding_fwd(
    ex: &mut Exec,
    out: &Buffer,
    ids: &Buffer,
    table: &Buffer,
    n: usize,
    d: usize,
    vocab: usize,
) {
    embedding_fwd_as(ex, out, ids, table, WeightFormat::F32, n, d, vocab);
}

/// [`embedding_fwd`] from a table stored in `format` (16-bit values packed in pairs, as
/// [`pack_half`] writes them); the output is f32, the same values as from the widened table.
#[allow(clippy::too_many_arguments)]
pub fn embedding_fwd_as(
    ex: &mut Exec,
    out: &Buffer,
    ids: &Buffer,
    table: &Buffer,
    format: WeightFormat,
    n: usize,
    d: usize,
    vocab: usize,
) {
    // Rows of the table per launch: all, unless the table exceeds the binding limit. Chunks
    // start on 256-byte boundaries: 64 rows of f32, 128 rows of 16-bit values.
    let bytes = format.bytes();
    let multiple = 256 / bytes;
    let chunk = rows_per_binding_as(ex.binding_limit(), d, bytes, multiple).min(vocab.max(1));
    for first in (0..vocab.max(1)).step_by(chunk) {
        let count = chunk.min(vocab - first.min(vocab));
        let p = Params::new().u(n).u(d).u(vocab).u(first).u(count);
        let tb = (
            table,
            (first * d * bytes) as u64,
            binding_bytes(count * d, bytes),
        );
        let tb = if chunk >= vocab { (table, 0, 0) } else { tb };
        ex.dispatch_as(
            Kernel::EmbeddingFwd,
            format,
            0,
            &[(ids, 0, 0), tb, (out, 0, 0)],
            p,
            linear(n * d, 256),
        );
    }
}

/// Bytes of a binding of `len` values of `bytes` each, rounded up to whole 4-byte words (a
/// 16-bit tensor of odd length ends in a half-used word; its buffer holds that word).
fn binding_bytes(len: usize, bytes: usize) -> u64 {
    ((len * bytes).div_ceil(4) * 4) as u64
}

/// 16-bit values (bf16 or f16 bit patterns) packed two per `u32` as the `weight_bf16` and
/// `weight_f16` preludes read them: value `2j` in the low half of word `j`, `2j + 1` in the
/// high half; an odd count leaves the last word's high half zero.
pub fn pack_half(bits: &[u16]) -> Vec<u32> {
    bits.chunks(2)
        .map(|p| u32::from(p[0]) | (u32::from(p.get(1).copied().unwrap_or(0)) << 16))
        .collect()
}

/// Values of `len` f32 per binding of `limit` bytes for an elementwise op: all of them, or a
/// multiple of 64 (so that every chunk starts on a 256-byte boundary); at least 64.
pub fn elementwise_chunk(limit: usize, len: usize) -> usize {
    if len.saturating_mul(4) <= limit {
        return len.max(1);
    }
    (limit / 4 / 64 * 64).max(64)
}

/// `(first, count)` of each chunk of `len` values, [`elementwise_chunk`] at a time.
fn chunks(limit: usize, len: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunk = elementwise_chunk(limit, len);
    (0..len.max(1))
        .step_by(chunk)
        .map(move |first| (first, chunk.min(len - first.min(len))))
}

/// How many rows of `width` f32 one binding of `limit` bytes holds, rounded down to a
/// multiple of `multiple` (itself a multiple of 64, so that every chunk starts on a 256-byte
/// boundary, the largest storage offset alignment WebGPU allows); at least `multiple`.
pub fn rows_per_binding(limit: usize, width: usize, multiple: usize) -> usize {
    rows_per_binding_as(limit, width, 4, multiple)
}

/// [`rows_per_binding`] for values of `bytes` bytes; `multiple · bytes` must be a multiple of
/// 256 for the chunks to stay aligned.
pub fn rows_per_binding_as(limit: usize, width: usize, bytes: usize, multiple: usize) -> usize {
    let rows = limit / (width.max(1) * bytes);
    (rows / multiple * multiple).max(multiple)
}

/// The positions of a scatter-add sorted by the row they add to, built on the host from
/// ids the host already has (token ids, selected rows), for [`embedding_bwd`].
///
/// `pairs` holds `(row, position)` for every position, sorted by row and ascending within
/// a row (a stable sort); `starts` holds where each touched row's pairs begin, then `n`.
/// Building it is O(n log n) on the host for the n ≤ a few thousand rows of a micro-batch
/// (a counting sort would be O(n + vocab), more at a 151,936-entry vocabulary).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScatterIndex {
    /// First index into `pairs` of each touched row, then `n`.
    pub starts: Vec<u32>,
    /// `(row, position)` per position, flattened.
    pub pairs: Vec<u32>,
}

impl ScatterIndex {
    /// Sorts positions `0..ids.len()` by `ids[position]`, clamped below `rows` (the host
    /// validates ids first; clamping keeps two bad ids from becoming two writers of one row).
    pub fn new(ids: &[u32], rows: usize) -> Self {
        let last = rows.saturating_sub(1).min(u32::MAX as usize) as u32;
        let row = |i: u32| ids[i as usize].min(last);
        let mut order: Vec<u32> = (0..ids.len() as u32).collect();
        order.sort_by_key(|&i| row(i));
        let mut starts = Vec::new();
        let mut pairs = Vec::with_capacity(2 * ids.len());
        for (k, &i) in order.iter().enumerate() {
            if k == 0 || row(order[k - 1]) != row(i) {
                starts.push(k as u32);
            }
            pairs.extend([row(i), i]);
        }
        starts.push(ids.len() as u32);
        Self { starts, pairs }
    }

    /// Number of distinct rows written.
    pub fn touched(&self) -> usize {
        self.starts.len() - 1
    }

    /// Length of `starts` for up to `n` positions.
    pub fn starts_len(n: usize) -> usize {
        n + 1
    }

    /// Length of `pairs` for up to `n` positions.
    pub fn pairs_len(n: usize) -> usize {
        2 * n
    }
}

/// About how many workgroups [`embedding_bwd`] spreads its touched rows over (more only
/// where a row is wider than that many · 64 columns). The split changes no sum, so it can
/// follow the adapter:
/// - a GPU wants many workgroups in flight (1,024 of 64 lanes: 64 Ki invocations; a guess,
///   not yet tuned on a GPU);
/// - a CPU adapter (lavapipe) runs each workgroup as a loop on one of a few cores and pays
///   a fixed cost per workgroup, so it wants few and long ones: with 256 the small model's
///   512-token embedding gradient (64 touched rows) ran 128 workgroups and was ~1.2x slower
///   than the column-serial kernel it replaces; with 16 it is not.
fn embedding_bwd_groups(ex: &Exec) -> usize {
    if ex.gpu().adapter_info().device_type == wgpu::DeviceType::Cpu {
        16
    } else {
        1024
    }
}

/// Largest y workgroup count of a dispatch (WebGPU's default limit).
const MAX_GROUPS_Y: usize = 65_535;

/// `dtable[ids[t], :] += dout[t, :]` (also a row scatter-add), with the positions grouped
/// by row on the host ([`ScatterIndex`], written to `starts` and `pairs`): each workgroup
/// takes 64 columns of a run of touched rows and adds each row's positions to them in
/// ascending order, so the sums are the CPU reference's, bit for bit.
#[allow(clippy::too_many_arguments)]
pub fn embedding_bwd(
    ex: &mut Exec,
    dtable: &Buffer,
    dout: &Buffer,
    starts: &Buffer,
    pairs: &Buffer,
    touched: usize,
    d: usize,
    vocab: usize,
) {
    let spread = embedding_bwd_groups(ex);
    embedding_bwd_spread(ex, dtable, dout, starts, pairs, touched, d, vocab, spread);
}

/// [`embedding_bwd`] spread over about `spread` workgroups instead of the adapter's
/// choice (the conformance suite checks that every spread gives the same bits).
#[allow(clippy::too_many_arguments)]
pub fn embedding_bwd_spread(
    ex: &mut Exec,
    dtable: &Buffer,
    dout: &Buffer,
    starts: &Buffer,
    pairs: &Buffer,
    touched: usize,
    d: usize,
    vocab: usize,
    spread: usize,
) {
    if touched == 0 {
        return;
    }
    let col_blocks = d.div_ceil(64).max(1);
    let runs = (spread / col_blocks).clamp(1, touched.min(MAX_GROUPS_Y));
    let per_group = touched.div_ceil(runs);
    // Rows of the table per launch: all, unless it exceeds the binding limit.
    let chunk = rows_per_binding(ex.binding_limit(), d, 64).min(vocab.max(1));
    for first in (0..vocab.max(1)).step_by(chunk) {
        let count = chunk.min(vocab - first.min(vocab));
        let p = Params::new()
            .u(touched)
            .u(d)
            .u(vocab)
            .u(per_group)
            .u(first)
            .u(count);
        let tb = if chunk >= vocab {
            (dtable, 0, 0)
        } else {
            (dtable, (first * d * 4) as u64, (count * d * 4) as u64)
        };
        ex.dispatch_ranges(
            Kernel::EmbeddingBwd,
            0,
            &[(starts, 0, 0), (pairs, 0, 0), (dout, 0, 0), tb],
            p,
            [col_blocks as u32, touched.div_ceil(per_group) as u32],
        );
    }
}

/// RMSNorm of `rows` rows of width `d`, saving `rstd[rows]`.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_fwd(
    ex: &mut Exec,
    out: &Buffer,
    rstd: &Buffer,
    x: &Buffer,
    w: &Buffer,
    rows: usize,
    d: usize,
    eps: f64,
) {
    let p = Params::new().u(rows).u(d).f(eps as f32);
    ex.dispatch(Kernel::RmsnormFwd, 0, &[x, w, out, rstd], p, groups(rows));
}

/// Rows per partial sum of `rmsnorm_bwd`'s `dw`: ⌈√rows⌉, so that the partial sums and
/// their reduction are both about √rows long. Depends on `rows` only, so the summation
/// order (and the result's bits) is fixed for a given shape.
pub fn rmsnorm_dw_chunk(rows: usize) -> usize {
    let r = rows.max(1);
    let s = r.isqrt();
    s + usize::from(s * s < r)
}

/// Floats of the `part` scratch that [`rmsnorm_bwd`] needs for up to `rows` rows of width
/// `d` (the number of chunks is at most ⌈√rows⌉).
pub fn rmsnorm_dw_scratch(rows: usize, d: usize) -> usize {
    rmsnorm_dw_chunk(rows) * d
}

/// Backward of [`rmsnorm_fwd`]: `dx (+)= …` (added when `accumulate`), `dw += …`, the
/// latter in two fixed-order stages through `part` (at least
/// [`rmsnorm_dw_scratch`]`(rows, d)` floats).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_bwd(
    ex: &mut Exec,
    dx: &Buffer,
    dw: &Buffer,
    part: &Buffer,
    dout: &Buffer,
    x: &Buffer,
    w: &Buffer,
    rstd: &Buffer,
    rows: usize,
    d: usize,
    accumulate: bool,
) {
    let chunk = rmsnorm_dw_chunk(rows);
    let chunks = rows.div_ceil(chunk).max(1);
    let p = Params::new().u(rows).u(d).u(accumulate as usize).u(chunk);
    let b = [x, w, rstd, dout, dx, dw, part];
    ex.dispatch(Kernel::RmsnormBwd, 0, &b, p, groups(rows));
    ex.dispatch(
        Kernel::RmsnormBwd,
        1,
        &b,
        p,
        [d.div_ceil(64) as u32, chunks as u32],
    );
    ex.dispatch(Kernel::RmsnormBwd, 2, &b, p, linear(d, 64));
}

/// `y[n, dout] (+)= x[n, din] · wᵀ` with `w` `[dout, din]`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_fwd(
    ex: &mut Exec,
    y: &Buffer,
    x: &Buffer,
    w: &Buffer,
    n: usize,
    din: usize,
    dout: usize,
    accumulate: bool,
) {
    matmul_fwd_as(ex, y, x, w, WeightFormat::F32, n, din, dout, accumulate);
}

/// A binding of part of a buffer: `(buffer, byte offset, byte size)`, size 0 = to the end.
pub type Part<'a> = (&'a Buffer, u64, u64);

/// [`matmul_fwd`] with `w` stored in `format` (16-bit values packed in pairs, as
/// [`pack_half`] writes them), widened exactly in registers: every output is the same fma
/// chain as from the widened f32 W, so the bits are too.
#[allow(clippy::too_many_arguments)]
pub fn matmul_fwd_as(
    ex: &mut Exec,
    y: &Buffer,
    x: &Buffer,
    w: &Buffer,
    format: WeightFormat,
    n: usize,
    din: usize,
    dout: usize,
    accumulate: bool,
) {
    matmul_fwd_window(
        ex,
        (y, 0, 0),
        (x, 0, 0),
        w,
        format,
        Window::all(dout),
        n,
        din,
        accumulate,
    );
}

/// Rows `first .. first + rows` of a weight matrix: the part a chunked op multiplies by.
/// `first` must be a multiple of 256 (so that the rows start on a 256-byte boundary).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// First row of W.
    pub first: usize,
    /// Rows of W.
    pub rows: usize,
}

impl Window {
    /// All `rows` rows of W.
    pub fn all(rows: usize) -> Self {
        Self { first: 0, rows }
    }
}

/// `y[n, rows] (+)= x[n, din] · W[first .. first + rows]ᵀ` for a [`Window`] of `w` (the
/// chunked lm_head's vocabulary chunks); `y` and `x` may be parts of larger buffers.
/// [`matmul_fwd_as`] is the window of all of W.
#[allow(clippy::too_many_arguments)]
pub fn matmul_fwd_window(
    ex: &mut Exec,
    y: Part<'_>,
    x: Part<'_>,
    w: &Buffer,
    format: WeightFormat,
    window: Window,
    n: usize,
    din: usize,
    accumulate: bool,
) {
    let dout = window.rows;
    // Columns (rows of W) per launch: all, unless the window exceeds the binding limit;
    // chunks are whole 256-column strips, so no output changes its launch geometry's
    // summation order (256 rows of W start on a 256-byte boundary in any format).
    let bytes = format.bytes();
    let chunk = rows_per_binding_as(ex.binding_limit(), din, bytes, 256).min(dout.max(1));
    let lanes = gemv_lanes(ex, din);
    for c0 in (0..dout.max(1)).step_by(chunk) {
        let cols = chunk.min(dout - c0.min(dout));
        // W bound whole only where the window is all of it: a first chunk of a larger W
        // (the lm_head's first vocabulary chunk) must not bind the rest.
        let whole = chunk >= dout && covers(w, window, din, bytes);
        let (wb, yb) = if whole {
            ((w, 0, 0), y)
        } else {
            (
                (
                    w,
                    ((window.first + c0) * din * bytes) as u64,
                    binding_bytes(cols * din, bytes),
                ),
                sub_part(y, c0 * 4),
            )
        };
        // Vector loads need K in whole vectors; every binding offset is 16-byte aligned
        // already (checked at submit), so x's and W's rows then start on vectors too.
        let vec4 = ex.vector_loads() && din.is_multiple_of(4);
        let p = Params::new()
            .u(n)
            .u(cols)
            .u(din)
            .u(accumulate as usize)
            .u(dout)
            .u(lanes)
            .u(vec4 as usize);
        let bufs = [x, wb, yb];
        if let Some(t) = ex.tensor_cores() {
            // Every row count on the one tensor-core kernel, so that a row's sums do not
            // depend on its batch (matmul_fwd_coop.wgsl: summation order).
            let wt = t.tile.workgroup_tile() as usize;
            ex.dispatch_coop(format, &bufs, p, coop_tiles(cols, n, wt));
        } else if n <= MATMUL_ROWS_MAX {
            ex.dispatch_as(
                Kernel::MatmulFwd,
                format,
                1,
                &bufs,
                p,
                linear(cols, 256 / lanes),
            );
        } else {
            ex.dispatch_as(Kernel::MatmulFwd, format, 0, &bufs, p, tiles(cols, n));
        }
    }
}

/// Whether `window` (rows of `din` values of `bytes` each) is all of `w`'s buffer (whose size
/// is padded to 16 bytes).
fn covers(w: &Buffer, window: Window, din: usize, bytes: usize) -> bool {
    window.first == 0 && padded(binding_bytes(window.rows * din, bytes)) == w.size()
}

/// `part` from `skip` more bytes on (its size shrunk to match, unless it runs to the end).
fn sub_part(part: Part<'_>, skip: usize) -> Part<'_> {
    let (b, off, size) = part;
    let skip = skip as u64;
    (
        b,
        off + skip,
        if size == 0 {
            0
        } else {
            size.saturating_sub(skip)
        },
    )
}

/// Products with at most this many rows (decode steps) use `matmul_fwd_gemv`, the split-K
/// GEMV.
pub const MATMUL_ROWS_MAX: usize = 8;

/// Lanes per column of `matmul_fwd_gemv` (a workgroup takes 256 / lanes columns), which
/// changes no result: on a GPU, 16 lanes (8 where K has fewer than 16 chunks of 64), so a
/// 1,024-wide projection launches 64 workgroups; on a CPU adapter, whose threads are SIMD
/// lanes of a few cores, one thread walks a column's whole K (idle lanes cost it time).
fn gemv_lanes(ex: &Exec, din: usize) -> usize {
    if let Some(l) = ex.forced_gemv_lanes() {
        return l;
    }
    if ex.gpu().adapter_info().device_type == wgpu::DeviceType::Cpu {
        1
    } else if din >= 16 * 64 {
        16
    } else {
        8
    }
}

/// Backward of [`matmul_fwd`]: `dx (+)= dy·w` when `dx` is given (`(buffer, accumulate)`),
/// and `dw += dyᵀ·x`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_bwd(
    ex: &mut Exec,
    dx: Option<(&Buffer, bool)>,
    dw: &Buffer,
    dy: &Buffer,
    x: &Buffer,
    w: &Buffer,
    n: usize,
    din: usize,
    dout: usize,
) {
    let dx = dx.map(|(b, acc)| ((b, 0, 0), acc));
    let all = Window::all(dout);
    matmul_bwd_window(ex, dx, dw, (dy, 0, 0), (x, 0, 0), w, all, n, din);
}

/// Backward of [`matmul_fwd_window`] for a window of `w` (and the same rows of `dw`):
/// `dx (+)= dy·W[window]` when `dx` is given, `dW[window] += dyᵀ·x`; `dy` is `[n, rows]`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_bwd_window(
    ex: &mut Exec,
    dx: Option<(Part<'_>, bool)>,
    dw: &Buffer,
    dy: Part<'_>,
    x: Part<'_>,
    w: &Buffer,
    window: Window,
    n: usize,
    din: usize,
) {
    let dout = window.rows;
    let dummy = ex.dummy();
    let (dxb, acc) = match dx {
        Some((b, acc)) => (b, acc),
        None => ((&dummy, 0, 0), false),
    };
    // Rows of W (and dW) per launch: all, unless the window exceeds the binding limit. Then
    // dx sums the chunks' products one after another (deterministic, but not the single fma
    // chain of one launch); each dW row is still one chain.
    let chunk = rows_per_binding(ex.binding_limit(), din, 256).min(dout.max(1));
    for (i, c0) in (0..dout.max(1)).step_by(chunk).enumerate() {
        let rows = chunk.min(dout - c0.min(dout));
        let first_acc = if i == 0 { acc } else { true };
        // Vector loads need dy's and W's rows (and dW's tile edge) in whole vectors.
        let vec4 = ex.vector_loads()
            && din.is_multiple_of(4)
            && rows.is_multiple_of(4)
            && dout.is_multiple_of(4);
        let p = Params::new()
            .u(n)
            .u(rows)
            .u(din)
            .u(first_acc as usize)
            .u(dout)
            .u(vec4 as usize);
        let whole = chunk >= dout && covers(w, window, din, 4) && covers(dw, window, din, 4);
        let part = |b: &Buffer| {
            if whole {
                (b.clone(), 0, 0)
            } else {
                let len = (rows * din * 4) as u64;
                (b.clone(), ((window.first + c0) * din * 4) as u64, len)
            }
        };
        let (wb, dwb) = (part(w), part(dw));
        let dyb = if whole { dy } else { sub_part(dy, c0 * 4) };
        let b = [dyb, x, (&wb.0, wb.1, wb.2), dxb, (&dwb.0, dwb.1, dwb.2)];
        if let Some(t) = ex.tensor_cores() {
            // The launch's |dy| maxima first (they pick the chunk's gradient scale), then dx
            // and dW on tensor cores (matmul_bwd_coop.wgsl: gradient scaling).
            let wt = t.tile.workgroup_tile() as usize;
            let parts = (n * rows)
                .div_ceil(256)
                .clamp(1, MATMUL_BWD_COOP_PARTS as usize);
            let p = p.u(parts);
            ex.dispatch_coop_bwd(0, &b, p, [parts as u32, 1]);
            if dx.is_some() {
                ex.dispatch_coop_bwd(1, &b, p, coop_tiles(din, n, wt));
            }
            ex.dispatch_coop_bwd(2, &b, p, coop_tiles(din, rows, wt));
            continue;
        }
        if dx.is_some() {
            ex.dispatch_ranges(Kernel::MatmulBwd, 0, &b, p, tiles(din, n));
        }
        ex.dispatch_ranges(Kernel::MatmulBwd, 1, &b, p, tiles(din, rows));
    }
}

/// Rotate-half RoPE in place on `x[rows, heads·hd]` at `pos[rows]`, from the `[max_pos,
/// hd/2]` cos/sin tables.
#[allow(clippy::too_many_arguments)]
pub fn rope_fwd(
    ex: &mut Exec,
    x: &Buffer,
    pos: &Buffer,
    cos: &Buffer,
    sin: &Buffer,
    rows: usize,
    heads: usize,
    hd: usize,
    max_pos: usize,
) {
    let p = Params::new().u(rows).u(heads).u(hd).u(max_pos);
    ex.dispatch(
        Kernel::RopeFwd,
        0,
        &[x, pos, cos, sin],
        p,
        linear(rows * heads * hd / 2, 256),
    );
}

/// Backward of [`rope_fwd`] in place on the gradient.
#[allow(clippy::too_many_arguments)]
pub fn rope_bwd(
    ex: &mut Exec,
    dx: &Buffer,
    pos: &Buffer,
    cos: &Buffer,
    sin: &Buffer,
    rows: usize,
    heads: usize,
    hd: usize,
    max_pos: usize,
) {
    let p = Params::new().u(rows).u(heads).u(hd).u(max_pos);
    ex.dispatch(
        Kernel::RopeBwd,
        0,
        &[dx, pos, cos, sin],
        p,
        linear(rows * heads * hd / 2, 256),
    );
}

/// The attention scale `head_dim^-½`, rounded from f64 as the CPU reference does.
pub fn attention_scale(hd: usize) -> f32 {
    (1.0 / (hd as f64).sqrt()) as f32
}

/// The launch shape of [`attention_fwd`] (see `kernels/wgsl/attention_fwd.wgsl`): a (row,
/// head) "slot" of `td` threads, each owning at most 8 of the head's output dims; `slots`
/// of them per workgroup, holding `hg` query heads of one kv head's group for up to `qt`
/// rows of one sequence; keys staged in chunks of `ck`. `td`, `slots` and `ck` depend on
/// head_dim only, so a row's arithmetic does not depend on the group size either.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionFwdTiling {
    /// Threads per (row, head): a power of two `>= head_dim / 8`.
    pub td: usize,
    /// (row, head) slots per workgroup: `ATTN_WG / td`.
    pub slots: usize,
    /// Keys per staged K/V chunk.
    pub ck: usize,
    /// Query heads per workgroup: `min(G, slots)`.
    pub hg: usize,
    /// Query rows per tile: `slots / hg`.
    pub qt: usize,
    /// Workgroups per (tile, kv head): `ceil(G / hg)`.
    pub parts: usize,
    /// Keys per launch (a multiple of `ck`, [`attention_fwd_window`]): rows with more keys
    /// carry their softmax state to the next launch, so that no invocation's loops pass
    /// llvmpipe's 65,535-trip cap.
    pub wk: usize,
}

/// Loop trips of one launch of `attention_fwd` the windows aim at: half llvmpipe's cap
/// of 65,535 (one counter per invocation, decremented at every back-edge of every loop that
/// is not unrolled; at zero the loop exits and the results are silently wrong).
const ATTN_FWD_TRIPS: usize = 32_768;

/// Loop trips a chunk of `ck` keys costs one invocation of `attention_fwd`, counted
/// conservatively (every loop counted, the constant 8-trip `DPT` loops too, and every
/// bound rounded up): the chunk loop, the K and V staging, the score loop with its dot
/// product, the max, p and psum loops and the 8 accumulator loops over the chunk's keys.
pub fn attention_fwd_chunk_trips(hd: usize, td: usize, ck: usize) -> usize {
    let scores = ck.div_ceil(td);
    1 + 2 * (ck * hd).div_ceil(ATTN_WG) + scores * (1 + hd) + 2 * ck + scores + 8 * (1 + ck)
}

/// The most keys (whole chunks, at least one) a launch of `attention_fwd` with chunks of
/// `ck` may cover within [`ATTN_FWD_TRIPS`], beside the prologue's few hundred trips (tile
/// scan <= 128, q staging <= 9, state load 8). About 1,570 keys at head_dim 128, 690 at 256.
pub fn attention_fwd_window(hd: usize, td: usize, ck: usize) -> usize {
    ck * (ATTN_FWD_TRIPS / attention_fwd_chunk_trips(hd, td, ck)).max(1)
}

/// `attention_fwd`'s workgroup size and workgroup-memory arrays (floats), as declared in the
/// kernel (`WG`, `QS_LEN`, `KV_LEN`, `SC_LEN`): 15,104 bytes of them whatever head_dim, so
/// the kernel fits WebGPU's guaranteed 16 KiB on any adapter.
const ATTN_WG: usize = 128;
const ATTN_QS: usize = 1152;
const ATTN_KV: usize = 2112;
const ATTN_SC: usize = 256;

/// The [`AttentionFwdTiling`] for `h` query heads on `kvh` kv heads of `hd` (1 ..= 1024).
pub fn attention_fwd_tiling(h: usize, kvh: usize, hd: usize) -> AttentionFwdTiling {
    assert!(
        (1..=1024).contains(&hd) && kvh > 0 && h.is_multiple_of(kvh),
        "attention_fwd: head_dim {hd} (1..=1024), heads {h} / kv heads {kvh}"
    );
    let td = hd.div_ceil(8).next_power_of_two();
    let slots = ATTN_WG / td;
    // Padded rows (hd + 1 floats) in qs and kv; one score and one p per (slot, key).
    let ck = (ATTN_KV / (hd + 1)).min(ATTN_SC / slots);
    debug_assert!(slots * (hd + 1) <= ATTN_QS && ck >= 1);
    let g = h / kvh;
    let hg = g.min(slots);
    AttentionFwdTiling {
        td,
        slots,
        ck,
        hg,
        qt: slots / hg,
        parts: g.div_ceil(hg),
        wk: attention_fwd_window(hd, td, ck),
    }
}

/// Causal GQA attention of `n_q` query rows; query `i` attends key rows
/// `qmeta[2i] ..= qmeta[2i] + qmeta[2i+1]` of `k`, `v` (`n_k` rows). Writes `out` and the
/// log-sum-exp into the first `n_q·h` entries of `stats`. One workgroup per (row, kv head,
/// part of its group's heads): the kernel tiles runs of a sequence's rows itself, and a
/// row's result does not depend on its tile (see `attention_fwd.wgsl`). On an adapter that
/// caps loop iterations ([`Gpu::loop_cap`](super::gpu::Gpu::loop_cap): llvmpipe), rows of more keys than a launch window
/// take several launches, whose state crosses in `out` and the second half of `stats`, which
/// must then hold `2·n_q·h` floats; elsewhere it is one launch (the same bits).
#[allow(clippy::too_many_arguments)]
pub fn attention_fwd(
    ex: &mut Exec,
    out: &Buffer,
    stats: &Buffer,
    q: &Buffer,
    k: &Buffer,
    v: &Buffer,
    qmeta: &Buffer,
    n_q: usize,
    n_k: usize,
    h: usize,
    kvh: usize,
    hd: usize,
) {
    let mut t = attention_fwd_tiling(h, kvh, hd);
    if ex.gpu().loop_cap().is_none() {
        // No loop limit to stay under (see `Gpu::loop_cap`): every key in one launch.
        t.wk = n_k.max(1).next_multiple_of(t.ck);
    }
    attention_fwd_tiled(ex, out, stats, q, k, v, qmeta, n_q, n_k, h, kvh, hd, t);
}

/// [`attention_fwd`] with the tiling `t`: [`attention_fwd_tiling`]'s, or in tests one with
/// the same `td` and smaller `hg`, `qt`, `ck` (`parts = ceil(G / hg)`) and any window `wk`
/// (a multiple of `ck`) up to [`attention_fwd_window`]`(hd, td, ck)`, which must give
/// bit-identical outputs. (`wk` above that is let through only to show llvmpipe's cap.)
#[allow(clippy::too_many_arguments)]
pub fn attention_fwd_tiled(
    ex: &mut Exec,
    out: &Buffer,
    stats: &Buffer,
    q: &Buffer,
    k: &Buffer,
    v: &Buffer,
    qmeta: &Buffer,
    n_q: usize,
    n_k: usize,
    h: usize,
    kvh: usize,
    hd: usize,
    t: AttentionFwdTiling,
) {
    let d = attention_fwd_tiling(h, kvh, hd);
    assert!(
        t.td == d.td
            && t.slots == d.slots
            && (1..=d.ck).contains(&t.ck)
            && (1..=d.hg).contains(&t.hg)
            && (1..=t.slots / t.hg).contains(&t.qt)
            && t.parts == (h / kvh).div_ceil(t.hg)
            && t.wk >= t.ck
            && t.wk.is_multiple_of(t.ck),
        "attention_fwd: tiling {t:?} does not fit {d:?}"
    );
    let p = Params::new()
        .u(n_q)
        .u(h)
        .u(kvh)
        .u(hd)
        .u(n_k)
        .f(attention_scale(hd))
        .u(t.td)
        .u(t.ck)
        .u(t.hg)
        .u(t.qt);
    // A row has at most n_k keys; launches past a tile's last key return at once (one
    // launch at training sizes).
    let windows = n_k.max(1).div_ceil(t.wk);
    if windows > 1 {
        assert!(
            stats.size() >= (2 * n_q * h * 4) as u64,
            "attention_fwd: {windows} launch windows carry l in stats' second half: \
             stats needs 2·n_q·h = {} floats",
            2 * n_q * h
        );
    }
    let b = [q, k, v, qmeta, out, stats];
    // Entry 0 (one launch) skips the state loads and stores; entry 1 runs window w.
    let entry = usize::from(windows > 1);
    for w in 0..windows {
        let pw = p.u(w * t.wk).u((w + 1) * t.wk);
        let wg = groups(n_q * kvh * t.parts);
        ex.dispatch(Kernel::AttentionFwd, entry, &b, pw, wg);
    }
}

/// The launch shape of [`attention_bwd`] (see `kernels/wgsl/attention_bwd.wgsl`): slots of
/// `td` threads as in [`AttentionFwdTiling`] (`slots = ATTN_WG / td`). `attention_bwd_dq`
/// holds `hg` query heads of `qt` rows a tile (`parts` workgroups a tile when G > slots) and
/// stages keys in chunks of `ck`; `attention_bwd_dkv` holds `slots` keys a tile and stages
/// (query row, head) items in chunks of `cq`. `td`, `slots`, `ck` and `cq` depend on head_dim
/// only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionBwdTiling {
    /// Threads per slot: a power of two `>= head_dim / 8`.
    pub td: usize,
    /// Slots per workgroup: `ATTN_WG / td`; also the keys of a `dkv` tile.
    pub slots: usize,
    /// Keys per staged K/V chunk (`dq`).
    pub ck: usize,
    /// (query row, head) items per staged q/dout chunk (`dkv`).
    pub cq: usize,
    /// Query heads per `dq` workgroup: `min(G, slots)`.
    pub hg: usize,
    /// Query rows per `dq` tile: `slots / hg`.
    pub qt: usize,
    /// `dq` workgroups per (tile, kv head): `ceil(G / hg)`.
    pub parts: usize,
    /// Keys per `dkv` tile: `slots` (fewer only in tests, to move where tiles begin).
    pub kt: usize,
    /// Keys per `dq` launch (a multiple of `ck`): rows with more keys continue their sums in
    /// the next launch, so that no invocation's loops pass llvmpipe's 65,535-trip cap.
    pub wk: usize,
    /// (query row, head) items per `dkv` launch (a multiple of `cq`), likewise.
    pub wi: usize,
}

/// Keys or items per launch of an `attention_bwd` entry, rounded down to whole chunks: at
/// most about 35 loop trips a chunk (46 at head_dim 256) stay far below llvmpipe's cap.
const ATTN_BWD_WINDOW: usize = 2048;

/// `attention_bwd`'s f32 arena (`SM_LEN`, as declared in the kernel), partitioned per entry:
/// with `red[WG]` and three u32s, 15,884 bytes, within WebGPU's guaranteed 16 KiB.
const ATTN_BWD_SM: usize = 3840;

/// The [`AttentionBwdTiling`] for `h` query heads on `kvh` kv heads of `hd` (1 ..= 512).
pub fn attention_bwd_tiling(h: usize, kvh: usize, hd: usize) -> AttentionBwdTiling {
    assert!(
        (1..=512).contains(&hd) && kvh > 0 && h.is_multiple_of(kvh),
        "attention_bwd: head_dim {hd} (1..=512), heads {h} / kv heads {kvh}"
    );
    let td = hd.div_ceil(8).next_power_of_two();
    let slots = ATTN_WG / td;
    let hs = hd + 1;
    // Both entries stage two padded rows a slot; the rest of the arena holds the chunks:
    // dq a K and a V row a key and one dS a (slot, key); dkv a q and a dout row, lse and
    // delta an item and P and dS a (slot, item).
    let rest = ATTN_BWD_SM - 2 * slots * hs;
    let ck = rest / (2 * hs + slots);
    let cq = rest / (2 * hs + 2 + 2 * slots);
    debug_assert!(ck >= 1 && cq >= 1);
    let g = h / kvh;
    let hg = g.min(slots);
    AttentionBwdTiling {
        td,
        slots,
        ck,
        cq,
        hg,
        qt: slots / hg,
        parts: g.div_ceil(hg),
        kt: slots,
        wk: ck * (ATTN_BWD_WINDOW / ck),
        wi: cq * (ATTN_BWD_WINDOW / cq),
    }
}

/// Backward of [`attention_fwd`] over `n` packed rows (`meta_rows[2r..2r+2]` = start and
/// length of row r's sequence): writes `dq` and `dkv = [dk, dv]`; `stats` holds the
/// forward's log-sum-exp and receives the row sums `delta` in its second half. `dq` runs
/// per (query tile, kv head, head part), `dk, dv` per (key tile, kv head); the kernel finds
/// its tiles itself and no output depends on its tile (see `attention_bwd.wgsl`). Each entry
/// launches in windows on an adapter that caps loop iterations
/// ([`Gpu::loop_cap`](super::gpu::Gpu::loop_cap)), once
/// elsewhere (the same bits).
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd(
    ex: &mut Exec,
    dq: &Buffer,
    dkv: &Buffer,
    stats: &Buffer,
    dout: &Buffer,
    q: &Buffer,
    k: &Buffer,
    v: &Buffer,
    out: &Buffer,
    meta_rows: &Buffer,
    n: usize,
    h: usize,
    kvh: usize,
    hd: usize,
) {
    let mut t = attention_bwd_tiling(h, kvh, hd);
    if ex.gpu().loop_cap().is_none() {
        // No loop limit to stay under (see `Gpu::loop_cap`): one launch per entry.
        t.wk = n.max(1).next_multiple_of(t.ck);
        t.wi = (n * (h / kvh)).max(1).next_multiple_of(t.cq);
    }
    attention_bwd_tiled(
        ex, dq, dkv, stats, dout, q, k, v, out, meta_rows, n, h, kvh, hd, t,
    );
}

/// [`attention_bwd`] with the tiling `t`: [`attention_bwd_tiling`]'s, or in tests one with
/// the same `td` and smaller `hg`, `qt`, `ck`, `cq`, `kt` (`parts = ceil(G / hg)`), which
/// must give bit-identical outputs.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd_tiled(
    ex: &mut Exec,
    dq: &Buffer,
    dkv: &Buffer,
    stats: &Buffer,
    dout: &Buffer,
    q: &Buffer,
    k: &Buffer,
    v: &Buffer,
    out: &Buffer,
    meta_rows: &Buffer,
    n: usize,
    h: usize,
    kvh: usize,
    hd: usize,
    t: AttentionBwdTiling,
) {
    let d = attention_bwd_tiling(h, kvh, hd);
    assert!(
        t.td == d.td
            && t.slots == d.slots
            && (1..=d.ck).contains(&t.ck)
            && (1..=d.cq).contains(&t.cq)
            && (1..=d.hg).contains(&t.hg)
            && (1..=t.slots / t.hg).contains(&t.qt)
            && t.parts == (h / kvh).div_ceil(t.hg)
            && (1..=t.slots).contains(&t.kt)
            && t.wk >= t.ck
            && t.wk.is_multiple_of(t.ck)
            && t.wi >= t.cq
            && t.wi.is_multiple_of(t.cq)
            // Windows above the default pass llvmpipe's loop limit; elsewhere any will do.
            && (ex.gpu().loop_cap().is_none() || (t.wk <= d.wk && t.wi <= d.wi)),
        "attention_bwd: tiling {t:?} does not fit {d:?}"
    );
    let p = Params::new()
        .u(n)
        .u(h)
        .u(kvh)
        .u(hd)
        .f(attention_scale(hd))
        .u(t.td)
        .u(t.ck)
        .u(t.hg)
        .u(t.qt)
        .u(t.cq)
        .u(t.kt);
    let b = [q, k, v, out, stats, dout, dq, dkv, meta_rows];
    // A row has at most n keys and a key tile at most n·G items; launches past a tile's
    // last window return at once (one launch each at training sizes).
    for w in (0..n.max(1)).step_by(t.wk) {
        let pw = p.u(w).u(w + t.wk);
        ex.dispatch(Kernel::AttentionBwd, 0, &b, pw, groups(n * kvh * t.parts));
    }
    for w in (0..(n * (h / kvh)).max(1)).step_by(t.wi) {
        let pw = p.u(w).u(w + t.wi);
        ex.dispatch(Kernel::AttentionBwd, 1, &b, pw, groups(n * kvh));
    }
}

/// `out = silu(gate)·up` over `n` values.
pub fn swiglu_fwd(ex: &mut Exec, out: &Buffer, gate: &Buffer, up: &Buffer, n: usize) {
    ex.dispatch(
        Kernel::SwigluFwd,
        0,
        &[gate, up, out],
        Params::new().u(n),
        linear(n, 256),
    );
}

/// Backward of [`swiglu_fwd`] (written, not accumulated).
pub fn swiglu_bwd(
    ex: &mut Exec,
    dgate: &Buffer,
    dup: &Buffer,
    dout: &Buffer,
    gate: &Buffer,
    up: &Buffer,
    n: usize,
) {
    let b = [gate, up, dout, dgate, dup];
    ex.dispatch(Kernel::SwigluBwd, 0, &b, Params::new().u(n), linear(n, 256));
}

/// `out = a + b` over `n` values.
pub fn residual_fwd(ex: &mut Exec, out: &Buffer, a: &Buffer, b: &Buffer, n: usize) {
    ex.dispatch(
        Kernel::ResidualFwd,
        0,
        &[a, b, out],
        Params::new().u(n),
        linear(n, 256),
    );
}

/// One launch of the chunked log-probs: `rows` scored rows from `row0` of the per-row
/// buffers (targets, state, outputs), over vocabulary columns `v0 .. v0 + cols`, whose
/// logits are held `[rows, cols]` in a chunk buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VocabChunk {
    /// First row of the per-row buffers.
    pub row0: usize,
    /// Rows of this launch.
    pub rows: usize,
    /// Vocabulary index of the chunk's first column.
    pub v0: usize,
    /// Columns of the chunk.
    pub cols: usize,
}

/// The per-row buffers of the chunked log-probs: the running log-sum-exp state `[rows, 4]`
/// and the three outputs `[rows]`.
#[derive(Debug, Clone, Copy)]
pub struct LogprobBufs<'a> {
    /// `(max, Σ e^(z − max), Σ e^(z − max)·(z − max), z[target])` per row.
    pub state: &'a Buffer,
    /// `log_softmax(z)[target]`.
    pub logp: &'a Buffer,
    /// Entropy of `softmax(z)`.
    pub entropy: &'a Buffer,
    /// `logsumexp(z)`, which the backward reads.
    pub lse: &'a Buffer,
}

fn logprob_params(c: VocabChunk, first: bool, temperature: f64) -> Params {
    Params::new()
        .u(c.rows)
        .u(c.cols)
        .u(c.v0)
        .u(first as usize)
        .f((1.0 / temperature) as f32)
        .u(c.row0)
}

/// Folds one vocabulary chunk of `z = logits / T` (`logits` `[rows, cols]`) into the running
/// log-sum-exp state of its rows, starting it fresh when `first`; after the last chunk,
/// [`logprob_fwd_finish`] writes the outputs.
pub fn logprob_fwd(
    ex: &mut Exec,
    out: LogprobBufs<'_>,
    logits: &Buffer,
    targets: &Buffer,
    c: VocabChunk,
    first: bool,
    temperature: f64,
) {
    let b = [logits, targets, out.state, out.logp, out.entropy, out.lse];
    let p = logprob_params(c, first, temperature);
    ex.dispatch(Kernel::LogprobFwd, 0, &b, p, groups(c.rows));
}

/// `lse`, `logp = z[target] − lse` and the entropy of rows `row0 .. row0 + rows` from their
/// states after the last chunk of [`logprob_fwd`].
pub fn logprob_fwd_finish(ex: &mut Exec, out: LogprobBufs<'_>, row0: usize, rows: usize) {
    let dummy = ex.dummy();
    let b = [&dummy, &dummy, out.state, out.logp, out.entropy, out.lse];
    let c = VocabChunk {
        row0,
        rows,
        v0: 0,
        cols: 0,
    };
    let p = logprob_params(c, false, 1.0);
    ex.dispatch(Kernel::LogprobFwd, 1, &b, p, linear(rows, 256));
}

/// Backward of [`logprob_fwd`] for one chunk: turns its logits `[rows, cols]` into their
/// gradient `dlogp/T · (1[k = target] − softmax(z)_k)` in place, from the saved `lse`.
#[allow(clippy::too_many_arguments)]
pub fn logprob_bwd(
    ex: &mut Exec,
    logits: &Buffer,
    dlogp: &Buffer,
    lse: &Buffer,
    targets: &Buffer,
    c: VocabChunk,
    temperature: f64,
) {
    let p = Params::new()
        .u(c.rows)
        .u(c.cols)
        .u(c.v0)
        .f((1.0 / temperature) as f32)
        .u(c.row0);
    ex.dispatch(
        Kernel::LogprobBwd,
        0,
        &[targets, dlogp, lse, logits],
        p,
        linear(c.rows * c.cols, 256),
    );
}

/// Per-token flag bits of the loss kernels (shared by every device backend).
pub use crate::model::loss::flags;
pub use crate::model::{AdamScalars, Loss};

/// The loss kernels' parameters for `n` tokens.
fn loss_params(loss: Loss, n: usize) -> Params {
    match loss {
        Loss::Grpo {
            eps_low,
            eps_high,
            beta,
        } => Params::new()
            .u(n)
            .u(0)
            .f(eps_low as f32)
            .f(eps_high as f32)
            .f(beta as f32),
        Loss::Sft => Params::new().u(n).u(1).f(0.0).f(0.0).f(0.0),
    }
}

/// `stats = [Σ w·loss, Σ KL, #clipped, Σ entropy]` over the `n` tokens (see the kernel).
#[allow(clippy::too_many_arguments)]
pub fn grpo_loss_fwd(
    ex: &mut Exec,
    stats: &Buffer,
    logp: &Buffer,
    old: &Buffer,
    refp: &Buffer,
    adv: &Buffer,
    w: &Buffer,
    entropy: &Buffer,
    tok_flags: &Buffer,
    n: usize,
    loss: Loss,
) {
    let b = [logp, old, refp, adv, w, entropy, stats, tok_flags];
    ex.dispatch(Kernel::GrpoLossFwd, 0, &b, loss_params(loss, n), [1, 1]);
}

/// `dlogp = w·∂loss/∂logp` (written).
#[allow(clippy::too_many_arguments)]
pub fn grpo_loss_bwd(
    ex: &mut Exec,
    dlogp: &Buffer,
    logp: &Buffer,
    old: &Buffer,
    refp: &Buffer,
    adv: &Buffer,
    w: &Buffer,
    tok_flags: &Buffer,
    n: usize,
    loss: Loss,
) {
    let b = [logp, old, refp, adv, w, dlogp, tok_flags];
    ex.dispatch(
        Kernel::GrpoLossBwd,
        0,
        &b,
        loss_params(loss, n),
        linear(n, 256),
    );
}

/// One AdamW step of an `n`-value tensor in place. A tensor above the binding limit runs in
/// chunks (elementwise, so with the same bits).
pub fn adamw_step(
    ex: &mut Exec,
    p: &Buffer,
    g: &Buffer,
    m: &Buffer,
    v: &Buffer,
    n: usize,
    s: AdamScalars,
) {
    let whole = elementwise_chunk(ex.binding_limit(), n) >= n;
    for (first, count) in chunks(ex.binding_limit(), n) {
        let prm = Params::new()
            .u(count)
            .f(s.grad_scale)
            .f(s.decay)
            .f(s.step_size)
            .f(s.one_minus_beta1)
            .f(s.beta2)
            .f(s.one_minus_beta2)
            .f(s.sqrt_bc2)
            .f(s.eps);
        let r = |b| {
            if whole {
                (b, 0, 0)
            } else {
                (b, (first * 4) as u64, (count * 4) as u64)
            }
        };
        ex.dispatch_ranges(
            Kernel::AdamwStep,
            0,
            &[r(p), r(g), r(m), r(v)],
            prm,
            linear(count, 256),
        );
    }
}

/// Workgroups [`grad_norm`] launches for one binding of `n` values (its partials' count).
pub fn grad_norm_groups(n: usize) -> usize {
    n.div_ceil(256).clamp(1, 64)
}

/// Partials [`grad_norm`] writes for an `n`-value tensor under a binding limit of `limit`
/// bytes: [`grad_norm_groups`] of each chunk.
pub fn grad_norm_partials(limit: usize, n: usize) -> usize {
    chunks(limit, n).map(|(_, c)| grad_norm_groups(c)).sum()
}

/// Sum of squares of `g[n]` into `partials[base ..]`, one partial per workgroup of each
/// binding-sized chunk; returns how many it wrote ([`grad_norm_partials`]). The chunks and
/// their workgroups are fixed by `n` and the limit, so the sum's order is too.
pub fn grad_norm(
    ex: &mut Exec,
    partials: &Buffer,
    total: &Buffer,
    g: &Buffer,
    n: usize,
    base: usize,
) -> usize {
    let whole = elementwise_chunk(ex.binding_limit(), n) >= n;
    let mut at = base;
    for (first, count) in chunks(ex.binding_limit(), n) {
        let p = Params::new().u(count).u(at).u(0);
        let gb = if whole {
            (g, 0, 0)
        } else {
            (g, (first * 4) as u64, (count * 4) as u64)
        };
        ex.dispatch_ranges(
            Kernel::GradNorm,
            0,
            &[gb, (partials, 0, 0), (total, 0, 0)],
            p,
            [grad_norm_groups(count) as u32, 1],
        );
        at += grad_norm_groups(count);
    }
    at - base
}

/// `total[0] = Σ partials[0 .. count]`.
pub fn grad_norm_reduce(ex: &mut Exec, total: &Buffer, partials: &Buffer, count: usize) {
    let dummy = ex.dummy();
    let p = Params::new().u(0).u(0).u(count);
    ex.dispatch(Kernel::GradNorm, 1, &[&dummy, partials, total], p, [1, 1]);
}

/// Samples one token per row of `logits[rows, v]`; `rowp[r]` = (1/T or 0 for greedy,
/// top_k bits, top_p, u). Writes `tokens[rows]` and their log-probs.
#[allow(clippy::too_many_arguments)]
pub fn sample(
    ex: &mut Exec,
    tokens: &Buffer,
    logp: &Buffer,
    logits: &Buffer,
    rowp: &Buffer,
    rows: usize,
    v: usize,
) {
    let p = Params::new().u(rows).u(v);
    ex.dispatch(
        Kernel::Sample,
        0,
        &[logits, rowp, tokens, logp],
        p,
        groups(rows),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scatter_index_sorts_positions_by_row_in_order() {
        let ix = ScatterIndex::new(&[5, 2, 5, 0, 2, 5], 6);
        assert_eq!(ix.starts, vec![0, 1, 3, 6]);
        assert_eq!(ix.pairs, vec![0, 3, 2, 1, 2, 4, 5, 0, 5, 2, 5, 5]);
        assert_eq!(ix.touched(), 3);
        // Out-of-range ids clamp to the last row and share its one group.
        let ix = ScatterIndex::new(&[9, 1, 7], 4);
        assert_eq!(
            (ix.starts, ix.pairs),
            (vec![0, 1, 3], vec![1, 1, 3, 0, 3, 2])
        );
        let empty = ScatterIndex::new(&[], 4);
        assert_eq!((empty.touched(), empty.pairs.len()), (0, 0));
    }

    #[test]
    fn binding_chunks_fit_the_limit_and_stay_aligned() {
        // lm_head of Qwen3-0.6B on lavapipe: 32,768 rows of W a launch, 5 launches.
        assert_eq!(rows_per_binding(128 << 20, 1024, 256), 32_768);
        assert_eq!(151_936usize.div_ceil(32_768), 5);
        for (limit, width, multiple) in [(128 << 20, 1000, 256), (1 << 31, 3, 64), (4096, 7, 64)] {
            let rows = rows_per_binding(limit, width, multiple);
            assert_eq!(rows % multiple, 0);
            // Fits, unless even one multiple does not (then the device reports the error).
            assert!(
                rows * width * 4 <= limit || rows == multiple,
                "{limit} {width}"
            );
            // Chunk starts are 256-byte aligned: rows·width·4 with rows a multiple of 64.
            assert_eq!(rows * width * 4 % 256, 0);
            // and rows·width·2 with rows a multiple of 128 (16-bit tables).
            let half = rows_per_binding_as(limit, width, 2, 128);
            assert_eq!((half % 128, half * width * 2 % 256), (0, 0));
            assert!(half * width * 2 <= limit || half == 128, "{limit} {width}");
        }
    }

    #[test]
    fn half_values_pack_low_half_first_and_odd_counts_pad_with_zero() {
        assert_eq!(
            pack_half(&[0x1234, 0xabcd, 0x0f0f]),
            vec![0xabcd_1234, 0x0000_0f0f]
        );
        assert_eq!(pack_half(&[]), Vec::<u32>::new());
        assert_eq!(
            (
                binding_bytes(3, 2),
                binding_bytes(4, 2),
                binding_bytes(3, 4)
            ),
            (8, 8, 12)
        );
    }

    #[test]
    fn elementwise_chunks_cover_the_tensor_aligned_and_within_the_limit() {
        for (limit, len) in [
            (4096, 0),
            (4096, 1),
            (4096, 1024),
            (4096, 1025),
            (4096, 5000),
            (1000, 300),
            (128 << 20, 155_582_464),
        ] {
            let cs: Vec<_> = chunks(limit, len).collect();
            // Contiguous, in order, covering 0..len (one empty chunk for an empty tensor).
            let mut next = 0;
            for &(first, count) in &cs {
                assert_eq!(first, next, "{limit} {len}");
                next += count;
                assert!(count * 4 <= limit || count == 64, "{limit} {len}: {count}");
                if cs.len() > 1 {
                    assert_eq!(first * 4 % 256, 0, "{limit} {len}: chunk at {first}");
                }
            }
            assert_eq!(next, len);
            assert_eq!(
                cs.len() == 1,
                len * 4 <= limit || len <= 64,
                "{limit} {len}"
            );
            let partials = grad_norm_partials(limit, len);
            assert_eq!(
                partials,
                cs.iter().map(|&(_, c)| grad_norm_groups(c)).sum::<usize>()
            );
        }
        // The 0.6B embedding (151,936 × 1024 f32) on lavapipe's 128 MiB: 5 chunks.
        assert_eq!(chunks(128 << 20, 155_582_464).count(), 5);
    }

    #[test]
    fn rmsnorm_dw_chunks_fit_the_scratch() {
        for rows in (0..3000).chain([65_535, 65_536, 65_537, 1 << 20]) {
            let chunk = rmsnorm_dw_chunk(rows);
            assert!(chunk * chunk >= rows && (chunk - 1) * (chunk - 1) < rows.max(1));
            // Chunks never exceed the chunk length, so a scratch sized for the largest
            // call's rows serves every smaller call.
            assert!(rows.div_ceil(chunk) <= chunk, "{rows}");
            assert!(rmsnorm_dw_chunk(rows) <= rmsnorm_dw_chunk(rows + 1));
        }
    }

    #[test]
    fn attention_fwd_tiling_fits_the_kernel() {
        // The host's copies of the kernel's sizes are the kernel's.
        let src = Kernel::AttentionFwd.wgsl();
        for (name, n) in [
            ("WG", ATTN_WG),
            ("QS_LEN", ATTN_QS),
            ("KV_LEN", ATTN_KV),
            ("SC_LEN", ATTN_SC),
        ] {
            assert!(
                src.contains(&format!("const {name}: u32 = {n}u;")),
                "{name}"
            );
        }
        assert!(src.contains(&format!("@workgroup_size({ATTN_WG})")));
        // Workgroup memory: the four f32 arrays, rpos[WG] and three u32s.
        let bytes = 4 * (ATTN_QS + ATTN_KV + 2 * ATTN_SC + ATTN_WG + 3);
        assert!(bytes <= 16_384, "{bytes}");
        for hd in 1..=1024 {
            for (h, kvh) in [(1, 1), (2, 1), (16, 8), (8, 2), (16, 1), (40, 8), (64, 1)] {
                let t = attention_fwd_tiling(h, kvh, hd);
                let g = h / kvh;
                assert!(t.td.is_power_of_two() && t.td * t.slots == ATTN_WG, "{hd}");
                assert!(hd.div_ceil(t.td) <= 8, "{hd}: more than 8 dims a thread");
                assert!(t.slots * (hd + 1) <= ATTN_QS, "{hd}");
                assert!(t.ck >= 1 && t.ck * (hd + 1) <= ATTN_KV, "{hd}");
                assert!(t.slots * t.ck <= ATTN_SC, "{hd}");
                assert!(t.hg * t.qt <= t.slots && t.qt >= 1, "{hd} {g}");
                assert!(t.hg * t.parts >= g && t.hg * (t.parts - 1) < g, "{hd} {g}");
                // What fixes a row's arithmetic depends on head_dim only.
                let one = attention_fwd_tiling(1, 1, hd);
                assert_eq!((t.td, t.slots, t.ck), (one.td, one.slots, one.ck));
            }
        }
        // Qwen3 (head_dim 128, 16 / 8 heads): 16 threads of 8 dims, 4 rows × 2 heads a
        // tile, chunks of 16 keys.
        let t = attention_fwd_tiling(16, 8, 128);
        assert_eq!(
            (t.td, t.slots, t.ck, t.hg, t.qt, t.parts),
            (16, 8, 16, 2, 4, 1)
        );
        // Launch windows: whole chunks within the trip budget, one launch at training sizes.
        for hd in 1..=1024 {
            let t = attention_fwd_tiling(1, 1, hd);
            let trips = t.wk / t.ck * attention_fwd_chunk_trips(hd, t.td, t.ck);
            assert!(t.wk.is_multiple_of(t.ck) && trips <= ATTN_FWD_TRIPS, "{hd}");
            // (at head_dim <= 256 a window holds the training sizes' few hundred keys)
            assert!(hd > 256 || t.wk >= 512, "{hd}: {}", t.wk);
        }
        assert_eq!(attention_fwd_tiling(16, 8, 128).wk, 1568);
        assert_eq!(attention_fwd_tiling(2, 1, 256).wk, 688);
    }

    #[test]
    fn attention_bwd_tiling_fits_the_kernel() {
        let src = Kernel::AttentionBwd.wgsl();
        for (name, n) in [("WG", ATTN_WG), ("SM_LEN", ATTN_BWD_SM)] {
            assert!(
                src.contains(&format!("const {name}: u32 = {n}u;")),
                "{name}"
            );
        }
        assert!(src.contains(&format!("@workgroup_size({ATTN_WG})")));
        // Workgroup memory: the arena, red[WG] and three u32s.
        let bytes = 4 * (ATTN_BWD_SM + ATTN_WG + 3);
        assert!(bytes <= 16_384, "{bytes}");
        for hd in 1..=512 {
            for (h, kvh) in [(1, 1), (2, 1), (16, 8), (8, 2), (16, 1), (40, 8), (64, 1)] {
                let t = attention_bwd_tiling(h, kvh, hd);
                let g = h / kvh;
                let hs = hd + 1;
                assert!(t.td.is_power_of_two() && t.td * t.slots == ATTN_WG, "{hd}");
                assert!(hd.div_ceil(t.td) <= 8, "{hd}: more than 8 dims a thread");
                // The kernel's arena offsets, per entry.
                let dq = 2 * t.slots * hs + 2 * t.ck * hs + t.slots * t.ck;
                let dkv = 2 * t.slots * hs + 2 * t.cq * hs + 2 * t.cq + 2 * t.slots * t.cq;
                assert!(t.ck >= 1 && dq <= ATTN_BWD_SM, "{hd}: dq {dq}");
                assert!(t.cq >= 1 && dkv <= ATTN_BWD_SM, "{hd}: dkv {dkv}");
                assert!(t.hg * t.qt <= t.slots && t.qt >= 1, "{hd} {g}");
                assert!(t.hg * t.parts >= g && t.hg * (t.parts - 1) < g, "{hd} {g}");
                assert!(
                    t.wk.is_multiple_of(t.ck) && t.wk > ATTN_BWD_WINDOW - t.ck,
                    "{hd}"
                );
                assert!(
                    t.wi.is_multiple_of(t.cq) && t.wi > ATTN_BWD_WINDOW - t.cq,
                    "{hd}"
                );
                let one = attention_bwd_tiling(1, 1, hd);
                assert_eq!(
                    (t.td, t.slots, t.ck, t.cq),
                    (one.td, one.slots, one.ck, one.cq)
                );
            }
        }
        // Qwen3 (head_dim 128, 16 / 8 heads): 8 slots of 16 threads; dq tiles of 4 rows ×
        // 2 heads with 6-key chunks, dkv tiles of 8 keys with 6-item chunks.
        let t = attention_bwd_tiling(16, 8, 128);
        assert_eq!(
            (t.td, t.slots, t.ck, t.cq, t.hg, t.qt, t.parts),
            (16, 8, 6, 6, 2, 4, 1)
        );
    }

    /// f64 reference of attention_fwd for query rows `meta` (base, pos) over `k`, `v`:
    /// (out [n_q, h, hd], lse [n_q, h]).
    fn attention_fwd_ref(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        meta: &[u32],
        h: usize,
        kvh: usize,
        hd: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let n_q = meta.len() / 2;
        let (mut out, mut lse) = (vec![0f32; n_q * h * hd], vec![0f32; n_q * h]);
        let scale = attention_scale(hd) as f64;
        for i in 0..n_q {
            let (b, pos) = (meta[2 * i] as usize, meta[2 * i + 1] as usize);
            for hh in 0..h {
                let qi = &q[(i * h + hh) * hd..(i * h + hh + 1) * hd];
                let kr = |j: usize| ((b + j) * kvh + hh / (h / kvh)) * hd;
                let s: Vec<f64> = (0..=pos)
                    .map(|j| {
                        let kj = &k[kr(j)..kr(j) + hd];
                        qi.iter()
                            .zip(kj)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for d in 0..hd {
                    let o: f64 = (0..=pos)
                        .map(|j| (s[j] - m).exp() * v[kr(j) + d] as f64)
                        .sum();
                    out[(i * h + hh) * hd + d] = (o / l) as f32;
                }
                lse[i * h + hh] = (m + l.ln()) as f32;
            }
        }
        (out, lse)
    }

    fn close(what: &str, got: &[f32], want: &[f32]) {
        let worst = got
            .iter()
            .zip(want)
            .map(|(g, w)| (g - w).abs())
            .fold(0f32, f32::max);
        assert!(
            got.len() == want.len() && worst <= 1e-4,
            "{what}: off by {worst} from the reference"
        );
    }

    fn test_gpu() -> Option<std::sync::Arc<crate::wgpu::Gpu>> {
        let g = crate::wgpu::Gpu::new().expect("wgpu device");
        if g.is_none() {
            assert!(
                !std::env::var("ROLLOUTPIPE_REQUIRE_GPU").is_ok_and(|v| v == "1"),
                "no wgpu adapter and ROLLOUTPIPE_REQUIRE_GPU=1"
            );
            eprintln!("SKIP: no wgpu adapter");
        }
        g
    }

    fn test_rand(seed: &mut u32, len: usize) -> Vec<f32> {
        (0..len)
            .map(|_| {
                *seed ^= *seed << 13;
                *seed ^= *seed >> 17;
                *seed ^= *seed << 5;
                (*seed >> 8) as f32 / (1u32 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// The forward's out and lse match an f64 reference under other tilings and launch
    /// windows, and are bit-identical among those of the same chunk length (which sets the
    /// online softmax's steps): the default (one launch here), smaller tiles with windows of
    /// two chunks, windows of one chunk; chunks of 3 keys in windows of 3 and 12; chunks of
    /// one key in windows of 60 and the widest they may have. The last would cross llvmpipe's
    /// cap of 65,535 loop trips an invocation at about 230 keys at head_dim 256 launched as
    /// one window (281 trips a key): the 300-token sequence catches a forward that does not
    /// split its launches (ATTN_FWD_ONE_LAUNCH=1 launches that case as one window).
    #[test]
    fn attention_fwd_outputs_do_not_depend_on_the_tiling_or_windows() {
        let Some(g) = test_gpu() else { return };
        let mut seed = 0x2545_f491_u32;
        let lens = [300usize, 5, 37, 1];
        let n: usize = lens.iter().sum();
        let mut meta = Vec::new();
        let mut s = 0;
        for &m in &lens {
            for t in 0..m {
                meta.extend([s as u32, t as u32]);
            }
            s += m;
        }
        for (h, kvh, hd) in [(2, 1, 256), (4, 2, 32), (16, 8, 128)] {
            let (qd, kd) = (h * hd, kvh * hd);
            let (qh, kh, vh) = (
                test_rand(&mut seed, n * qd),
                test_rand(&mut seed, n * kd),
                test_rand(&mut seed, n * kd),
            );
            let (q, k, v) = (g.upload("q", &qh), g.upload("k", &kh), g.upload("v", &vh));
            let qm = g.upload("qmeta", &meta);
            let d = attention_fwd_tiling(h, kvh, hd);
            let grp = h / kvh;
            let hg1 = d.hg.div_ceil(2);
            let ck3 = d.ck.min(3);
            let one = std::env::var("ATTN_FWD_ONE_LAUNCH").is_ok_and(|v| v == "1");
            let small = AttentionFwdTiling {
                hg: hg1,
                qt: (d.slots / hg1).min(3),
                parts: grp.div_ceil(hg1),
                ..d
            };
            let tilings = [
                d,
                AttentionFwdTiling {
                    wk: 2 * d.ck,
                    ..small
                },
                AttentionFwdTiling { wk: d.ck, ..d },
                AttentionFwdTiling {
                    ck: ck3,
                    wk: ck3,
                    ..d
                },
                AttentionFwdTiling {
                    ck: ck3,
                    wk: 4 * ck3,
                    ..small
                },
                AttentionFwdTiling { ck: 1, wk: 60, ..d },
                AttentionFwdTiling {
                    hg: 1,
                    qt: 1,
                    parts: grp,
                    ck: 1,
                    // (ATTN_FWD_ONE_LAUNCH=1: everything in one launch, as before windows)
                    wk: if one {
                        n
                    } else {
                        attention_fwd_window(hd, d.td, 1)
                    },
                    ..d
                },
            ];
            let (want_o, want_l) = attention_fwd_ref(&qh, &kh, &vh, &meta, h, kvh, hd);
            let mut first: std::collections::HashMap<usize, [Vec<u32>; 2]> = Default::default();
            for t in tilings {
                let (out, st) = (g.buffer("out", n * qd), g.buffer("stats", 2 * n * h));
                let mut ex = Exec::new(std::sync::Arc::clone(&g));
                attention_fwd_tiled(&mut ex, &out, &st, &q, &k, &v, &qm, n, n, h, kvh, hd, t);
                ex.submit().expect("forward");
                let got = [
                    g.read::<u32>(&out, n * qd).expect("out"),
                    g.read::<u32>(&st, n * h).expect("stats"),
                ];
                let f = |b: &[u32]| b.iter().map(|&x| f32::from_bits(x)).collect::<Vec<_>>();
                close(&format!("out h{h} hd{hd} {t:?}"), &f(&got[0]), &want_o);
                close(&format!("lse h{h} hd{hd} {t:?}"), &f(&got[1]), &want_l);
                match first.get(&t.ck) {
                    None => {
                        first.insert(t.ck, got);
                    }
                    Some(f) => {
                        assert!(f[0] == got[0], "out h{h} hd{hd} differs under {t:?}");
                        assert!(f[1] == got[1], "lse h{h} hd{hd} differs under {t:?}");
                    }
                }
            }
        }
    }

    /// A realistic long row: one head of 128 dims against 4,096 keys (the default tiling's
    /// three launch windows; as one launch it passes llvmpipe's loop cap at about 3,200
    /// keys; ATTN_FWD_ONE_LAUNCH=1 launches it so). Only four query rows: it costs little.
    #[test]
    fn attention_fwd_long_rows_match_the_reference() {
        let Some(g) = test_gpu() else { return };
        let mut seed = 0x6b43_a9b5_u32;
        let (n_k, hd) = (4096usize, 128usize);
        let meta = [0u32, 4095, 0, 4094, 0, 3001, 0, 0];
        let n_q = meta.len() / 2;
        let (qh, kh, vh) = (
            test_rand(&mut seed, n_q * hd),
            test_rand(&mut seed, n_k * hd),
            test_rand(&mut seed, n_k * hd),
        );
        let (q, k, v) = (g.upload("q", &qh), g.upload("k", &kh), g.upload("v", &vh));
        let qm = g.upload("qmeta", &meta);
        let (out, st) = (g.buffer("out", n_q * hd), g.buffer("stats", 2 * n_q));
        let mut t = attention_fwd_tiling(1, 1, hd);
        // (ATTN_FWD_ONE_LAUNCH=1: all 4,096 keys in one launch, as before windows)
        if std::env::var("ATTN_FWD_ONE_LAUNCH").is_ok_and(|v| v == "1") {
            t.wk = n_k;
        }
        let mut ex = Exec::new(std::sync::Arc::clone(&g));
        attention_fwd_tiled(&mut ex, &out, &st, &q, &k, &v, &qm, n_q, n_k, 1, 1, hd, t);
        ex.submit().expect("forward");
        let (want_o, want_l) = attention_fwd_ref(&qh, &kh, &vh, &meta, 1, 1, hd);
        close("out", &g.read::<f32>(&out, n_q * hd).expect("out"), &want_o);
        close("lse", &g.read::<f32>(&st, n_q).expect("stats"), &want_l);
    }

    /// The backward's outputs are bit-identical under other tilings (smaller query and key
    /// tiles, fewer heads a workgroup, shorter chunks): tiles and chunks then begin at other
    /// rows, keys and items, which the packing tests (whose tiles always align at a
    /// sequence's start) cannot move. Sequences shorter than a tile, ending mid-tile and
    /// mid-chunk; G = 1, 2, 16 (more heads than slots at head_dim 128); short launch windows
    /// (`wk`, `wi`), so sums continue across launches. Chunks of one key and one item at
    /// G = 16 in one window first caught llvmpipe's cap of 65,535 loop trips a loop nest.
    #[test]
    fn attention_bwd_outputs_do_not_depend_on_the_tiling() {
        let Some(g) = crate::wgpu::Gpu::new().expect("wgpu device") else {
            assert!(
                !std::env::var("ROLLOUTPIPE_REQUIRE_GPU").is_ok_and(|v| v == "1"),
                "no wgpu adapter and ROLLOUTPIPE_REQUIRE_GPU=1"
            );
            eprintln!("SKIP: no wgpu adapter");
            return;
        };
        let mut seed = 0x9e37_79b9_u32;
        let mut rand = |len: usize| -> Vec<f32> {
            (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 17;
                    seed ^= seed << 5;
                    (seed >> 8) as f32 / (1u32 << 23) as f32 - 1.0
                })
                .collect()
        };
        let lens = [2usize, 29, 1, 11];
        let n: usize = lens.iter().sum();
        let mut rows = Vec::new();
        let mut meta = Vec::new();
        let mut s = 0;
        for &m in &lens {
            for t in 0..m {
                rows.extend([s as u32, m as u32]);
                meta.extend([s as u32, t as u32]);
            }
            s += m;
        }
        for (h, kvh, hd) in [
            (4, 2, 32),
            (2, 2, 16),
            (16, 8, 128),
            (16, 1, 128),
            (2, 1, 256),
        ] {
            let (qd, kd) = (h * hd, kvh * hd);
            let (q, k, v, dout) = (
                g.upload("q", &rand(n * qd)),
                g.upload("k", &rand(n * kd)),
                g.upload("v", &rand(n * kd)),
                g.upload("dout", &rand(n * qd)),
            );
            let (qm, rm) = (g.upload("qmeta", &meta), g.upload("rows", &rows));
            let (out, st) = (g.buffer("out", n * qd), g.buffer("stats", 2 * n * h));
            let mut ex = Exec::new(std::sync::Arc::clone(&g));
            attention_fwd(&mut ex, &out, &st, &q, &k, &v, &qm, n, n, h, kvh, hd);
            ex.submit().expect("forward");
            let d = attention_bwd_tiling(h, kvh, hd);
            let grp = h / kvh;
            let hg1 = d.hg.div_ceil(2);
            let tilings = [
                d,
                AttentionBwdTiling {
                    hg: hg1,
                    qt: (d.slots / hg1).min(3),
                    parts: grp.div_ceil(hg1),
                    ck: d.ck.min(5).max(d.ck / 3),
                    cq: d.cq.min(4).max(d.cq / 3),
                    kt: d.slots.min(3),
                    wk: 4 * d.ck.min(5).max(d.ck / 3),
                    wi: 3 * d.cq.min(4).max(d.cq / 3),
                    ..d
                },
                AttentionBwdTiling {
                    hg: 1,
                    qt: 1,
                    parts: grp,
                    ck: 1,
                    cq: 1,
                    kt: 1,
                    wk: 2,
                    wi: 5,
                    ..d
                },
            ];
            let mut first: Option<[Vec<u32>; 2]> = None;
            for t in tilings {
                let (dq, dkv) = (g.buffer("dq", n * qd), g.buffer("dkv", 2 * n * kd));
                // (delta, in stats' second half, is rewritten alike by each run)
                let mut ex = Exec::new(std::sync::Arc::clone(&g));
                attention_bwd_tiled(
                    &mut ex, &dq, &dkv, &st, &dout, &q, &k, &v, &out, &rm, n, h, kvh, hd, t,
                );
                ex.submit().expect("backward");
                let got = [
                    g.read::<u32>(&dq, n * qd).expect("dq"),
                    g.read::<u32>(&dkv, 2 * n * kd).expect("dkv"),
                ];
                assert!(got[0].iter().all(|&b| f32::from_bits(b).is_finite()));
                match &first {
                    None => first = Some(got),
                    Some(f) => {
                        assert!(
                            f[0] == got[0],
                            "dq h{h} kvh{kvh} hd{hd} differs under {t:?}"
                        );
                        assert!(
                            f[1] == got[1],
                            "dk/dv h{h} kvh{kvh} hd{hd} differs under {t:?}"
                        );
                    }
                }
            }
        }
    }
}
