// matmul_fwd: y[M, N] (+)= x[M, K] · W[N, K]ᵀ  (W stored [out, in] as in HF checkpoints).
// Entry matmul_fwd is the shared tiled GEMM of the `gemm` prelude (128x128 per 16x16
// workgroup, 8x8 per thread; see kernels/wgsl/prelude/gemm.wgsl) in its forward mode.
// Entry matmul_fwd_gemv serves products with at most 8 rows (decode steps), where a 128-row
// tile would be mostly idle: a split-K GEMV (below). Both entries sum each output in the
// same order (ascending fma chains over 64-wide chunks of K, the chunks added in order), so
// a decode step's rows come out bit for bit as they would in a larger product.
// A W above the device's storage-binding limit (lm_head at a 151,936 vocabulary: 622 MB) is
// launched in column chunks by the host: W and y bound from the chunk's first column, y's
// row stride ldy the full width; each output's sum is unchanged.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    accumulate: u32, // 1: y += x·Wᵀ, 0: y = x·Wᵀ
    ldy: u32,        // row stride of y (n, or the full width when launched in column chunks)
    lanes: u32,      // matmul_fwd_gemv: lanes per column (1, 8 or 16)
    vec4: u32,       // 1: K and the x / W offsets are multiples of 4 values (vector loads)
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// x is read through vector loads where p.vec4 is set (see the `gemm` prelude), so it is typed
// by them; the host pads every binding to whole vectors.
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
// Binding 2, the weight W, is declared by the `weight_*` prelude (f32, bf16 or f16 storage)
// and read only through its hook `weight(i)`.
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

fn x_at(i: u32) -> f32 {
    return x[i >> 2u][i & 3u];
}

fn gemm_a(mode: u32, r: u32, i: u32) -> f32 {
    if (r < p.m && i < p.k) {
        return x_at(r * p.k + i);
    }
    return 0.0;
}

fn gemm_a4(mode: u32, r: u32, i: u32) -> vec4<f32> {
    if (r < p.m && i < p.k) {
        return x[(r * p.k + i) >> 2u];
    }
    return vec4<f32>(0.0);
}

// B(i, c) = Wᵀ(i, c) = W[c, i].
fn gemm_b(mode: u32, i: u32, c: u32) -> f32 {
    if (c < p.n && i < p.k) {
        return weight(c * p.k + i);
    }
    return 0.0;
}

fn gemm_b4(mode: u32, i: u32, c: u32) -> vec4<f32> {
    if (c < p.n && i < p.k) {
        return weight4(c * p.k + i);
    }
    return vec4<f32>(0.0);
}

fn gemm_store(mode: u32, r: u32, c: u32, v: f32) {
    let o = r * p.ldy + c;
    if (p.accumulate != 0u) {
        y[o] += v;
    } else {
        y[o] = v;
    }
}

@compute @workgroup_size(16, 16)
fn matmul_fwd(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid3: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    gemm(GEMM_FWD, wid, lid3.x, lid3.y, lid);
}

// matmul_fwd_gemv: a workgroup takes 256 / L columns of y for every row (<= GV_ROWS), with
// L = p.lanes lanes per column (1, 8 or 16, the host's choice for the adapter: it changes no
// result). Lane l sums the GEMM_KC chunks l, l + L, ... of K, each as the tiled body does.
// With L > 1 a round of L chunks is written to workgroup memory and added to the running
// sum in chunk order by the thread of (row, column); with L = 1 the one thread adds each of
// its chunks as it finishes it. On a GPU, L = 16 gives a 1,024 x 1,024 projection 64
// workgroups (one per 16 columns) instead of 4.
const GV_ROWS: u32 = 8u;
var<workgroup> gv_part: array<f32, 2048>; // [lane][row][column]: L * GV_ROWS * (256 / L)

