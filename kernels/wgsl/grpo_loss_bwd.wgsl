// grpo_loss_bwd: dlogp = w · dL/dlogp for the objective of grpo_loss_fwd:
//   unclipped branch chosen (ρA <= clip(ρ)A): −A·ρ; clipped branch: 0 (clip(ρ) is constant
//   outside the range, and on a tie inside it both branches have the same gradient);
//   KL term: β·(1 − exp(ref − logp));  SFT: −1.
// flags as in grpo_loss_fwd; unscored tokens get 0. Written, not accumulated.

struct Params {
    n: u32,
    objective: u32,
    eps_low: f32,
    eps_high: f32,
    beta: f32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logp: array<f32>;
@group(0) @binding(2) var<storage, read> old_logp: array<f32>;
@group(0) @binding(3) var<storage, read> ref_logp: array<f32>;
@group(0) @binding(4) var<storage, read> adv: array<f32>;
@group(0) @binding(5) var<storage, read> weight: array<f32>;
@group(0) @binding(6) var<storage, read_write> dlogp: array<f32>;
@group(0) @binding(7) var<storage, read> flags: array<u32>;

@compute @workgroup_size(256)
fn grpo_loss_bwd(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= p.n) {
        return;
    }
    let f = flags[i];
    if ((f & 1u) == 0u) {
        dlogp[i] = 0.0;
        return;
    }
    let w = weight[i];
    let lp = logp[i];
    var g = 0.0;
    if (p.objective == 1u) {
        g = -1.0;
    } else {
        let a = adv[i];
        let old = select(lp, old_logp[i], (f & 2u) != 0u);
        let rf = select(lp, ref_logp[i], (f & 4u) != 0u);
        let ratio = exp(lp - old);
        let unclipped = ratio * a;
        let clipped_v = clamp(ratio, 1.0 - p.eps_low, 1.0 + p.eps_high) * a;
        if (unclipped <= clipped_v) {
            g = -a * ratio;
        }
        g += p.beta * (1.0 - exp(rf - lp));
    }
    dlogp[i] = w * g;
}
