//! The wgpu GEMMs' launch paths give the same bits: the decode GEMV and the tiled GEMM, and
//! vector (`vec4`) and scalar operand loads, in every weight format, forward and backward.
//! What they compute is checked against the CPU reference in `conformance.rs`; here only that
//! a path chosen for speed changes no bit of it.
#![cfg(feature = "wgpu")]

#[path = "support/check.rs"]
#[allow(dead_code)]
mod check;
#[path = "support/device.rs"]
mod device;

use check::rand_vec;
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::SeedableRng;
use rolloutpipe_backends::wgpu::{Exec, Gpu, ops};
use rolloutpipe_kernels::WeightFormat;

/// The first differing element of two bit patterns, for the failure message.
fn first_diff(got: &[u32], want: &[u32]) -> Option<(usize, f32, f32)> {
    (0..got.len().max(want.len()))
        .find(|&i| got.get(i) != want.get(i))
        .map(|i| {
            let f = |v: &[u32]| v.get(i).map_or(f32::NAN, |b| f32::from_bits(*b));
            (i, f(got), f(want))
        })
}

/// The decode GEMV (`matmul_fwd_gemv`, ≤ 8 rows, K split across lanes) gives each row the bits
/// the tiled GEMM gives it in a 20-row product: both add the same 64-wide chunks of K in the
/// same order. The inner dimensions cover one partial chunk, K not a multiple of the tiled
/// body's 8-step, exactly one chunk, one chunk and a bit, and more than one 16-chunk round of
/// the GEMV's lanes (1,100: 18 chunks; 3,072: 48), at each lane count (1, 8, 16) whatever the
/// adapter would pick.
#[test]
fn wgpu_gemv_matches_tiled_gemm_bits() {
    let Some(g) = device::gpu() else { return };
    let mut ex = Exec::new(std::sync::Arc::clone(&g));
    let mut rng = ChaCha8Rng::seed_from_u64(47);
    let rows = 20usize;
    assert!(rows > ops::MATMUL_ROWS_MAX);
    for &(din, dout) in &[
        (1usize, 5usize),
        (7, 17),
        (63, 16),
        (64, 40),
        (65, 300),
        (1100, 23),
        (3072, 20),
    ] {
        let x = rand_vec(&mut rng, rows * din, 1.0);
        let w = g.upload("w", &rand_vec(&mut rng, dout * din, 1.0));
        let (xb, yb) = (g.upload("x", &x), g.buffer("y", rows * dout));
        ops::matmul_fwd(&mut ex, &yb, &xb, &w, rows, din, dout, false);
        ex.submit().expect("submit");
        let full = g.read::<u32>(&yb, rows * dout).expect("read");
        for lanes in [1, 8, 16] {
            ex.force_gemv_lanes(Some(lanes));
            for &(first, m) in &[(0usize, 1usize), (5, 3), (12, 8)] {
                let part = g.upload("x rows", &x[first * din..(first + m) * din]);
                let yp = g.buffer("y rows", m * dout);
                ops::matmul_fwd(&mut ex, &yp, &part, &w, m, din, dout, false);
                ex.submit().expect("submit");
                let got = g.read::<u32>(&yp, m * dout).expect("read");
                let want = &full[first * dout..(first + m) * dout];
                if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
                    panic!(
                        "{din}x{dout}, {lanes} lanes: rows {first}..{} element {i}: gemv {} vs tiled {}",
                        first + m,
                        f32::from_bits(got[i]),
                        f32::from_bits(want[i])
                    );
                }
            }
        }
        ex.force_gemv_lanes(None);
    }
}

/// `W` in `format` on the device, and the f32 values it holds (16-bit formats round `w`).
fn upload_weight(g: &Gpu, w: &[f32], format: WeightFormat) -> wgpu::Buffer {
    match format {
        WeightFormat::F32 => g.upload("w", w),
        WeightFormat::Bf16 => {
            let h: Vec<u16> = w
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            g.upload("w bf16", &ops::pack_half(&h))
        }
        WeightFormat::F16 => {
            let h: Vec<u16> = w
                .iter()
                .map(|&v| half::f16::from_f32(v).to_bits())
                .collect();
            g.upload("w f16", &ops::pack_half(&h))
        }
    }
}

