//! Dtype-tagged host tensors: what crosses the seam when weights cannot stay on a device.
//!
//! Engines may store weights in bf16 or f16; the trainer keeps f32 master weights and f32
//! AdamW moments. A [`TypedTensor`] says which it holds, so a conversion happens once, where
//! the two sides meet, instead of widening everything to f32 at every hop.

use half::{bf16, f16};

use crate::error::{BackendError, Result};

/// Storage type of a tensor (serde: `"f32"`, `"bf16"`, `"f16"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// bfloat16: f32's exponent, 8 bits of mantissa.
    Bf16,
    /// IEEE binary16.
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }

    /// The safetensors / torch spelling (`"F32"`, `"BF16"`, `"F16"`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::Bf16 => "BF16",
            DType::F16 => "F16",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Elements of one storage type.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 values.
    Bf16(Vec<bf16>),
    /// f16 values.
    F16(Vec<f16>),
}

impl TensorData {
    /// f32 values converted to `dtype`, rounding to nearest-even (`half`'s conversion).
    pub fn from_f32(data: &[f32], dtype: DType) -> Self {
        match dtype {
            DType::F32 => TensorData::F32(data.to_vec()),
            DType::Bf16 => TensorData::Bf16(round_to_bf16(data)),
            DType::F16 => TensorData::F16(round_to_f16(data)),
        }
    }

    /// The storage type.
    pub fn dtype(&self) -> DType {
        match self {
            TensorData::F32(_) => DType::F32,
            TensorData::Bf16(_) => DType::Bf16,
            TensorData::F16(_) => DType::F16,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorData::F32(v) => v.len(),
            TensorData::Bf16(v) => v.len(),
            TensorData::F16(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes the values, widened to f32 (exact for every storage type), into `out`.
    pub fn write_f32(&self, out: &mut [f32]) -> Result<()> {
        if out.len() != self.len() {
            return Err(BackendError::shape("tensor data", out.len(), self.len()));
        }
        match self {
            TensorData::F32(v) => out.copy_from_slice(v),
            TensorData::Bf16(v) => out.iter_mut().zip(v).for_each(|(o, x)| *o = x.to_f32()),
            TensorData::F16(v) => out.iter_mut().zip(v).for_each(|(o, x)| *o = x.to_f32()),
        }
        Ok(())
    }

    /// The values widened to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        // Lengths agree by construction.
        let _ = self.write_f32(&mut out);
        out
    }

    /// The same values in `dtype` (a copy when it already is).
    pub fn to_dtype(&self, dtype: DType) -> Self {
        match (self, dtype) {
            (TensorData::F32(v), d) => Self::from_f32(v, d),
            (d, t) if d.dtype() == t => d.clone(),
            (d, t) => Self::from_f32(&d.to_f32(), t),
        }
    }
}

/// Rounds f32 values to bf16 (nearest-even), in parallel chunks.
pub fn round_to_bf16(src: &[f32]) -> Vec<bf16> {
    round_with(src, bf16::ZERO, bf16::from_f32)
}

/// Rounds f32 values to f16 (nearest-even; beyond ±65504 gives ±inf), in parallel chunks.
pub fn round_to_f16(src: &[f32]) -> Vec<f16> {
    round_with(src, f16::ZERO, f16::from_f32)
}

fn round_with<H: Copy + Send + Sync>(src: &[f32], zero: H, f: impl Fn(f32) -> H + Sync) -> Vec<H> {
    use rayon::prelude::*;
    let mut out = vec![zero; src.len()];
    out.par_chunks_mut(1 << 16)
        .zip(src.par_chunks(1 << 16))
        .for_each(|(o, s)| {
            for (o, x) in o.iter_mut().zip(s) {
                *o = f(*x);
            }
        });
    out
}

/// A dense row-major tensor with its storage type.
#[derive(Debug, Clone, PartialEq)]
pub struct TypedTensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` elements.
    pub data: TensorData,
}

impl TypedTensor {
    /// A tensor, checking that `data` fills `shape`.
    pub fn new(shape: Vec<usize>, data: TensorData) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(BackendError::shape(
                "tensor data",
                format!("{n} values for shape {shape:?}"),
                data.len(),
            ));
        }
        Ok(Self { shape, data })
    }

    /// The storage type.
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_round_to_nearest_even_and_widen_exactly() {
        // 1 + 2^-8 is halfway between two bf16 values: ties go to the even one (1.0);
        // 1 + 3·2^-8 rounds up to 1 + 2^-6.
        let x = [
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            -2.5,
            65504.0,
        ];
        let b = TensorData::from_f32(&x, DType::Bf16);
        assert_eq!(b.dtype(), DType::Bf16);
        assert_eq!(b.to_f32(), vec![1.0, 1.0 + 2f32.powi(-6), -2.5, 65536.0]);
        let h = TensorData::from_f32(&x, DType::F16);
        assert_eq!(h.to_f32()[2..], [-2.5, 65504.0]);
        // Widening then narrowing again is the identity.
        assert_eq!(b.to_dtype(DType::F32).to_dtype(DType::Bf16), b);
        assert_eq!(h.to_dtype(DType::Bf16).dtype(), DType::Bf16);
        assert_eq!(DType::Bf16.size() + DType::F32.size(), 6);
    }

    #[test]
    fn shape_must_match_data() {
        let e = TypedTensor::new(vec![2, 3], TensorData::F32(vec![0.0; 5])).unwrap_err();
        assert!(e.to_string().contains("6 values"), "{e}");
        let t = TypedTensor::new(vec![2], TensorData::from_f32(&[1.0, 2.0], DType::F16)).unwrap();
        assert_eq!(t.dtype(), DType::F16);
        let mut short = [0.0; 1];
        assert!(t.data.write_f32(&mut short).is_err());
    }
}