// Adds chunk `ch` of K (GEMM_KC values, zeros past K up to its multiple of GEMM_TK, as in the
// tiled body) for column c into one fma chain per row, from 0.0. Every chunk but the last is
// whole and takes one of the first two loops, without a bounds test per k (four values per
// load where p.vec4 is set, added in turn); the last loop is the same chain with the tests,
// for the last chunk.
fn gemv_chunk(ch: u32, c: u32, m: u32, kpad: u32) -> array<f32, 8> {
    var acc: array<f32, 8>;
    for (var r = 0u; r < GV_ROWS; r++) {
        acc[r] = 0.0;
    }
    let kb = ch * GEMM_KC;
    if (kb + GEMM_KC <= p.k && p.vec4 != 0u) {
        for (var kq = 0u; kq < GEMM_KC; kq += 4u) {
            let wv = weight4(c * p.k + kb + kq);
            for (var r = 0u; r < GV_ROWS; r++) {
                var xv = vec4<f32>(0.0);
                if (r < m) {
                    xv = x[(r * p.k + kb + kq) >> 2u];
                }
                var a = acc[r];
                for (var j = 0u; j < 4u; j++) {
                    a = fma(xv[j], wv[j], a);
                }
                acc[r] = a;
            }
        }
        return acc;
    }
    if (kb + GEMM_KC <= p.k) {
        for (var kk = 0u; kk < GEMM_KC; kk++) {
            let wv = weight(c * p.k + kb + kk);
            for (var r = 0u; r < GV_ROWS; r++) {
                var xv = 0.0;
                if (r < m) {
                    xv = x_at(r * p.k + kb + kk);
                }
                acc[r] = fma(xv, wv, acc[r]);
            }
        }
        return acc;
    }
    for (var kx = kb; kx < kpad; kx++) {
        var wv = 0.0;
        if (kx < p.k) {
            wv = weight(c * p.k + kx);
        }
        for (var r = 0u; r < GV_ROWS; r++) {
            var xv = 0.0;
            if (r < m && kx < p.k) {
                xv = x_at(r * p.k + kx);
            }
            acc[r] = fma(xv, wv, acc[r]);
        }
    }
    return acc;
}

@compute @workgroup_size(16, 16)
fn matmul_fwd_gemv(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    // 1, 8 or 16: the sums below need a lane per row (<= 8) whenever L > 1.
    let lanes = select(select(16u, 8u, p.lanes <= 8u), 1u, p.lanes <= 1u);
    let cols = 256u / lanes;
    let col0 = (wid.x + wid.y * nwg.x) * cols;
    if (col0 >= p.n) {
        return;
    }
    let j = lid % cols; // this thread's column; neighbouring threads share an x read
    let lane = lid / cols; // its chunk within a round; with L > 1 also its row when adding
    let c = col0 + j;
    let m = min(p.m, GV_ROWS);
    let kpad = (p.k + GEMM_TK - 1u) / GEMM_TK * GEMM_TK;
    let chunks = (p.k + GEMM_KC - 1u) / GEMM_KC;
    if (lanes == 1u) {
        var own: array<f32, 8>;
        for (var r = 0u; r < GV_ROWS; r++) {
            own[r] = 0.0;
        }
        if (c < p.n) {
            for (var ch = 0u; ch < chunks; ch++) {
                let acc = gemv_chunk(ch, c, m, kpad);
                for (var r = 0u; r < GV_ROWS; r++) {
                    own[r] += acc[r];
                }
            }
            for (var r = 0u; r < m; r++) {
                gemv_store(r, c, own[r]);
            }
        }
        return;
    }
    var tot = 0.0;
    for (var c0 = 0u; c0 < chunks; c0 += lanes) {
        let ch = c0 + lane;
        var acc: array<f32, 8>;
        if (ch < chunks && c < p.n) {
            acc = gemv_chunk(ch, c, m, kpad);
        }
        for (var r = 0u; r < GV_ROWS; r++) {
            gv_part[(lane * GV_ROWS + r) * cols + j] = acc[r];
        }
        workgroupBarrier();
        if (lane < m) {
            let here = min(lanes, chunks - c0);
            for (var l = 0u; l < here; l++) {
                tot += gv_part[(l * GV_ROWS + lane) * cols + j];
            }
        }
        workgroupBarrier();
    }
    if (lane < m && c < p.n) {
        gemv_store(lane, c, tot);
    }
}

fn gemv_store(r: u32, c: u32, v: f32) {
    let o = r * p.ldy + c;
    if (p.accumulate != 0u) {
        y[o] += v;
    } else {
        y[o] = v;
    }
}
