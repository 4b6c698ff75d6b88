// matmul_bwd for y = x·Wᵀ (x [M, K], W [N, K], dy [M, N]):
//   matmul_bwd_dx: dx[M, K] (+)= dy[M, N] · W[N, K]
//   matmul_bwd_dw: dW[N, K] += dyᵀ[N, M] · x[M, K]   (weight gradients always accumulate)
// Both share one tiled kernel body (64x64 output tile per 16x16 workgroup, 4x4 per thread,
// inner dimension staged 16 at a time in workgroup memory); the mode only changes how the
// operands are indexed and which way the tile loads walk so that reads stay contiguous.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    accumulate: u32, // for dx: 1 adds into dx (residual-stream gradients), 0 overwrites
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> dy: array<f32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> w: array<f32>;
@group(0) @binding(4) var<storage, read_write> dx: array<f32>;
@group(0) @binding(5) var<storage, read_write> dw: array<f32>;

const T: u32 = 64u;
const TK: u32 = 16u;
var<workgroup> a_tile: array<f32, 1024>; // [TK][T]
var<workgroup> b_tile: array<f32, 1024>; // [TK][T]

const MODE_DX: u32 = 0u;
const MODE_DW: u32 = 1u;

// A(r, i) of the product C = A·B.
fn load_a(mode: u32, r: u32, i: u32) -> f32 {
    if (mode == MODE_DX) {
        // dy[r, i], r < M, i < N
        if (r < p.m && i < p.n) {
            return dy[r * p.n + i];
        }
        return 0.0;
    }
    // dyᵀ[r, i] = dy[i, r], r < N, i < M
    if (r < p.n && i < p.m) {
        return dy[i * p.n + r];
    }
    return 0.0;
}

// B(i, c) of the product C = A·B.
fn load_b(mode: u32, i: u32, c: u32) -> f32 {
    if (mode == MODE_DX) {
        // W[i, c], i < N, c < K
        if (i < p.n && c < p.k) {
            return w[i * p.k + c];
        }
        return 0.0;
    }
    // x[i, c], i < M, c < K
    if (i < p.m && c < p.k) {
        return x[i * p.k + c];
    }
    return 0.0;
}

fn gemm(mode: u32, wid: vec3<u32>, tx: u32, ty: u32, lid: u32) {
    var rows = p.m;
    var inner = p.n;
    if (mode == MODE_DW) {
        rows = p.n;
        inner = p.m;
    }
    let cols = p.k;
    let row0 = wid.y * T;
    let col0 = wid.x * T;
    var acc: array<f32, 16>;
    for (var i = 0u; i < 16u; i++) {
        acc[i] = 0.0;
    }
    // Threads owning no output (first row or column past the edge) only help load tiles.
    let live = row0 + ty < rows && col0 + tx < cols;
    for (var k0 = 0u; k0 < inner; k0 += TK) {
        for (var q = 0u; q < 4u; q++) {
            let e = lid + 256u * q;
            // dy is contiguous along the inner dimension in dx mode and along rows in dw
            // mode; B (W or x) is contiguous along columns in both modes.
            if (mode == MODE_DX) {
                let r = e / TK;
                let kk = e % TK;
                a_tile[kk * T + r] = load_a(mode, row0 + r, k0 + kk);
            } else {
                let r = e % T;
                let kk = e / T;
                a_tile[kk * T + r] = load_a(mode, row0 + r, k0 + kk);
            }
            let c = e % T;
            let kk = e / T;
            b_tile[kk * T + c] = load_b(mode, k0 + kk, col0 + c);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < select(0u, TK, live); kk++) {
            var av: array<f32, 4>;
            var bv: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                av[i] = a_tile[kk * T + ty + 16u * i];
                bv[i] = b_tile[kk * T + tx + 16u * i];
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
            if (r < rows && c < cols) {
                let o = r * cols + c;
                if (mode == MODE_DW) {
                    dw[o] += acc[i * 4u + j];
                } else if (p.accumulate != 0u) {
                    dx[o] += acc[i * 4u + j];
                } else {
                    dx[o] = acc[i * 4u + j];
                }
            }
        }
    }
}

@compute @workgroup_size(16, 16)
fn matmul_bwd_dx(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid3: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    gemm(MODE_DX, wid, lid3.x, lid3.y, lid);
}

@compute @workgroup_size(16, 16)
fn matmul_bwd_dw(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid3: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    gemm(MODE_DW, wid, lid3.x, lid3.y, lid);
}
