// attention_bwd for a training batch: n_seq sequences of t positions each, query row
// seq*t + pos attends keys 0..=pos of its sequence (the layout attention_fwd saw with
// meta = (seq, pos) for every row). With P = softmax(scale · q·kᵀ) recomputed from the
// saved log-sum-exp and delta_i = dout_i · out_i:
//   dS_ij = P_ij (dout_i · v_j − delta_i)
//   dq_i = scale Σ_j dS_ij k_j                    (entry attention_bwd_dq, per (query, head))
//   dk_j = scale Σ_i dS_ij q_i, dv_j = Σ_i P_ij dout_i
//                                  (entry attention_bwd_dkv, per (key, kv head), summing over
//                                   the queries i >= j and the query heads of the group)
// Splitting by who owns the output avoids float atomics. attention_bwd_dq also stores
// delta in stats[n_q*heads ..], so it must run before attention_bwd_dkv.
// Buffers: dkv holds dk [n_seq*t, kv_heads, head_dim] followed by dv of the same shape.

struct Params {
    n_seq: u32,
    t: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    scale: f32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> q: array<f32>;
@group(0) @binding(2) var<storage, read_write> k: array<f32>;
@group(0) @binding(3) var<storage, read_write> v: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> stats: array<f32>;
@group(0) @binding(6) var<storage, read_write> dout: array<f32>;
@group(0) @binding(7) var<storage, read_write> dq: array<f32>;
@group(0) @binding(8) var<storage, read_write> dkv: array<f32>;

const WG: u32 = 64u;
var<workgroup> xs: array<f32, 256>;
var<workgroup> ys: array<f32, 256>;
var<workgroup> ps: array<f32, WG>;
var<workgroup> ds: array<f32, WG>;
var<workgroup> red: array<f32, WG>;

@compute @workgroup_size(64)
fn attention_bwd_dq(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let n_q = p.n_seq * p.t;
    let flat = wid.x + wid.y * nwg.x;
    if (flat >= n_q * p.heads) {
        return;
    }
    let qi = flat / p.heads;
    let h = flat % p.heads;
    let seq = qi / p.t;
    let pos = qi % p.t;
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
        stats[n_q * p.heads + flat] = delta;
    }
    var acc: array<f32, 4>;
    for (var r = 0u; r < 4u; r++) {
        acc[r] = 0.0;
    }
    for (var c = 0u; c <= pos; c += WG) {
        let j = c + lid;
        var dsv = 0.0;
        if (j <= pos) {
            let kb = (seq * p.t + j) * kv_stride + kvh * hd;
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
                    a += ds[jj] * k[(seq * p.t + c + jj) * kv_stride + kvh * hd + d];
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
    let n_q = p.n_seq * p.t;
    let flat = wid.x + wid.y * nwg.x;
    if (flat >= n_q * p.kv_heads) {
        return;
    }
    let kj = flat / p.kv_heads; // key row: seq * t + j
    let g = flat % p.kv_heads;
    let seq = kj / p.t;
    let j = kj % p.t;
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
    let span = p.t - j; // queries j..t-1 of this sequence see key j
    for (var hi = 0u; hi < group; hi++) {
        let h = g * group + hi;
        for (var c = 0u; c < span; c += WG) {
            let i = j + c + lid;
            var pv = 0.0;
            var dsv = 0.0;
            if (i < p.t) {
                let row = (seq * p.t + i) * p.heads + h;
                let qb = row * hd;
                var sdot = 0.0;
                var pdot = 0.0;
                for (var d = 0u; d < hd; d++) {
                    sdot += q[qb + d] * xs[d];
                    pdot += dout[qb + d] * ys[d];
                }
                pv = exp(sdot * p.scale - stats[row]);
                dsv = pv * (pdot - stats[n_q * p.heads + row]);
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
                        let qb = ((seq * p.t + j + c + ii) * p.heads + h) * hd + d;
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
    let dv_off = n_q * p.kv_heads * hd;
    for (var r = 0u; r < 4u; r++) {
        let d = lid + WG * r;
        if (d < hd) {
            dkv[kb + d] = acc_k[r] * p.scale;
            dkv[dv_off + kb + d] = acc_v[r];
        }
    }
}
