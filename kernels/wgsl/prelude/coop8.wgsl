// Prelude `coop8` (prepended first by the kernels crate to matmul_fwd_coop for adapters whose
// cooperative matrices are 8x8x8, f16 x f16 -> f32: Mesa's lavapipe, Apple's simdgroup
// matrices). It enables the extensions and names the fragment types the kernel uses:
//   CoopA  an 8x8 f16 left operand, CoopB  an 8x8 f16 right operand,
//   CoopC  an 8x8 f32 accumulator,  CT     the fragment edge (8).
// `coop16` is the same for 16x16x16 (NVIDIA tensor cores, AMD WMMA).
enable f16;
enable wgpu_cooperative_matrix;

alias CoopA = coop_mat8x8<f16, A>;
alias CoopB = coop_mat8x8<f16, B>;
alias CoopC = coop_mat8x8<f32, C>;
const CT: u32 = 8u;
