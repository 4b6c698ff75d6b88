// adamw_step with torch.optim.AdamW semantics on one tensor, g scaled by grad_scale
// (1/normaliser times the global-norm clip factor, applied to the raw gradient sums):
//   p ← p·(1 − lr·wd);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²
//   p ← p − (lr / bc1) · m / (sqrt(v) / sqrt(bc2) + eps)
// bc1 = 1 − β1^t and bc2 = 1 − β2^t come from the host (computed once, in f64 there).

struct Params {
    n: u32,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    wd: f32,
    bc1: f32,
    sqrt_bc2: f32,
    grad_scale: f32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> param: array<f32>;
@group(0) @binding(2) var<storage, read_write> grad: array<f32>;
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
    var x = param[i] * (1.0 - p.lr * p.wd);
    let mi = p.beta1 * m[i] + (1.0 - p.beta1) * g;
    let vi = p.beta2 * v[i] + (1.0 - p.beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    let denom = sqrt(vi) / p.sqrt_bc2 + p.eps;
    x -= (p.lr / p.bc1) * (mi / denom);
    param[i] = x;
}
