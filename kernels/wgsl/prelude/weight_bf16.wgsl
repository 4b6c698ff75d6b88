// Prelude `weight_bf16`: the weight binding (binding 2) as bfloat16 values packed in pairs,
// value 2j in the low 16 bits of word j and 2j + 1 in the high 16 bits (little-endian, as
// the host writes them); an odd-length tensor's last word has a zero high half. No
// `shader-f16` needed: a bf16 value is the top half of an f32, so widening is a 16-bit shift
// (exact). See `weight_f32` for the hook.

@group(0) @binding(2) var<storage, read> w: array<u32>;

fn weight(i: u32) -> f32 {
    let word = w[i >> 1u];
    return bitcast<f32>(select(word << 16u, word & 0xffff0000u, (i & 1u) == 1u));
}
