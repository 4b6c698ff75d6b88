// attention_fwd: causal grouped-query attention, one workgroup per (query row, head).
//   q   [n_q, heads, head_dim]                      (after q_norm and RoPE)
//   k,v [n_k, kv_heads, head_dim]                   (a packed batch or the KV cache)
//   qmeta[2 * n_q] = (base, pos) of each query: it attends key rows base ..= base + pos.
//                   The same kernel serves training and scoring (packed sequences: base is
//                   the sequence's first row), prefill and decode against the KV cache (base
//                   is the request's slot).
//   out [n_q, heads, head_dim]; stats[0 .. n_q*heads] = log-sum-exp of the scaled scores,
//   kept for attention_bwd (which stores its row sums in the second half of stats).
// Query head h reads kv head h / (heads / kv_heads). Keys are visited in chunks of 64 with
// an online softmax (running max and sum, rescaling the accumulator), so any context
// length works with fixed workgroup memory; each thread owns head_dim/64 (<= 4) output
// dimensions, hence head_dim <= 256.

struct Params {
    n_q: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    n_k: u32, // rows of k and v, to keep a bad base/pos from reading past them
    scale: f32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> v: array<f32>;
@group(0) @binding(4) var<storage, read> qmeta: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;
@group(0) @binding(6) var<storage, read_write> stats: array<f32>;

const WG: u32 = 64u;
// Stands in for -inf: exp(NEG - m) underflows to 0 without producing NaN from inf - inf.
const NEG: f32 = -3.0e38;
var<workgroup> qs: array<f32, 256>;
var<workgroup> sc: array<f32, WG>;
var<workgroup> pw: array<f32, WG>;
var<workgroup> base_s: u32;
var<workgroup> pos_s: u32;

@compute @workgroup_size(64)
fn attention_fwd(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let flat = wid.x + wid.y * nwg.x;
    if (flat >= p.n_q * p.heads) {
        return;
    }
    let qi = flat / p.heads;
    let h = flat % p.heads;
    let kvh = h / (p.heads / p.kv_heads);
    if (lid == 0u) {
        let b = min(qmeta[2u * qi], p.n_k - 1u);
        base_s = b;
        pos_s = min(qmeta[2u * qi + 1u], p.n_k - 1u - b);
    }
    // Broadcast through workgroup memory: values read from a storage buffer are not
    // uniform to the compiler, and the loop below holds barriers.
    let kbase = workgroupUniformLoad(&base_s);
    let pos = workgroupUniformLoad(&pos_s);
    let hd = p.head_dim;
    let kv_stride = p.kv_heads * hd;
    let qbase = flat * hd;
    for (var d = lid; d < hd; d += WG) {
        qs[d] = q[qbase + d];
    }
    workgroupBarrier();
    var m = NEG;
    var l = 0.0;
    var acc: array<f32, 4>;
    for (var r = 0u; r < 4u; r++) {
        acc[r] = 0.0;
    }
    for (var c = 0u; c <= pos; c += WG) {
        let j = c + lid;
        var s = NEG;
        if (j <= pos) {
            let kb = (kbase + j) * kv_stride + kvh * hd;
            var dot = 0.0;
            for (var d = 0u; d < hd; d++) {
                dot += qs[d] * k[kb + d];
            }
            s = dot * p.scale;
        }
        sc[lid] = s;
        workgroupBarrier();
        var cmax = NEG;
        for (var jj = 0u; jj < WG; jj++) {
            cmax = max(cmax, sc[jj]);
        }
        let m_new = max(m, cmax);
        let alpha = exp(m - m_new);
        pw[lid] = exp(sc[lid] - m_new);
        workgroupBarrier();
        let cnt = min(WG, pos + 1u - c);
        var psum = 0.0;
        for (var jj = 0u; jj < cnt; jj++) {
            psum += pw[jj];
        }
        l = l * alpha + psum;
        for (var r = 0u; r < 4u; r++) {
            let d = lid + WG * r;
            if (d < hd) {
                var a = acc[r] * alpha;
                for (var jj = 0u; jj < cnt; jj++) {
                    a += pw[jj] * v[(kbase + c + jj) * kv_stride + kvh * hd + d];
                }
                acc[r] = a;
            }
        }
        m = m_new;
        workgroupBarrier();
    }
    for (var r = 0u; r < 4u; r++) {
        let d = lid + WG * r;
        if (d < hd) {
            out[qbase + d] = acc[r] / l;
        }
    }
    if (lid == 0u) {
        stats[flat] = m + log(l);
    }
}
