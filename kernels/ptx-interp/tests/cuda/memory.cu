// Reference kernels for the interpreter's memory model: a tiled transpose through padded
// shared memory with 2-D blocks, a reversal through dynamic shared memory, and a cp.async
// double buffer (two commit groups, wait_group 1 then 0).

#define TILE 32

// out[j][i] = in[i][j] for an rows x cols matrix; blockDim (32, 8).
extern "C" __global__ void transpose(float* out, const float* in, int rows, int cols) {
    __shared__ float tile[TILE][TILE + 1];
    int x = blockIdx.x * TILE + threadIdx.x, y = blockIdx.y * TILE + threadIdx.y;
    for (int k = 0; k < TILE; k += 8) {
        if (x < cols && y + k < rows) tile[threadIdx.y + k][threadIdx.x] = in[(y + k) * cols + x];
    }
    __syncthreads();
    x = blockIdx.y * TILE + threadIdx.x;
    y = blockIdx.x * TILE + threadIdx.y;
    for (int k = 0; k < TILE; k += 8) {
        if (x < rows && y + k < cols) out[(y + k) * rows + x] = tile[threadIdx.x][threadIdx.y + k];
    }
}

// Each block reverses its blockDim.x elements through dynamic shared memory.
extern "C" __global__ void reverse(int* out, const int* in) {
    extern __shared__ int buf[];
    int t = threadIdx.x, base = blockIdx.x * blockDim.x;
    buf[t] = in[base + t];
    __syncthreads();
    out[base + t] = buf[blockDim.x - 1 - t];
}

__device__ void copy16(void* smem, const void* gmem) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

// out[i] = a[i] + b[i] for 4 * blockDim.x floats per block: a's tile in commit group 0, b's
// in group 1; a is read after wait_group 1, b after wait_group 0.
extern "C" __global__ void async_add(float* out, const float* a, const float* b) {
    __shared__ __align__(16) float sa[512];
    __shared__ __align__(16) float sb[512];
    int t = threadIdx.x, base = blockIdx.x * blockDim.x * 4;
    copy16(&sa[4 * t], &a[base + 4 * t]);
    asm volatile("cp.async.commit_group;\n" ::);
    copy16(&sb[4 * t], &b[base + 4 * t]);
    asm volatile("cp.async.commit_group;\n" ::);
    asm volatile("cp.async.wait_group 1;\n" ::);
    __syncthreads();
    // Each thread reads another thread's four elements (landed by that thread's copies).
    float s[4];
    for (int k = 0; k < 4; k++) s[k] = sa[(4 * t + k + 4 * 37) % (4 * blockDim.x)];
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();
    for (int k = 0; k < 4; k++) {
        int j = (4 * t + k + 4 * 37) % (4 * blockDim.x);
        out[base + j] = s[k] + sb[j];
    }
}
