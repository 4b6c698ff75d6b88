// embedding_fwd: out[n, d] = table[tokens[n], :].
// One thread per output element; the grid may spill into y when n*d exceeds what
// one dispatch dimension can address (65535 workgroups).

struct Params {
    n: u32,      // rows (tokens)
    dim: u32,    // hidden size
    vocab: u32,  // rows of the table, to keep an out-of-range id from reading past it
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> tokens: array<u32>;
@group(0) @binding(2) var<storage, read> table: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn embedding_fwd(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= p.n * p.dim) {
        return;
    }
    let row = i / p.dim;
    let col = i % p.dim;
    // The host validates ids before upload; clamping keeps a bad id from reading
    // another buffer's memory should that validation ever be bypassed.
    let tok = min(tokens[row], p.vocab - 1u);
    out[i] = table[tok * p.dim + col];
}
