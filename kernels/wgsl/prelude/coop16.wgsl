// Prelude `coop16`: `coop8` for adapters whose cooperative matrices are 16x16x16,
// f16 x f16 -> f32 (NVIDIA tensor cores through VK_KHR_cooperative_matrix, AMD WMMA).
enable f16;
enable wgpu_cooperative_matrix;

alias CoopA = coop_mat16x16<f16, A>;
alias CoopB = coop_mat16x16<f16, B>;
alias CoopC = coop_mat16x16<f32, C>;
const CT: u32 = 16u;
