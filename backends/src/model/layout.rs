//! Where every parameter lives: the tensors in [`param_specs`] order, each with its offset
//! in a flat buffer (the CPU backend's parameters, gradients and AdamW moments; checkpoints
//! of optimizer state) and its index (the device backends keep one buffer per tensor), and
//! the index of each tensor the layer loops read ([`ParamIds`]).

use std::collections::HashMap;

use crate::config::ModelConfig;
use crate::error::{BackendError, Result};
use crate::optim::ParamGroup;
use crate::weights::{Tensor, Weights, is_norm_weight, param_specs};

/// One parameter tensor in the flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamEntry {
    /// Hugging Face name.
    pub name: String,
    /// Shape (`[out, in]` for matrices).
    pub shape: Vec<usize>,
    /// Start in the flat buffer.
    pub offset: usize,
    /// Number of values.
    pub len: usize,
}

/// A parameter tensor by its index in [`Layout::entries`]: how the layer loops name the
/// weights they read and the gradients they add to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ParamId(pub usize);

/// The tensors of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct LayerParams {
    pub input_norm: ParamId,
    pub q: ParamId,
    pub k: ParamId,
    pub v: ParamId,
    pub o: ParamId,
    pub q_norm: ParamId,
    pub k_norm: ParamId,
    pub post_norm: ParamId,
    pub gate: ParamId,
    pub up: ParamId,
    pub down: ParamId,
}

/// Every tensor the layer loops read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamIds {
    /// `model.embed_tokens.weight`.
    pub embed: ParamId,
    /// `lm_head.weight`, or the embedding when tied (both uses then add their gradients into
    /// one tensor, as SPEC §6 requires).
    pub lm_head: ParamId,
    /// `model.norm.weight`.
    pub final_norm: ParamId,
    /// Per layer.
    pub layers: Vec<LayerParams>,
}

/// Where every parameter lives (the order of [`param_specs`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    /// All tensors in buffer order.
    pub entries: Vec<ParamEntry>,
    /// The tensors the layer loops read.
    pub ids: ParamIds,
    /// Total number of values.
    pub total: usize,
}

impl Layout {
    /// The layout of `cfg`.
    pub fn new(cfg: &ModelConfig) -> Self {
        let mut entries = Vec::new();
        let mut off = 0;
        for (name, shape) in param_specs(cfg) {
            let len = shape.iter().product();
            entries.push(ParamEntry {
                name,
                shape,
                offset: off,
                len,
            });
            off += len;
        }
        let by: HashMap<&str, usize> = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.name.as_str(), i))
            .collect();
        let at = |n: &str| ParamId(by[n]);
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let p = format!("model.layers.{i}.");
                LayerParams {
                    input_norm: at(&format!("{p}input_layernorm.weight")),
                    q: at(&format!("{p}self_attn.q_proj.weight")),
                    k: at(&format!("{p}self_attn.k_proj.weight")),
                    v: at(&format!("{p}self_attn.v_proj.weight")),
                    o: at(&format!("{p}self_attn.o_proj.weight")),
                    q_norm: at(&format!("{p}self_attn.q_norm.weight")),
                    k_norm: at(&format!("{p}self_attn.k_norm.weight")),
                    post_norm: at(&format!("{p}post_attention_layernorm.weight")),
                    gate: at(&format!("{p}mlp.gate_proj.weight")),
                    up: at(&format!("{p}mlp.up_proj.weight")),
                    down: at(&format!("{p}mlp.down_proj.weight")),
                }
            })
            .collect();
        let embed = at("model.embed_tokens.weight");
        let ids = ParamIds {
            lm_head: if cfg.tie_word_embeddings {
                embed
            } else {
                at("lm_head.weight")
            },
            embed,
            final_norm: at("model.norm.weight"),
            layers,
        };
        Self {
            entries,
            ids,
            total: off,
        }
    }

    /// The entry of tensor `id`.
    pub fn entry(&self, id: ParamId) -> &ParamEntry {
        &self.entries[id.0]
    }

    /// The flat range of tensor `id`.
    pub fn range(&self, id: ParamId) -> std::ops::Range<usize> {
        let e = self.entry(id);
        e.offset..e.offset + e.len
    }

    /// Copies a validated [`Weights`] into a flat buffer (f32, or widened exactly to f64).
    pub fn flatten<T: From<f32> + Copy + Default>(&self, w: &Weights) -> Result<Vec<T>> {
        let mut buf = vec![T::default(); self.total];
        for e in &self.entries {
            let t = w.get(&e.name)?;
            if t.data.len() != e.len {
                return Err(BackendError::shape(e.name.clone(), e.len, t.data.len()));
            }
            for (d, s) in buf[e.offset..e.offset + e.len].iter_mut().zip(&t.data) {
                *d = T::from(*s);
            }
        }
        Ok(buf)
    }

    /// A flat buffer (parameters or gradients) as named f32 tensors.
    pub fn to_weights<T: Into<f64> + Copy>(&self, buf: &[T]) -> Weights {
        let tensors = self
            .entries
            .iter()
            .map(|e| {
                let data = buf[e.offset..e.offset + e.len]
                    .iter()
                    .map(|x| (*x).into() as f32)
                    .collect();
                (
                    e.name.clone(),
                    Tensor {
                        shape: e.shape.clone(),
                        data,
                    },
                )
            })
            .collect();
        Weights { tensors }
    }

    /// Optimizer groups: one per tensor, norm weights optionally without decay.
    pub fn param_groups(&self, exclude_norms_from_decay: bool) -> Vec<ParamGroup> {
        self.entries
            .iter()
            .map(|e| ParamGroup {
                offset: e.offset,
                len: e.len,
                decay: !(exclude_norms_from_decay && is_norm_weight(&e.name)),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_name_the_tensors_of_each_layer_and_tied_lm_head_is_the_embedding() {
        for tied in [false, true] {
            let cfg = ModelConfig {
                tie_word_embeddings: tied,
                ..ModelConfig::tiny()
            };
            let l = Layout::new(&cfg);
            assert_eq!(l.entry(l.ids.embed).name, "model.embed_tokens.weight");
            assert_eq!(
                l.entry(l.ids.layers[1].k_norm).name,
                "model.layers.1.self_attn.k_norm.weight"
            );
            assert_eq!(l.entry(l.ids.final_norm).name, "model.norm.weight");
            let lm = &l.entry(l.ids.lm_head).name;
            assert_eq!(
                lm,
                if tied {
                    "model.embed_tokens.weight"
                } else {
                    "lm_head.weight"
                }
            );
            let e = l.entry(l.ids.layers[0].q);
            assert_eq!(
                l.range(l.ids.layers[0].q),
                e.offset..e.offset + cfg.q_dim() * cfg.hidden_size
            );
            assert_eq!(l.total, l.entries.iter().map(|e| e.len).sum::<usize>());
        }
    }
}
