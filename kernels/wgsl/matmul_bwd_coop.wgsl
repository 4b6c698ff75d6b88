// matmul_bwd_coop: the backward of y = x·Wᵀ (x [M, K], W [N, K], dy [M, N]) on cooperative
// matrices (tensor cores), with f16 operands and f32 accumulation:
//   matmul_bwd_coop_dx: dx[M, K] (+)= dy[M, N] · W[N, K]
//   matmul_bwd_coop_dw: dW[N, K] += dyᵀ[N, M] · x[M, K]   (weight gradients always accumulate)
// The bindings and Params of matmul_bwd, plus binding 6, `amax`: the host launches it in that
// kernel's place (lm_head chunks with ldy included) when the trainer's tensor cores are on.
//
// A `coop8` or `coop16` prelude comes first, then `coop_tile` (the tiling, shared with
// matmul_fwd_coop); W is the trainer's f32 master copy.
//
// Gradient scaling. f16's smallest normal is 6.1e-5 and token-mean gradients are often far
// smaller, so dy is not rounded as it is: it is multiplied by a power of two s, chosen per
// product from max|dy| so that the largest |dy|·s lies in [2^14, 2^15) (below 65504), and
// every result is multiplied by 1/s. Both are exact in f32, so the only error is the f16
// rounding of dy·s, x and W: relative 2^-11 for every |dy| down to max|dy|·2^-29 (f16's
// normal range), not a flush to zero. No loss scale to tune, no step to skip.
//   matmul_bwd_coop_amax: workgroup g of p.parts (at most 256) writes max|dy| over its
//   elements (g·256 + lane, then every parts·256 on) to amax[g], as the bits of an f32;
//   the product kernels' workgroups reduce the parts' maxima and derive s themselves.
// The maximum does not depend on the order it is taken in, so the result is deterministic;
// a NaN or infinity in dy makes s = 1 and propagates as in f32.
//
// Summation order: every output is one chain of multiply-adds over the inner dimension (N
// for dx, M for dW) in steps of CT, ascending; the backward is deterministic, not batch-
// invariant (dW sums over the batch's rows by definition).

