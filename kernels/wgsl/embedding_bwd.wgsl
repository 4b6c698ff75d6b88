// embedding_bwd: dtable[tokens[n], :] += dout[n, :], without float atomics and in a fixed
// order.
// The host sorts the positions by the table row they add to (`ScatterIndex` in
// backends/src/wgpu/ops.rs; a stable sort, so each row's positions stay ascending):
//   pairs  = (row, position) for every position, in that order
//   starts = where each touched row's pairs begin, then n
// A workgroup owns 64 columns of a run of `per_group` consecutive touched rows; each lane
// takes one column and walks the run's pairs in order, adding each position's gradient to
// its row and storing a row's sum when the row changes. No two invocations write the same
// element, the work is O(n·dim) spread over ⌈dim/64⌉·⌈touched/per_group⌉ workgroups, and
// every element is summed in the order of the CPU reference's loop (`dtable[row] +=
// dout[pos]` for pos ascending), so the result is bit-identical to it and to itself from
// run to run, whatever `per_group` is. Per element a lane loads one pair and one gradient,
// as the column-serial kernel this replaces loaded one token id and one gradient.
// A table above the device's storage-binding limit (151,936 x 1024 f32 = 622 MB) is launched
// in chunks of rows by the host, dtable bound from row `first`: each launch walks the same
// runs and adds only the rows of its chunk, so every element's sum is unchanged.

struct Params {
    touched: u32,
    dim: u32,
    vocab: u32,
    per_group: u32, // touched rows per workgroup
    first: u32,     // first table row bound
    count: u32,     // table rows bound
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> starts: array<u32>;
@group(0) @binding(2) var<storage, read> pairs: array<vec2<u32>>;
@group(0) @binding(3) var<storage, read> dout: array<f32>;
@group(0) @binding(4) var<storage, read_write> dtable: array<f32>;

// Launched over (⌈dim/64⌉, ⌈touched/per_group⌉) workgroups.
@compute @workgroup_size(64)
fn embedding_bwd(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let col = wid.x * 64u + lid;
    let t0 = wid.y * p.per_group;
    if (col >= p.dim || t0 >= p.touched) {
        return;
    }
    let k0 = starts[t0];
    let k1 = starts[min(t0 + p.per_group, p.touched)];
    // The host clamps rows below vocab; min keeps a bad one inside the table regardless.
    var cur = min(pairs[k0].x, p.vocab - 1u);
    var mine = in_chunk(cur);
    var acc = 0.0;
    if (mine) {
        acc = dtable[(cur - p.first) * p.dim + col];
    }
    for (var k = k0; k < k1; k++) {
        let e = pairs[k];
        let row = min(e.x, p.vocab - 1u);
        if (row != cur) {
            if (mine) {
                dtable[(cur - p.first) * p.dim + col] = acc;
            }
            cur = row;
            mine = in_chunk(cur);
            if (mine) {
                acc = dtable[(cur - p.first) * p.dim + col];
            }
        }
        if (mine) {
            acc += dout[e.y * p.dim + col];
        }
    }
    if (mine) {
        dtable[(cur - p.first) * p.dim + col] = acc;
    }
}

fn in_chunk(row: u32) -> bool {
    return row >= p.first && row - p.first < p.count;
}
