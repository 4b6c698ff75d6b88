// attention_fwd: causal grouped-query attention, one workgroup per (query tile, kv head[,
// part of its group's heads]), K/V chunks staged once in workgroup memory for the tile.
//   q   [n_q, heads, head_dim]                      (after q_norm and RoPE)
//   k,v [n_k, kv_heads, head_dim]                   (a packed batch or the KV cache)
//   qmeta[2 * n_q] = (base, pos) of each query: it attends key rows base ..= base + pos.
//                   The same kernel serves training and scoring (packed sequences: base is
//                   the sequence's first row) and prefill against the KV cache (base is the
//                   request's slot).
//   out [n_q, heads, head_dim]; stats[0 .. n_q*heads] = log-sum-exp of the scaled scores,
//   kept for attention_bwd (which stores its row sums in the second half of stats); stats
//   holds 2 * n_q * heads floats, the second half carrying l between launch windows.
// Query head h reads kv head h / G, G = heads / kv_heads.
//
// Shape (chosen on the host, `attention_fwd_tiling` in backends/src/wgpu/ops.rs, from
// head_dim and G only): a (row, head) pair is a "slot" of TD threads (a power of two
// >= head_dim / 8), thread t of the slot owning output dims t, t + TD, .. (<= 8 of them).
// The WG / TD slots of a workgroup hold HG heads (of one kv head's group) of QT = slots / HG
// rows; when G > slots the group's heads are split over ceil(G / HG) workgroups.
// Tiles: the launch has one workgroup per (row, kv head, head part); only a tile's first row
// works. A tile is a run of up to QT consecutive rows with the same base and consecutive
// positions; a run starts at row 0, where (base, pos) does not continue the previous row,
// or at pos % QT == 0. So no tile straddles two sequences and the host needs no tile list.
// Keys come in chunks of CK rows aligned at base (CK depends on head_dim only); per chunk:
//   1. K chunk -> kv (coalesced, rows padded to head_dim + 1 floats: the TD threads of a
//      slot read TD different keys at the same d, in different banks)
//   2. each score (slot, key) is one ascending fma chain over d from 0.0, by one thread,
//      from the q staged in qs and the K row in kv
//   3. V chunk -> kv (over K); each slot's max, rescale alpha and p = exp(s - m_new)
//   4. each thread updates its <= 8 accumulators over the chunk's keys in order
// Batch invariance: a slot touches only the keys base .. base + pos of its row: chunks past
// its pos are skipped and a chunk's keys past its pos are never read (n below), so masked
// keys contribute nothing, not even 0 * v. Every value a slot computes (scores, max,
// p, psum, l, acc) is the same expression in the same order whatever tile the row lands in,
// whatever rows share it and whichever thread computes it, so its output is bit-identical.
// The first chunk of every row holds its key base (pos >= 0), so m is finite after it.
// Launch windows (llvmpipe stops an invocation's loops after 65,535 trips in all, silently):
// the host launches once per window w0 .. w1 of keys (multiples of CK, so chunks begin where
// they would in one launch). A row whose pos reaches w1 stores its running max m in
// stats[row], its sum l in stats[n_q*heads + row] (the half attention_bwd later fills with
// delta) and its unnormalised accumulators in out; the next launch loads them and continues
// the same sequence of operations on the same f32 values, so one launch or many give
// bit-identical out and stats. Only the launch holding a row's last key normalises
// (acc / l) and writes lse = m + log(l); launches past it leave the row alone.

