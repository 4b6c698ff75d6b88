// rmsnorm_fwd: out[r, :] = w * x[r, :] / sqrt(mean(x[r, :]^2) + eps); rstd[r] saved for
// the backward. Also serves q_norm/k_norm per head: rows = tokens*heads, dim = head_dim.
// One workgroup per row with a tree reduction in workgroup memory.

struct Params {
    rows: u32,
    dim: u32,
    eps: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read_write> rstd: array<f32>;

const WG: u32 = 64u;
var<workgroup> red: array<f32, WG>;

@compute @workgroup_size(64)
fn rmsnorm_fwd(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row = wid.x + wid.y * nwg.x;
    // Uniform per workgroup: the whole group leaves together, so the barriers below stay
    // in uniform control flow.
    if (row >= p.rows) {
        return;
    }
    let base = row * p.dim;
    var ss = 0.0;
    for (var i = lid; i < p.dim; i += WG) {
        let v = x[base + i];
        ss += v * v;
    }
    red[lid] = ss;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    let r = inverseSqrt(red[0] / f32(p.dim) + p.eps);
    for (var i = lid; i < p.dim; i += WG) {
        out[base + i] = w[i] * (x[base + i] * r);
    }
    if (lid == 0u) {
        rstd[row] = r;
    }
}
