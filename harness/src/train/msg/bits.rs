//! Floats as their bit patterns, for `#[serde(with = "bits")]`: exact through JSON, NaN and
//! signed zero included, for every value that feeds training (log-probs, rewards, sampling
//! settings), so that a remote or resumed run trains on exactly the values an in-process one
//! would.
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A value whose floats travel as bit patterns.
pub trait Bits: Sized {
    /// Its form with every `f32` as a `u32`.
    type Repr: Serialize + DeserializeOwned;
    /// To the bit-pattern form.
    fn to_bits(&self) -> Self::Repr;
    /// From the bit-pattern form.
    fn from_bits(r: Self::Repr) -> Self;
}

impl Bits for f32 {
    type Repr = u32;
    fn to_bits(&self) -> u32 {
        f32::to_bits(*self)
    }
    fn from_bits(r: u32) -> Self {
        f32::from_bits(r)
    }
}

impl<T: Bits> Bits for Vec<T> {
    type Repr = Vec<T::Repr>;
    fn to_bits(&self) -> Self::Repr {
        self.iter().map(Bits::to_bits).collect()
    }
    fn from_bits(r: Self::Repr) -> Self {
        r.into_iter().map(T::from_bits).collect()
    }
}

impl<T: Bits> Bits for Option<T> {
    type Repr = Option<T::Repr>;
    fn to_bits(&self) -> Self::Repr {
        self.as_ref().map(Bits::to_bits)
    }
    fn from_bits(r: Self::Repr) -> Self {
        r.map(T::from_bits)
    }
}

/// Serialises `v` with its floats as bit patterns.
pub fn serialize<T: Bits, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    v.to_bits().serialize(s)
}

/// Reads what [`serialize`] wrote.
pub fn deserialize<'de, T: Bits, D: Deserializer<'de>>(d: D) -> Result<T, D::Error> {
    T::Repr::deserialize(d).map(T::from_bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Doc {
        #[serde(with = "super")]
        one: f32,
        #[serde(with = "super")]
        nested: Option<Vec<Vec<f32>>>,
    }

    #[test]
    fn floats_cross_json_bit_exact() {
        // Values whose shortest decimal form would not survive an f64 detour, NaN included.
        let odd = [
            f32::from_bits(0x3f80_0001),
            -1.0e-38,
            f32::MIN_POSITIVE / 3.0,
            f32::NAN,
            -0.0,
        ];
        let doc = Doc {
            one: f32::from_bits(0x7fc0_0001),
            nested: Some(vec![odd.to_vec(), vec![]]),
        };
        let back: Doc = serde_json::from_str(&serde_json::to_string(&doc).unwrap()).unwrap();
        assert_eq!(back.one.to_bits(), doc.one.to_bits());
        assert_eq!(back.nested.to_bits(), doc.nested.to_bits());
        let none = Doc {
            one: 1.0,
            nested: None,
        };
        let json = serde_json::to_string(&none).unwrap();
        assert_eq!(json, r#"{"one":1065353216,"nested":null}"#);
    }
}
