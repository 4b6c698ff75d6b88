// Prelude `lse` (after `reduce`, for logprob_fwd): the max and the shifted exponential sums
// of one row of z = logits[base .. base + p.cols] * p.inv_temp; the including file binds
// `logits` and has `cols` and `inv_temp` in its Params. Like the reduce helpers, every
// thread of the workgroup calls them and gets the same value.

// max over the row of z = logits * inv_temp.
fn row_max(lid: u32, base: u32) -> f32 {
    var mx = NEG;
    for (var i = lid; i < p.cols; i += WG) {
        mx = max(mx, logits[base + i] * p.inv_temp);
    }
    return reduce_max(lid, mx);
}

// (Σ e^(z − m), Σ e^(z − m)·(z − m)) over the row, given its max m.
fn row_sums(lid: u32, base: u32, m: f32) -> vec2<f32> {
    var se = 0.0;
    var sz = 0.0;
    for (var i = lid; i < p.cols; i += WG) {
        let z = logits[base + i] * p.inv_temp;
        let e = exp(z - m);
        se += e;
        sz += e * (z - m);
    }
    return vec2<f32>(reduce_sum(lid, se), reduce_sum(lid, sz));
}
