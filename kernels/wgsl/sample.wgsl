// sample: one token per row of logits[rows, vocab] with temperature, top-k and top-p, using
// a uniform u in [0, 1) drawn on the host from the request's own seeded RNG (the CPU
// reference's stream), so that a request's tokens depend only on its seed and the weights.
// Also writes the token's log-prob under the sampling distribution log_softmax(z / T)
// (temperature 0 = greedy argmax, log-prob of the temperature-1 distribution).
//
// Semantics are those of the CPU reference `cpu::ops::sample`, with e_j = exp(z_j − max z):
// - greedy: the first maximum of z;
// - no truncation: inverse CDF in token order, the first j with Σ_{i<=j} e_i > u·Σ e;
// - top-k / top-p: order tokens by f32(e) descending, ties by lower index; keep the first
//   top_k; of those, keep the shortest prefix whose renormalised mass reaches top_p; then
//   walk the kept prefix in that order to the first cumulative mass > u·(kept mass).
//
// Every "shortest prefix of the order whose count or mass satisfies a monotone predicate" is
// a radix select (`select_cut`): 4 passes over the row, each a 256-bin histogram of the next
// 8 bits of the ordering key (count, and mass as an exact 64-bit fixed-point sum with 44
// fraction bits, built from u32 workgroup atomics with carries: integer sums, so the result
// does not depend on the order the threads add in), after which one thread walks the bins
// from the top to the one where the predicate first holds. The 4 passes fix the key of the
// cut exactly; among tokens of equal key (equal weight) the count to take is arithmetic, and
// the lowest index of the bin is tracked, so only when more than one of several equal
// tokens is taken does an index select run (ceil(log2(vocab) / 8) more passes, counts only).
// In token order the key is the complemented index, which is unique.
// Passes over the row: max + sum (2), then 4 per selection: greedy 2, untruncated 6, top-k or
// top-p 10, both 14 (+ up to 3 per selection whose cut splits a run of equal weights), where
// the bisection this replaced made about 150 with both.
// Where this can differ from the CPU: it sums in f64 in sequence, this kernel weights of f32
// exp (not f64) to 2^-44, and u arrives rounded to f32; so when u·mass (or top_p) falls
// within ~1e-6 relative of a cumulative boundary the neighbouring token may be picked (the
// conformance suite measures how often).
//
// rowp[r] = (1/temperature (0 = greedy), bitcast top_k (0 = off), top_p (1 = off), u).

struct Params {
    rows: u32,
    vocab: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> rowp: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> tokens: array<u32>;
@group(0) @binding(4) var<storage, read_write> logp: array<f32>;

const ALL: u32 = 0xffffffffu;
// Ordering modes: by f32 weight (truncated sampling), by token index (untruncated).
const BY_PROB: u32 = 0u;
const BY_INDEX: u32 = 1u;
// Selection predicates on the prefix's (count, mass): count >= thr, mass >= thr·kept mass,
// mass > thr·kept mass.
const COUNT_AT_LEAST: u32 = 0u;
const MASS_AT_LEAST: u32 = 1u;
const MASS_ABOVE: u32 = 2u;
// The mass's fixed point: e·2^44 as (hi, lo) u32; a row's total (≤ vocab < 2^20) fits.
const FIX: f32 = 17592186044416.0;
const TWO32: f32 = 4294967296.0;

var<workgroup> rp_s: vec4<f32>;
var<workgroup> tok_s: u32;
var<workgroup> h_cnt: array<atomic<u32>, 256>;
var<workgroup> h_hi: array<atomic<u32>, 256>;
var<workgroup> h_lo: array<atomic<u32>, 256>;
var<workgroup> h_min: array<atomic<u32>, 256>;
// Selection state, written by thread 0 between passes: (key prefix, count above, mass
// above hi, lo) and (count of the chosen bin, its lowest index, 1 if the whole kept set
// satisfies the predicate, bitcast threshold).
var<workgroup> st_a: vec4<u32>;
var<workgroup> st_b: vec4<u32>;

struct Row {
    base: u32,
    scale: f32,
    m: f32,
    mode: u32,
}

fn weight(row: Row, i: u32) -> f32 {
    return exp(logits[row.base + i] * row.scale - row.m);
}

fn key_of(mode: u32, i: u32, e: f32) -> u32 {
    if (mode == BY_PROB) {
        // e >= 0, so its bit pattern already orders like its value.
        return bitcast<u32>(e);
    }
    return ~i;
}

// Is element (k, i) at or before the cut (ck, ci) in the order (key desc, index asc)?
fn at_or_before(k: u32, i: u32, ck: u32, ci: u32) -> bool {
    return k > ck || (k == ck && i <= ci);
}

// e·2^44 as (hi, lo), truncated; exact for e >= 2^-20 (24 significant bits).
fn fix_of(e: f32) -> vec2<u32> {
    let v = e * FIX;
    let hi = u32(v / TWO32);
    return vec2<u32>(hi, u32(v - f32(hi) * TWO32));
}

fn add64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let lo = a.y + b.y;
    return vec2<u32>(a.x + b.x + select(0u, 1u, lo < a.y), lo);
}

