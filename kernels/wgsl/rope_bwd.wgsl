// rope_bwd, in place on the gradient dx[rows, heads, head_dim]: the transpose of the
// rotation in rope_fwd,  d1 = g1·cos + g2·sin,  d2 = g2·cos − g1·sin.

struct Params {
    rows: u32,
    heads: u32,
    head_dim: u32,
    max_pos: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> dx: array<f32>;
@group(0) @binding(2) var<storage, read> positions: array<u32>;
@group(0) @binding(3) var<storage, read> cos_t: array<f32>;
@group(0) @binding(4) var<storage, read> sin_t: array<f32>;

@compute @workgroup_size(256)
fn rope_bwd(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let half = p.head_dim / 2u;
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= p.rows * p.heads * half) {
        return;
    }
    let d = i % half;
    let rh = i / half;
    let row = rh / p.heads;
    let pos = min(positions[row], p.max_pos - 1u);
    let c = cos_t[pos * half + d];
    let s = sin_t[pos * half + d];
    let o = rh * p.head_dim + d;
    let g1 = dx[o];
    let g2 = dx[o + half];
    dx[o] = g1 * c + g2 * s;
    dx[o + half] = g2 * c - g1 * s;
}
