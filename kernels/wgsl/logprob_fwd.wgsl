// logprob_fwd: with z = logits[r, :] / temperature and lse = log Σ exp(z),
//   logp[r] = z[targets[r]] − lse,   entropy[r] = lse − Σ softmax(z)·z.
// One workgroup of 256 threads per row; max, sum and the entropy term are tree
// reductions in workgroup memory (three passes over the row, nothing stored per element).

struct Params {
    rows: u32,
    vocab: u32,
    inv_temp: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> targets: array<u32>;
@group(0) @binding(3) var<storage, read_write> logp: array<f32>;
@group(0) @binding(4) var<storage, read_write> entropy: array<f32>;

@compute @workgroup_size(256)
fn logprob_fwd(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.vocab;
    let m = row_max(lid, base);
    var se = 0.0;
    var sz = 0.0;
    for (var i = lid; i < p.vocab; i += WG) {
        let z = logits[base + i] * p.inv_temp;
        let e = exp(z - m);
        se += e;
        sz += e * (z - m);
    }
    let s = reduce_sum(lid, se);
    let szm = reduce_sum(lid, sz);
    if (lid == 0u) {
        let lse = m + log(s);
        let t = min(targets[row], p.vocab - 1u);
        logp[row] = logits[base + t] * p.inv_temp - lse;
        // Σ p·z − lse = Σ p·(z − m) − log s, computed shifted by m to avoid cancellation.
        entropy[row] = log(s) - szm / s;
    }
}
