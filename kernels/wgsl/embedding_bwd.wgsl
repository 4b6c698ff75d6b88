// embedding_bwd: dtable[tokens[n], :] += dout[n, :].
// WGSL has no float atomics, so one thread owns one column of the table and walks the
// tokens in order: no two threads ever write the same element, and the summation order
// per element is the token order, the same as the CPU reference's loop.

struct Params {
    n: u32,
    dim: u32,
    vocab: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> tokens: array<u32>;
@group(0) @binding(2) var<storage, read_write> dout: array<f32>;
@group(0) @binding(3) var<storage, read_write> dtable: array<f32>;

@compute @workgroup_size(64)
fn embedding_bwd(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = gid.x;
    if (col >= p.dim) {
        return;
    }
    for (var r = 0u; r < p.n; r++) {
        let tok = min(tokens[r], p.vocab - 1u);
        dtable[tok * p.dim + col] += dout[r * p.dim + col];
    }
}
