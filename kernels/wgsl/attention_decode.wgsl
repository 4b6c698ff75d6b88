// attention_decode: causal grouped-query attention of a generation step against the paged KV
// pool, and the KV-append that writes the step's new keys and values into the pool in place.
//   q          [n_q, heads, head_dim]               (after q_norm and RoPE)
//   k_new,v_new[n_q, kv_heads, head_dim]            (the step's rows, after k_norm and RoPE)
//   rmeta[2 * n_q] = (page-table offset, pos) of each row: it is at position pos of its
//                   request and attends positions 0 ..= pos.
//   pages      the page tables of every request of the step, concatenated: position j of a
//              row lives at pool row pages[offset + j / page] * page + j % page.
//   kpool,vpool[pool_rows, kv_heads, head_dim]      (one pair per layer)
//   out        [n_q, heads, head_dim]
// attention_decode_append (one thread per value): kpool/vpool at the row's own position
// (pos) receive k_new/v_new. Group samples share the pages of their prompt's prefix: only
// one row of the step writes any pool row (the engine's page bookkeeping ensures it).
// attention_decode: one workgroup per (row, kv head), so K and V are read once for all the
// `heads / kv_heads` query heads of the GQA group (at most GMAX). Keys are visited in chunks
// of 64 with an online softmax per head; each thread owns head_dim / 64 (<= 4) output
// dimensions of every head, hence head_dim <= 256. The result of a row depends only on its
// own q, its keys and values, never on the other rows of the step (batch invariance).
// Windows: one launch covers keys k0 .. k0 + kw - 1 of every row (kw a multiple of 64, so the
// chunks are those of one launch). A row whose keys run past the window leaves its running
// max and sum in `state` and its unnormalised accumulators in `out`; the next launch (k0 + kw)
// loads them and continues the same operations, and only the launch that holds a row's last
// key divides by the sum. So any number of launches gives the same bits as one. The host
// splits only on adapters that stop long loops: llvmpipe ends a shader's loops after 65,535
// iterations in all (its loop limiter), silently, which one launch over thousands of keys
// passes (GQA 8:1 at head_dim 128: about 1,250 keys); elsewhere kw covers every key.

