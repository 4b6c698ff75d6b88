//! Named f32 tensors under Hugging Face's parameter names, and model directories on disk.
//!
//! `Weights` is the exchange format between backends (weight sync to rollout engines, saving,
//! golden tests): plain row-major f32, matrices `[out, in]` as torch stores them. A model
//! directory is `config.json` + `model.safetensors`; F32, F16 and BF16 tensors are read, F32 is
//! written, and a tied checkpoint carries no `lm_head.weight`. Model directories are read
//! memory-mapped ([`mapped`]).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use crate::config::ModelConfig;
use crate::error::{BackendError, Result};

pub mod mapped;

/// One dense row-major f32 tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values.
    pub data: Vec<f32>,
}

impl Tensor {
    /// A tensor, checking that `data` fills `shape`.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Result<Self> {
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
}

/// Model parameters (or gradients) by Hugging Face name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Weights {
    /// Tensors by name, in name order.
    pub tensors: BTreeMap<String, Tensor>,
}

/// Names and shapes of every parameter of `cfg`, in the order of the CPU backend's flat buffer.
/// Tied configurations have no `lm_head.weight`.
pub fn param_specs(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (d, f, v, hd) = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.vocab_size,
        cfg.head_dim,
    );
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, d])];
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}.");
        out.push((format!("{p}input_layernorm.weight"), vec![d]));
        out.push((format!("{p}self_attn.q_proj.weight"), vec![cfg.q_dim(), d]));
        out.push((format!("{p}self_attn.k_proj.weight"), vec![cfg.kv_dim(), d]));
        out.push((format!("{p}self_attn.v_proj.weight"), vec![cfg.kv_dim(), d]));
        out.push((format!("{p}self_attn.o_proj.weight"), vec![d, cfg.q_dim()]));
        out.push((format!("{p}self_attn.q_norm.weight"), vec![hd]));
        out.push((format!("{p}self_attn.k_norm.weight"), vec![hd]));
        out.push((format!("{p}post_attention_layernorm.weight"), vec![d]));
        out.push((format!("{p}mlp.gate_proj.weight"), vec![f, d]));
        out.push((format!("{p}mlp.up_proj.weight"), vec![f, d]));
        out.push((format!("{p}mlp.down_proj.weight"), vec![d, f]));
    }
    out.push(("model.norm.weight".to_string(), vec![d]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![v, d]));
    }
    out
}

/// Whether a parameter is an RMSNorm weight (initialised at 1; optionally excluded from decay).
pub fn is_norm_weight(name: &str) -> bool {
    name.ends_with("norm.weight")
}

impl Weights {
    /// Seeded random initialisation: matrices and the embedding from N(0, 0.02²) (Qwen3's
    /// `initializer_range`), RMSNorm weights at 1.
    pub fn random(cfg: &ModelConfig, seed: u64) -> Result<Self> {
        cfg.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut tensors = BTreeMap::new();
        for (name, shape) in param_specs(cfg) {
            let n = shape.iter().product();
            let data = if is_norm_weight(&name) {
                vec![1.0; n]
            } else {
                (0..n).map(|_| 0.02 * normal(&mut rng) as f32).collect()
            };
            tensors.insert(name, Tensor { shape, data });
        }
        Ok(Self { tensors })
    }

    /// All-zero tensors of every parameter of `cfg` (gradient buffers).
    pub fn zeros(cfg: &ModelConfig) -> Self {
        let tensors = param_specs(cfg)
            .into_iter()
            .map(|(name, shape)| {
                let n = shape.iter().product();
                (
                    name,
                    Tensor {
                        shape,
                        data: vec![0.0; n],
                    },
                )
            })
            .collect();
        Self { tensors }
    }

    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Result<&Tensor> {
        self.tensors
            .get(name)
            .ok_or_else(|| BackendError::MissingTensor(name.to_string()))
    }

