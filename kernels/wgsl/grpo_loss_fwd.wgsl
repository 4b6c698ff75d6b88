// grpo_loss_fwd: the per-token GRPO objective of SPEC §6 summed with per-token weights
// (the aggregation's weights; the normaliser is applied later, at the optimizer step):
//   ρ = exp(logp − old),  L = −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)·A) + β·KL,
//   KL = exp(ref − logp) − (ref − logp) − 1   (k3).
// objective = 1 selects SFT instead: L = −logp.
// flags[t]: bit 0 = a scored token (others are skipped), bit 1 = old_logp given (else the
// current logp, detached: ρ = 1), bit 2 = ref_logp given (else the current logp: KL = 0).
// One workgroup walks all tokens and writes four scalars, so the host reads back 16 bytes:
//   stats = [Σ w·L, Σ KL, #clipped tokens, Σ entropy]   (KL and entropy unweighted, as the
//   CPU reference's AccumStats). A token is clipped when min() picks the clipped branch
//   strictly.

struct Params {
    n: u32,
    objective: u32, // 0: GRPO, 1: SFT
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
@group(0) @binding(6) var<storage, read> entropy: array<f32>;
@group(0) @binding(7) var<storage, read_write> stats: array<f32>;
@group(0) @binding(8) var<storage, read> flags: array<u32>;

const WG: u32 = 256u;
var<workgroup> red: array<vec4<f32>, WG>;

@compute @workgroup_size(256)
fn grpo_loss_fwd(@builtin(local_invocation_index) lid: u32) {
    var acc = vec4<f32>(0.0);
    for (var i = lid; i < p.n; i += WG) {
        let f = flags[i];
        if ((f & 1u) == 0u) {
            continue;
        }
        let w = weight[i];
        let lp = logp[i];
        var loss = 0.0;
        var kl = 0.0;
        var clipped = 0.0;
        if (p.objective == 1u) {
            loss = -lp;
        } else {
            let a = adv[i];
            let old = select(lp, old_logp[i], (f & 2u) != 0u);
            let rf = select(lp, ref_logp[i], (f & 4u) != 0u);
            let ratio = exp(lp - old);
            let unclipped = ratio * a;
            let clipped_v = clamp(ratio, 1.0 - p.eps_low, 1.0 + p.eps_high) * a;
            loss = -min(unclipped, clipped_v);
            if (clipped_v < unclipped) {
                clipped = 1.0;
            }
            let dr = rf - lp;
            kl = exp(dr) - dr - 1.0;
            loss += p.beta * kl;
        }
        acc += vec4<f32>(w * loss, kl, clipped, entropy[i]);
    }
    red[lid] = acc;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        let r = red[0];
        stats[0] = r.x;
        stats[1] = r.y;
        stats[2] = r.z;
        stats[3] = r.w;
    }
}
