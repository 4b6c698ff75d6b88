// Prelude `weight_f16`: the weight binding (binding 2) as IEEE half values packed in pairs
// (value 2j in the low 16 bits of word j, as `unpack2x16float` reads them), bound as
// `array<vec2<u32>>` (four values per element, so weight4 is one 8-byte load). No
// `shader-f16` needed: `unpack2x16float` is core WGSL (it needs only the downlevel capability
// SHADER_F16_IN_F32, present on every Vulkan, Metal and DX12 adapter), and every f16 value,
// subnormals included, is exact in f32. See `weight_f32` for the hooks.

@group(0) @binding(2) var<storage, read> w: array<vec2<u32>>;

fn weight(i: u32) -> f32 {
    return unpack2x16float(w[i >> 2u][(i >> 1u) & 1u])[i & 1u];
}

fn weight4(i: u32) -> vec4<f32> {
    let q = w[i >> 2u];
    return vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y));
}
