//! The frame every remote message travels in, between the scheduler's proxies
//! (`remote::Forwarding`) and the remote hosts: a JSON header (serde_json: the message, one of
//! `remote::protocol`'s) followed by binary parts.
//!
//! ```text
//! b"RPW1" | u32 LE: parts n | n × u64 LE: part lengths | part 0: JSON header | parts 1..n
//! ```
//!
//! Weights and AdamW moments travel as safetensors blobs (the layout the trainer exports and
//! checkpoints use), so nothing bulky goes through JSON. Decoding never panics: a short,
//! oversized or malformed frame is a [`WireError`].
use rolloutpipe_backends::optim::AdamState;
use rolloutpipe_backends::{Tensor, Weights};
use serde::Serialize;
use serde::de::DeserializeOwned;

const MAGIC: &[u8; 4] = b"RPW1";
/// More parts than any message has; a frame claiming more is refused before allocating.
const MAX_PARTS: u32 = 16;

/// Why a frame could not be read.
#[derive(Debug)]
pub enum WireError {
    /// Too short for what it claims, or does not start with the magic.
    Frame(&'static str),
    /// The JSON header does not parse as the expected message.
    Header(serde_json::Error),
    /// A part the message needs is missing.
    Missing(&'static str),
    /// A safetensors part does not load.
    Blob {
        /// Which part.
        what: &'static str,
        /// Why.
        why: String,
    },
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::Frame(why) => write!(f, "not a RolloutPipe wire frame: {why}"),
            WireError::Header(e) => write!(f, "bad message header: {e}"),
            WireError::Missing(what) => write!(f, "message is missing its {what} part"),
            WireError::Blob { what, why } => write!(f, "bad {what} blob: {why}"),
        }
    }
}

impl std::error::Error for WireError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            WireError::Header(e) => Some(e),
            _ => None,
        }
    }
}

impl From<serde_json::Error> for WireError {
    fn from(e: serde_json::Error) -> Self {
        WireError::Header(e)
    }
}

/// Frames `header` (as JSON) and `parts`.
pub fn encode<T: Serialize>(header: &T, parts: &[&[u8]]) -> Vec<u8> {
    // Serialising our own message types cannot fail (no maps with non-string keys, no
    // non-finite floats: those travel as bits).
    let head = serde_json::to_vec(header).unwrap_or_default();
    let n = 1 + parts.len();
    let total = 8 + 8 * n + head.len() + parts.iter().map(|p| p.len()).sum::<usize>();
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(n as u32).to_le_bytes());
    out.extend_from_slice(&(head.len() as u64).to_le_bytes());
    for p in parts {
        out.extend_from_slice(&(p.len() as u64).to_le_bytes());
    }
    out.extend_from_slice(&head);
    for p in parts {
        out.extend_from_slice(p);
    }
    out
}

/// Reads a frame: its header as `T` and its binary parts (borrowed from `bytes`).
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<(T, Vec<&[u8]>), WireError> {
    if bytes.len() < 8 || &bytes[..4] != MAGIC {
        return Err(WireError::Frame("no RPW1 magic"));
    }
    let n = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    if n == 0 || n > MAX_PARTS {
        return Err(WireError::Frame("part count out of range"));
    }
    let table_end = 8 + 8 * n as usize;
    let table = bytes
        .get(8..table_end)
        .ok_or(WireError::Frame("truncated part table"))?;
    let mut parts = Vec::with_capacity(n as usize);
    let mut at = table_end;
    for len in table.chunks_exact(8) {
        let mut b = [0u8; 8];
        b.copy_from_slice(len);
        let len = usize::try_from(u64::from_le_bytes(b))
            .map_err(|_| WireError::Frame("part length out of range"))?;
        let end = at
            .checked_add(len)
            .ok_or(WireError::Frame("part length out of range"))?;
        parts.push(
            bytes
                .get(at..end)
                .ok_or(WireError::Frame("truncated part"))?,
        );
        at = end;
    }
    if at != bytes.len() {
        return Err(WireError::Frame("trailing bytes after the last part"));
    }
    let header = serde_json::from_slice(parts[0])?;
    parts.remove(0);
    Ok((header, parts))
}