/// Vector loads stage exactly the values scalar loads stage, so every output has the same
/// bits either way: the forward GEMM (tiled, at 20 and 65 rows) and its decode GEMV (3 rows)
/// in f32, bf16 and f16 weights, onto zeros and accumulated, and the backward's dx and dW, at
/// inner dimensions that are whole vectors but not whole tiles or K-steps (4, 68, 132, 300)
/// and one long K (3,072), with output edges that are not whole tiles either.
#[test]
fn wgpu_vector_loads_match_scalar_bits() {
    let Some(g) = device::gpu() else { return };
    let mut ex = Exec::new(std::sync::Arc::clone(&g));
    let mut rng = ChaCha8Rng::seed_from_u64(53);
    let run = |ex: &mut Exec, scalar: bool, f: &mut dyn FnMut(&mut Exec) -> Vec<u32>| {
        ex.force_scalar_loads(scalar);
        let out = f(ex);
        ex.force_scalar_loads(false);
        out
    };
    for format in WeightFormat::ALL.iter().copied() {
        for &(rows, din, dout) in &[
            (3usize, 4usize, 5usize),
            (20, 68, 67),
            (65, 132, 130),
            (3, 300, 256),
            (20, 3072, 20),
        ] {
            let x = g.upload("x", &rand_vec(&mut rng, rows * din, 1.0));
            let w = upload_weight(&g, &rand_vec(&mut rng, dout * din, 1.0), format);
            let y0 = rand_vec(&mut rng, rows * dout, 1.0);
            for accumulate in [false, true] {
                let mut fwd = |ex: &mut Exec| {
                    let y = g.upload("y", &y0);
                    ops::matmul_fwd_as(ex, &y, &x, &w, format, rows, din, dout, accumulate);
                    ex.submit().expect("submit");
                    g.read::<u32>(&y, rows * dout).expect("read")
                };
                let vector = run(&mut ex, false, &mut fwd);
                let scalar = run(&mut ex, true, &mut fwd);
                if let Some((i, a, b)) = first_diff(&vector, &scalar) {
                    panic!(
                        "{format:?} {rows}x{din}->{dout} accumulate {accumulate}: y[{i}] vector {a} vs scalar {b}"
                    );
                }
                assert!(vector.iter().any(|&b| b != 0), "y was computed");
            }
        }
    }
    // The backward vectorises only where rows, din and dout are all whole vectors.
    for &(rows, din, dout) in &[
        (4usize, 4usize, 4usize),
        (68, 132, 76),
        (128, 64, 200),
        (20, 300, 8),
    ] {
        let x = g.upload("x", &rand_vec(&mut rng, rows * din, 1.0));
        let w = g.upload("w", &rand_vec(&mut rng, dout * din, 1.0));
        let dy = g.upload("dy", &rand_vec(&mut rng, rows * dout, 1.0));
        let (dx0, dw0) = (
            rand_vec(&mut rng, rows * din, 1.0),
            rand_vec(&mut rng, dout * din, 1.0),
        );
        let mut bwd = |ex: &mut Exec| {
            let (dx, dw) = (g.upload("dx", &dx0), g.upload("dw", &dw0));
            ops::matmul_bwd(ex, Some((&dx, true)), &dw, &dy, &x, &w, rows, din, dout);
            ex.submit().expect("submit");
            let mut out = g.read::<u32>(&dx, rows * din).expect("read dx");
            out.extend(g.read::<u32>(&dw, dout * din).expect("read dw"));
            out
        };
        let vector = run(&mut ex, false, &mut bwd);
        let scalar = run(&mut ex, true, &mut bwd);
        if let Some((i, a, b)) = first_diff(&vector, &scalar) {
            let which = if i < rows * din { "dx" } else { "dW" };
            panic!("backward {rows}x{din}->{dout}: {which} (flat {i}) vector {a} vs scalar {b}");
        }
    }
}
