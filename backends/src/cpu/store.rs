//! bf16 weight storage for engine-only models: half the memory of f32, read by the forward
//! kernels directly (`cpu::kernel::matmul_nt_bf16` widens in registers, exactly).
//!
//! Every parameter is stored in bf16 in the layout's flat order; the 1-D tensors (RMSNorm
//! weights, a few thousand values per layer) are also kept widened, because the norms read
//! them as slices of the compute type. A bf16 model computes exactly what an f32 model computes
//! from the same weights rounded to bf16, bit for bit: only the storage differs.

use std::collections::HashMap;

use half::bf16;

use super::model::Layout;
use super::ops::Float;
use crate::error::{BackendError, Result};

/// A model's parameters in bf16, with its 1-D tensors widened.
#[derive(Debug, Clone)]
pub struct HalfStore<T> {
    /// Every parameter in bf16, at the layout's offsets.
    pub data: Vec<bf16>,
    /// The 1-D tensors widened to the compute type, concatenated.
    small: Vec<T>,
    /// Start in `small` of each 1-D tensor, by its layout offset.
    small_at: HashMap<usize, usize>,
}

impl<T: Float> HalfStore<T> {
    /// Storage for `layout` from its flat bf16 values.
    pub fn new(layout: &Layout, data: Vec<bf16>) -> Result<Self> {
        if data.len() != layout.total {
            return Err(BackendError::shape(
                "bf16 parameters",
                layout.total,
                data.len(),
            ));
        }
        let mut small = Vec::new();
        let mut small_at = HashMap::new();
        for e in layout.entries.iter().filter(|e| e.shape.len() == 1) {
            small_at.insert(e.offset, small.len());
            small.extend(
                data[e.offset..e.offset + e.len]
                    .iter()
                    .map(|x| T::from_f64(x.to_f64())),
            );
        }
        Ok(Self {
            data,
            small,
            small_at,
        })
    }

    /// The widened 1-D tensor at layout offset `off` (`len` values).
    ///
    /// # Panics
    /// When no 1-D tensor starts at `off` (a bug in the caller: offsets come from the layout).
    pub fn small(&self, off: usize, len: usize) -> &[T] {
        let at = self.small_at[&off];
        &self.small[at..at + len]
    }

    /// Bytes held (bf16 values plus the widened 1-D tensors).
    pub fn bytes(&self) -> usize {
        self.data.len() * 2 + self.small.len() * std::mem::size_of::<T>()
    }
}

/// Rounds f32 values to bf16 (nearest-even), in parallel chunks.
pub fn round_to_bf16(src: &[f32]) -> Vec<bf16> {
    use rayon::prelude::*;
    let mut out = vec![bf16::ZERO; src.len()];
    out.par_chunks_mut(1 << 16)
        .zip(src.par_chunks(1 << 16))
        .for_each(|(o, s)| {
            for (o, x) in o.iter_mut().zip(s) {
                *o = bf16::from_f32(*x);
            }
        });
    out
}
