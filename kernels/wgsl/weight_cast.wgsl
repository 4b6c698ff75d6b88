// weight_cast: an f32 tensor rounded to bf16 or f16 on the device, for a same-device weight
// sync from an f32 trainer to a 16-bit engine (no trip through the host). The rounding is the
// CPU reference's (`cpu::store::round_to_bf16` / `round_to_f16`, i.e. the `half` crate's
// from_f32): nearest-even, in integer arithmetic so that no driver's float conversion (WGSL
// leaves its rounding to the implementation) can change a bit.
//   weight_cast        thread j packs values 2j and 2j + 1 into dst[j] (the even one in the
//                      low half; a missing odd value is 0), as `ops::pack_half` does;
//   weight_cast_round  thread i writes value i rounded, then widened back to f32 exactly
//                      (a 16-bit model's 1-D tensors, which it keeps as f32 values).
// f16 only: a result that is not finite (|x| past 65,504, or an infinite or NaN input) sets
// overflow[p.tensor], so that the host refuses the sync naming the tensor, as the host path
// does.

struct Params {
    n: u32,
    mode: u32,   // 0: bf16, 1: f16
    tensor: u32, // index into overflow
    _p: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;
@group(0) @binding(3) var<storage, read_write> overflow: array<atomic<u32>>;

// half::bf16::from_f32.
fn cast_bf16(v: f32) -> u32 {
    let x = bitcast<u32>(v);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (x >> 16u) | 0x0040u; // NaN stays NaN (quiet)
    }
    let r = 0x8000u;
    if ((x & r) != 0u && (x & (3u * r - 1u)) != 0u) {
        return (x >> 16u) + 1u;
    }
    return x >> 16u;
}

// half's f32 -> f16 (its software path; the F16C instruction it may use rounds the same).
fn cast_f16(v: f32) -> u32 {
    let x = bitcast<u32>(v);
    let sign = (x & 0x80000000u) >> 16u;
    let exp = x & 0x7f800000u;
    let man = x & 0x007fffffu;
    if (exp == 0x7f800000u) {
        return sign | 0x7c00u | select(0u, 0x0200u, man != 0u) | (man >> 13u);
    }
    let he = i32(exp >> 23u) - 127 + 15;
    if (he >= 0x1f) {
        return sign | 0x7c00u;
    }
    if (he <= 0) {
        if (14 - he > 24) {
            return sign;
        }
        let m = man | 0x00800000u;
        var hm = m >> u32(14 - he);
        let r = 1u << u32(13 - he);
        if ((m & r) != 0u && (m & (3u * r - 1u)) != 0u) {
            hm += 1u;
        }
        return sign | hm;
    }
    let h = sign | (u32(he) << 10u) | (man >> 13u);
    let r = 0x1000u;
    if ((man & r) != 0u && (man & (3u * r - 1u)) != 0u) {
        return h + 1u;
    }
    return h;
}

// The 16-bit bits of v in p.mode, flagging an f16 result that is not finite.
fn cast_to(v: f32) -> u32 {
    if (p.mode == 0u) {
        return cast_bf16(v);
    }
    let h = cast_f16(v);
    if ((h & 0x7c00u) == 0x7c00u) {
        atomicOr(&overflow[p.tensor], 1u);
    }
    return h;
}

// The f32 bits of 16-bit bits h in p.mode, exactly.
fn widen(h: u32) -> u32 {
    if (p.mode == 0u) {
        return h << 16u;
    }
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    var m = h & 0x3ffu;
    if (e == 0u) {
        if (m == 0u) {
            return sign;
        }
        var e2 = 113u; // a subnormal m·2^-24, normalised
        for (var s = 0u; s < 10u && (m & 0x400u) == 0u; s++) {
            m = m << 1u;
            e2 -= 1u;
        }
        return sign | (e2 << 23u) | ((m & 0x3ffu) << 13u);
    }
    if (e == 0x1fu) {
        return sign | 0x7f800000u | (m << 13u);
    }
    return sign | ((e + 112u) << 23u) | (m << 13u);
}

@compute @workgroup_size(256)
fn weight_cast(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let j = gid.x + gid.y * nwg.x * 256u;
    if (2u * j >= p.n) {
        return;
    }
    let lo = cast_to(src[2u * j]);
    var hi = 0u;
    if (2u * j + 1u < p.n) {
        hi = cast_to(src[2u * j + 1u]);
    }
    dst[j] = lo | (hi << 16u);
}

@compute @workgroup_size(256)
fn weight_cast_round(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= p.n) {
        return;
    }
    dst[i] = widen(cast_to(src[i]));
}
