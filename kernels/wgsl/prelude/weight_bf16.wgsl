// Prelude `weight_bf16`: the weight binding (binding 2) as bfloat16 values packed in pairs,
// value 2j in the low 16 bits of word j and 2j + 1 in the high 16 bits (little-endian, as
// the host writes them); an odd-length tensor's last word has a zero high half. Bound as
// `array<vec2<u32>>`: four values per element, so weight4 is one 8-byte load. No
// `shader-f16` needed: a bf16 value is the top half of an f32, so widening is a 16-bit shift
// (exact). See `weight_f32` for the hooks.

@group(0) @binding(2) var<storage, read> w: array<vec2<u32>>;

fn bf16_lo(word: u32) -> f32 {
    return bitcast<f32>(word << 16u);
}

fn bf16_hi(word: u32) -> f32 {
    return bitcast<f32>(word & 0xffff0000u);
}

fn weight(i: u32) -> f32 {
    let word = w[i >> 2u][(i >> 1u) & 1u];
    return select(bf16_lo(word), bf16_hi(word), (i & 1u) == 1u);
}

fn weight4(i: u32) -> vec4<f32> {
    let q = w[i >> 2u];
    return vec4<f32>(bf16_lo(q.x), bf16_hi(q.x), bf16_lo(q.y), bf16_hi(q.y));
}
