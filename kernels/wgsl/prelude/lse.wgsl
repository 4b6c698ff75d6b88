// Prelude `lse` (after `reduce`, for logprob_fwd and logprob_bwd): the per-row max and
// log-sum-exp of z = logits[base .. base + p.vocab] * p.inv_temp; the including file binds
// `logits` and has `vocab` and `inv_temp` in its Params. Like the reduce helpers, every
// thread of the workgroup calls them and gets the same value.

// max over the row of z = logits * inv_temp.
fn row_max(lid: u32, base: u32) -> f32 {
    var mx = NEG;
    for (var i = lid; i < p.vocab; i += WG) {
        mx = max(mx, logits[base + i] * p.inv_temp);
    }
    return reduce_max(lid, mx);
}

// log Σ exp(z) over the row, given its max m.
fn row_lse(lid: u32, base: u32, m: f32) -> f32 {
    var se = 0.0;
    for (var i = lid; i < p.vocab; i += WG) {
        se += exp(logits[base + i] * p.inv_temp - m);
    }
    return m + log(reduce_sum(lid, se));
}
