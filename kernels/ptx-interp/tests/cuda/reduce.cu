// Reference kernels for the interpreter: a grid-stride fma, a block sum through shared
// memory and warp shuffles, and the shuffle variants with sub-warp widths.

extern "C" __global__ void saxpy(float* y, const float* x, float a, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        y[i] = fmaf(a, x[i], y[i]);
    }
}

// sums[blockIdx.x] = sum of x over the block's grid-stride slice: per-thread sums, a warp
// butterfly, the warp sums through shared memory, then warp 0.
extern "C" __global__ void block_sum(float* sums, const float* x, int n) {
    __shared__ float warp_sums[32];
    float s = 0.0f;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        s += x[i];
    }
    for (int o = 16; o > 0; o /= 2) {
        s += __shfl_xor_sync(0xffffffffu, s, o);
    }
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) warp_sums[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < (blockDim.x + 31) / 32 ? warp_sums[lane] : 0.0f;
        for (int o = 16; o > 0; o /= 2) {
            s += __shfl_down_sync(0xffffffffu, s, o);
        }
        if (lane == 0) sums[blockIdx.x] = s;
    }
}

// out[4 * tid + k] = the four shuffles of x[tid] within segments of `width` lanes.
extern "C" __global__ void shuffles(int* out, const int* x, int delta, int src, int width) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    int v = x[t];
    out[4 * t + 0] = __shfl_up_sync(0xffffffffu, v, delta, width);
    out[4 * t + 1] = __shfl_down_sync(0xffffffffu, v, delta, width);
    out[4 * t + 2] = __shfl_xor_sync(0xffffffffu, v, delta, width);
    out[4 * t + 3] = __shfl_sync(0xffffffffu, v, src, width);
}