struct Params {
    n_q: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    pool_rows: u32, // rows of each pool, to keep a bad page table from reading past them
    page: u32,
    pages_len: u32,
    scale: f32,
    k0: u32, // first key of this launch
    kw: u32, // keys per launch (a multiple of 64; at least every key when not split)
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k_new: array<f32>;
@group(0) @binding(3) var<storage, read> v_new: array<f32>;
@group(0) @binding(4) var<storage, read> rmeta: array<u32>;
@group(0) @binding(5) var<storage, read> pages: array<u32>;
@group(0) @binding(6) var<storage, read_write> kpool: array<f32>;
@group(0) @binding(7) var<storage, read_write> vpool: array<f32>;
@group(0) @binding(8) var<storage, read_write> out: array<f32>;
// [n_q, heads, 2]: running max and sum of each (row, head) between launches.
@group(0) @binding(9) var<storage, read_write> state: array<f32>;

const WG: u32 = 64u;
const GMAX: u32 = 8u;
// Stands in for -inf: exp(NEG - m) underflows to 0 without producing NaN from inf - inf.
const NEG: f32 = -3.0e38;
var<workgroup> qs: array<f32, 2048>; // GMAX * 256
var<workgroup> sc: array<f32, 512>; // GMAX * WG
var<workgroup> pw: array<f32, 512>;
var<workgroup> prow: array<u32, WG>;
var<workgroup> pos_s: u32;

// The pool row of position j of a row whose page table starts at `off`.
fn pool_row(off: u32, j: u32) -> u32 {
    let e = min(off + j / p.page, p.pages_len - 1u);
    return min(pages[e] * p.page + j % p.page, p.pool_rows - 1u);
}

@compute @workgroup_size(64)
fn attention_decode(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let flat = wid.x + wid.y * nwg.x;
    if (flat >= p.n_q * p.kv_heads) {
        return;
    }
    let qi = flat / p.kv_heads;
    let kvh = flat % p.kv_heads;
    let g = min(p.heads / p.kv_heads, GMAX);
    let hd = p.head_dim;
    let off = rmeta[2u * qi];
    if (lid == 0u) {
        pos_s = rmeta[2u * qi + 1u];
    }
    // Broadcast through workgroup memory: values read from a storage buffer are not
    // uniform to the compiler, and the loop below holds barriers.
    let pos = workgroupUniformLoad(&pos_s);
    if (pos < p.k0) {
        return; // finished by an earlier launch
    }
    // This launch's last key of the row, and whether it is the row's last.
    let kend = min(pos, p.k0 + (p.kw - 1u));
    let last = kend == pos;
    let kv_stride = p.kv_heads * hd;
    // Query heads kvh * g .. kvh * g + g, contiguous in q.
    let qbase = (qi * p.heads + kvh * g) * hd;
    for (var d = lid; d < g * hd; d += WG) {
        qs[d] = q[qbase + d];
    }
    workgroupBarrier();
    var m: array<f32, GMAX>;
    var l: array<f32, GMAX>;
    var acc: array<f32, 32>; // GMAX * 4: head hh, dimension lid + WG * r at hh * 4 + r
    for (var hh = 0u; hh < GMAX; hh++) {
        m[hh] = NEG;
        l[hh] = 0.0;
    }
    for (var a = 0u; a < 32u; a++) {
        acc[a] = 0.0;
    }
    let sbase = (qi * p.heads + kvh * g) * 2u;
    if (p.k0 > 0u) {
        for (var hh = 0u; hh < g; hh++) {
            m[hh] = state[sbase + 2u * hh];
            l[hh] = state[sbase + 2u * hh + 1u];
            for (var r = 0u; r < 4u; r++) {
                let d = lid + WG * r;
                if (d < hd) {
                    acc[hh * 4u + r] = out[qbase + hh * hd + d];
                }
            }
        }
    }
    for (var c = p.k0; c <= kend; c += WG) {
        let j = c + lid;
        let row = pool_row(off, min(j, pos));
        prow[lid] = row;
        let kb = row * kv_stride + kvh * hd;
        for (var hh = 0u; hh < g; hh++) {
            var s = NEG;
            if (j <= pos) {
                var dot = 0.0;
                for (var d = 0u; d < hd; d++) {
                    dot += qs[hh * hd + d] * kpool[kb + d];
                }
                s = dot * p.scale;
            }
            sc[hh * WG + lid] = s;
        }
        workgroupBarrier();
        var alpha: array<f32, GMAX>;
        for (var hh = 0u; hh < g; hh++) {
            var cmax = NEG;
            for (var jj = 0u; jj < WG; jj++) {
                cmax = max(cmax, sc[hh * WG + jj]);
            }
            let m_new = max(m[hh], cmax);
            alpha[hh] = exp(m[hh] - m_new);
            pw[hh * WG + lid] = exp(sc[hh * WG + lid] - m_new);
            m[hh] = m_new;
        }
        workgroupBarrier();
        let cnt = min(WG, pos + 1u - c);
        for (var hh = 0u; hh < g; hh++) {
            var psum = 0.0;
            for (var jj = 0u; jj < cnt; jj++) {
                psum += pw[hh * WG + jj];
            }
            l[hh] = l[hh] * alpha[hh] + psum;
            for (var r = 0u; r < 4u; r++) {
                let d = lid + WG * r;
                if (d < hd) {
                    var a = acc[hh * 4u + r] * alpha[hh];
                    for (var jj = 0u; jj < cnt; jj++) {
                        a += pw[hh * WG + jj] * vpool[prow[jj] * kv_stride + kvh * hd + d];
                    }
                    acc[hh * 4u + r] = a;
                }
            }
        }
        workgroupBarrier();
    }
    for (var hh = 0u; hh < g; hh++) {
        for (var r = 0u; r < 4u; r++) {
            let d = lid + WG * r;
            if (d < hd) {
                out[qbase + hh * hd + d] = select(acc[hh * 4u + r], acc[hh * 4u + r] / l[hh], last);
            }
        }
        if (!last && lid == 0u) {
            state[sbase + 2u * hh] = m[hh];
            state[sbase + 2u * hh + 1u] = l[hh];
        }
    }
}

@compute @workgroup_size(64)
fn attention_decode_append(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let i = gid.x + gid.y * nwg.x * WG;
    let kd = p.kv_heads * p.head_dim;
    if (i >= p.n_q * kd) {
        return;
    }
    let r = i / kd;
    let dst = pool_row(rmeta[2u * r], rmeta[2u * r + 1u]) * kd + i % kd;
    kpool[dst] = k_new[i];
    vpool[dst] = v_new[i];
}
