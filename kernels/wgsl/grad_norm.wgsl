// grad_norm: sum of squares of gradient tensors, deterministic and without atomics.
//   entry grad_norm: over one tensor g[n], workgroup w writes its partial sum to
//                    partials[base + w] (the host gives each tensor its own range);
//   entry grad_norm_reduce: one workgroup sums partials[0 .. count] into total[0].
// The host reads back the one scalar total[0].

struct Params {
    n: u32,
    base: u32,
    count: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> g: array<f32>;
@group(0) @binding(2) var<storage, read_write> partials: array<f32>;
@group(0) @binding(3) var<storage, read_write> total: array<f32>;

@compute @workgroup_size(256)
fn grad_norm(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    // Grid-stride over the tensor: any number of workgroups covers any n.
    var acc = 0.0;
    let stride = nwg.x * WG;
    for (var i = wid.x * WG + lid; i < p.n; i += stride) {
        let x = g[i];
        acc += x * x;
    }
    let s = reduce_sum(lid, acc);
    if (lid == 0u) {
        partials[p.base + wid.x] = s;
    }
}

@compute @workgroup_size(256)
fn grad_norm_reduce(@builtin(local_invocation_index) lid: u32) {
    var acc = 0.0;
    for (var i = lid; i < p.count; i += WG) {
        acc += partials[i];
    }
    let s = reduce_sum(lid, acc);
    if (lid == 0u) {
        total[0] = s;
    }
}
