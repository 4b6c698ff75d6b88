// embedding_fwd: out[n, d] = table[tokens[n], :].
// One thread per output element; the grid may spill into y when n*d exceeds what
// one dispatch dimension can address (65535 workgroups).
// A table above the device's storage-binding limit (151,936 x 1024 f32 = 622 MB) is launched
// in chunks of rows by the host, the table bound from row `first`; each launch writes the
// outputs whose token falls in its chunk.

struct Params {
    n: u32,      // rows (tokens)
    dim: u32,    // hidden size
    vocab: u32,  // rows of the table, to keep an out-of-range id from reading past it
    first: u32,  // first table row bound
    count: u32,  // table rows bound
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> tokens: array<u32>;
// Binding 2, the table, is declared by the `weight_*` prelude (f32, bf16 or f16 storage) and
// read only through its hook `weight(i)`; the row gather binds an f32 activation there.
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
    if (tok < p.first || tok - p.first >= p.count) {
        return;
    }
    out[i] = weight((tok - p.first) * p.dim + col);
}