fn mass_of(a: vec2<u32>) -> f32 {
    return (f32(a.x) * TWO32 + f32(a.y)) / FIX;
}

fn pred(kind: u32, cnt: u32, mass: f32, thr: f32) -> bool {
    if (kind == COUNT_AT_LEAST) {
        return f32(cnt) >= thr;
    }
    if (kind == MASS_AT_LEAST) {
        return mass >= thr;
    }
    return mass > thr;
}

fn hist_clear(lid: u32) {
    atomicStore(&h_cnt[lid], 0u);
    atomicStore(&h_hi[lid], 0u);
    atomicStore(&h_lo[lid], 0u);
    atomicStore(&h_min[lid], ALL);
    workgroupBarrier();
}

fn hist_add(b: u32, i: u32, e: f32) {
    atomicAdd(&h_cnt[b], 1u);
    atomicMin(&h_min[b], i);
    let f = fix_of(e);
    var carry = 0u;
    if (f.y != 0u) {
        let old = atomicAdd(&h_lo[b], f.y);
        carry = select(0u, 1u, old + f.y < old);
    }
    if (f.x + carry != 0u) {
        atomicAdd(&h_hi[b], f.x + carry);
    }
}

fn bin_mass(d: u32) -> vec2<u32> {
    return vec2<u32>(atomicLoad(&h_hi[d]), atomicLoad(&h_lo[d]));
}

struct Cut {
    key: u32,
    idx: u32,
    // Whether the whole kept set satisfies the predicate (else key and idx mean nothing).
    ok: bool,
}

// The cut (last element) of the shortest prefix, within the kept cut kc, whose count
// reaches thr (COUNT_AT_LEAST) or whose mass reaches / exceeds thr times the kept mass.
fn select_cut(lid: u32, row: Row, kind: u32, thr_in: f32, kc: vec2<u32>) -> Cut {
    // Every barrier-guarded write of the state below follows a barrier after the last read
    // of it (a previous selection's uniform loads).
    workgroupBarrier();
    if (lid == 0u) {
        st_a = vec4<u32>(0u);
        st_b = vec4<u32>(0u, ALL, 0u, bitcast<u32>(thr_in));
    }
    var pfx = 0u;
    for (var step = 0u; step < 4u; step++) {
        let shift = 24u - 8u * step;
        // The key bits already fixed: none in step 0, then the top 8, 16, 24.
        let fixed = ~(ALL >> (8u * step));
        hist_clear(lid);
        for (var i = lid; i < p.vocab; i += WG) {
            let e = weight(row, i);
            let k = key_of(row.mode, i, e);
            if ((k & fixed) == pfx && at_or_before(k, i, kc.x, kc.y)) {
                hist_add((k >> shift) & 255u, i, e);
            }
        }
        workgroupBarrier();
        if (lid == 0u) {
            var thr = bitcast<f32>(st_b.w);
            if (step == 0u) {
                var whole = vec2<u32>(0u);
                var n = 0u;
                for (var d = 0u; d < 256u; d++) {
                    whole = add64(whole, bin_mass(d));
                    n += atomicLoad(&h_cnt[d]);
                }
                if (kind != COUNT_AT_LEAST) {
                    thr = thr_in * mass_of(whole);
                }
                st_b.w = bitcast<u32>(thr);
                st_b.z = select(0u, 1u, pred(kind, n, mass_of(whole), thr));
            }
            var cnt = st_a.y;
            var mass = st_a.zw;
            var chosen = 0u;
            for (var t = 0u; t < 256u; t++) {
                let d = 255u - t;
                let n = atomicLoad(&h_cnt[d]);
                if (n == 0u) {
                    continue;
                }
                let next = add64(mass, bin_mass(d));
                if (pred(kind, cnt + n, mass_of(next), thr)) {
                    chosen = d;
                    st_b.x = n;
                    st_b.y = atomicLoad(&h_min[d]);
                    break;
                }
                cnt += n;
                mass = next;
            }
            st_a = vec4<u32>(st_a.x | (chosen << shift), cnt, mass);
        }
        pfx = workgroupUniformLoad(&st_a).x;
    }
    // The cut's key is pfx; take j of its n tokens (lowest indices first), the fewest that
    // satisfy the predicate. All n have the same weight.
    workgroupBarrier();
    if (lid == 0u) {
        let thr = bitcast<f32>(st_b.w);
        let n = max(st_b.x, 1u);
        var one = 0.0;
        if (row.mode == BY_PROB) {
            one = mass_of(fix_of(bitcast<f32>(pfx)));
        }
        let above = mass_of(st_a.zw);
        var lo = 1u;
        var hi = n;
        while (lo < hi) {
            let mid = (lo + hi) / 2u;
            if (pred(kind, st_a.y + mid, above + f32(mid) * one, thr)) {
                hi = mid;
            } else {
                lo = mid + 1u;
            }
        }
        // Reuse st_a.y for j; the index prefix starts at 0.
        st_a = vec4<u32>(pfx, lo, 0u, 0u);
    }
    let sel = workgroupUniformLoad(&st_a);
    let b = workgroupUniformLoad(&st_b);
    var idx = b.y;
    if (sel.y > 1u) {
        // Index select: the j-th lowest index among kept tokens of key pfx, 8 bits a step.
        let bits = 32u - countLeadingZeros(max(p.vocab - 1u, 1u));
        let nd = (bits + 7u) / 8u;
        var ipfx = 0u;
        for (var q = 0u; q < nd; q++) {
            let shift = 8u * (nd - 1u - q);
            let fixed = select(0u, ALL << (shift + 8u), shift + 8u < 32u);
            hist_clear(lid);
            for (var i = lid; i < p.vocab; i += WG) {
                let e = weight(row, i);
                let k = key_of(row.mode, i, e);
                if (k == pfx && (i & fixed) == ipfx && at_or_before(k, i, kc.x, kc.y)) {
                    atomicAdd(&h_cnt[(i >> shift) & 255u], 1u);
                }
            }
            workgroupBarrier();
            if (lid == 0u) {
                var left = st_a.y;
                var chosen = 255u;
                for (var d = 0u; d < 256u; d++) {
                    let n = atomicLoad(&h_cnt[d]);
                    if (n >= left) {
                        chosen = d;
                        break;
                    }
                    left -= n;
                }
                st_a = vec4<u32>(pfx, left, st_a.z | (chosen << shift), 0u);
            }
            ipfx = workgroupUniformLoad(&st_a).z;
        }
        idx = ipfx;
    }
    return Cut(pfx, idx, b.z != 0u);
}

