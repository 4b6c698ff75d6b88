// rmsnorm_bwd: with xh = x * rstd and g = w * dout,
//   dx = rstd * (g - xh * mean(g * xh))          (entry rmsnorm_bwd, one workgroup per row)
//   dw += sum over rows of dout * xh             (two stages, below)
// The weight gradient is a column sum over all rows. It is reduced in two stages, without
// float atomics and in a fixed order, so it is bit-reproducible from run to run:
//   rmsnorm_bwd_dw:        part[c, col] = sum of rows c·chunk .. (c+1)·chunk, ascending,
//                          one invocation per (chunk c, column);
//   rmsnorm_bwd_dw_reduce: dw[col] += sum of part[0..chunks, col], ascending, one
//                          invocation per column.
// The host picks chunk ≈ √rows (`rmsnorm_dw_chunk`), so both stages are ~√rows long and
// rows/chunk · dim invocations share the first (one thread per column walked all rows
// before).

struct Params {
    rows: u32,
    dim: u32,
    accumulate: u32, // 1: dx += result (residual stream gradients), 0: dx = result
    chunk: u32,      // rows per partial sum of dw
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> rstd: array<f32>;
@group(0) @binding(4) var<storage, read> dout: array<f32>;
@group(0) @binding(5) var<storage, read_write> dx: array<f32>;
@group(0) @binding(6) var<storage, read_write> dw: array<f32>;
@group(0) @binding(7) var<storage, read_write> part: array<f32>; // [chunks, dim] scratch

const WG: u32 = 64u;
var<workgroup> red: array<f32, WG>;

@compute @workgroup_size(64)
fn rmsnorm_bwd(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.dim;
    let r = rstd[row];
    var acc = 0.0;
    for (var i = lid; i < p.dim; i += WG) {
        acc += w[i] * dout[base + i] * x[base + i] * r;
    }
    red[lid] = acc;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    let m = red[0] / f32(p.dim);
    for (var i = lid; i < p.dim; i += WG) {
        let xh = x[base + i] * r;
        let v = r * (w[i] * dout[base + i] - xh * m);
        if (p.accumulate != 0u) {
            dx[base + i] += v;
        } else {
            dx[base + i] = v;
        }
    }
}

// Launched over (ceil(dim / 64), chunks) workgroups.
@compute @workgroup_size(64)
fn rmsnorm_bwd_dw(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = gid.x;
    let c = gid.y;
    if (col >= p.dim) {
        return;
    }
    let end = min(p.rows, (c + 1u) * p.chunk);
    var acc = 0.0;
    for (var row = c * p.chunk; row < end; row++) {
        acc += dout[row * p.dim + col] * x[row * p.dim + col] * rstd[row];
    }
    part[c * p.dim + col] = acc;
}

@compute @workgroup_size(64)
fn rmsnorm_bwd_dw_reduce(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = gid.x;
    if (col >= p.dim) {
        return;
    }
    let chunks = (p.rows + p.chunk - 1u) / p.chunk;
    var acc = 0.0;
    for (var c = 0u; c < chunks; c++) {
        acc += part[c * p.dim + col];
    }
    dw[col] += acc;
}
