// sample: one token per row of logits[rows, vocab] with temperature, top-k and top-p, using
// a uniform u in [0, 1) drawn on the host from the request's own seeded RNG (the CPU
// reference's stream), so that a request's tokens depend only on its seed and the weights.
// Also writes the token's log-prob under the sampling distribution log_softmax(z / T)
// (temperature 0 = greedy argmax, log-prob of the temperature-1 distribution).
//
// Semantics (those of a sort-based sampler): order tokens by scaled logit descending, ties
// by lower index first; keep the shortest prefix holding top_k tokens and the shortest
// holding probability mass >= top_p (the intersection of two prefixes is the shorter);
// then walk the kept prefix in that order and return the first token whose cumulative
// mass exceeds u · (kept mass).
// Sorting a 150k-entry row inside one workgroup is costly, so each "shortest prefix whose
// count/mass satisfies a monotone predicate" is found by bisection instead: first on the
// order-preserving integer image of the logit (32 steps), then on the index among tied
// logits (20 steps); each step is one pass over the row with a workgroup reduction.
// Where this can differ from a CPU walk: the prefix masses are summed in a different order,
// so when u·mass (or top_p) lies within a few ulps of a cumulative boundary the neighbouring
// token may be picked (probability about 1e-6 per token; see the conformance suite).
//
// rowp[r] = (inv_temp (0 = greedy), bitcast top_k (0 = off), top_p (1 = off), u).

struct Params {
    rows: u32,
    vocab: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> rowp: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> tokens: array<u32>;
@group(0) @binding(4) var<storage, read_write> logp: array<f32>;

const WG: u32 = 256u;
const NEG: f32 = -3.0e38;
const IDX_BITS: u32 = 20u; // vocabularies up to 2^20 entries
var<workgroup> red: array<vec2<f32>, WG>;

// Maps an f32 to a u32 whose unsigned order is the float order.
fn key_of(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x80000000u) != 0u) {
        return ~b;
    }
    return b | 0x80000000u;
}

// Is element (k, i) at or before the cut (ck, ci) in the order (key desc, index asc)?
fn at_or_before(k: u32, i: u32, ck: u32, ci: u32) -> bool {
    return k > ck || (k == ck && i <= ci);
}

// (count, mass) of the elements at or before cut (ck, ci) and also at or before the kept
// cut (kk, ki); mass is Σ exp(z − m) (unnormalised, as the host-free reference sums it).
fn prefix(lid: u32, base: u32, scale: f32, m: f32, ck: u32, ci: u32, kk: u32, ki: u32) -> vec2<f32> {
    var acc = vec2<f32>(0.0);
    for (var i = lid; i < p.vocab; i += WG) {
        let z = logits[base + i] * scale;
        let k = key_of(z);
        if (at_or_before(k, i, ck, ci) && at_or_before(k, i, kk, ki)) {
            acc += vec2<f32>(1.0, exp(z - m));
        }
    }
    red[lid] = acc;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

// pred(kind, stats): kind 0 = count >= thr, kind 1 = mass >= thr, kind 2 = mass > thr.
fn pred(kind: u32, st: vec2<f32>, thr: f32) -> bool {
    if (kind == 0u) {
        return st.x >= thr;
    }
    if (kind == 1u) {
        return st.y >= thr;
    }
    return st.y > thr;
}

// The shortest prefix (as its last element's cut) satisfying pred, within kept cut (kk, ki).
// If even the whole kept set fails (rounding), the kept cut itself is returned.
fn shortest(lid: u32, base: u32, scale: f32, m: f32, kind: u32, thr: f32, kk: u32, ki: u32) -> vec2<u32> {
    let all = prefix(lid, base, scale, m, 0u, 0xffffffffu, kk, ki);
    let ok = pred(kind, all, thr);
    // Largest key level zc whose "all keys >= zc" prefix satisfies pred.
    var zc = 0u;
    for (var b = 0u; b < 32u; b++) {
        let cand = zc | (1u << (31u - b));
        let st = prefix(lid, base, scale, m, cand, 0xffffffffu, kk, ki);
        if (pred(kind, st, thr)) {
            zc = cand;
        }
    }
    // Among ties at zc: the largest i with "ties of index < i" failing pred; the cut is
    // then the element of index i.
    var ic = 0u;
    for (var b = 0u; b < IDX_BITS; b++) {
        let cand = ic | (1u << (IDX_BITS - 1u - b));
        var fails = false;
        if (cand <= p.vocab) {
            let st = prefix(lid, base, scale, m, zc, cand - 1u, kk, ki);
            fails = !pred(kind, st, thr);
        }
        if (fails) {
            ic = cand;
        }
    }
    if (!ok) {
        return vec2<u32>(kk, ki);
    }
    return vec2<u32>(zc, ic);
}

// Shorter of two prefixes given by their cuts.
fn shorter(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    if (at_or_before(a.x, a.y, b.x, b.y)) {
        return a;
    }
    return b;
}

@compute @workgroup_size(256)
fn sample(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.vocab;
    let rp = rowp[row];
    let greedy = rp.x == 0.0;
    var scale = rp.x;
    if (greedy) {
        scale = 1.0;
    }
    var top_k = bitcast<u32>(rp.y);
    if (greedy) {
        top_k = 1u;
    }
    if (top_k == 0u || top_k > p.vocab) {
        top_k = p.vocab;
    }
    let top_p = rp.z;
    let u = rp.w;

    var mx = NEG;
    for (var i = lid; i < p.vocab; i += WG) {
        mx = max(mx, logits[base + i] * scale);
    }
    red[lid] = vec2<f32>(mx, 0.0);
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] = max(red[lid], red[lid + s]);
        }
        workgroupBarrier();
    }
    let m = red[0].x;
    workgroupBarrier();

    let everything = vec2<u32>(0u, 0xffffffffu);
    let total = prefix(lid, base, scale, m, everything.x, everything.y, everything.x, everything.y);
    var kept = everything;
    if (top_k < p.vocab) {
        kept = shortest(lid, base, scale, m, 0u, f32(top_k), everything.x, everything.y);
    }
    if (!greedy && top_p < 1.0) {
        let cut_p = shortest(lid, base, scale, m, 1u, top_p * total.y, everything.x, everything.y);
        kept = shorter(kept, cut_p);
    }
    var tok = kept.y;
    if (!greedy) {
        let kept_mass = prefix(lid, base, scale, m, kept.x, kept.y, kept.x, kept.y).y;
        let cut = shortest(lid, base, scale, m, 2u, u * kept_mass, kept.x, kept.y);
        tok = cut.y;
    }
    if (lid == 0u) {
        let t = min(tok, p.vocab - 1u);
        tokens[row] = t;
        logp[row] = logits[base + t] * scale - m - log(total.y);
    }
}