struct Params {
    n_q: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    n_k: u32, // rows of k and v, to keep a bad base/pos from reading past them
    scale: f32,
    td: u32, // threads per slot
    ck: u32, // keys per chunk
    hg: u32, // query heads per workgroup
    qt: u32, // rows per tile
    // This launch's window of keys, relative to a row's base (multiples of ck): chunks
    // w0 <= c < w1. A row with keys past w1 leaves its state for the next launch.
    w0: u32,
    w1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> v: array<f32>;
@group(0) @binding(4) var<storage, read> qmeta: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;
@group(0) @binding(6) var<storage, read_write> stats: array<f32>;

const WG: u32 = 128u;
// Most output dims per thread (head_dim / TD).
const DPT: u32 = 8u;
// Stands in for -inf: exp(NEG - m) underflows to 0 without producing NaN from inf - inf.
const NEG: f32 = -3.0e38;
// Workgroup memory, 15,104 bytes + 520 in all (below WebGPU's guaranteed 16,384 whatever
// head_dim): the host sizes slots * (head_dim + 1) <= QS_LEN, CK * (head_dim + 1) <= KV_LEN
// and slots * CK <= SC_LEN (the same constants in ops.rs).
const QS_LEN: u32 = 1152u;
const KV_LEN: u32 = 2112u;
const SC_LEN: u32 = 256u;
var<workgroup> qs: array<f32, QS_LEN>;
var<workgroup> kv: array<f32, KV_LEN>;
var<workgroup> sc: array<f32, SC_LEN>;
var<workgroup> pw: array<f32, SC_LEN>;
var<workgroup> rpos: array<u32, WG>;
var<workgroup> cnt_s: u32;
var<workgroup> base_s: u32;
var<workgroup> pmax_s: u32;

// (base, pos) of query row i clamped to the key rows.
fn row_meta(i: u32) -> vec2<u32> {
    let b = min(qmeta[2u * i], p.n_k - 1u);
    return vec2<u32>(b, min(qmeta[2u * i + 1u], p.n_k - 1u - b));
}

// The host launches attention_fwd when one launch covers every row's keys (training and
// scoring sizes), attention_fwd_window once per window otherwise. The body is one function,
// inlined into both with `windowed` a constant: the one-launch entry computes the same
// values without the state loads and stores (w0 = 0, every row finishes).
@compute @workgroup_size(128)
fn attention_fwd(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    attention_fwd_body(wid, nwg, lid, false);
}

@compute @workgroup_size(128)
fn attention_fwd_window(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    attention_fwd_body(wid, nwg, lid, true);
}

fn attention_fwd_body(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, windowed: bool) {
    let grp = p.heads / p.kv_heads;
    let parts = (grp + p.hg - 1u) / p.hg;
    let flat = wid.x + wid.y * nwg.x;
    if (flat >= p.n_q * p.kv_heads * parts) {
        return;
    }
    let q0 = flat / (p.kv_heads * parts);
    let kvh = (flat / parts) % p.kv_heads;
    let h0 = kvh * grp + (flat % parts) * p.hg;
    let nh = min(p.hg, kvh * grp + grp - h0);
    let qt = p.qt;
    if (lid == 0u) {
        let b0 = qmeta[2u * q0];
        let p0 = qmeta[2u * q0 + 1u];
        var lead = q0 == 0u || p0 % qt == 0u;
        if (!lead) {
            lead = qmeta[2u * q0 - 2u] != b0 || qmeta[2u * q0 - 1u] + 1u != p0;
        }
        var cnt = 0u;
        if (lead) {
            cnt = 1u;
            loop {
                let i = q0 + cnt;
                if (cnt >= qt || i >= p.n_q || (p0 + cnt) % qt == 0u) {
                    break;
                }
                if (qmeta[2u * i] != b0 || qmeta[2u * i + 1u] != p0 + cnt) {
                    break;
                }
                cnt++;
            }
        }
        cnt_s = cnt;
        base_s = row_meta(q0).x;
        // Rows of a tile share base, so the last row has the largest clamped pos.
        pmax_s = row_meta(q0 + max(cnt, 1u) - 1u).y;
    }
    // Broadcast through workgroup memory: values read from a storage buffer are not
    // uniform to the compiler, and the loop below holds barriers.
    let cnt = workgroupUniformLoad(&cnt_s);
    if (cnt == 0u) {
        return;
    }
    let kbase = workgroupUniformLoad(&base_s);
    let pmax = workgroupUniformLoad(&pmax_s);
    let hd = p.head_dim;
    let hs = hd + 1u;
    let td = p.td;
    let ck = p.ck;
    let kv_stride = p.kv_heads * hd;
    let kvoff = kvh * hd;
    // Slot s = (row s / nh of the tile, head h0 + s % nh); this thread is lane t of slot sl.
    let nslots = cnt * nh;
    let sl = lid / td;
    let t = lid % td;
    let mine = sl < nslots;
    let sr = min(sl, nslots - 1u);
    let qi = q0 + sr / nh;
    let h = h0 + sr % nh;
    if (lid < cnt) {
        rpos[lid] = row_meta(q0 + lid).y;
    }
    for (var e = lid; e < nslots * hd; e += WG) {
        let s = e / hd;
        qs[s * hs + e % hd] = q[((q0 + s / nh) * p.heads + h0 + s % nh) * hd + e % hd];
    }
    workgroupBarrier();
    let pos = rpos[sr / nh];
    let qrow = sr * hs;
    let srow = sr * ck;
    var m = NEG;
    var l = 0.0;
    var acc: array<f32, DPT>;
    for (var r = 0u; r < DPT; r++) {
        acc[r] = 0.0;
    }
    // A row continued from the previous window: its state as that launch stored it.
    let w0 = select(0u, p.w0, windowed);
    if (windowed && mine && w0 > 0u && pos >= w0) {
        let si = qi * p.heads + h;
        m = stats[si];
        l = stats[p.n_q * p.heads + si];
        for (var r = 0u; r < DPT; r++) {
            let d = t + td * r;
            if (d < hd) {
                acc[r] = out[si * hd + d];
            }
        }
    }
    var alpha = 0.0;
    var m_new = NEG;
    // The window's last chunk start (w1 >= ck >= 1). In a launch past every row of the
    // tile (pmax < w0) no chunk runs and nothing is written.
    let cend = select(pmax, min(pmax, p.w1 - 1u), windowed);
    for (var c = w0; c <= cend; c += ck) {
        let rows = min(ck, pmax + 1u - c);
        let live = mine && c <= pos;
        // This slot's keys of the chunk: c .. c + n - 1 <= pos.
        var n = 0u;
        if (live) {
            n = min(ck, pos + 1u - c);
        }
        for (var e = lid; e < rows * hd; e += WG) {
            kv[(e / hd) * hs + e % hd] = k[(kbase + c + e / hd) * kv_stride + kvoff + e % hd];
        }
        workgroupBarrier();
        for (var j = t; j < n; j += td) {
            var dot = 0.0;
            for (var d = 0u; d < hd; d++) {
                dot += qs[qrow + d] * kv[j * hs + d];
            }
            sc[srow + j] = dot * p.scale;
        }
        workgroupBarrier();
        for (var e = lid; e < rows * hd; e += WG) {
            kv[(e / hd) * hs + e % hd] = v[(kbase + c + e / hd) * kv_stride + kvoff + e % hd];
        }
        if (live) {
            var cmax = NEG;
            for (var j = 0u; j < n; j++) {
                cmax = max(cmax, sc[srow + j]);
            }
            m_new = max(m, cmax);
            alpha = exp(m - m_new);
            for (var j = t; j < n; j += td) {
                pw[srow + j] = exp(sc[srow + j] - m_new);
            }
        }
        workgroupBarrier();
        if (live) {
            var psum = 0.0;
            for (var j = 0u; j < n; j++) {
                psum += pw[srow + j];
            }
            l = l * alpha + psum;
            for (var r = 0u; r < DPT; r++) {
                let d = t + td * r;
                if (d < hd) {
                    var a = acc[r] * alpha;
                    for (var j = 0u; j < n; j++) {
                        a += pw[srow + j] * kv[j * hs + d];
                    }
                    acc[r] = a;
                }
            }
            m = m_new;
        }
        workgroupBarrier();
    }
    if (mine && pos >= w0) {
        let si = qi * p.heads + h;
        let ob = si * hd;
        // Whether the row's last key was in this window (else its state is stored).
        let fin = !windowed || pos < p.w1;
        for (var r = 0u; r < DPT; r++) {
            let d = t + td * r;
            if (d < hd) {
                out[ob + d] = select(acc[r], acc[r] / l, fin);
            }
        }
        if (t == 0u) {
            stats[si] = select(m, m + log(l), fin);
            if (!fin) {
                stats[p.n_q * p.heads + si] = l;
            }
        }
    }
}