    /// Checks that the tensors are exactly the parameters of `cfg` with their shapes and that
    /// every value is finite.
    pub fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        let specs = param_specs(cfg);
        for (name, shape) in &specs {
            let t = self.get(name)?;
            if &t.shape != shape {
                return Err(BackendError::shape(
                    name.clone(),
                    format!("{shape:?}"),
                    format!("{:?}", t.shape),
                ));
            }
            if t.data.len() != shape.iter().product::<usize>() {
                return Err(BackendError::shape(
                    name.clone(),
                    shape.iter().product::<usize>(),
                    t.data.len(),
                ));
            }
            if t.data.iter().any(|x| !x.is_finite()) {
                return Err(BackendError::non_finite(name.clone()));
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

    /// Parses a safetensors file's bytes, converting F32, F16 and BF16 tensors to f32.
    pub fn from_safetensors_bytes(bytes: &[u8], what: &str) -> Result<Self> {
        let st = SafeTensors::deserialize(bytes).map_err(|e| BackendError::Safetensors {
            what: what.to_string(),
            reason: e.to_string(),
        })?;
        let mut tensors = BTreeMap::new();
        for (name, view) in st.tensors() {
            let raw = view.data();
            let data: Vec<f32> = match view.dtype() {
                Dtype::F32 => raw
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
                Dtype::F16 => raw
                    .chunks_exact(2)
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                Dtype::BF16 => raw
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                other => {
                    return Err(BackendError::Safetensors {
                        what: format!("{what}: tensor `{name}`"),
                        reason: format!("dtype {other:?} is not supported (F32, F16, BF16)"),
                    });
                }
            };
            tensors.insert(name, Tensor::new(view.shape().to_vec(), data)?);
        }
        Ok(Self { tensors })
    }

    /// Serialises every tensor as F32 safetensors (with `{"format": "pt"}` metadata, which
    /// transformers expects).
    pub fn to_safetensors_bytes(&self) -> Result<Vec<u8>> {
        let bytes: Vec<(&String, Vec<u8>, &Vec<usize>)> = self
            .tensors
            .iter()
            .map(|(n, t)| {
                (
                    n,
                    t.data.iter().flat_map(|x| x.to_le_bytes()).collect(),
                    &t.shape,
                )
            })
            .collect();
        let mut views = Vec::with_capacity(bytes.len());
        for (name, data, shape) in &bytes {
            let view = TensorView::new(Dtype::F32, shape.to_vec(), data).map_err(|e| {
                BackendError::Safetensors {
                    what: format!("tensor `{name}`"),
                    reason: e.to_string(),
                }
            })?;
            views.push((name.as_str(), view));
        }
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize(views, Some(meta)).map_err(|e| BackendError::Safetensors {
            what: "serialise".to_string(),
            reason: e.to_string(),
        })
    }

    /// Reads a safetensors file.
    pub fn load_safetensors(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|error| BackendError::Io {
            path: path.to_path_buf(),
            error,
        })?;
        Self::from_safetensors_bytes(&bytes, &path.display().to_string())
    }

    /// Writes a safetensors file (F32).
    pub fn save_safetensors(&self, path: &Path) -> Result<()> {
        let bytes = self.to_safetensors_bytes()?;
        std::fs::write(path, bytes).map_err(|error| BackendError::Io {
            path: path.to_path_buf(),
            error,
        })
    }
}

/// Reads a model directory (`config.json` + `model.safetensors`, or shards listed in
/// `model.safetensors.index.json`), validating the tensors against the configuration. The
/// files are memory-mapped and each tensor widened to f32 once (see [`mapped`]); a backend that
/// keeps its own flat storage loads faster and in less memory with
/// [`mapped::MappedCheckpoint`] directly.
pub fn load_model_dir(dir: &Path) -> Result<(ModelConfig, Weights)> {
    let ck = mapped::MappedCheckpoint::open_dir(dir)?;
    let w = ck.to_weights()?;
    Ok((ck.config().clone(), w))
}

/// Writes a model directory (creating it): `config.json` and F32 `model.safetensors`.
pub fn save_model_dir(dir: &Path, cfg: &ModelConfig, w: &Weights) -> Result<()> {
    w.validate(cfg)?;
    std::fs::create_dir_all(dir).map_err(|error| BackendError::Io {
        path: dir.to_path_buf(),
        error,
    })?;
    write_config(dir, cfg)?;
    w.save_safetensors(&dir.join("model.safetensors"))
}

/// Writes `dir/config.json`.
fn write_config(dir: &Path, cfg: &ModelConfig) -> Result<()> {
    let cfg_path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&cfg.to_json())
        .map_err(|e| BackendError::config("config.json", e.to_string()))?;
    std::fs::write(&cfg_path, text).map_err(|error| BackendError::Io {
        path: cfg_path,
        error,
    })
}

