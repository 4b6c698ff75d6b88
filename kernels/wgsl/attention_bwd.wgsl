// attention_bwd for a packed batch of n rows: row r belongs to the sequence of rows
// start .. start+len (meta[2r] = start, meta[2r+1] = len) and, as in attention_fwd with
// (base, pos) = (start, r − start), attends key rows start ..= r.
// With P = softmax(scale · q·kᵀ) recomputed from the saved log-sum-exp, and
// delta_i = dout_i · out_i:
//   dS_ij = P_ij (dout_i · v_j − delta_i)
//   dq_i = scale Σ_j dS_ij k_j                     (entry attention_bwd_dq)
//   dk_j = scale Σ_i dS_ij q_i, dv_j = Σ_i P_ij dout_i   (entry attention_bwd_dkv, over the
//                   query rows i >= j of the sequence and the G query heads of the group)
// Splitting by who owns each output avoids float atomics. attention_bwd_dq also stores
// delta in stats[n*heads ..], so it runs before attention_bwd_dkv. Outputs are written,
// not accumulated (the caller's dq/dk/dv are per micro-batch).
// Packed buffers keep the binding count low: stats = [lse (n·heads), delta (n·heads)];
// dkv = [dk (n·kv_heads·head_dim), dv (same)].
//
// Shape (host: `attention_bwd_tiling` in backends/src/wgpu/ops.rs, from head_dim and G):
// as in attention_fwd, a "slot" is TD threads (a power of two >= head_dim / 8), thread t
// owning output dims t, t + TD, .. (<= 8 of them); a workgroup has WG / TD slots.
//   attention_bwd_dq: one workgroup per (query tile, kv head, part of the group's heads);
//     a slot is a (query row, head); the tile is up to QT rows of one sequence × HG heads.
//     q and dout of the tile's slots are staged once; the keys come in chunks of CK rows
//     aligned at the sequence's start, K and V of a chunk staged once for every slot.
//   attention_bwd_dkv: one workgroup per (key tile, kv head); a slot is a key row, the tile
//     up to KT <= WG / TD keys of one sequence. k and v of the tile's keys are staged once; the
//     query side comes as "items" (query row i, head hi of the group) in the order
//     (i ascending, hi ascending) from the tile's first key to the sequence's end, in
//     chunks of CQ items, q, dout, lse and delta of a chunk staged once for every key.
//     Each thread holds 8 dk and 8 dv accumulators (one per output dim it owns).
// Tiles, found in-kernel as in attention_fwd: the launch has one workgroup per (row, kv
// head[, head part]); only a tile's first row works. A tile is a run of consecutive rows
// of one sequence (same clamped start and end); a run starts at row 0, where the sequence
// changes, or at (r − start) % tile == 0. No tile straddles two sequences.
// Batch invariance: every value an output depends on is one expression in a fixed order,
// whoever computes it and whatever tile it lands in:
//   scores and dout·v: one ascending fma chain over d from 0.0, by one thread;
//   delta_i: each of the slot's TD threads sums its dims in ascending order, then the TD
//     partials are summed in lane order (TD depends on head_dim only);
//   dq_i: one sequential sum over its keys start ..= i in ascending order (the chunking
//     does not reorder a sequential sum);
//   dk_j, dv_j: one sequential sum over the items (i >= j ascending, head ascending) —
//     heads inner, so the order does not depend on where chunks begin.
// Masked pairs (a key after its query) are never read, not even as 0 · x.
// Launch windows: the host launches each entry once per window w0 .. w1 of keys (dq, from
// the sequence's start) or items (dkv, from the tile's first key), whole chunks, so that
// no invocation passes llvmpipe's cap of 65,535 loop trips a loop nest (which it enforces
// silently). An output whose range goes past w1 is stored unscaled and the next window
// loads and continues it, the scale applied in its last window: the same sequential sum.

