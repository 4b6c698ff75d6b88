// logprob_bwd: for logp = z[t] − lse with z = logits / temperature and π = softmax(z),
//   dlogits_k = dlogp / temperature · (1[k = t] − π_k)
// (written, not accumulated: logits are per micro-batch; the objective has no entropy term,
// as in the CPU reference). One workgroup per row; lse is recomputed rather than stored.

struct Params {
    rows: u32,
    vocab: u32,
    inv_temp: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> targets: array<u32>;
@group(0) @binding(3) var<storage, read> dlogp: array<f32>;
@group(0) @binding(4) var<storage, read_write> dlogits: array<f32>;

@compute @workgroup_size(256)
fn logprob_bwd(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.vocab;
    let lse = row_lse(lid, base, row_max(lid, base));
    let t = min(targets[row], p.vocab - 1u);
    let g = dlogp[row] * p.inv_temp;
    for (var i = lid; i < p.vocab; i += WG) {
        var dz = -g * exp(logits[base + i] * p.inv_temp - lse);
        if (i == t) {
            dz += g;
        }
        dlogits[base + i] = dz;
    }
}
