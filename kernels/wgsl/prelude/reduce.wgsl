// Prelude `reduce` (prepended by the kernels crate to grad_norm, logprob_fwd,
// sample):
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

var<workgroup> red_i: array<u32, WG>;

struct ArgMax {
    v: f32,
    i: u32,
}

// The largest v and, among equal ones, the lowest i (the first maximum when each thread
// passes its own first maximum in index order).
fn reduce_argmax(lid: u32, v: f32, i: u32) -> ArgMax {
    red[lid] = v;
    red_i[lid] = i;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            let ov = red[lid + s];
            let oi = red_i[lid + s];
            if (ov > red[lid] || (ov == red[lid] && oi < red_i[lid])) {
                red[lid] = ov;
                red_i[lid] = oi;
            }
        }
        workgroupBarrier();
    }
    let r = ArgMax(red[0], red_i[0]);
    workgroupBarrier();
    return r;
}
