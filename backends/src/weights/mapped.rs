//! Memory-mapped safetensors checkpoints: a model directory's tensors read in place, converted
//! tensor by tensor into whatever storage the caller builds (an f32 flat buffer, a bf16 flat
//! buffer, named [`Weights`]), so no second copy of the whole model exists while loading.
//!
//! The file pages of each tensor are released from the process (`MADV_DONTNEED`) once it is
//! converted, so loading a bf16 checkpoint into f32 storage peaks at the f32 buffer plus one
//! tensor's pages, not plus the whole file. The files must not be rewritten while a
//! checkpoint is open (the mapping is dropped when loading ends).

use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use half::bf16;
use memmap2::{Mmap, UncheckedAdvice};
use rayon::prelude::*;
use safetensors::{Dtype, SafeTensors};

use super::{Tensor, Weights, param_specs};
use crate::config::ModelConfig;
use crate::error::{BackendError, Result};
use crate::model::Layout;
use crate::seam::DType;

/// Values converted per parallel task.
const CHUNK: usize = 1 << 16;

/// One tensor's place in a mapped file.
#[derive(Debug, Clone)]
struct Entry {
    shard: usize,
    dtype: DType,
    shape: Vec<usize>,
    bytes: Range<usize>,
}

/// A model directory (`config.json` + `model.safetensors`, or shards listed in
/// `model.safetensors.index.json`) mapped into memory, its tensors checked against the
/// configuration's names and shapes (values are checked for finiteness as they are converted).
#[derive(Debug)]
pub struct MappedCheckpoint {
    cfg: ModelConfig,
    maps: Vec<(PathBuf, Mmap)>,
    tensors: BTreeMap<String, Entry>,
}

/// A tensor of a mapped checkpoint: its storage type, shape and raw little-endian bytes.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    /// Storage type in the file.
    pub dtype: DType,
    /// Dimensions.
    pub shape: &'a [usize],
    bytes: &'a [u8],
}

impl TensorRef<'_> {
    /// Number of values.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    /// Whether the tensor has no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Widens every value into `out` (exact), in parallel chunks.
    fn write_f32(&self, out: &mut [f32]) {
        let sz = self.dtype.size();
        let dt = self.dtype;
        out.par_chunks_mut(CHUNK)
            .zip(self.bytes.par_chunks(CHUNK * sz))
            .for_each(|(o, b)| match dt {
                DType::F32 => o.iter_mut().zip(b.chunks_exact(4)).for_each(|(o, b)| {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }),
                DType::Bf16 => o.iter_mut().zip(b.chunks_exact(2)).for_each(|(o, b)| {
                    *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }),
                DType::F16 => o.iter_mut().zip(b.chunks_exact(2)).for_each(|(o, b)| {
                    *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                }),
            });
    }

    /// Converts every value into `out`: bf16 copied as is, f32 and f16 rounded to nearest-even.
    fn write_bf16(&self, out: &mut [bf16]) {
        let sz = self.dtype.size();
        let dt = self.dtype;
        out.par_chunks_mut(CHUNK)
            .zip(self.bytes.par_chunks(CHUNK * sz))
            .for_each(|(o, b)| match dt {
                DType::Bf16 => o.iter_mut().zip(b.chunks_exact(2)).for_each(|(o, b)| {
                    *o = bf16::from_le_bytes([b[0], b[1]]);
                }),
                DType::F32 => o.iter_mut().zip(b.chunks_exact(4)).for_each(|(o, b)| {
                    *o = bf16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                }),
                DType::F16 => o.iter_mut().zip(b.chunks_exact(2)).for_each(|(o, b)| {
                    *o = bf16::from_f32(half::f16::from_le_bytes([b[0], b[1]]).to_f32());
                }),
            });
    }
}

impl TensorRef<'_> {
    /// Converts every value into `out`: f16 copied as is, f32 and bf16 rounded to nearest-even.
    fn write_f16(&self, out: &mut [half::f16]) {
        use half::f16;
        let sz = self.dtype.size();
        let dt = self.dtype;
        out.par_chunks_mut(CHUNK)
            .zip(self.bytes.par_chunks(CHUNK * sz))
            .for_each(|(o, b)| match dt {
                DType::F16 => o.iter_mut().zip(b.chunks_exact(2)).for_each(|(o, b)| {
                    *o = f16::from_le_bytes([b[0], b[1]]);
                }),
                DType::F32 => o.iter_mut().zip(b.chunks_exact(4)).for_each(|(o, b)| {
                    *o = f16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                }),
                DType::Bf16 => o.iter_mut().zip(b.chunks_exact(2)).for_each(|(o, b)| {
                    *o = f16::from_f32(bf16::from_le_bytes([b[0], b[1]]).to_f32());
                }),
            });
    }
}

