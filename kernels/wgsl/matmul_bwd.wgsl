// matmul_bwd for y = x·Wᵀ (x [M, K], W [N, K], dy [M, N]):
//   matmul_bwd_dx: dx[M, K] (+)= dy[M, N] · W[N, K]
//   matmul_bwd_dw: dW[N, K] += dyᵀ[N, M] · x[M, K]   (weight gradients always accumulate)
// Both are the shared tiled GEMM of the `gemm` prelude (kernels/wgsl/prelude/gemm.wgsl) in
// its GEMM_DX and GEMM_DW modes; this file only says how the operands are indexed.
// A W above the device's storage-binding limit (lm_head at a 151,936 vocabulary) is launched
// in chunks of its rows by the host: W, dW and dy bound from the chunk's first row (dy's row
// stride ldy the full width), dx accumulating chunk after chunk.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    accumulate: u32, // for dx: 1 adds into dx (residual-stream gradients), 0 overwrites
    ldy: u32,        // row stride of dy (n, or the full width when launched in chunks)
    vec4: u32,       // 1: n, k, ldy and the operands' offsets are multiples of 4 values
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// The operands are read through vector loads where p.vec4 is set (see the `gemm` prelude),
// so they are typed by them; the host pads every binding to whole vectors. dy_at, x_at and
// w_at read one value.
@group(0) @binding(1) var<storage, read> dy: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> w: array<vec4<f32>>;

fn dy_at(i: u32) -> f32 {
    return dy[i >> 2u][i & 3u];
}

fn x_at(i: u32) -> f32 {
    return x[i >> 2u][i & 3u];
}

fn w_at(i: u32) -> f32 {
    return w[i >> 2u][i & 3u];
}
@group(0) @binding(4) var<storage, read_write> dx: array<f32>;
@group(0) @binding(5) var<storage, read_write> dw: array<f32>;

// A(r, i) of the product: dy[r, i] for dx, dyᵀ[r, i] = dy[i, r] for dW.
fn gemm_a(mode: u32, r: u32, i: u32) -> f32 {
    if (mode == GEMM_DX) {
        if (r < p.m && i < p.n) {
            return dy_at(r * p.ldy + i);
        }
        return 0.0;
    }
    if (r < p.n && i < p.m) {
        return dy_at(i * p.ldy + r);
    }
    return 0.0;
}

// B(i, c) of the product: W[i, c] for dx, x[i, c] for dW.
fn gemm_b(mode: u32, i: u32, c: u32) -> f32 {
    if (mode == GEMM_DX) {
        if (i < p.n && c < p.k) {
            return w_at(i * p.k + c);
        }
        return 0.0;
    }
    if (i < p.m && c < p.k) {
        return x_at(i * p.k + c);
    }
    return 0.0;
}

// A(r, i..i+3) = dy[r, i..i+3] for dx; A(r..r+3, i) = dy[i, r..r+3] for dW.
fn gemm_a4(mode: u32, r: u32, i: u32) -> vec4<f32> {
    if (mode == GEMM_DX) {
        if (r < p.m && i < p.n) {
            return dy[(r * p.ldy + i) >> 2u];
        }
        return vec4<f32>(0.0);
    }
    if (r < p.n && i < p.m) {
        return dy[(i * p.ldy + r) >> 2u];
    }
    return vec4<f32>(0.0);
}

// B(i, c..c+3) = W[i, c..c+3] for dx, x[i, c..c+3] for dW.
fn gemm_b4(mode: u32, i: u32, c: u32) -> vec4<f32> {
    if (mode == GEMM_DX) {
        if (i < p.n && c < p.k) {
            return w[(i * p.k + c) >> 2u];
        }
        return vec4<f32>(0.0);
    }
    if (i < p.m && c < p.k) {
        return x[(i * p.k + c) >> 2u];
    }
    return vec4<f32>(0.0);
}

fn gemm_store(mode: u32, r: u32, c: u32, v: f32) {
    let o = r * p.k + c;
    if (mode == GEMM_DW) {
        dw[o] += v;
    } else if (p.accumulate != 0u) {
        dx[o] += v;
    } else {
        dx[o] = v;
    }
}

@compute @workgroup_size(16, 16)
fn matmul_bwd_dx(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid3: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    gemm(GEMM_DX, wid, lid3.x, lid3.y, lid);
}

@compute @workgroup_size(16, 16)
fn matmul_bwd_dw(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid3: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    gemm(GEMM_DW, wid, lid3.x, lid3.y, lid);
}
