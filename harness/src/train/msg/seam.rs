//! Serde for the backends' seam types that messages carry (`SamplingParams`, `ResumeState`,
//! `Sequence`, `AccumStats`, `OptStats`, `DType`), which have none of their own: serde's
//! remote derives, used as `#[serde(with = "…")]` on the messages' fields. They are checked
//! against the seam types' fields by the compiler and convert nothing by hand; the floats that
//! feed training travel as bit patterns.
use rolloutpipe_backends::{
    AccumStats, DType, GenRequest, OptStats, RequestKey, ResumeState, SamplingParams, Sequence,
};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::bits;
use crate::train::config::WeightDType;

/// [`SamplingParams`], its floats as bit patterns.
#[derive(Serialize, Deserialize)]
#[serde(remote = "SamplingParams")]
pub struct Sampling {
    #[serde(with = "bits")]
    temperature: f32,
    top_k: usize,
    #[serde(with = "bits")]
    top_p: f32,
    max_new_tokens: usize,
    stop_tokens: Vec<u32>,
    seed: u64,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "RequestKey")]
struct Key(u64);

#[derive(Serialize, Deserialize)]
#[serde(remote = "GenRequest")]
struct Request {
    #[serde(with = "Key")]
    id: RequestKey,
    prompt: Vec<u32>,
    #[serde(with = "Sampling")]
    params: SamplingParams,
}

/// [`ResumeState`]: a migrated request's prompt, settings, tokens and stream position.
#[derive(Serialize, Deserialize)]
#[serde(remote = "ResumeState")]
pub struct Resume {
    #[serde(with = "Request")]
    request: GenRequest,
    tokens: Vec<u32>,
    #[serde(with = "bits")]
    logprobs: Vec<f32>,
    stream_words: u128,
}

/// [`AccumStats`]: a micro-batch's (or an optimizer step's) sums.
#[derive(Serialize, Deserialize)]
#[serde(remote = "AccumStats")]
pub struct Accum {
    loss_sum: f64,
    tokens: usize,
    sequences: usize,
    kl_sum: f64,
    entropy_sum: f64,
    clipped: usize,
}

/// [`OptStats`]: what an optimizer step measured.
#[derive(Serialize, Deserialize)]
#[serde(remote = "OptStats")]
pub struct Opt {
    grad_norm: f64,
    clip_scale: f64,
    step: u64,
}

/// `Vec<Sequence>` as `[[prompt, response], …]`.
pub mod sequences {
    use super::*;

    /// Serialises the sequences as (prompt, response) pairs.
    pub fn serialize<S: Serializer>(v: &[Sequence], s: S) -> Result<S::Ok, S::Error> {
        let pairs: Vec<(&[u32], &[u32])> = v
            .iter()
            .map(|q| (q.prompt.as_slice(), q.response.as_slice()))
            .collect();
        pairs.serialize(s)
    }

    /// Reads what [`serialize`] wrote.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Sequence>, D::Error> {
        let pairs = Vec::<(Vec<u32>, Vec<u32>)>::deserialize(d)?;
        Ok(pairs
            .into_iter()
            .map(|(prompt, response)| Sequence { prompt, response })
            .collect())
    }
}

/// A weight [`DType`] by its config name (`f32`, `bf16`, `f16`).
pub mod dtype {
    use super::*;

    /// Serialises the dtype's config name.
    pub fn serialize<S: Serializer>(v: &DType, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&v.name().to_ascii_lowercase())
    }

    /// Reads a config name.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DType, D::Error> {
        Ok(WeightDType::deserialize(d)?.dtype())
    }

    /// f32: what a sender that names no dtype means.
    pub fn f32() -> DType {
        DType::F32
    }
}
