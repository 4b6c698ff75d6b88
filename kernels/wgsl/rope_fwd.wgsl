// rope_fwd, in place on x[rows, heads, head_dim] (rotate-half: dimension i pairs with
// i + head_dim/2):  x1' = x1·cos − x2·sin,  x2' = x2·cos + x1·sin.
// cos/sin come from host tables [max_pos, head_dim/2] computed by the CPU reference's own
// function, so both backends rotate by bit-identical angles; positions[rows] indexes them.

struct Params {
    rows: u32,
    heads: u32,
    head_dim: u32,
    max_pos: u32, // rows of the tables; positions beyond are clamped (host validates)
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> positions: array<u32>;
@group(0) @binding(3) var<storage, read> cos_t: array<f32>;
@group(0) @binding(4) var<storage, read> sin_t: array<f32>;

@compute @workgroup_size(256)
fn rope_fwd(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let half = p.head_dim / 2u;
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= p.rows * p.heads * half) {
        return;
    }
    let d = i % half;
    let rh = i / half; // row * heads + head
    let row = rh / p.heads;
    let pos = min(positions[row], p.max_pos - 1u);
    let c = cos_t[pos * half + d];
    let s = sin_t[pos * half + d];
    let o = rh * p.head_dim + d;
    let x1 = x[o];
    let x2 = x[o + half];
    x[o] = x1 * c - x2 * s;
    x[o + half] = x2 * c + x1 * s;
}
