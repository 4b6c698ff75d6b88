//! 16-bit weight storage for engine-only models: bf16 or f16, half the memory of f32, read by
//! the forward kernels directly (`cpu::kernel::matmul_nt_{bf16,f16}` widen in registers,
//! exactly).
//!
//! Every parameter is stored in 16 bits in the layout's flat order; the 1-D tensors (RMSNorm
//! weights, a few thousand values per layer) are also kept widened, because the norms read
//! them as slices of the compute type. A 16-bit model computes exactly what an f32 model
//! computes from the same weights rounded to its dtype, bit for bit: only the storage differs.

use std::collections::HashMap;

use half::{bf16, f16};

use super::ops::{Float, Mat};
use crate::error::{BackendError, Result};
use crate::model::Layout;
use crate::seam::tensor::{round_to_bf16, round_to_f16};
use crate::seam::{DType, TensorData};

/// Flat parameters in one 16-bit dtype.
#[derive(Debug, Clone)]
pub enum HalfData {
    /// bfloat16.
    Bf16(Vec<bf16>),
    /// IEEE half precision.
    F16(Vec<f16>),
}

impl HalfData {
    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            HalfData::Bf16(v) => v.len(),
            HalfData::F16(v) => v.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dtype stored.
    pub fn dtype(&self) -> DType {
        match self {
            HalfData::Bf16(_) => DType::Bf16,
            HalfData::F16(_) => DType::F16,
        }
    }

    /// Value `i` widened (exact).
    fn get(&self, i: usize) -> f64 {
        match self {
            HalfData::Bf16(v) => v[i].to_f64(),
            HalfData::F16(v) => v[i].to_f64(),
        }
    }

    /// Every value widened to f32 (a copy; exact).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            HalfData::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
            HalfData::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// Values `r` widened to f32 (a copy; exact).
    pub fn range_f32(&self, r: std::ops::Range<usize>) -> Vec<f32> {
        match self {
            HalfData::Bf16(v) => v[r].iter().map(|x| x.to_f32()).collect(),
            HalfData::F16(v) => v[r].iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// A copy as seam tensor data.
    pub fn to_tensor_data(&self) -> TensorData {
        match self {
            HalfData::Bf16(v) => TensorData::Bf16(v.clone()),
            HalfData::F16(v) => TensorData::F16(v.clone()),
        }
    }

    /// `src` rounded (nearest-even) to `dtype` (Bf16 or F16). A value beyond f16's range
    /// (|x| > 65504) is an error naming it, not a silent infinity.
    pub fn round(src: &[f32], dtype: DType) -> Result<Self> {
        match dtype {
            DType::Bf16 => Ok(HalfData::Bf16(round_to_bf16(src))),
            DType::F16 => {
                let v = round_to_f16(src);
                if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                    return Err(BackendError::invalid(
                        "weight dtype",
                        format!(
                            "parameter value {} (flat index {i}) does not fit in f16 (|x| <= 65504); use BF16",
                            src[i]
                        ),
                    ));
                }
                Ok(HalfData::F16(v))
            }
            DType::F32 => Err(BackendError::invalid(
                "weight dtype",
                "F32 is not a 16-bit storage dtype",
            )),
        }
    }
}

/// A model's parameters in 16 bits, with its 1-D tensors widened.
#[derive(Debug, Clone)]
pub struct HalfStore<T> {
    /// Every parameter, at the layout's offsets.
    pub data: HalfData,
    /// The 1-D tensors widened to the compute type, concatenated.
    small: Vec<T>,
    /// Start in `small` of each 1-D tensor, by its layout offset.
    small_at: HashMap<usize, usize>,
}

impl<T: Float> HalfStore<T> {
    /// Storage for `layout` from its flat 16-bit values.
    pub fn new(layout: &Layout, data: HalfData) -> Result<Self> {
        if data.len() != layout.total {
            return Err(BackendError::shape(
                "16-bit parameters",
                layout.total,
                data.len(),
            ));
        }
        let mut small = Vec::new();
        let mut small_at = HashMap::new();
        for e in layout.entries.iter().filter(|e| e.shape.len() == 1) {
            small_at.insert(e.offset, small.len());
            small.extend((e.offset..e.offset + e.len).map(|i| T::from_f64(data.get(i))));
        }
        Ok(Self {
            data,
            small,
            small_at,
        })
    }

    /// The tensor at `off..off + len` as the forward kernels read it.
    pub fn mat(&self, off: usize, len: usize) -> Mat<'_, T> {
        match &self.data {
            HalfData::Bf16(v) => Mat::Bf16(&v[off..off + len]),
            HalfData::F16(v) => Mat::F16(&v[off..off + len]),
        }
    }

    /// The widened 1-D tensor at layout offset `off` (`len` values).
    ///
    /// # Panics
    /// When no 1-D tensor starts at `off` (a bug in the caller: offsets come from the layout).
    pub fn small(&self, off: usize, len: usize) -> &[T] {
        let at = self.small_at[&off];
        &self.small[at..at + len]
    }

    /// Bytes held (16-bit values plus the widened 1-D tensors).
    pub fn bytes(&self) -> usize {
        self.data.len() * 2 + self.small.len() * std::mem::size_of::<T>()
    }
}
