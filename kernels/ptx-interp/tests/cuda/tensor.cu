// Reference kernel for the interpreter's tensor-core path: one warp loads a 16x16 A tile and
// a 16x8 B tile (both row-major in global memory) into shared memory, takes the fragments
// with ldmatrix (B with .trans, as it is stored k-major) and computes D = A.B + C with
// mma.sync m16n8k16 (bf16 or f16 inputs, f32 accumulators), writing D row-major.

template <bool BF16>
__device__ void mma_tile(float* d, const unsigned short* a, const unsigned short* b, const float* c) {
    __shared__ __align__(16) unsigned short sa[16 * 16];
    __shared__ __align__(16) unsigned short sb[16 * 8];
    int l = threadIdx.x;
    for (int i = l; i < 256; i += 32) sa[i] = a[i];
    for (int i = l; i < 128; i += 32) sb[i] = b[i];
    __syncwarp();
    unsigned r[4], q[2];
    // A: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
    unsigned pa = (unsigned)__cvta_generic_to_shared(&sa[(l % 16) * 16 + (l / 16) * 8]);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(pa));
    // B [k][n]: k rows 0-7 then 8-15, transposed into the col-major fragments.
    unsigned pb = (unsigned)__cvta_generic_to_shared(&sb[(l % 16) * 8]);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(q[0]), "=r"(q[1]) : "r"(pb));
    int g = l / 4, t = l % 4;
    float acc[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t], c[(g + 8) * 8 + 2 * t + 1]};
    if (BF16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                     : "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]), "r"(q[0]), "r"(q[1]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                     : "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]), "r"(q[0]), "r"(q[1]));
    }
    d[g * 8 + 2 * t] = acc[0];
    d[g * 8 + 2 * t + 1] = acc[1];
    d[(g + 8) * 8 + 2 * t] = acc[2];
    d[(g + 8) * 8 + 2 * t + 1] = acc[3];
}

extern "C" __global__ void mma_bf16(float* d, const unsigned short* a, const unsigned short* b, const float* c) {
    mma_tile<true>(d, a, b, c);
}

extern "C" __global__ void mma_f16(float* d, const unsigned short* a, const unsigned short* b, const float* c) {
    mma_tile<false>(d, a, b, c);
}