/// Writes an F32 safetensors file (with `{"format": "pt"}` metadata) tensor by tensor:
/// `specs` names every tensor with its shape, in file order, and `fill` hands their values
/// over in that order. Only a small buffer of bytes is held besides the caller's values, so a
/// large model is written without a copy of it. The file appears only once it is complete
/// (written beside it, then renamed).
pub fn write_safetensors(
    path: &Path,
    specs: &[(String, Vec<usize>)],
    fill: impl FnOnce(&mut dyn FnMut(&str, &[f32]) -> Result<()>) -> Result<()>,
) -> Result<()> {
    use std::io::Write;
    let io = |error| BackendError::Io {
        path: path.to_path_buf(),
        error,
    };
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut at = 0usize;
    for (name, shape) in specs {
        let bytes = 4 * shape.iter().product::<usize>();
        let entry =
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [at, at + bytes]});
        header.insert(name.clone(), entry);
        at += bytes;
    }
    let mut head = serde_json::to_vec(&header).map_err(|e| BackendError::Safetensors {
        what: "header".into(),
        reason: e.to_string(),
    })?;
    // The data starts on an 8-byte boundary (the format pads the header with spaces).
    head.resize(head.len().next_multiple_of(8), b' ');
    let tmp = path.with_extension("safetensors.partial");
    let file = std::fs::File::create(&tmp).map_err(io)?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    out.write_all(&(head.len() as u64).to_le_bytes())
        .map_err(io)?;
    out.write_all(&head).map_err(io)?;
    let mut next = 0;
    let filled = {
        let mut put = |name: &str, values: &[f32]| -> Result<()> {
            let (want, shape) = specs.get(next).ok_or_else(|| {
                BackendError::invalid(
                    "safetensors writer",
                    format!("tensor `{name}` past the last one named"),
                )
            })?;
            if want != name || values.len() != shape.iter().product::<usize>() {
                return Err(BackendError::shape(
                    format!("tensor `{want}`"),
                    format!("{shape:?}"),
                    format!("`{name}` of {} values", values.len()),
                ));
            }
            for chunk in values.chunks(1 << 14) {
                let bytes: Vec<u8> = chunk.iter().flat_map(|x| x.to_le_bytes()).collect();
                out.write_all(&bytes).map_err(io)?;
            }
            next += 1;
            Ok(())
        };
        fill(&mut put)
    };
    let done = next == specs.len();
    let written = filled
        .and_then(|()| {
            if done {
                Ok(())
            } else {
                Err(BackendError::invalid(
                    "safetensors writer",
                    "fewer tensors than named",
                ))
            }
        })
        .and_then(|()| out.flush().map_err(io));
    drop(out);
    match written {
        Ok(()) => std::fs::rename(&tmp, path).map_err(io),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Writes a model directory (creating it) from tensors handed over one at a time in
/// [`param_specs`] order (see [`write_safetensors`]): `config.json` and F32
/// `model.safetensors`.
pub fn write_model_dir(
    dir: &Path,
    cfg: &ModelConfig,
    fill: impl FnOnce(&mut dyn FnMut(&str, &[f32]) -> Result<()>) -> Result<()>,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|error| BackendError::Io {
        path: dir.to_path_buf(),
        error,
    })?;
    write_safetensors(&dir.join("model.safetensors"), &param_specs(cfg), fill)?;
    write_config(dir, cfg)
}

