// matmul_fwd: y[M, N] (+)= x[M, K] · W[N, K]ᵀ  (W stored [out, in] as in HF checkpoints).
// Entry matmul_fwd is the shared tiled GEMM of the `gemm` prelude (128x128 per 16x16
// workgroup, 8x8 per thread; see kernels/wgsl/prelude/gemm.wgsl) in its forward mode.
// Entry matmul_fwd_rows serves products with at most 8 rows (decode steps), where a 128-row
// tile would be mostly idle: a workgroup computes 256 columns for all rows, staging x's rows
// through workgroup memory 256 values of K at a time, so it needs two barriers per 256 of K.
// Both entries sum each output in the same order (one fma chain over K, ascending), so a
// decode step's rows come out bit for bit as they would in a larger product.
// A W above the device's storage-binding limit (lm_head at a 151,936 vocabulary: 622 MB) is
// launched in column chunks by the host: W and y bound from the chunk's first column, y's
// row stride ldy the full width; each output's sum is unchanged.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    accumulate: u32, // 1: y += x·Wᵀ, 0: y = x·Wᵀ
    ldy: u32,        // row stride of y (n, or the full width when launched in column chunks)
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
// Binding 2, the weight W, is declared by the `weight_*` prelude (f32, bf16 or f16 storage)
// and read only through its hook `weight(i)`.
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

fn gemm_a(mode: u32, r: u32, i: u32) -> f32 {
    if (r < p.m && i < p.k) {
        return x[r * p.k + i];
    }
    return 0.0;
}

// B(i, c) = Wᵀ(i, c) = W[c, i].
fn gemm_b(mode: u32, i: u32, c: u32) -> f32 {
    if (c < p.n && i < p.k) {
        return weight(c * p.k + i);
    }
    return 0.0;
}

fn gemm_store(mode: u32, r: u32, c: u32, v: f32) {
    let o = r * p.ldy + c;
    if (p.accumulate != 0u) {
        y[o] += v;
    } else {
        y[o] = v;
    }
}

@compute @workgroup_size(16, 16)
fn matmul_fwd(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid3: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    gemm(GEMM_FWD, wid, lid3.x, lid3.y, lid);
}

const ROWS_MAX: u32 = 8u;
const GK: u32 = 256u;
var<workgroup> x_rows: array<f32, 2048>; // ROWS_MAX * GK

@compute @workgroup_size(16, 16)
fn matmul_fwd_rows(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let c = wid.x * 256u + lid;
    let m = min(p.m, ROWS_MAX);
    var acc: array<f32, 8>;
    for (var r = 0u; r < ROWS_MAX; r++) {
        acc[r] = 0.0;
    }
    for (var k0 = 0u; k0 < p.k; k0 += GK) {
        for (var q = 0u; q < ROWS_MAX; q++) {
            let e = lid + 256u * q;
            let r = e / GK;
            let kk = k0 + e % GK;
            var xv = 0.0;
            if (r < m && kk < p.k) {
                xv = x[r * p.k + kk];
            }
            x_rows[e] = xv;
        }
        workgroupBarrier();
        if (c < p.n) {
            let len = min(GK, p.k - k0);
            let wb = c * p.k + k0;
            for (var kk = 0u; kk < len; kk++) {
                let wv = weight(wb + kk);
                for (var r = 0u; r < ROWS_MAX; r++) {
                    acc[r] = fma(x_rows[r * GK + kk], wv, acc[r]);
                }
            }
        }
        workgroupBarrier();
    }
    if (c < p.n) {
        for (var r = 0u; r < m; r++) {
            let o = r * p.ldy + c;
            if (p.accumulate != 0u) {
                y[o] += acc[r];
            } else {
                y[o] = acc[r];
            }
        }
    }
}
