// attention_bwd for a packed batch of n rows: row r belongs to the sequence of rows
// start .. start+len (meta[2r] = start, meta[2r+1] = len) and, as in attention_fwd with
// (base, pos) = (start, r − start), attends key rows start ..= r.
// With P = softmax(scale · q·kᵀ) recomputed from the saved log-sum-exp, and
// delta_i = dout_i · out_i:
//   dS_ij = P_ij (dout_i · v_j − delta_i)
//   dq_i = scale Σ_j dS_ij k_j                     (entry attention_bwd_dq, per (row, head))
//   dk_j = scale Σ_i dS_ij q_i, dv_j = Σ_i P_ij dout_i
//                  (entry attention_bwd_dkv, per (key row, kv head), over the query rows
//                   i >= j of the sequence and the query heads of the group)
// Splitting by who owns each output avoids float atomics. attention_bwd_dq also stores
// delta in stats[n*heads ..], so it runs before attention_bwd_dkv. Outputs are written,
// not accumulated (the caller's dq/dk/dv are per micro-batch).
// Packed buffers keep the binding count low: stats = [lse (n·heads), delta (n·heads)];
// dkv = [dk (n·kv_heads·head_dim), dv (same)].

struct Params {
    n: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    scale: f32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> v: array<f32>;
@group(0) @binding(4) var<storage, read> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> stats: array<f32>;
@group(0) @binding(6) var<storage, read> dout: array<f32>;
@group(0) @binding(7) var<storage, read_write> dq: array<f32>;
@group(0) @binding(8) var<storage, read_write> dkv: array<f32>;
@group(0) @binding(9) var<storage, read> meta_rows: array<u32>;

const WG: u32 = 64u;
var<workgroup> xs: array<f32, 256>;
var<workgroup> ys: array<f32, 256>;
var<workgroup> ps: array<f32, WG>;
var<workgroup> ds: array<f32, WG>;
var<workgroup> red: array<f32, WG>;
var<workgroup> start_s: u32;
var<workgroup> end_s: u32;

// Loads the sequence bounds of row r (clamped to the batch) as workgroup-uniform values.
fn bounds(lid: u32, r: u32) -> vec2<u32> {
    if (lid == 0u) {
        let s = min(meta_rows[2u * r], r);
        start_s = s;
        end_s = clamp(s + meta_rows[2u * r + 1u], r + 1u, p.n);
    }
    let s = workgroupUniformLoad(&start_s);
    let e = workgroupUniformLoad(&end_s);
    return vec2<u32>(s, e);
}

@compute @workgroup_size(64)
fn attention_bwd_dq(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let flat = wid.x + wid.y * nwg.x;
    if (flat >= p.n * p.heads) {
        return;
    }
    let qi = flat / p.heads;
    let h = flat % p.heads;
    let start = bounds(lid, qi).x;
    let pos = qi - start;
    let kvh = h / (p.heads / p.kv_heads);
    let hd = p.head_dim;
    let kv_stride = p.kv_heads * hd;
    let base = flat * hd;
    // xs = q_i, ys = dout_i; delta_i by a tree reduction.
    var part = 0.0;
    for (var d = lid; d < hd; d += WG) {
        xs[d] = q[base + d];
        ys[d] = dout[base + d];
        part += dout[base + d] * out[base + d];
    }
    red[lid] = part;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    let delta = red[0];
    let lse = stats[flat];
    if (lid == 0u) {
        stats[p.n * p.heads + flat] = delta;
    }
    var acc: array<f32, 4>;
    for (var r = 0u; r < 4u; r++) {
        acc[r] = 0.0;
    }
    for (var c = 0u; c <= pos; c += WG) {
        let j = c + lid;
        var dsv = 0.0;
        if (j <= pos) {
            let kb = (start + j) * kv_stride + kvh * hd;
            var sdot = 0.0;
            var pdot = 0.0;
            for (var d = 0u; d < hd; d++) {
                sdot += xs[d] * k[kb + d];
                pdot += ys[d] * v[kb + d];
            }
            let pr = exp(sdot * p.scale - lse);
            dsv = pr * (pdot - delta);
        }
        ds[lid] = dsv;
        workgroupBarrier();
        let cnt = min(WG, pos + 1u - c);
        for (var r = 0u; r < 4u; r++) {
            let d = lid + WG * r;
            if (d < hd) {
                var a = acc[r];
                for (var jj = 0u; jj < cnt; jj++) {
                    a += ds[jj] * k[(start + c + jj) * kv_stride + kvh * hd + d];
                }
                acc[r] = a;
            }
        }
        workgroupBarrier();
    }
    for (var r = 0u; r < 4u; r++) {
        let d = lid + WG * r;
        if (d < hd) {
            dq[base + d] = acc[r] * p.scale;
        }
    }
}

@compute @workgroup_size(64)
fn attention_bwd_dkv(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let flat = wid.x + wid.y * nwg.x;
    if (flat >= p.n * p.kv_heads) {
        return;
    }
    let kj = flat / p.kv_heads; // key row
    let g = flat % p.kv_heads;
    let end = bounds(lid, kj).y;
    let hd = p.head_dim;
    let group = p.heads / p.kv_heads;
    let kb = flat * hd;
    // xs = k_j, ys = v_j
    for (var d = lid; d < hd; d += WG) {
        xs[d] = k[kb + d];
        ys[d] = v[kb + d];
    }
    workgroupBarrier();
    var acc_k: array<f32, 4>;
    var acc_v: array<f32, 4>;
    for (var r = 0u; r < 4u; r++) {
        acc_k[r] = 0.0;
        acc_v[r] = 0.0;
    }
    let span = end - kj; // query rows kj .. end-1 see key row kj
    for (var hi = 0u; hi < group; hi++) {
        let h = g * group + hi;
        for (var c = 0u; c < span; c += WG) {
            let i = kj + c + lid;
            var pv = 0.0;
            var dsv = 0.0;
            if (i < end) {
                let row = i * p.heads + h;
                let qb = row * hd;
                var sdot = 0.0;
                var pdot = 0.0;
                for (var d = 0u; d < hd; d++) {
                    sdot += q[qb + d] * xs[d];
                    pdot += dout[qb + d] * ys[d];
                }
                pv = exp(sdot * p.scale - stats[row]);
                dsv = pv * (pdot - stats[p.n * p.heads + row]);
            }
            ps[lid] = pv;
            ds[lid] = dsv;
            workgroupBarrier();
            let cnt = min(WG, span - c);
            for (var r = 0u; r < 4u; r++) {
                let d = lid + WG * r;
                if (d < hd) {
                    var ak = acc_k[r];
                    var av = acc_v[r];
                    for (var ii = 0u; ii < cnt; ii++) {
                        let qb = ((kj + c + ii) * p.heads + h) * hd + d;
                        ak += ds[ii] * q[qb];
                        av += ps[ii] * dout[qb];
                    }
                    acc_k[r] = ak;
                    acc_v[r] = av;
                }
            }
            workgroupBarrier();
        }
    }
    let dv_off = p.n * p.kv_heads * hd;
    for (var r = 0u; r < 4u; r++) {
        let d = lid + WG * r;
        if (d < hd) {
            dkv[kb + d] = acc_k[r] * p.scale;
            dkv[dv_off + kb + d] = acc_v[r];
        }
    }
}