/// One standard normal draw (Box–Muller), so initialisation needs no distribution crate.
fn normal(rng: &mut ChaCha8Rng) -> f64 {
    // 53-bit uniforms; u1 in (0, 1] keeps ln finite.
    let u1 = ((rng.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64);
    let u2 = (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_safetensors_load_back_and_a_short_stream_leaves_no_file() {
        let cfg = ModelConfig::tiny();
        let w = Weights::random(&cfg, 4).unwrap();
        let dir = std::env::temp_dir().join(format!("rp-stream-{}", std::process::id()));
        write_model_dir(&dir, &cfg, |put| {
            for (name, _) in param_specs(&cfg) {
                put(&name, &w.tensors[&name].data)?;
            }
            Ok(())
        })
        .unwrap();
        let (c2, w2) = load_model_dir(&dir).unwrap();
        assert_eq!((c2, w2), (cfg.clone(), w.clone()));
        let path = dir.join("short.safetensors");
        let specs = param_specs(&cfg);
        let e = write_safetensors(&path, &specs, |put| {
            put(&specs[0].0, &w.tensors[&specs[0].0].data)
        });
        assert!(e.unwrap_err().to_string().contains("fewer tensors"));
        let e = write_safetensors(&path, &specs, |put| put("lm_head.weight", &[0.0]));
        assert!(e.unwrap_err().to_string().contains(&specs[0].0));
        assert!(!path.exists() && !path.with_extension("safetensors.partial").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn random_is_seeded_and_well_scaled() {
        let cfg = ModelConfig::tiny();
        let a = Weights::random(&cfg, 7).unwrap();
        assert_eq!(a, Weights::random(&cfg, 7).unwrap());
        assert_ne!(a, Weights::random(&cfg, 8).unwrap());
        a.validate(&cfg).unwrap();
        let q = &a
            .get("model.layers.0.self_attn.q_proj.weight")
            .unwrap()
            .data;
        let var = q.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / q.len() as f64;
        assert!((var.sqrt() - 0.02).abs() < 0.006, "std {}", var.sqrt());
        assert!(
            a.get("model.norm.weight")
                .unwrap()
                .data
                .iter()
                .all(|x| *x == 1.0)
        );
    }

    #[test]
    fn half_precision_tensors_are_read() {
        let vals = [1.5f32, -0.25, 3.0];
        let f16: Vec<u8> = vals
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect();
        let bf16: Vec<u8> = vals
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect();
        let views = vec![
            ("a", TensorView::new(Dtype::F16, vec![3], &f16).unwrap()),
            (
                "b",
                TensorView::new(Dtype::BF16, vec![1, 3], &bf16).unwrap(),
            ),
        ];
        let bytes = safetensors::serialize(views, None).unwrap();
        let w = Weights::from_safetensors_bytes(&bytes, "test").unwrap();
        assert_eq!(w.get("a").unwrap().data, vals);
        assert_eq!(w.get("b").unwrap().shape, vec![1, 3]);
        assert_eq!(w.get("b").unwrap().data, vals);
    }

    #[test]
    fn sharded_checkpoint_loads_like_a_single_file() {
        let cfg = ModelConfig::tiny();
        let w = Weights::random(&cfg, 3).unwrap();
        let dir = std::env::temp_dir().join(format!("rolloutpipe-shards-{}", std::process::id()));
        save_model_dir(&dir, &cfg, &w).unwrap();
        std::fs::remove_file(dir.join("model.safetensors")).unwrap();
        // two shards: the embedding alone, everything else together
        let (emb, rest): (Vec<_>, Vec<_>) = w
            .tensors
            .iter()
            .partition(|(n, _)| n.as_str() == "model.embed_tokens.weight");
        let mut map = serde_json::Map::new();
        for (file, part) in [("a.safetensors", emb), ("b.safetensors", rest)] {
            let shard = Weights {
                tensors: part
                    .into_iter()
                    .map(|(n, t)| (n.clone(), t.clone()))
                    .collect(),
            };
            for n in shard.tensors.keys() {
                map.insert(n.clone(), file.into());
            }
            shard.save_safetensors(&dir.join(file)).unwrap();
        }
        let index = serde_json::json!({ "metadata": {}, "weight_map": map });
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
        let (_, back) = load_model_dir(&dir).unwrap();
        assert_eq!(back, w);
        // an index pointing outside the directory is refused
        let evil = serde_json::json!({ "weight_map": { "model.norm.weight": "../x.safetensors" } });
        std::fs::write(dir.join("model.safetensors.index.json"), evil.to_string()).unwrap();
        assert!(matches!(
            load_model_dir(&dir),
            Err(BackendError::Safetensors { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn validate_names_missing_extra_and_misshaped() {
        let cfg = ModelConfig::tiny();
        let good = Weights::random(&cfg, 1).unwrap();
        let mut w = good.clone();
        w.tensors.remove("model.norm.weight");
        assert!(
            matches!(w.validate(&cfg), Err(BackendError::MissingTensor(n)) if n == "model.norm.weight")
        );
        let mut w = good.clone();
        w.tensors.insert(
            "extra.weight".into(),
            Tensor::new(vec![1], vec![0.0]).unwrap(),
        );
        assert!(
            matches!(w.validate(&cfg), Err(BackendError::UnexpectedTensor(n)) if n == "extra.weight")
        );
        let mut w = good.clone();
        w.tensors.insert(
            "model.norm.weight".into(),
            Tensor::new(vec![3], vec![1.0; 3]).unwrap(),
        );
        assert!(
            matches!(w.validate(&cfg), Err(BackendError::Shape { what, .. }) if what == "model.norm.weight")
        );
        let mut w = good;
        w.tensors.get_mut("model.norm.weight").unwrap().data[0] = f32::NAN;
        assert!(matches!(
            w.validate(&cfg),
            Err(BackendError::NonFinite { .. })
        ));
        assert!(Weights::from_safetensors_bytes(b"garbage", "x").is_err());
    }
}
