// swiglu_bwd: with s = sigmoid(gate),
//   dgate = dout · up · s · (1 + gate · (1 − s)),   dup = dout · gate · s.

struct Params {
    n: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> gate: array<f32>;
@group(0) @binding(2) var<storage, read> up: array<f32>;
@group(0) @binding(3) var<storage, read> dout: array<f32>;
@group(0) @binding(4) var<storage, read_write> dgate: array<f32>;
@group(0) @binding(5) var<storage, read_write> dup: array<f32>;

@compute @workgroup_size(256)
fn swiglu_bwd(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= p.n) {
        return;
    }
    let g = gate[i];
    let u = up[i];
    let d = dout[i];
    let s = 1.0 / (1.0 + exp(-g));
    dgate[i] = d * u * s * (1.0 + g * (1.0 - s));
    dup[i] = d * g * s;
}
