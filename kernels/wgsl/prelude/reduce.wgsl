// Prelude `reduce` (prepended by the kernels crate to grad_norm, logprob_fwd, logprob_bwd):
// tree reductions over one 256-thread workgroup. Every thread of the workgroup must call a
// helper (each contains barriers); all get the same value back.
// The summation order is fixed (strided per thread, then the tree), so results are
// deterministic and independent of anything but the row.

const WG: u32 = 256u;
const NEG: f32 = -3.0e38;
var<workgroup> red: array<f32, WG>;

fn reduce_max(lid: u32, v: f32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] = max(red[lid], red[lid + s]);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn reduce_sum(lid: u32, v: f32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}
