// adamw_step with torch.optim.AdamW semantics on one tensor, the arithmetic of the CPU
// reference's `adamw_step` (scalars derived in f64 on the host, applied in f32):
//   g = grad·grad_scale   (1/normaliser times the global-norm clip factor)
//   p ← p·decay;  m ← m + (1−β1)(g − m)  (torch's lerp);  v ← β2·v + (1−β2)·g²
//   p ← p − step_size · m / (√v / √bc2 + eps)
// with decay = 1 − lr·wd, step_size = lr / (1 − β1^t), √bc2 = √(1 − β2^t).

struct Params {
    n: u32,
    grad_scale: f32,
    decay: f32,
    step_size: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    sqrt_bc2: f32,
    eps: f32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> param: array<f32>;
@group(0) @binding(2) var<storage, read> grad: array<f32>;
@group(0) @binding(3) var<storage, read_write> m: array<f32>;
@group(0) @binding(4) var<storage, read_write> v: array<f32>;

@compute @workgroup_size(256)
fn adamw_step(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= p.n) {
        return;
    }
    let g = grad[i] * p.grad_scale;
    var x = param[i] * p.decay;
    let mi = m[i] + p.one_minus_beta1 * (g - m[i]);
    let vi = v[i] * p.beta2 + p.one_minus_beta2 * g * g;
    m[i] = mi;
    v[i] = vi;
    let denom = sqrt(vi) / p.sqrt_bc2 + p.eps;
    x -= p.step_size * (mi / denom);
    param[i] = x;
}
