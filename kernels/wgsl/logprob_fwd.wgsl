// logprob_fwd: log-probs of the targets under log_softmax(logits / T), their entropies and
// the log-sum-exp, fused with a chunked lm_head: the [rows, vocab] logits are never stored.
// The host (backends/src/wgpu/lm_head.rs) walks the vocabulary in chunks [v0, v0 + cols):
// matmul_fwd writes the chunk's logits [rows, cols] = hidden · W[v0 .. v0 + cols]ᵀ, then
//   logprob_fwd        folds them into a per-row running state (m, s, sz, zt), first = 1
//                      starting fresh, and after the last chunk
//   logprob_fwd_finish writes lse = m + log s, logp = zt − lse, entropy = log s − sz / s.
// With z = logits / T: m is the running max, s = Σ e^(z − m), sz = Σ e^(z − m)·(z − m) (kept
// shifted by m, so the entropy has no cancellation), zt = the target's z once its chunk is
// seen. A larger max m' rescales by a = e^(m − m'): s' = a·s, sz' = a·(sz + (m − m')·s).
// With one chunk the outputs are those of a single pass over the row, as before chunking.
// logprob_fwd: one workgroup of 256 threads per row (the `lse` prelude's tree reductions);
// logprob_fwd_finish: one thread per row. Rows of a launch are rows row0.. of the state,
// targets and outputs (the host walks them in blocks that fit the chunk scratch).
// Mirrors: kernels/ptx/logprob_fwd.ptx (same state, same entry points), and the CPU
// reference cpu::lm_head::lm_head_logprob_fwd (f64 accumulation there, f32 here).
// Determinism: a fixed chunk order (host), fixed per-thread order and reduction tree, no
// atomics; a row's values do not depend on the other rows (batch-invariant).

struct Params {
    rows: u32,     // rows of this launch
    cols: u32,     // columns of this chunk (the `lse` prelude's row width)
    v0: u32,       // vocabulary index of the chunk's first column
    first: u32,    // 1: the first chunk, the state starts fresh
    inv_temp: f32,
    row0: u32,     // first row of the state, targets and outputs
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>; // [rows, cols], this chunk
@group(0) @binding(2) var<storage, read> targets: array<u32>;
@group(0) @binding(3) var<storage, read_write> state: array<f32>; // [rows, 4]: m, s, sz, zt
@group(0) @binding(4) var<storage, read_write> logp: array<f32>;
@group(0) @binding(5) var<storage, read_write> entropy: array<f32>;
@group(0) @binding(6) var<storage, read_write> lse: array<f32>;

@compute @workgroup_size(256)
fn logprob_fwd(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.cols;
    let cm = row_max(lid, base);
    let sums = row_sums(lid, base, cm);
    if (lid == 0u) {
        let g = p.row0 + row;
        let t = targets[g];
        var zt = 0.0;
        if (p.first == 0u) {
            zt = state[4u * g + 3u];
        }
        if (t >= p.v0 && t - p.v0 < p.cols) {
            zt = logits[base + t - p.v0] * p.inv_temp;
        }
        var m = cm;
        var s = sums.x;
        var sz = sums.y;
        if (p.first == 0u) {
            let om = state[4u * g];
            let os = state[4u * g + 1u];
            let osz = state[4u * g + 2u];
            m = max(om, cm);
            let a = exp(om - m);
            let b = exp(cm - m);
            s = a * os + b * sums.x;
            sz = a * (osz + (om - m) * os) + b * (sums.y + (cm - m) * sums.x);
        }
        state[4u * g] = m;
        state[4u * g + 1u] = s;
        state[4u * g + 2u] = sz;
        state[4u * g + 3u] = zt;
    }
}

@compute @workgroup_size(256)
fn logprob_fwd_finish(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let row = gid.x + gid.y * nwg.x * 256u;
    if (row >= p.rows) {
        return;
    }
    let g = p.row0 + row;
    let m = state[4u * g];
    let s = state[4u * g + 1u];
    let l = m + log(s);
    lse[g] = l;
    logp[g] = state[4u * g + 3u] - l;
    entropy[g] = log(s) - state[4u * g + 2u] / s;
}