struct Params {
    m: u32,
    n: u32,
    k: u32,
    accumulate: u32, // for dx: 1 adds into dx (residual-stream gradients), 0 overwrites
    ldy: u32,        // row stride of dy (n, or the full width when launched in chunks)
    vec4: u32,       // unused here (matmul_bwd's vector loads)
    parts: u32,      // workgroups of matmul_bwd_coop_amax (1 ..= 256)
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> dy: array<f32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read> w: array<f32>;
@group(0) @binding(4) var<storage, read_write> dx: array<f32>;
@group(0) @binding(5) var<storage, read_write> dw: array<f32>;
@group(0) @binding(6) var<storage, read_write> amax: array<u32>;

// The amax workgroup's lanes, or the maxima a product workgroup reduces (4·SG at most 256).
var<workgroup> coop_max: array<u32, 256>;

// Tree maximum of coop_max[0 .. 4·SG) into coop_max[0] (4·SG a power of two, at most 256).
fn coop_max_tree(lid: u32) {
    for (var s = 2u * SG; s > 0u; s >>= 1u) {
        if (lid < s) {
            coop_max[lid] = max(coop_max[lid], coop_max[lid + s]);
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(256)
fn matmul_bwd_coop_amax(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let total = p.m * p.n;
    var v = 0u;
    for (var e = wid.x * 256u + lid; e < total; e += p.parts * 256u) {
        let r = e / p.n;
        v = max(v, bitcast<u32>(abs(dy[r * p.ldy + e % p.n])));
    }
    coop_max[lid] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (lid < s) {
            coop_max[lid] = max(coop_max[lid], coop_max[lid + s]);
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        amax[wid.x] = coop_max[0];
    }
}

// (s, 1/s) from the parts' maxima (every invocation of the workgroup calls it).
fn coop_scale(lid: u32) -> vec2<f32> {
    var v = 0u;
    for (var g = lid; g < p.parts; g += 4u * SG) {
        v = max(v, amax[g]);
    }
    coop_max[lid] = v;
    workgroupBarrier();
    coop_max_tree(lid);
    let bits = coop_max[0];
    workgroupBarrier();
    let e = i32((bits >> 23u) & 0xffu); // biased exponent of max|dy|
    if (bits == 0u || e == 255) {
        return vec2<f32>(1.0, 1.0);
    }
    // max|dy| < 2^(e - 126), so max|dy|·2^(141 - e) < 2^15; clamped so s and 1/s are normal.
    let se = clamp(141 - e, -126, 126);
    return vec2<f32>(bitcast<f32>(u32(se + 127) << 23u), bitcast<f32>(u32(127 - se) << 23u));
}

// Writes the fragment the subgroup `sg` stored in its slice of coop_out, times `inv`, to dx
// (dw_mode false) or dW at (r0, c0): rows below `rows`, columns below p.k.
fn coop_flush_grad(dw_mode: bool, sg: u32, lane: u32, r0: u32, c0: u32, rows: u32, inv: f32) {
    for (var e = lane; e < CT * CT; e += SG) {
        let r = r0 + e / CT;
        let c = c0 + e % CT;
        if (r < rows && c < p.k) {
            let v = coop_out[sg * CT * CT + e] * inv;
            let o = r * p.k + c;
            if (dw_mode) {
                dw[o] += v;
            } else if (p.accumulate != 0u) {
                dx[o] += v;
            } else {
                dx[o] = v;
            }
        }
    }
}

// C[rows, p.k] = A · B over `inner`, for dx (dw_mode false: A = dy, B = W, inner = N) or dW
// (A = dyᵀ, B = x, inner = M). Global reads: neighbouring lanes read neighbouring addresses
// (dy along k for dx, along its rows for dW; W and x along their columns).
fn coop_bwd(dw_mode: bool, wid: vec3<u32>, lid: u32) {
    let sc2 = coop_scale(lid);
    let row0 = wid.y * WT;
    let col0 = wid.x * WT;
    let sg = lid / SG;
    let lane = lid % SG;
    let sr = (sg / 2u) * 2u * CT;
    let sc = (sg % 2u) * 2u * CT;
    var rows = p.m;
    var inner = p.n;
    if (dw_mode) {
        rows = p.n;
        inner = p.m;
    }
    var c00 = CoopC();
    var c01 = CoopC();
    var c10 = CoopC();
    var c11 = CoopC();
    for (var i0 = 0u; i0 < inner; i0 += KT) {
        for (var e = lid; e < WT * KT; e += 4u * SG) {
            // A(r, i): dy[r, i] (lanes along i) or dy[i, r] (lanes along r).
            var r = e / KT;
            var kk = e % KT;
            if (dw_mode) {
                r = e % WT;
                kk = e / WT;
            }
            let i = i0 + kk;
            var a = 0.0;
            if (row0 + r < rows && i < inner) {
                if (dw_mode) {
                    a = dy[i * p.ldy + row0 + r];
                } else {
                    a = dy[(row0 + r) * p.ldy + i];
                }
            }
            coop_a[r * KT + kk] = f16(a * sc2.x);
            // B(i, c): W[i, c] or x[i, c], lanes along c.
            let c = e % WT;
            let kb = e / WT;
            let ib = i0 + kb;
            var b = 0.0;
            if (col0 + c < p.k && ib < inner) {
                if (dw_mode) {
                    b = x[ib * p.k + col0 + c];
                } else {
                    b = w[ib * p.k + col0 + c];
                }
            }
            coop_b[c * KT + kb] = coop_half(b);
        }
        workgroupBarrier();
        coop_tile_mma(sr, sc, &c00, &c01, &c10, &c11);
        workgroupBarrier();
    }
    let slice = sg * CT * CT;
    let inv = sc2.y;
    coopStoreT(c00, &coop_out[slice], CT);
    workgroupBarrier();
    coop_flush_grad(dw_mode, sg, lane, row0 + sr, col0 + sc, rows, inv);
    workgroupBarrier();
    coopStoreT(c01, &coop_out[slice], CT);
    workgroupBarrier();
    coop_flush_grad(dw_mode, sg, lane, row0 + sr, col0 + sc + CT, rows, inv);
    workgroupBarrier();
    coopStoreT(c10, &coop_out[slice], CT);
    workgroupBarrier();
    coop_flush_grad(dw_mode, sg, lane, row0 + sr + CT, col0 + sc, rows, inv);
    workgroupBarrier();
    coopStoreT(c11, &coop_out[slice], CT);
    workgroupBarrier();
    coop_flush_grad(dw_mode, sg, lane, row0 + sr + CT, col0 + sc + CT, rows, inv);
}

@compute @workgroup_size(4u * SG)
fn matmul_bwd_coop_dx(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    coop_bwd(false, wid, lid);
}

@compute @workgroup_size(4u * SG)
fn matmul_bwd_coop_dw(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    coop_bwd(true, wid, lid);
}
