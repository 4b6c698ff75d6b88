// Reference kernels for the interpreter's float semantics: the rounding-mode intrinsics, the
// conversions to bf16/f16 and to integers, min/max with NaN, and the fast exponential and
// logarithm, one result per input element.
// NVRTC has no cuda_bf16.h / cuda_fp16.h: the 16-bit conversions are inline PTX (sm_80 has
// .rn and .rz for bf16, all four modes for f16).

__device__ unsigned short cvt_bits(float v, int k) {
    unsigned short h;
    switch (k) {
        case 0: asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v)); break;
        case 1: asm("cvt.rz.bf16.f32 %0, %1;" : "=h"(h) : "f"(v)); break;
        case 2: asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v)); break;
        case 3: asm("cvt.rz.f16.f32 %0, %1;" : "=h"(h) : "f"(v)); break;
        case 4: asm("cvt.rm.f16.f32 %0, %1;" : "=h"(h) : "f"(v)); break;
        default: asm("cvt.rp.f16.f32 %0, %1;" : "=h"(h) : "f"(v)); break;
    }
    return h;
}

// out[8 * i + k]: a op b in the four rounding modes for add (k = 0..3) and mul (4..7).
extern "C" __global__ void rounding(float* out, const float* a, const float* b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = a[i], y = b[i];
    float* o = out + 8 * i;
    o[0] = __fadd_rn(x, y); o[1] = __fadd_rz(x, y); o[2] = __fadd_rd(x, y); o[3] = __fadd_ru(x, y);
    o[4] = __fmul_rn(x, y); o[5] = __fmul_rz(x, y); o[6] = __fmul_rd(x, y); o[7] = __fmul_ru(x, y);
}

// out[8 * i + k]: fma in the four modes (0..3), division in the four modes (4..7).
extern "C" __global__ void rounding3(float* out, const float* a, const float* b, const float* c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = a[i], y = b[i], z = c[i];
    float* o = out + 8 * i;
    o[0] = __fmaf_rn(x, y, z); o[1] = __fmaf_rz(x, y, z); o[2] = __fmaf_rd(x, y, z); o[3] = __fmaf_ru(x, y, z);
    o[4] = __fdiv_rn(x, y); o[5] = __fdiv_rz(x, y); o[6] = __fdiv_rd(x, y); o[7] = __fdiv_ru(x, y);
}

// halves[6 * i + k]: x to bf16 (.rn, .rz) and f16 (.rn, .rz, .rm, .rp), as bits.
extern "C" __global__ void to_half(unsigned short* halves, const float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    for (int k = 0; k < 6; k++) halves[6 * i + k] = cvt_bits(x[i], k);
}

// ints[4 * i + k]: x to int rounded to nearest, toward zero, down and up (saturating; NaN 0).
extern "C" __global__ void to_int(int* ints, const float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    ints[4 * i + 0] = __float2int_rn(v);
    ints[4 * i + 1] = __float2int_rz(v);
    ints[4 * i + 2] = __float2int_rd(v);
    ints[4 * i + 3] = __float2int_ru(v);
}

// out[4 * i + k]: fminf, fmaxf, 2^x and log2(x) by the fast intrinsics.
extern "C" __global__ void misc(float* out, const float* a, const float* b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = a[i], y = b[i];
    out[4 * i + 0] = fminf(x, y);
    out[4 * i + 1] = fmaxf(x, y);
    out[4 * i + 2] = exp2f(x);
    out[4 * i + 3] = __log2f(y);
}