/// Weights as a safetensors blob.
pub fn weights_blob(w: &Weights) -> anyhow::Result<Vec<u8>> {
    Ok(w.to_safetensors_bytes()?)
}

/// Weights from a safetensors blob.
pub fn weights_from(blob: &[u8], what: &'static str) -> Result<Weights, WireError> {
    Weights::from_safetensors_bytes(blob, what).map_err(|e| WireError::Blob {
        what,
        why: e.to_string(),
    })
}

/// AdamW moments as a safetensors blob (`adam.m`, `adam.v`; the step count goes in the header,
/// since f32 cannot hold every u64).
pub fn adam_blob(a: &AdamState) -> anyhow::Result<Vec<u8>> {
    let mut o = Weights::default();
    o.tensors
        .insert("adam.m".into(), Tensor::new(vec![a.m.len()], a.m.clone())?);
    o.tensors
        .insert("adam.v".into(), Tensor::new(vec![a.v.len()], a.v.clone())?);
    Ok(o.to_safetensors_bytes()?)
}

/// AdamW moments from [`adam_blob`]'s blob and the step count.
pub fn adam_from(blob: &[u8], step: u64) -> Result<AdamState, WireError> {
    let o = weights_from(blob, "optimizer")?;
    let get = |k: &str| {
        o.get(k)
            .map(|t| t.data.clone())
            .map_err(|e| WireError::Blob {
                what: "optimizer",
                why: e.to_string(),
            })
    };
    Ok(AdamState {
        m: get("adam.m")?,
        v: get("adam.v")?,
        step,
    })
}

#[cfg(test)]
mod tests {
    use super::super::protocol::{TrainerMsg, VerifierMsg};
    use super::*;
    use crate::train::msg::TrainCmd;

    #[test]
    fn weights_and_moments_round_trip_as_safetensors() {
        let cfg = rolloutpipe_backends::ModelConfig::tiny();
        let w = Weights::random(&cfg, 7).unwrap();
        let back = weights_from(&weights_blob(&w).unwrap(), "weights").unwrap();
        assert_eq!(back.tensors.len(), w.tensors.len());
        for (name, t) in &w.tensors {
            assert_eq!(back.tensors[name].shape, t.shape, "{name}");
            assert_eq!(back.tensors[name].data, t.data, "{name}");
        }
        let a = AdamState {
            m: vec![0.5, -0.25, 3.0],
            v: vec![1e-8, 2.0, 0.0],
            step: u64::MAX - 1,
        };
        assert_eq!(adam_from(&adam_blob(&a).unwrap(), a.step).unwrap(), a);
    }

    #[test]
    fn bad_frames_are_errors_not_panics() {
        let good = encode(&TrainerMsg::Cmd(TrainCmd::OptStep), &[b"abc"]);
        // Every truncation, and every single-byte corruption of the frame's fixed fields.
        for n in 0..good.len() {
            assert!(decode::<TrainerMsg>(&good[..n]).is_err(), "prefix {n}");
        }
        for i in 0..24 {
            let mut b = good.clone();
            b[i] ^= 0xA5;
            assert!(decode::<TrainerMsg>(&b).is_err(), "byte {i}");
        }
        let mut long = good.clone();
        long.push(0);
        assert!(matches!(
            decode::<TrainerMsg>(&long),
            Err(WireError::Frame(_))
        ));
        // A huge length must not allocate or overflow.
        let mut huge = good.clone();
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode::<TrainerMsg>(&huge).is_err());
        // A well-framed header of the wrong message type.
        let other = encode(&VerifierMsg::Score(vec![]), &[]);
        assert!(matches!(
            decode::<TrainerMsg>(&other),
            Err(WireError::Header(_))
        ));
        assert!(weights_from(b"not safetensors", "weights").is_err());
        assert!(adam_from(&weights_blob(&Weights::default()).unwrap(), 1).is_err());
    }
}
