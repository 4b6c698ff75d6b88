// Prelude `gemm` (prepended by the kernels crate to matmul_fwd and matmul_bwd): the one tiled
// GEMM body, C[rows, cols] = A[rows, inner] · B[inner, cols] in f32.
//
// The including file's Params starts with m, n, k, accumulate and has a field vec4, and the
// file defines
//   gemm_a(mode, r, i) -> f32         A(r, i), zero outside the matrix;
//   gemm_b(mode, i, c) -> f32         B(i, c), zero outside the matrix;
//   gemm_a4(mode, r, i) -> vec4<f32>  4 values of A from (r, i) on along its contiguous
//                                     dimension: A(r, i..i+3) where A is contiguous along the
//                                     inner dimension (GEMM_FWD, GEMM_DX), else A(r..r+3, i);
//   gemm_b4(mode, i, c) -> vec4<f32>  likewise B(i..i+3, c) (GEMM_FWD) or B(i, c..c+3);
//   gemm_store(mode, r, c, v)         writes (or adds) C(r, c), called only inside the matrix.
// The vector hooks are one 16-byte load each (8 bytes for 16-bit weights) and are called
// only where the host set p.vec4: every operand's row stride, its extent along the
// contiguous dimension and its binding offset are multiples of 4 values, so a vector is
// aligned and wholly inside or wholly outside the matrix (zeros). Otherwise the staging
// reads one value at a time; both stage the same values, so the results are the same bits.
// The mode picks the product: GEMM_FWD  y[M, N] = x[M, K] · W[N, K]ᵀ     (rows M, cols N, inner K)
//                             GEMM_DX   dx[M, K] = dy[M, N] · W[N, K]    (rows M, cols K, inner N)
//                             GEMM_DW   dW[N, K] = dyᵀ[N, M] · x[M, K]   (rows N, cols K, inner M)
//
// Tiling: a 16x16 workgroup computes a 128x128 tile of C, each thread an 8x8 register block
// (rows 4·ty + {0..3} and 64 + 4·ty + {0..3}, columns likewise from tx, so a warp's stores
// cover 64 consecutive columns). The inner dimension is walked GEMM_TK = 8 at a time: each
// thread stages 4 values of A and 4 of B into workgroup memory per step (one vector load of
// each on the vector path: gemm_stage4), then reads its
// operands as four vec4 loads and does 64 fmas per step (16 fmas per shared load, against 4
// in the 64x64 / 4x4 tiling this replaced). Tiles are stored [k][row] with a row stride of
// 132 floats: the 4 floats of padding make the transposing stores (A or B contiguous along
// the inner dimension: 8 lanes of a warp walk k, 4 walk rows) hit 32 distinct banks, while
// keeping the vec4 reads 16-byte aligned; the vec4 reads of a warp are either one broadcast
// (A) or 16 consecutive vec4s (B), both conflict-free. On the vector path an operand
// contiguous along k is loaded as (row e / 2, k 4·(e % 2) ..+3) by thread e, whose four
// transposing stores put a warp's 16 rows × 2 k-quads on 32 distinct banks (the two quads
// are 4·132 floats apart: 16 banks); one contiguous across the tile is loaded as (k e / 32,
// columns 4·(e % 32) ..+3) and stored as one vec4, a warp's 32 consecutive ones.
//
// Summation order. In the backward modes every output is one chain of fmas over the inner
// dimension in ascending order from 0.0. The forward mode splits the inner dimension into
// chunks of GEMM_KC = 64 aligned at 0: each chunk is one ascending fma chain from 0.0 (the
// last one runs to K rounded up to GEMM_TK, the extra terms being fma(0, 0, acc)), and an
// output is 0.0 + chunk 0 + chunk 1 + ... added in chunk order. matmul_fwd_gemv (the decode
// path, <= 8 rows) computes its chunks on separate lanes (split-K) and adds them in the same
// order, so a row's result does not depend on how many rows share the launch or which path
// serves it: this is what keeps decoding and scoring batch-invariant bit for bit.

const GEMM_FWD: u32 = 0u;
const GEMM_DX: u32 = 1u;
const GEMM_DW: u32 = 2u;

const GEMM_T: u32 = 128u; // output tile edge
const GEMM_TK: u32 = 8u; // inner-dimension step
const GEMM_KC: u32 = 64u; // forward mode: inner-dimension chunk summed on its own
const GEMM_S: u32 = 33u; // staged tile row stride in vec4s: 128 floats + 4 of padding
var<workgroup> gemm_as: array<vec4<f32>, 264>; // GEMM_TK * GEMM_S
var<workgroup> gemm_bs: array<vec4<f32>, 264>;

// (rows, cols, inner) of the mode's product.
fn gemm_dims(mode: u32) -> vec3<u32> {
    if (mode == GEMM_DX) {
        return vec3<u32>(p.m, p.k, p.n);
    }
    if (mode == GEMM_DW) {
        return vec3<u32>(p.n, p.k, p.m);
    }
    return vec3<u32>(p.m, p.n, p.k);
}

// Stages element (row or column `r` of the tile, step `kk`) at float index kk·132 + r.
fn gemm_stage(dst_a: bool, kk: u32, r: u32, v: f32) {
    let i = kk * GEMM_S + r / 4u;
    if (dst_a) {
        gemm_as[i][r % 4u] = v;
    } else {
        gemm_bs[i][r % 4u] = v;
    }
}

