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
// Sorting a 150k-entry row inside one workgroup is costly, so every "shortest prefix whose
// count or mass satisfies a monotone predicate" is found by bisection instead: first on the
// ordering key's bits (32 steps), then on the index among equal keys (log2(vocab) steps); each step
// is one pass over the row with a workgroup reduction. In token order only the index
// bisection runs.
// Where this can differ from the CPU: it sums in f64 in sequence, this kernel in f32 by a
// tree, and u arrives rounded to f32; so when u·mass (or top_p) falls within ~1e-6 relative
// of a cumulative boundary the neighbouring token may be picked (the conformance suite
// measures how often).
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

const WG: u32 = 256u;
const NEG: f32 = -3.0e38;
const ALL: u32 = 0xffffffffu;
// Ordering modes: by f32 probability (truncated sampling), by token index (untruncated),
// by logit (greedy: exact, where probabilities near the max could round to equal).
const BY_PROB: u32 = 0u;
const BY_INDEX: u32 = 1u;
const BY_LOGIT: u32 = 2u;

var<workgroup> red: array<vec2<f32>, WG>;
var<workgroup> rp_s: vec4<f32>;

// Maps an f32 to a u32 whose unsigned order is the float order.
fn key_of(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x80000000u) != 0u) {
        return ~b;
    }
    return b | 0x80000000u;
}

fn order_key(mode: u32, z: f32, e: f32) -> u32 {
    if (mode == BY_PROB) {
        // e >= 0, so its bit pattern already orders like its value.
        return bitcast<u32>(e);
    }
    if (mode == BY_LOGIT) {
        return key_of(z);
    }
    return 0u;
}

// Is element (k, i) at or before the cut (ck, ci) in the order (key desc, index asc)?
fn at_or_before(k: u32, i: u32, ck: u32, ci: u32) -> bool {
    return k > ck || (k == ck && i <= ci);
}

struct Row {
    base: u32,
    scale: f32,
    m: f32,
    mode: u32,
}

// (count, mass) of the elements at or before cut c and also at or before the kept cut kc;
// mass is Σ e_j with e_j = exp(z_j − m).
fn prefix(lid: u32, row: Row, c: vec2<u32>, kc: vec2<u32>) -> vec2<f32> {
    var acc = vec2<f32>(0.0);
    for (var i = lid; i < p.vocab; i += WG) {
        let z = logits[row.base + i] * row.scale;
        let e = exp(z - row.m);
        let k = order_key(row.mode, z, e);
        if (at_or_before(k, i, c.x, c.y) && at_or_before(k, i, kc.x, kc.y)) {
            acc += vec2<f32>(1.0, e);
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

// The cut (last element) of the shortest prefix satisfying pred, within the kept cut kc.
// If even the whole kept set fails (rounding), the kept cut itself is returned.
fn shortest(lid: u32, row: Row, kind: u32, thr: f32, kc: vec2<u32>) -> vec2<u32> {
    let ok = pred(kind, prefix(lid, row, vec2<u32>(0u, ALL), kc), thr);
    // Largest key level zc whose "all keys >= zc" prefix satisfies pred (all keys are 0 in
    // token order, where this search is skipped).
    var zc = 0u;
    if (row.mode != BY_INDEX) {
        for (var b = 0u; b < 32u; b++) {
            let cand = zc | (1u << (31u - b));
            if (pred(kind, prefix(lid, row, vec2<u32>(cand, ALL), kc), thr)) {
                zc = cand;
            }
        }
    }
    // Among keys equal to zc: the largest i such that those of index < i still fail pred;
    // element i is then the one whose inclusion satisfies it.
    // Bits enough for any index below vocab: fewer passes for small vocabularies.
    let bits = 32u - countLeadingZeros(p.vocab);
    var ic = 0u;
    for (var b = 0u; b < bits; b++) {
        let cand = ic | (1u << (bits - 1u - b));
        var fails = false;
        if (cand <= p.vocab) {
            fails = !pred(kind, prefix(lid, row, vec2<u32>(zc, cand - 1u), kc), thr);
        }
        if (fails) {
            ic = cand;
        }
    }
    if (!ok) {
        return kc;
    }
    return vec2<u32>(zc, ic);
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
        row.mode = BY_LOGIT;
    } else if (truncate) {
        row.mode = BY_PROB;
    }

    var mx = NEG;
    for (var i = lid; i < p.vocab; i += WG) {
        mx = max(mx, logits[row.base + i] * row.scale);
    }
    red[lid] = vec2<f32>(mx, 0.0);
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] = max(red[lid], red[lid + s]);
        }
        workgroupBarrier();
    }
    row.m = red[0].x;
    workgroupBarrier();

    let everything = vec2<u32>(0u, ALL);
    let total = prefix(lid, row, everything, everything).y;
    var tok = ALL;
    if (greedy) {
        tok = shortest(lid, row, 0u, 1.0, everything).y;
    } else {
        var kept = everything;
        if (top_k > 0u && top_k < p.vocab) {
            kept = shortest(lid, row, 0u, f32(top_k), everything);
        }
        if (top_p < 1.0) {
            let mass_k = prefix(lid, row, kept, kept).y;
            kept = shortest(lid, row, 1u, top_p * mass_k, kept);
        }
        let kept_mass = prefix(lid, row, kept, kept).y;
        tok = shortest(lid, row, 2u, rp.w * kept_mass, kept).y;
    }
    // If rounding left the target above the whole mass, the CPU takes the last token with
    // non-zero weight; found by a max-reduction over indices (run always: uniform control).
    {
        var last = 0.0;
        for (var i = lid; i < p.vocab; i += WG) {
            if (exp(logits[row.base + i] * row.scale - row.m) > 0.0) {
                last = max(last, f32(i));
            }
        }
        red[lid] = vec2<f32>(last, 0.0);
        workgroupBarrier();
        for (var s = WG / 2u; s > 0u; s >>= 1u) {
            if (lid < s) {
                red[lid] = max(red[lid], red[lid + s]);
            }
            workgroupBarrier();
        }
        if (tok >= p.vocab) {
            tok = u32(red[0].x);
        }
    }
    if (lid == 0u) {
        let t = min(tok, p.vocab - 1u);
        tokens[r] = t;
        logp[r] = logits[row.base + t] * row.scale - row.m - log(total);
    }
}