@compute @workgroup_size(256)
fn sample(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let r = wid.x + wid.y * nwg.x;
    if (r >= p.rows) {
        return;
    }
    if (lid == 0u) {
        rp_s = rowp[r];
    }
    // Broadcast so that branching on the row's settings stays uniform for the compiler.
    let rp = workgroupUniformLoad(&rp_s);
    let greedy = rp.x == 0.0;
    let top_k = bitcast<u32>(rp.y);
    let top_p = rp.z;
    // top_k >= vocab keeps every token but still samples in probability order, as the CPU.
    let truncate = top_k > 0u || top_p < 1.0;
    var row = Row(r * p.vocab, rp.x, 0.0, BY_INDEX);
    if (greedy) {
        row.scale = 1.0;
    } else if (truncate) {
        row.mode = BY_PROB;
    }

    // Pass 1: the maximum and its first index (each thread sees its indices in order).
    var mx = NEG;
    var arg = ALL;
    for (var i = lid; i < p.vocab; i += WG) {
        let z = logits[row.base + i] * row.scale;
        if (z > mx) {
            mx = z;
            arg = i;
        }
    }
    let am = reduce_argmax(lid, mx, arg);
    row.m = am.v;
    // Pass 2: the normaliser of the log-prob.
    var s = 0.0;
    for (var i = lid; i < p.vocab; i += WG) {
        s += weight(row, i);
    }
    let total = reduce_sum(lid, s);

    if (lid == 0u) {
        tok_s = am.i;
    }
    if (!greedy) {
        var kept = vec2<u32>(0u, ALL);
        if (top_k > 0u && top_k < p.vocab) {
            let c = select_cut(lid, row, COUNT_AT_LEAST, f32(top_k), kept);
            kept = vec2<u32>(c.key, c.idx);
        }
        if (top_p < 1.0) {
            // If even the whole kept set falls short (rounding), it stays kept.
            let c = select_cut(lid, row, MASS_AT_LEAST, top_p, kept);
            if (c.ok) {
                kept = vec2<u32>(c.key, c.idx);
            }
        }
        let c = select_cut(lid, row, MASS_ABOVE, rp.w, kept);
        if (lid == 0u) {
            // Rounding left the target at the whole mass: the CPU takes the last kept token.
            tok_s = select(kept.y, c.idx, c.ok);
        }
    }
    var tok = workgroupUniformLoad(&tok_s);
    if (tok >= p.vocab) {
        // Nothing was cut off and the draw fell past the whole mass (rounding): the last token
        // with non-zero weight, the CPU's choice in token order.
        var last = 0u;
        for (var i = lid; i < p.vocab; i += WG) {
            if (weight(row, i) > 0.0) {
                last = i;
            }
        }
        red_i[lid] = last;
        workgroupBarrier();
        for (var h = WG / 2u; h > 0u; h >>= 1u) {
            if (lid < h) {
                red_i[lid] = max(red_i[lid], red_i[lid + h]);
            }
            workgroupBarrier();
        }
        tok = red_i[0];
    }
    if (lid == 0u) {
        let t = min(tok, p.vocab - 1u);
        tokens[r] = t;
        logp[r] = logits[row.base + t] * row.scale - row.m - log(total);
    }
}
