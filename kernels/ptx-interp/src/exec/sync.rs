//! Warp-wide instructions: `shfl.sync`, `ldmatrix` and `mma.sync` (m16n8k16, bf16/f16
//! inputs, f32 accumulators), with the fragment layouts of the PTX ISA.

use crate::error::FaultKind;
use crate::exec::Block;
use crate::exec::warp::{Warp, for_lanes, lanes_str};
use crate::float::{self, F16};
use crate::ir::{Addr, Reg, ShflMode, Src};

/// `shfl.sync` on the lanes of `exec`; every lane it reads from must execute it too.
#[allow(clippy::too_many_arguments)]
pub(crate) fn shfl(
    w: &mut Warp,
    exec: u32,
    mode: ShflMode,
    d: Reg,
    p: Option<Reg>,
    a: Src,
    b: Src,
    c: Src,
) -> Result<(), (usize, FaultKind)> {
    let mut out = [(0u64, false); 32];
    let mut m = exec;
    while m != 0 {
        let l = m.trailing_zeros() as usize;
        m &= m - 1;
        let (bv, cv) = (w.get(b, l) as u32 & 31, w.get(c, l) as u32);
        let (clamp, seg) = (cv & 31, (cv >> 8) & 31);
        let lane = l as i32;
        let max_lane = ((l as u32 & seg) | (clamp & !seg)) as i32;
        let min_lane = (l as u32 & seg) as i32;
        let (j, ok) = match mode {
            ShflMode::Up => (lane - bv as i32, lane - bv as i32 >= max_lane),
            ShflMode::Down => (lane + bv as i32, lane + bv as i32 <= max_lane),
            ShflMode::Bfly => (lane ^ bv as i32, (lane ^ bv as i32) <= max_lane),
            ShflMode::Idx => {
                let j = min_lane | (bv & !seg) as i32;
                (j, j <= max_lane)
            }
        };
        let j = if ok { j as usize } else { l };
        if exec >> j & 1 == 0 {
            return Err((
                l,
                FaultKind::WarpSync(format!(
                    "shfl.sync in lane {l} reads lane {j}, which does not execute it"
                )),
            ));
        }
        out[l] = (w.get(a, j), ok);
    }
    for_lanes(exec, |l| {
        w.set(d, l, out[l].0 & 0xffff_ffff);
        if let Some(p) = p {
            w.set(p, l, out[l].1 as u64);
        }
    });
    Ok(())
}

impl Block<'_> {
    /// `ldmatrix.sync.aligned.m8n8.x{n}{.trans}.shared.b16`: lanes 8i..8i+7 give the row
    /// addresses of matrix i; lane l receives row l/4, columns 2(l%4) and 2(l%4)+1 of each
    /// matrix (of its transpose with `.trans`), the lower column in the low half.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ldmatrix(
        &mut self,
        w: &mut Warp,
        exec: u32,
        pc: u32,
        n: u8,
        trans: bool,
        d: [Reg; 4],
        addr: Addr,
    ) -> Result<(), (usize, FaultKind)> {
        let mut rows = [[[0u16; 8]; 8]; 4];
        for (i, matrix) in rows.iter_mut().enumerate().take(n as usize) {
            for (r, row) in matrix.iter_mut().enumerate() {
                let l = i * 8 + r;
                let base = addr.base.map_or(0, |b| w.regs[(b as usize) << 5 | l]);
                let a = base.wrapping_add(addr.off as u64);
                if !a.is_multiple_of(16) {
                    return Err((
                        l,
                        FaultKind::Misaligned {
                            space: "shared",
                            addr: a,
                            align: 16,
                        },
                    ));
                }
                let mut buf = [0u8; 16];
                let insts = &self.spec.entry.insts;
                self.shared
                    .read(a, &mut buf, (w.id * 32 + l as u32) as u16, pc, &|p| {
                        insts[p as usize].line
                    })
                    .map_err(|k| (l, k))?;
                for (c, v) in row.iter_mut().enumerate() {
                    *v = u16::from_le_bytes([buf[2 * c], buf[2 * c + 1]]);
                }
            }
        }
        for_lanes(exec, |l| {
            let (r, c) = (l / 4, 2 * (l % 4));
            for i in 0..n as usize {
                let (lo, hi) = if trans {
                    (rows[i][c][r], rows[i][c + 1][r])
                } else {
                    (rows[i][r][c], rows[i][r][c + 1])
                };
                w.set(d[i], l, lo as u64 | (hi as u64) << 16);
            }
        });
        Ok(())
    }
}

fn half_to_f64(h: u64, bf16: bool) -> f64 {
    if bf16 {
        f32::from_bits((h as u32 & 0xffff) << 16) as f64
    } else {
        float::to_f64(h & 0xffff, F16)
    }
}

/// `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32`: D = A.B + C with
/// groupID g = lane/4, t = lane%4: a0 = A[g][2t..2t+2], a1 = A[g+8][2t..], a2 = A[g][2t+8..],
/// a3 = A[g+8][2t+8..]; b0 = B[2t..2t+2][g], b1 = B[2t+8..2t+10][g]; c0..c3 = C[g][2t],
/// C[g][2t+1], C[g+8][2t], C[g+8][2t+1]. Products are exact and each output's 16 products
/// and accumulator are summed in f64, then rounded once to f32 (hardware's internal order
/// and rounding are not specified; results agree to about an f32 ulp of the sum).
pub(crate) fn mma(w: &mut Warp, bf16: bool, d: [Reg; 4], a: [Src; 4], b: [Src; 2], c: [Src; 4]) {
    let mut am = [[0f64; 16]; 16];
    let mut bm = [[0f64; 8]; 16];
    let mut cm = [[0f64; 8]; 16];
    for l in 0..32 {
        let (g, t) = (l / 4, l % 4);
        for (k, (r, col)) in [
            (g, 2 * t),
            (g + 8, 2 * t),
            (g, 2 * t + 8),
            (g + 8, 2 * t + 8),
        ]
        .into_iter()
        .enumerate()
        {
            let v = w.get(a[k], l);
            am[r][col] = half_to_f64(v, bf16);
            am[r][col + 1] = half_to_f64(v >> 16, bf16);
        }
        for (k, row) in [2 * t, 2 * t + 8].into_iter().enumerate() {
            let v = w.get(b[k], l);
            bm[row][g] = half_to_f64(v, bf16);
            bm[row + 1][g] = half_to_f64(v >> 16, bf16);
        }
        for (k, (r, col)) in [
            (g, 2 * t),
            (g, 2 * t + 1),
            (g + 8, 2 * t),
            (g + 8, 2 * t + 1),
        ]
        .into_iter()
        .enumerate()
        {
            cm[r][col] = f32::from_bits(w.get(c[k], l) as u32) as f64;
        }
    }
    for l in 0..32 {
        let (g, t) = (l / 4, l % 4);
        for (k, (r, col)) in [
            (g, 2 * t),
            (g, 2 * t + 1),
            (g + 8, 2 * t),
            (g + 8, 2 * t + 1),
        ]
        .into_iter()
        .enumerate()
        {
            let sum: f64 = (0..16).map(|kk| am[r][kk] * bm[kk][col]).sum::<f64>() + cm[r][col];
            w.set(d[k], l, float::canon(sum as f32) as u64);
        }
    }
}

/// Lanes named by a warp-synchronous instruction that are not in `have`, for messages.
pub(crate) fn missing(need: u32, have: u32) -> String {
    lanes_str(need & !have)
}
