// matmul_fwd_coop: y[M, N] (+)= x[M, K] · W[N, K]ᵀ on cooperative matrices (tensor cores),
// with f16 operands and f32 accumulation. The same Params and bindings as matmul_fwd, so the
// host launches it in its place (column chunks with ldy included) wherever the adapter has
// VK_KHR_cooperative_matrix-class support and the engine asked for it.
//
// A `coop8` or `coop16` prelude comes first (fragment edge CT = 8 or 16, the aliases CoopA,
// CoopB, CoopC), then the `coop_tile` prelude (the tiling, shared with matmul_bwd_coop), then
// a `weight_*` prelude (W in f32, bf16 or f16, read through weight(i)).
//
// Tiling (`coop_tile`): a WT x WT tile of y per workgroup of 4 subgroups; every thread stages
// part of the x rows (A, into coop_a) and W rows (B, into coop_b) of each KT-step as f16,
// then each subgroup does 2·2·2 multiply-adds.
//
// Operands: x and the widened weight are rounded to f16 (values past ±65504 clamped to it,
// so a large activation saturates instead of becoming infinite); products and sums are f32.
// The result differs from matmul_fwd's f32 one by the f16 rounding of the operands, which
// the tests bound per element.
//
// Summation order: every output is one chain of multiply-adds over K in steps of CT
// (ascending), each step done by the hardware in its own fixed order, and the chain does not
// depend on which other rows or columns share the tile. Every row count takes this kernel
// when tensor cores are on (decode steps too), so a row's result does not depend on the
// batch it was launched in: decoding and scoring stay batch-invariant bit for bit.
//
// Stores: a fragment is stored to the subgroup's CT x CT slice of workgroup memory, then
// written out by the subgroup's lanes, each output tested against M and N (and added to y
// when p.accumulate is set), since cooperative stores cannot stop at a matrix edge.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    accumulate: u32, // 1: y += x·Wᵀ, 0: y = x·Wᵀ
    ldy: u32,        // row stride of y (n, or the full width when launched in column chunks)
    lanes: u32,      // unused here (matmul_fwd_gemv's lanes per column)
    vec4: u32,       // unused here (matmul_fwd's vector loads)
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
// Binding 2, the weight W, is declared by the `weight_*` prelude and read through weight(i).
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

// Writes the fragment the subgroup `sg` stored in its slice of coop_out to y at (r0, c0).
fn coop_flush(sg: u32, lane: u32, r0: u32, c0: u32) {
    for (var e = lane; e < CT * CT; e += SG) {
        let r = r0 + e / CT;
        let c = c0 + e % CT;
        if (r < p.m && c < p.n) {
            let v = coop_out[sg * CT * CT + e];
            let o = r * p.ldy + c;
            if (p.accumulate != 0u) {
                y[o] += v;
            } else {
                y[o] = v;
            }
        }
    }
}

@compute @workgroup_size(4u * SG)
fn matmul_fwd_coop(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row0 = wid.y * WT;
    let col0 = wid.x * WT;
    let sg = lid / SG;
    let lane = lid % SG;
    let sr = (sg / 2u) * 2u * CT; // the subgroup's first row and column within the tile
    let sc = (sg % 2u) * 2u * CT;
    var c00 = CoopC();
    var c01 = CoopC();
    var c10 = CoopC();
    var c11 = CoopC();
    for (var k0 = 0u; k0 < p.k; k0 += KT) {
        // Neighbouring lanes read neighbouring k of one row of x or W.
        for (var e = lid; e < WT * KT; e += 4u * SG) {
            let r = e / KT;
            let kk = k0 + e % KT;
            var a = 0.0;
            if (row0 + r < p.m && kk < p.k) {
                a = x[(row0 + r) * p.k + kk];
            }
            coop_a[e] = coop_half(a);
            var b = 0.0;
            if (col0 + r < p.n && kk < p.k) {
                b = weight((col0 + r) * p.k + kk);
            }
            coop_b[e] = coop_half(b);
        }
        workgroupBarrier();
        coop_tile_mma(sr, sc, &c00, &c01, &c10, &c11);
        workgroupBarrier();
    }
    let slice = sg * CT * CT;
    coopStoreT(c00, &coop_out[slice], CT);
    workgroupBarrier();
    coop_flush(sg, lane, row0 + sr, col0 + sc);
    workgroupBarrier();
    coopStoreT(c01, &coop_out[slice], CT);
    workgroupBarrier();
    coop_flush(sg, lane, row0 + sr, col0 + sc + CT);
    workgroupBarrier();
    coopStoreT(c10, &coop_out[slice], CT);
    workgroupBarrier();
    coop_flush(sg, lane, row0 + sr + CT, col0 + sc);
    workgroupBarrier();
    coopStoreT(c11, &coop_out[slice], CT);
    workgroupBarrier();
    coop_flush(sg, lane, row0 + sr + CT, col0 + sc + CT);
}