struct Params {
    n: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    scale: f32,
    td: u32, // threads per slot
    ck: u32, // keys per chunk (dq)
    hg: u32, // query heads per workgroup (dq)
    qt: u32, // query rows per tile (dq)
    cq: u32, // items per chunk (dkv)
    kt: u32, // key rows per tile (dkv), <= WG / TD
    w0: u32, // this launch's window: keys (dq, from the sequence's start) or items (dkv,
    w1: u32, // from the tile's first key) w0 .. w1, multiples of CK resp. CQ
    _p1: u32,
    _p2: u32,
    _p3: u32,
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

const WG: u32 = 128u;
// Most output dims per thread (head_dim / TD).
const DPT: u32 = 8u;
// Workgroup memory: one f32 arena partitioned per entry (offsets below, the host sizes CK
// and CQ so the parts fit), the delta partials and three u32s: 15,884 bytes, below
// WebGPU's guaranteed 16,384 whatever head_dim (the same constants in ops.rs).
const SM_LEN: u32 = 3840u;
var<workgroup> sm: array<f32, SM_LEN>;
var<workgroup> red: array<f32, WG>;
var<workgroup> cnt_s: u32;
var<workgroup> start_s: u32;
var<workgroup> end_s: u32;

// The sequence rows start .. end of row r, clamped to the batch (end > r).
fn seq_of(r: u32) -> vec2<u32> {
    let s = min(meta_rows[2u * r], r);
    return vec2<u32>(s, clamp(s + meta_rows[2u * r + 1u], r + 1u, p.n));
}

// (a · b, c · e) over hd floats of the arena from a, b, c, e: two ascending chains from
// 0.0, unrolled by 8 (same order) to keep loop trips low: llvmpipe stops a loop nest after
// 65,535 iterations in all, silently, so a long sequence must not need more. For the same
// reason the accumulations below spell out their DPT = 8 dims instead of looping over them.
fn dot2(a: u32, b: u32, c: u32, e: u32, hd: u32) -> vec2<f32> {
    var x = 0.0;
    var y = 0.0;
    var d = 0u;
    for (; d + 8u <= hd; d += 8u) {
        x += sm[a + d] * sm[b + d];
        x += sm[a + d + 1u] * sm[b + d + 1u];
        x += sm[a + d + 2u] * sm[b + d + 2u];
        x += sm[a + d + 3u] * sm[b + d + 3u];
        x += sm[a + d + 4u] * sm[b + d + 4u];
        x += sm[a + d + 5u] * sm[b + d + 5u];
        x += sm[a + d + 6u] * sm[b + d + 6u];
        x += sm[a + d + 7u] * sm[b + d + 7u];
        y += sm[c + d] * sm[e + d];
        y += sm[c + d + 1u] * sm[e + d + 1u];
        y += sm[c + d + 2u] * sm[e + d + 2u];
        y += sm[c + d + 3u] * sm[e + d + 3u];
        y += sm[c + d + 4u] * sm[e + d + 4u];
        y += sm[c + d + 5u] * sm[e + d + 5u];
        y += sm[c + d + 6u] * sm[e + d + 6u];
        y += sm[c + d + 7u] * sm[e + d + 7u];
    }
    for (; d < hd; d++) {
        x += sm[a + d] * sm[b + d];
        y += sm[c + d] * sm[e + d];
    }
    return vec2<f32>(x, y);
}

// Run by one thread: the tile led by row r0 (cnt_s = 0 when r0 leads none), its
// sequence's start and end.
fn find_tile(r0: u32, tile: u32) {
    let se = seq_of(r0);
    var lead = r0 == 0u || (r0 - se.x) % tile == 0u;
    if (!lead) {
        let pr = seq_of(r0 - 1u);
        lead = pr.x != se.x || pr.y != se.y;
    }
    var cnt = 0u;
    if (lead) {
        cnt = 1u;
        loop {
            let i = r0 + cnt;
            if (cnt >= tile || i >= p.n || (i - se.x) % tile == 0u) {
                break;
            }
            let si = seq_of(i);
            if (si.x != se.x || si.y != se.y) {
                break;
            }
            cnt++;
        }
    }
    cnt_s = cnt;
    start_s = se.x;
    end_s = se.y;
}

@compute @workgroup_size(128)
fn attention_bwd_dq(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let grp = p.heads / p.kv_heads;
    let parts = (grp + p.hg - 1u) / p.hg;
    let flat = wid.x + wid.y * nwg.x;
    if (flat >= p.n * p.kv_heads * parts) {
        return;
    }
    let q0 = flat / (p.kv_heads * parts);
    let kvh = (flat / parts) % p.kv_heads;
    let h0 = kvh * grp + (flat % parts) * p.hg;
    let nh = min(p.hg, kvh * grp + grp - h0);
    if (lid == 0u) {
        find_tile(q0, p.qt);
    }
    // Broadcast through workgroup memory: values read from a storage buffer are not
    // uniform to the compiler, and the loop below holds barriers.
    let cnt = workgroupUniformLoad(&cnt_s);
    if (cnt == 0u) {
        return;
    }
    let start = workgroupUniformLoad(&start_s);
    let hd = p.head_dim;
    let hs = hd + 1u;
    let td = p.td;
    let ck = p.ck;
    let slots = WG / td;
    let kv_stride = p.kv_heads * hd;
    let kvoff = kvh * hd;
    // Slot s = (row s / nh of the tile, head h0 + s % nh); this thread is lane t of slot sl.
    let nslots = cnt * nh;
    let sl = lid / td;
    let t = lid % td;
    let mine = sl < nslots;
    let sr = min(sl, nslots - 1u);
    let qi = q0 + sr / nh;
    let row = qi * p.heads + h0 + sr % nh;
    let pos = qi - start;
    // Rows of a tile are consecutive: the last has the largest pos.
    let pmax = q0 + cnt - 1u - start;
    if (p.w0 > pmax) {
        return;
    }
    // Rows with keys in this window; one whose keys go on past it leaves its sum unscaled
    // in dq for the next window to continue.
    let live = mine && pos >= p.w0;
    // sm: q [slots][hs], dout [slots][hs], K chunk [ck][hs], V chunk [ck][hs], dS [slots][ck]
    // (rows padded to head_dim + 1: the lanes of a slot read different keys at one d).
    let o_do = slots * hs;
    let o_k = 2u * slots * hs;
    let o_v = o_k + ck * hs;
    let o_s = o_v + ck * hs;
    for (var e = lid; e < nslots * hd; e += WG) {
        let s = e / hd;
        let d = e % hd;
        let g = ((q0 + s / nh) * p.heads + h0 + s % nh) * hd + d;
        sm[s * hs + d] = q[g];
        sm[o_do + s * hs + d] = dout[g];
    }
    // delta: lane partials over the lane's dims, then summed in lane order.
    var part = 0.0;
    for (var r = 0u; r < DPT; r++) {
        let d = t + td * r;
        if (d < hd) {
            part += dout[row * hd + d] * out[row * hd + d];
        }
    }
    red[lid] = part;
    workgroupBarrier();
    var delta = 0.0;
    for (var u = 0u; u < td; u++) {
        delta += red[sl * td + u];
    }
    if (mine && t == 0u) {
        stats[p.n * p.heads + row] = delta;
    }
    let lse = stats[row];
    var acc: array<f32, DPT>;
    for (var r = 0u; r < DPT; r++) {
        acc[r] = 0.0;
        let d = t + td * r;
        if (live && p.w0 > 0u && d < hd) {
            acc[r] = dq[row * hd + d];
        }
    }
    for (var c = p.w0; c <= pmax && c < p.w1; c += ck) {
        let rows = min(ck, pmax + 1u - c);
        // This slot's keys of the chunk: start + c .. start + c + nk - 1 <= start + pos.
        var nk = 0u;
        if (mine && c <= pos) {
            nk = min(ck, pos + 1u - c);
        }
        for (var e = lid; e < rows * hd; e += WG) {
            let j = e / hd;
            let d = e % hd;
            let g = (start + c + j) * kv_stride + kvoff + d;
            sm[o_k + j * hs + d] = k[g];
            sm[o_v + j * hs + d] = v[g];
        }
        workgroupBarrier();
        for (var j = t; j < nk; j += td) {
            let sp = dot2(sr * hs, o_k + j * hs, o_do + sr * hs, o_v + j * hs, hd);
            let sdot = sp.x;
            let pdot = sp.y;
            let pr = exp(sdot * p.scale - lse);
            sm[o_s + sr * ck + j] = pr * (pdot - delta);
        }
        workgroupBarrier();
        for (var j = 0u; j < nk; j++) {
            let dsj = sm[o_s + sr * ck + j];
            let kr = o_k + j * hs;
            if (t + td * 0u < hd) {
                acc[0] += dsj * sm[kr + t + td * 0u];
            }
            if (t + td * 1u < hd) {
                acc[1] += dsj * sm[kr + t + td * 1u];
            }
            if (t + td * 2u < hd) {
                acc[2] += dsj * sm[kr + t + td * 2u];
            }
            if (t + td * 3u < hd) {
                acc[3] += dsj * sm[kr + t + td * 3u];
            }
            if (t + td * 4u < hd) {
                acc[4] += dsj * sm[kr + t + td * 4u];
            }
            if (t + td * 5u < hd) {
                acc[5] += dsj * sm[kr + t + td * 5u];
            }
            if (t + td * 6u < hd) {
                acc[6] += dsj * sm[kr + t + td * 6u];
            }
            if (t + td * 7u < hd) {
                acc[7] += dsj * sm[kr + t + td * 7u];
            }
        }
        workgroupBarrier();
    }
    if (live) {
        var f = 1.0;
        if (pos + 1u <= p.w1) {
            f = p.scale;
        }
        for (var r = 0u; r < DPT; r++) {
            let d = t + td * r;
            if (d < hd) {
                dq[row * hd + d] = acc[r] * f;
            }
        }
    }
}

@compute @workgroup_size(128)
fn attention_bwd_dkv(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let flat = wid.x + wid.y * nwg.x;
    if (flat >= p.n * p.kv_heads) {
        return;
    }
    let j0 = flat / p.kv_heads; // the tile's first key row
    let kvh = flat % p.kv_heads;
    let td = p.td;
    let slots = WG / td;
    if (lid == 0u) {
        find_tile(j0, p.kt);
    }
    let cnt = workgroupUniformLoad(&cnt_s);
    if (cnt == 0u) {
        return;
    }
    let end = workgroupUniformLoad(&end_s);
    let hd = p.head_dim;
    let hs = hd + 1u;
    let cq = p.cq;
    let grp = p.heads / p.kv_heads;
    let kv_stride = p.kv_heads * hd;
    let kvoff = kvh * hd;
    let sl = lid / td;
    let t = lid % td;
    let mine = sl < cnt;
    let sr = min(sl, cnt - 1u);
    let kj = j0 + sr;
    // sm: k [slots][hs], v [slots][hs], q items [cq][hs], dout items [cq][hs], lse [cq],
    // delta [cq], P [slots][cq], dS [slots][cq].
    let o_v = slots * hs;
    let o_q = 2u * slots * hs;
    let o_d = o_q + cq * hs;
    let o_l = o_d + cq * hs;
    let o_dl = o_l + cq;
    let o_p = o_dl + cq;
    let o_s = o_p + slots * cq;
    for (var e = lid; e < cnt * hd; e += WG) {
        let j = e / hd;
        let d = e % hd;
        let g = (j0 + j) * kv_stride + kvoff + d;
        sm[j * hs + d] = k[g];
        sm[o_v + j * hs + d] = v[g];
    }
    // Item it = (query row j0 + it / grp, head kvh * grp + it % grp); key kj sees the items
    // from (kj - j0) * grp (query rows i >= kj) to the sequence's end.
    let items = (end - j0) * grp;
    let first = (kj - j0) * grp;
    if (p.w0 >= items) {
        return;
    }
    // Keys with items in this window; one whose items started in an earlier window
    // continues the unscaled sums it left in dkv.
    let live = mine && first < p.w1;
    let cont = live && first < p.w0;
    let kb = (kj * p.kv_heads + kvh) * hd;
    let dv_off = p.n * p.kv_heads * hd;
    var acc_k: array<f32, DPT>;
    var acc_v: array<f32, DPT>;
    for (var r = 0u; r < DPT; r++) {
        acc_k[r] = 0.0;
        acc_v[r] = 0.0;
        let d = t + td * r;
        if (cont && d < hd) {
            acc_k[r] = dkv[kb + d];
            acc_v[r] = dkv[dv_off + kb + d];
        }
    }
    let hq0 = kvh * grp;
    for (var c = p.w0; c < items && c < p.w1; c += cq) {
        let m = min(cq, items - c);
        for (var e = lid; e < m * hd; e += WG) {
            let it = c + e / hd;
            let d = e % hd;
            let g = ((j0 + it / grp) * p.heads + hq0 + it % grp) * hd + d;
            sm[o_q + (e / hd) * hs + d] = q[g];
            sm[o_d + (e / hd) * hs + d] = dout[g];
        }
        if (lid < m) {
            let it = c + lid;
            let row = (j0 + it / grp) * p.heads + hq0 + it % grp;
            sm[o_l + lid] = stats[row];
            sm[o_dl + lid] = stats[p.n * p.heads + row];
        }
        workgroupBarrier();
        // This key's items of the chunk: c + lo .. c + m - 1.
        var lo = m;
        if (mine && first < c + m) {
            lo = max(first, c) - c;
        }
        for (var e = lo + t; e < m; e += td) {
            let sp = dot2(o_q + e * hs, sr * hs, o_d + e * hs, o_v + sr * hs, hd);
            let sdot = sp.x;
            let pdot = sp.y;
            let pr = exp(sdot * p.scale - sm[o_l + e]);
            sm[o_p + sr * cq + e] = pr;
            sm[o_s + sr * cq + e] = pr * (pdot - sm[o_dl + e]);
        }
        workgroupBarrier();
        // The 8 accumulators by hand, in the order of a loop over them: one loop trip an item
        // instead of nine, for llvmpipe's loop cap (header).
        for (var e = lo; e < m; e++) {
            let dse = sm[o_s + sr * cq + e];
            let pe = sm[o_p + sr * cq + e];
            let qr = o_q + e * hs;
            let dr = o_d + e * hs;
            if (t + td * 0u < hd) {
                acc_k[0] += dse * sm[qr + t + td * 0u];
                acc_v[0] += pe * sm[dr + t + td * 0u];
            }
            if (t + td * 1u < hd) {
                acc_k[1] += dse * sm[qr + t + td * 1u];
                acc_v[1] += pe * sm[dr + t + td * 1u];
            }
            if (t + td * 2u < hd) {
                acc_k[2] += dse * sm[qr + t + td * 2u];
                acc_v[2] += pe * sm[dr + t + td * 2u];
            }
            if (t + td * 3u < hd) {
                acc_k[3] += dse * sm[qr + t + td * 3u];
                acc_v[3] += pe * sm[dr + t + td * 3u];
            }
            if (t + td * 4u < hd) {
                acc_k[4] += dse * sm[qr + t + td * 4u];
                acc_v[4] += pe * sm[dr + t + td * 4u];
            }
            if (t + td * 5u < hd) {
                acc_k[5] += dse * sm[qr + t + td * 5u];
                acc_v[5] += pe * sm[dr + t + td * 5u];
            }
            if (t + td * 6u < hd) {
                acc_k[6] += dse * sm[qr + t + td * 6u];
                acc_v[6] += pe * sm[dr + t + td * 6u];
            }
            if (t + td * 7u < hd) {
                acc_k[7] += dse * sm[qr + t + td * 7u];
                acc_v[7] += pe * sm[dr + t + td * 7u];
            }
        }
        workgroupBarrier();
    }
    if (live) {
        var f = 1.0;
        if (items <= p.w1) {
            f = p.scale;
        }
        for (var r = 0u; r < DPT; r++) {
            let d = t + td * r;
            if (d < hd) {
                dkv[kb + d] = acc_k[r] * f;
                dkv[dv_off + kb + d] = acc_v[r];
            }
        }
    }
}
