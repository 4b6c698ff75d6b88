// Prelude `weight_f32` (prepended by the kernels crate to embedding_fwd and matmul_fwd):
// their weight binding (binding 2) as f32 values. It is one of three interchangeable
// preludes (`weight_f32`, `weight_bf16`, `weight_f16`; `Kernel::wgsl_as` picks one), each
// declaring `w` and defining the two hooks the including file reads it through:
//   weight(i) -> f32          value i of the bound tensor, widened to f32 exactly;
//   weight4(i) -> vec4<f32>   values i .. i + 3 in one 16-byte (8-byte for 16-bit formats)
//                             load, for i a multiple of 4 (the GEMM's vector path).
// The binding is typed by its widest load (`array<vec4<f32>>` here); the host pads every
// buffer and binding to 16 bytes and aligns their offsets so (`gpu::BIND_ALIGN`), so the
// last vector holds the tensor's last value. Everything else of the kernel is the same
// source for every storage format, so a half weight engine runs the f32 instruction sequence
// on the widened values.

@group(0) @binding(2) var<storage, read> w: array<vec4<f32>>;

fn weight(i: u32) -> f32 {
    return w[i >> 2u][i & 3u];
}

fn weight4(i: u32) -> vec4<f32> {
    return w[i >> 2u];
}