// The vector path's staging of inner-dimension step k0: one load of A and one of B by
// thread `lid` (see the tiling notes above).
fn gemm_stage4(mode: u32, k0: u32, row0: u32, col0: u32, lid: u32) {
    if (mode != GEMM_DW) {
        let r = lid / 2u;
        let kq = 4u * (lid % 2u);
        let v = gemm_a4(mode, row0 + r, k0 + kq);
        for (var j = 0u; j < 4u; j++) {
            gemm_stage(true, kq + j, r, v[j]);
        }
    } else {
        let kk = lid / 32u;
        let r4 = lid % 32u;
        gemm_as[kk * GEMM_S + r4] = gemm_a4(mode, row0 + 4u * r4, k0 + kk);
    }
    if (mode == GEMM_FWD) {
        let c = lid / 2u;
        let kq = 4u * (lid % 2u);
        let v = gemm_b4(mode, k0 + kq, col0 + c);
        for (var j = 0u; j < 4u; j++) {
            gemm_stage(false, kq + j, c, v[j]);
        }
    } else {
        let kk = lid / 32u;
        let c4 = lid % 32u;
        gemm_bs[kk * GEMM_S + c4] = gemm_b4(mode, k0 + kk, col0 + 4u * c4);
    }
}

fn gemm(mode: u32, wid: vec3<u32>, tx: u32, ty: u32, lid: u32) {
    let dims = gemm_dims(mode);
    let row0 = wid.y * GEMM_T;
    let col0 = wid.x * GEMM_T;
    // A is contiguous along the inner dimension except for dyᵀ; B (Wᵀ) only in the forward.
    let a_along_k = mode != GEMM_DW;
    let b_along_k = mode == GEMM_FWD;
    var acc: array<vec4<f32>, 16>; // [row i of 8][column half h]: acc[2i + h]
    var tot: array<vec4<f32>, 16>; // forward mode: the sum of the finished chunks
    for (var i = 0u; i < 16u; i++) {
        acc[i] = vec4<f32>(0.0);
        tot[i] = vec4<f32>(0.0);
    }
    // A thread whose first row or column is past the edge owns no output: it still stages
    // tiles (and meets every barrier) but skips the products.
    let live = row0 + 4u * ty < dims.x && col0 + 4u * tx < dims.y;
    for (var k0 = 0u; k0 < dims.z; k0 += GEMM_TK) {
        if (p.vec4 != 0u) {
            gemm_stage4(mode, k0, row0, col0, lid);
        }
        for (var q = 0u; q < select(4u, 0u, p.vec4 != 0u); q++) {
            let e = lid + 256u * q;
            // Contiguous along k: 8 neighbouring lanes read 8 consecutive k of one row;
            // otherwise 128 neighbouring lanes read one k across rows.
            var r = e % GEMM_T;
            var kk = e / GEMM_T;
            if (a_along_k) {
                r = e / GEMM_TK;
                kk = e % GEMM_TK;
            }
            gemm_stage(true, kk, r, gemm_a(mode, row0 + r, k0 + kk));
            var c = e % GEMM_T;
            var kb = e / GEMM_T;
            if (b_along_k) {
                c = e / GEMM_TK;
                kb = e % GEMM_TK;
            }
            gemm_stage(false, kb, c, gemm_b(mode, k0 + kb, col0 + c));
        }
        workgroupBarrier();
        for (var kk = 0u; kk < select(0u, GEMM_TK, live); kk++) {
            let a0 = gemm_as[kk * GEMM_S + ty];
            let a1 = gemm_as[kk * GEMM_S + 16u + ty];
            let b0 = gemm_bs[kk * GEMM_S + tx];
            let b1 = gemm_bs[kk * GEMM_S + 16u + tx];
            for (var i = 0u; i < 4u; i++) {
                acc[2u * i] = fma(vec4<f32>(a0[i]), b0, acc[2u * i]);
                acc[2u * i + 1u] = fma(vec4<f32>(a0[i]), b1, acc[2u * i + 1u]);
                acc[2u * i + 8u] = fma(vec4<f32>(a1[i]), b0, acc[2u * i + 8u]);
                acc[2u * i + 9u] = fma(vec4<f32>(a1[i]), b1, acc[2u * i + 9u]);
            }
        }
        workgroupBarrier();
        let chunk_end = (k0 + GEMM_TK) % GEMM_KC == 0u || k0 + GEMM_TK >= dims.z;
        if (mode == GEMM_FWD && chunk_end) {
            for (var i = 0u; i < 16u; i++) {
                tot[i] += acc[i];
                acc[i] = vec4<f32>(0.0);
            }
        }
    }
    if (mode == GEMM_FWD) {
        acc = tot;
    }
    for (var i = 0u; i < 8u; i++) {
        let r = row0 + 4u * ty + (i % 4u) + 64u * (i / 4u);
        for (var h = 0u; h < 2u; h++) {
            let v = acc[2u * i + h];
            for (var j = 0u; j < 4u; j++) {
                let c = col0 + 64u * h + 4u * tx + j;
                if (r < dims.x && c < dims.y) {
                    gemm_store(mode, r, c, v[j]);
                }
            }
        }
    }
}
