// matmul_fwd: y[M, N] (+)= x[M, K] · W[N, K]ᵀ  (W stored [out, in] as in HF checkpoints).
// Tiled through workgroup memory: a 16x16 workgroup computes a 64x64 tile of y, each thread
// a 4x4 block (rows ty + 16a, columns tx + 16b, so stores of a warp are contiguous); K is
// walked in steps of 16 with both operand tiles staged in workgroup memory, read along K
// where global memory is contiguous.
// Entry matmul_fwd_rows serves products with at most 8 rows (decode steps), where a 64-row
// tile would be mostly idle: a workgroup computes 256 columns for all rows, staging x's rows
// through workgroup memory 256 values of K at a time, so it needs two barriers per 256 of K
// instead of two per 16.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    accumulate: u32, // 1: y += x·Wᵀ, 0: y = x·Wᵀ
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

const TM: u32 = 64u;
const TN: u32 = 64u;
const TK: u32 = 16u;
// Stored [k][row] so that the inner product loop reads consecutive rows/columns.
var<workgroup> a_tile: array<f32, 1024>; // TK * TM
var<workgroup> b_tile: array<f32, 1024>; // TK * TN

@compute @workgroup_size(16, 16)
fn matmul_fwd(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid3: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let tx = lid3.x;
    let ty = lid3.y;
    let row0 = wid.y * TM;
    let col0 = wid.x * TN;
    var acc: array<f32, 16>;
    for (var i = 0u; i < 16u; i++) {
        acc[i] = 0.0;
    }
    // A thread whose first row or column is past the edge owns no output: it still helps
    // load tiles (and meets every barrier) but skips the products. Decode steps have few
    // rows, so most of a 64-row tile is idle there.
    let live = row0 + ty < p.m && col0 + tx < p.n;
    for (var k0 = 0u; k0 < p.k; k0 += TK) {
        for (var q = 0u; q < 4u; q++) {
            let e = lid + 256u * q;
            // x and W are both contiguous along K: 16 neighbouring threads read one row.
            let r = e / TK;
            let kk = e % TK;
            let gk = k0 + kk;
            var av = 0.0;
            if (row0 + r < p.m && gk < p.k) {
                av = x[(row0 + r) * p.k + gk];
            }
            a_tile[kk * TM + r] = av;
            var bv = 0.0;
            if (col0 + r < p.n && gk < p.k) {
                bv = w[(col0 + r) * p.k + gk];
            }
            b_tile[kk * TN + r] = bv;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < select(0u, TK, live); kk++) {
            var av: array<f32, 4>;
            var bv: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                av[i] = a_tile[kk * TM + ty + 16u * i];
                bv[i] = b_tile[kk * TN + tx + 16u * i];
            }
            for (var i = 0u; i < 4u; i++) {
                for (var j = 0u; j < 4u; j++) {
                    acc[i * 4u + j] = fma(av[i], bv[j], acc[i * 4u + j]);
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let r = row0 + ty + 16u * i;
        for (var j = 0u; j < 4u; j++) {
            let c = col0 + tx + 16u * j;
            if (r < p.m && c < p.n) {
                let o = r * p.n + c;
                if (p.accumulate != 0u) {
                    y[o] += acc[i * 4u + j];
                } else {
                    y[o] = acc[i * 4u + j];
                }
            }
        }
    }
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
                let wv = w[wb + kk];
                for (var r = 0u; r < ROWS_MAX; r++) {
                    acc[r] = fma(x_rows[r * GK + kk], wv, acc[r]);
                }
            }
        }
        workgroupBarrier();
    }
    if (c < p.n) {
        for (var r = 0u; r < m; r++) {
            let o = r * p.n + c;
            if (p.accumulate != 0u) {
                y[o] += acc[r];
            } else {
                y[o] = acc[r];
            }
        }
    }
}
