// Prelude `coop_tile` (prepended by the kernels crate, after `coop8` or `coop16`, to
// matmul_fwd_coop and matmul_bwd_coop): the tiling the two tensor-core products share.
//
// A workgroup is 4 subgroups of SG lanes (SG the adapter's one subgroup size, a pipeline
// override the host sets; fragments belong to one subgroup) and computes a WT x WT tile,
// WT = 4·CT; subgroup s takes the 2·CT x 2·CT quarter (s / 2, s % 2) as 2 x 2 fragments. The
// inner dimension is walked KT = 2·CT at a time: the workgroup stages the step's A rows into
// coop_a and its B columns into coop_b as f16, both [row or column][k] (read with stride KT:
// A with coopLoadT as a row-major operand, B with coopLoad as a column-major one). Each
// fragment goes out through the subgroup's CT x CT slice of coop_out, since cooperative
// stores cannot stop at a matrix edge.

override SG: u32 = 32u;

const KT: u32 = 2u * CT; // inner-dimension step
const WT: u32 = 4u * CT; // workgroup tile edge
var<workgroup> coop_a: array<f16, 2048>; // WT * KT at most (CT = 16): [row][k]
var<workgroup> coop_b: array<f16, 2048>; // [column][k]
var<workgroup> coop_out: array<f32, 1024>; // 4 subgroups * CT * CT at most

// An f32 rounded to f16, saturating at the largest finite half.
fn coop_half(v: f32) -> f16 {
    return f16(clamp(v, -65504.0, 65504.0));
}

// The multiply-adds of one KT-step staged in coop_a and coop_b: the subgroup's 2 x 2 fragments
// at (sr, sc) of the workgroup tile, each one more chain link over k, ascending.
fn coop_tile_mma(
    sr: u32,
    sc: u32,
    c00: ptr<function, CoopC>,
    c01: ptr<function, CoopC>,
    c10: ptr<function, CoopC>,
    c11: ptr<function, CoopC>,
) {
    for (var kf = 0u; kf < KT; kf += CT) {
        let a0 = coopLoadT<CoopA>(&coop_a[sr * KT + kf], KT);
        let a1 = coopLoadT<CoopA>(&coop_a[(sr + CT) * KT + kf], KT);
        let b0 = coopLoad<CoopB>(&coop_b[sc * KT + kf], KT);
        let b1 = coopLoad<CoopB>(&coop_b[(sc + CT) * KT + kf], KT);
        *c00 = coopMultiplyAdd(a0, b0, *c00);
        *c01 = coopMultiplyAdd(a0, b1, *c01);
        *c10 = coopMultiplyAdd(a1, b0, *c10);
        *c11 = coopMultiplyAdd(a1, b1, *c11);
    }
}
