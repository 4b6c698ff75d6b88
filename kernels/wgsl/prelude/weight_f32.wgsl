// Prelude `weight_f32` (prepended by the kernels crate to embedding_fwd and matmul_fwd):
// their weight binding (binding 2) as f32 values. It is one of three interchangeable
// preludes (`weight_f32`, `weight_bf16`, `weight_f16`; `Kernel::wgsl_as` picks one), each
// declaring `w` and defining the one hook the including file reads it through:
//   weight(i) -> f32    value i of the bound tensor, widened to f32 exactly.
// Everything else of the kernel is the same source for every storage format, so a half
// weight engine runs the f32 instruction sequence on the widened values.

@group(0) @binding(2) var<storage, read> w: array<f32>;

fn weight(i: u32) -> f32 {
    return w[i];
}
