// logprob_bwd: gradient of the log-probs with respect to one vocabulary chunk of the logits
// (the chunked lm_head of logprob_fwd): for column j of the chunk, token k = v0 + j,
//   dlogits[r, j] = g_r·(1[k = target_r] − π_rk),  g_r = dlogp[r] / T,
//   π_rk = exp(z_rk − lse_r), z = logits / T   (lse saved by logprob_fwd_finish).
// The host recomputes the chunk's logits with matmul_fwd, and this kernel turns them into
// dlogits in place, which matmul_bwd then takes through the chunk of the projection; no
// [rows, vocab] tensor is ever stored. Written, not accumulated; the objective has no entropy
// term, as in the CPU reference (cpu::lm_head::lm_head_logprob_bwd: −g·π, then + g at the
// target). One thread per element; rows row0.. of dlogp, lse and targets.
// Mirrors: kernels/ptx/logprob_bwd.ptx. Determinism: elementwise, no reduction.

struct Params {
    rows: u32,
    cols: u32,
    v0: u32,
    inv_temp: f32,
    row0: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> targets: array<u32>;
@group(0) @binding(2) var<storage, read> dlogp: array<f32>;
@group(0) @binding(3) var<storage, read> lse: array<f32>;
@group(0) @binding(4) var<storage, read_write> logits: array<f32>; // in: logits, out: dlogits

@compute @workgroup_size(256)
fn logprob_bwd(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= p.rows * p.cols) {
        return;
    }
    let r = i / p.cols;
    let j = i % p.cols;
    let g = p.row0 + r;
    let gr = dlogp[g] * p.inv_temp;
    var dz = -gr * exp(logits[i] * p.inv_temp - lse[g]);
    if (targets[g] == p.v0 + j) {
        dz += gr;
    }
    logits[i] = dz;
}