impl MappedCheckpoint {
    /// Maps the checkpoint in `dir` and checks its tensor names and shapes against its
    /// `config.json`. A tied checkpoint may carry an `lm_head.weight` equal to the embedding
    /// (ignored); a different one is an error.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|error| BackendError::Io {
            path: cfg_path.clone(),
            error,
        })?;
        let cfg = ModelConfig::from_json_str(&text)?;
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let mut ck = Self {
            cfg,
            maps: Vec::new(),
            tensors: BTreeMap::new(),
        };
        if !single.exists() && index.exists() {
            ck.add_sharded(dir, &index)?;
        } else {
            let shard = ck.map(&single)?;
            for (name, e) in ck.entries(shard)? {
                ck.tensors.insert(name, e);
            }
        }
        ck.check()?;
        Ok(ck)
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| BackendError::MissingTensor(name.to_string()))?;
        Ok(TensorRef {
            dtype: e.dtype,
            shape: &e.shape,
            bytes: &self.maps[e.shard].1[e.bytes.clone()],
        })
    }

    /// Every parameter widened into one f32 buffer in `layout`'s order.
    pub fn flatten_f32(&self, layout: &Layout) -> Result<Vec<f32>> {
        let mut buf = vec![0.0f32; layout.total];
        for e in &layout.entries {
            let out = &mut buf[e.offset..e.offset + e.len];
            self.convert(&e.name, e.len, |t| t.write_f32(out))?;
            if out.par_iter().any(|x| !x.is_finite()) {
                return Err(BackendError::non_finite(e.name.clone()));
            }
        }
        Ok(buf)
    }

    /// Every parameter as bf16 in one buffer in `layout`'s order (bf16 tensors copied, others
    /// rounded to nearest-even).
    pub fn flatten_bf16(&self, layout: &Layout) -> Result<Vec<bf16>> {
        let mut buf = vec![bf16::ZERO; layout.total];
        for e in &layout.entries {
            let out = &mut buf[e.offset..e.offset + e.len];
            self.convert(&e.name, e.len, |t| t.write_bf16(out))?;
            if out.par_iter().any(|x| !x.is_finite()) {
                return Err(BackendError::non_finite(e.name.clone()));
            }
        }
        Ok(buf)
    }

    /// Every parameter as f16 in one buffer in `layout`'s order (f16 tensors copied, others
    /// rounded to nearest-even). A value beyond f16's range is an error naming its tensor.
    pub fn flatten_f16(&self, layout: &Layout) -> Result<Vec<half::f16>> {
        let mut buf = vec![half::f16::ZERO; layout.total];
        for e in &layout.entries {
            let out = &mut buf[e.offset..e.offset + e.len];
            self.convert(&e.name, e.len, |t| t.write_f16(out))?;
            if out.par_iter().any(|x| !x.is_finite()) {
                return Err(BackendError::non_finite(format!(
                    "{} (in f16: a value is non-finite or beyond ±65504)",
                    e.name
                )));
            }
        }
        Ok(buf)
    }

    /// Every parameter as named f32 tensors (validated).
    pub fn to_weights(&self) -> Result<Weights> {
        let mut w = Weights::default();
        for (name, shape) in param_specs(&self.cfg) {
            let n = shape.iter().product();
            let mut data = vec![0.0f32; n];
            self.convert(&name, n, |t| t.write_f32(&mut data))?;
            w.tensors.insert(name, Tensor { shape, data });
        }
        w.validate(&self.cfg)?;
        Ok(w)
    }

    /// Runs `f` on tensor `name` (checked to hold `len` values), then releases its pages.
    fn convert(&self, name: &str, len: usize, f: impl FnOnce(TensorRef<'_>)) -> Result<()> {
        let t = self.tensor(name)?;
        if t.len() != len {
            return Err(BackendError::shape(name.to_string(), len, t.len()));
        }
        f(t);
        let e = &self.tensors[name];
        // SAFETY: a read-only file mapping: dropping its pages only makes a later read fetch
        // them from the file again, with the same contents; nothing here writes to it.
        let _ = unsafe {
            self.maps[e.shard].1.unchecked_advise_range(
                UncheckedAdvice::DontNeed,
                e.bytes.start,
                e.bytes.len(),
            )
        };
        Ok(())
    }

    /// Maps one file; returns its index.
    fn map(&mut self, path: &Path) -> Result<usize> {
        let io = |error| BackendError::Io {
            path: path.to_path_buf(),
            error,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only and private to this checkpoint; the module's
        // documentation requires that the file is not rewritten while it is open.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        self.maps.push((path.to_path_buf(), map));
        Ok(self.maps.len() - 1)
    }

    /// Parses the header of mapped file `shard`: every tensor with its byte range.
    fn entries(&self, shard: usize) -> Result<Vec<(String, Entry)>> {
        let (path, map) = &self.maps[shard];
        let what = path.display().to_string();
        let st = SafeTensors::deserialize(map).map_err(|e| BackendError::Safetensors {
            what: what.clone(),
            reason: e.to_string(),
        })?;
        let base = map.as_ptr() as usize;
        let mut out = Vec::new();
        for (name, view) in st.tensors() {
            let dtype = match view.dtype() {
                Dtype::F32 => DType::F32,
                Dtype::BF16 => DType::Bf16,
                Dtype::F16 => DType::F16,
                other => {
                    return Err(BackendError::Safetensors {
                        what: format!("{what}: tensor `{name}`"),
                        reason: format!("dtype {other:?} is not supported (F32, F16, BF16)"),
                    });
                }
            };
            let data = view.data();
            let start = data.as_ptr() as usize - base;
            out.push((
                name,
                Entry {
                    shard,
                    dtype,
                    shape: view.shape().to_vec(),
                    bytes: start..start + data.len(),
                },
            ));
        }
        Ok(out)
    }

    /// Maps the shards of `index` (each once) and takes each tensor from the shard the index
    /// names, so a tensor repeated in two shards cannot silently shadow the other.
    fn add_sharded(&mut self, dir: &Path, index: &Path) -> Result<()> {
        let text = std::fs::read_to_string(index).map_err(|error| BackendError::Io {
            path: index.to_path_buf(),
            error,
        })?;
        let bad = |reason: String| BackendError::Safetensors {
            what: index.display().to_string(),
            reason,
        };
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("no `weight_map` object".into()))?;
        let mut by_shard: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (name, shard) in map {
            let shard = shard
                .as_str()
                .ok_or_else(|| bad(format!("shard of `{name}` is not a string")))?;
            if shard.contains('/') || shard.contains('\\') || shard.starts_with('.') {
                return Err(bad(format!(
                    "shard name `{shard}` leaves the model directory"
                )));
            }
            by_shard.entry(shard).or_default().push(name);
        }
        for (shard, names) in by_shard {
            let i = self.map(&dir.join(shard))?;
            let mut found: BTreeMap<String, Entry> = self.entries(i)?.into_iter().collect();
            for name in names {
                let e = found.remove(name).ok_or_else(|| {
                    bad(format!(
                        "`{name}` is mapped to {shard} but not stored there"
                    ))
                })?;
                self.tensors.insert(name.to_string(), e);
            }
        }
        Ok(())
    }

    /// Names and shapes against the configuration; a tied checkpoint's redundant
    /// `lm_head.weight` is dropped when it equals the embedding.
    fn check(&mut self) -> Result<()> {
        if self.cfg.tie_word_embeddings && self.tensors.contains_key("lm_head.weight") {
            let (h, e) = (
                self.tensor("lm_head.weight")?,
                self.tensor("model.embed_tokens.weight")?,
            );
            if h.dtype != e.dtype || h.shape != e.shape || h.bytes != e.bytes {
                return Err(BackendError::UnexpectedTensor(
                    "lm_head.weight (differs from the embedding in a tied checkpoint)".into(),
                ));
            }
            self.tensors.remove("lm_head.weight");
        }
        let specs = param_specs(&self.cfg);
        for (name, shape) in &specs {
            let t = self.tensor(name)?;
            if t.shape != &shape[..] {
                return Err(BackendError::shape(
                    name.clone(),
                    format!("{shape:?}"),
                    format!("{:?}", t.shape),
                ));
            }
        }
        if self.tensors.len() != specs.len() {
            let known: std::collections::HashSet<&str> =
                specs.iter().map(|(n, _)| n.as_str()).collect();
            if let Some(extra) = self.tensors.keys().find(|k| !known.contains(k.as_str())) {
                return Err(BackendError::UnexpectedTensor(extra.clone()));
            }
        }
        Ok(())
    }
}
