//! A Qwen3 model's storage on the CPU: configuration, layout, the flat parameters (f32, or
//! 16-bit for an engine, [`HalfStore`]) and the RoPE tables, with the trainer's calls on the
//! one model of `crate::model` through [`CpuOps`](super::model_ops::CpuOps).
//!
//! The model is generic over [`Float`] so that the f64 instance checks the f32 one's gradients
//! by finite differences on the very same code.

use std::ops::Range;

use super::model_ops::CpuOps;
use super::ops::*;
use super::store::{HalfData, HalfStore};
use crate::config::ModelConfig;
use crate::error::{BackendError, Result};
use crate::model::acts::Acts;
use crate::model::train::Net;
use crate::model::{Layout, ParamId};
use crate::seam::{AccumStats, Objective, TrainBatch};
use crate::weights::Weights;

/// Resizes to `n` zeros without giving back capacity.
pub(crate) fn fit<T: Float>(v: &mut Vec<T>, n: usize) {
    v.clear();
    v.resize(n, T::ZERO);
}

/// The CPU's activation set: `Vec` buffers, sequences as row ranges.
type CpuActs<T> = Acts<Vec<T>, Vec<u32>, Vec<Range<usize>>>;

/// The activations of a training or scoring pass, reused across calls (grow-only), and the
/// fused lm_head's chunk scratch.
#[derive(Debug, Default)]
pub struct Activations<T> {
    acts: Option<CpuActs<T>>,
    lm_scratch: Vec<T>,
}

/// Weights of one layer as the forward reads them: matrices in the compute type or 16 bits
/// ([`Mat`]), norm weights in the compute type.
#[allow(missing_docs)]
pub struct LayerFwd<'a, T> {
    pub input_norm: &'a [T],
    pub q: Mat<'a, T>,
    pub k: Mat<'a, T>,
    pub v: Mat<'a, T>,
    pub o: Mat<'a, T>,
    pub q_norm: &'a [T],
    pub k_norm: &'a [T],
    pub post_norm: &'a [T],
    pub gate: Mat<'a, T>,
    pub up: Mat<'a, T>,
    pub down: Mat<'a, T>,
}

/// A Qwen3 model: config, layout, flat parameters and RoPE tables.
///
/// The parameters are either `params` (the compute type: trainers, f32 engines) or `half`
/// (bf16 or f16 storage for engine-only models, see [`HalfStore`]); exactly one is non-empty. A 16-bit
/// model runs every forward (generation, logits, scoring) and refuses training.
#[derive(Debug, Clone)]
pub struct Model<T> {
    /// Configuration.
    pub cfg: ModelConfig,
    /// Parameter layout.
    pub layout: Layout,
    /// Flat parameters (empty when `half` holds them).
    pub params: Vec<T>,
    /// 16-bit storage of the flat parameters, for engine-only models.
    pub half: Option<HalfStore<T>>,
    /// RoPE tables for every position up to `max_position_embeddings`.
    pub rope: RopeTable<T>,
}

impl<T: Float> Model<T> {
    /// A model from validated weights.
    pub fn new(cfg: &ModelConfig, w: &Weights) -> Result<Self> {
        cfg.validate()?;
        w.validate(cfg)?;
        let layout = Layout::new(cfg);
        let params = layout.flatten(w)?;
        Self::from_flat(cfg, layout, params)
    }

    /// A model over already flattened parameters in the layout of `cfg` (values not checked).
    pub fn from_flat(cfg: &ModelConfig, layout: Layout, params: Vec<T>) -> Result<Self> {
        cfg.validate()?;
        if params.len() != layout.total {
            return Err(BackendError::shape(
                "parameters",
                layout.total,
                params.len(),
            ));
        }
        Ok(Self {
            rope: RopeTable::of(cfg),
            cfg: cfg.clone(),
            layout,
            params,
            half: None,
        })
    }

    /// An engine-only model storing its flat parameters (the layout of `cfg`) in bf16.
    pub fn from_bf16(cfg: &ModelConfig, data: Vec<half::bf16>) -> Result<Self> {
        Self::from_half(cfg, HalfData::Bf16(data))
    }

    /// An engine-only model storing its flat parameters (the layout of `cfg`) in 16 bits
    /// (bf16 or f16).
    pub fn from_half(cfg: &ModelConfig, data: HalfData) -> Result<Self> {
        cfg.validate()?;
        let layout = Layout::new(cfg);
        let half = HalfStore::new(&layout, data)?;
        Ok(Self {
            rope: RopeTable::of(cfg),
            cfg: cfg.clone(),
            layout,
            params: Vec::new(),
            half: Some(half),
        })
    }

    /// Whether the parameters are stored in 16 bits, bf16 or f16 (engine-only).
    pub fn is_half(&self) -> bool {
        self.half.is_some()
    }

    /// The storage dtype of the parameters.
    pub fn storage_dtype(&self) -> crate::seam::DType {
        match &self.half {
            Some(h) => h.data.dtype(),
            None => crate::seam::DType::F32,
        }
    }

    /// Bytes of parameter storage.
    pub fn param_bytes(&self) -> usize {
        match &self.half {
            Some(h) => h.bytes(),
            None => self.params.len() * std::mem::size_of::<T>(),
        }
    }

    /// The weights of layer `l` as the forward reads them (any storage).
    pub fn layer_fwd(&self, l: usize) -> LayerFwd<'_, T> {
        let p = &self.layout.ids.layers[l];
        LayerFwd {
            input_norm: self.small(p.input_norm),
            q: self.tensor(p.q),
            k: self.tensor(p.k),
            v: self.tensor(p.v),
            o: self.tensor(p.o),
            q_norm: self.small(p.q_norm),
            k_norm: self.small(p.k_norm),
            post_norm: self.small(p.post_norm),
            gate: self.tensor(p.gate),
            up: self.tensor(p.up),
            down: self.tensor(p.down),
        }
    }

    /// `[vocab, hidden]` embedding as the forward reads it.
    pub fn embed_fwd(&self) -> Mat<'_, T> {
        self.tensor(self.layout.ids.embed)
    }

    /// `[vocab, hidden]` output projection as the forward reads it.
    pub fn lm_head_fwd(&self) -> Mat<'_, T> {
        self.tensor(self.layout.ids.lm_head)
    }

    /// `[hidden]` final norm weight.
    pub fn final_norm(&self) -> &[T] {
        self.small(self.layout.ids.final_norm)
    }

    /// Tensor `id` as the forward reads it (any storage).
    pub fn tensor(&self, id: ParamId) -> Mat<'_, T> {
        let r = self.layout.range(id);
        match &self.half {
            Some(h) => h.mat(r.start, r.len()),
            None => Mat::Full(&self.params[r]),
        }
    }

    /// 1-D tensor `id` (a norm weight) in the compute type.
    pub fn small(&self, id: ParamId) -> &[T] {
        let r = self.layout.range(id);
        match &self.half {
            Some(h) => h.small(r.start, r.len()),
            None => &self.params[r],
        }
    }

    /// Tensor `id` in the compute type (training).
    ///
    /// # Panics
    /// On a 16-bit model ([`Model::is_half`]), which has no compute-type copy.
    pub fn full(&self, id: ParamId) -> &[T] {
        &self.params[self.layout.range(id)]
    }

    /// The model of `crate::model` over this storage.
    fn net(&self) -> Net<'_> {
        Net {
            cfg: &self.cfg,
            ids: &self.layout.ids,
        }
    }

    /// The logits `[ids.len(), vocab]` of one sequence at every position (checked first).
    pub fn logits(&self, ids: &[u32], a: &mut Activations<T>) -> Result<Vec<f32>> {
        let mut o = CpuOps::new(self, None, &mut a.lm_scratch);
        self.net().logits(&mut o, &mut a.acts, ids)
    }

    /// Forward and backward of `obj` on a micro-batch (checked first), adding the gradient of
    /// Σ weight·loss to `grads` (skipped when `None`). A non-finite loss is an error and skips
    /// the backward.
    pub fn accumulate(
        &self,
        batch: &TrainBatch,
        obj: &Objective,
        a: &mut Activations<T>,
        grads: Option<&mut [T]>,
    ) -> Result<AccumStats> {
        if grads.is_some() && self.is_half() {
            return Err(BackendError::invalid(
                "training",
                "this model stores its weights in 16 bits (bf16 or f16) for generation only; train on f32 weights",
            ));
        }
        if let Some(g) = &grads
            && g.len() != self.layout.total
        {
            return Err(BackendError::shape(
                "gradient buffer",
                self.layout.total,
                g.len(),
            ));
        }
        let backward = grads.is_some();
        let mut o = CpuOps::new(self, grads, &mut a.lm_scratch);
        self.net()
            .accumulate(&mut o, &mut a.acts, batch, obj, backward)
    }

    /// Per response token log-probs at `temperature` (sequences and temperature are checked).
    pub fn logprobs(
        &self,
        seqs: &[(&[u32], &[u32])],
        temperature: f64,
        a: &mut Activations<T>,
    ) -> Result<Vec<Vec<f32>>> {
        let mut o = CpuOps::new(self, None, &mut a.lm_scratch);
        self.net().logprobs(&mut o, &mut a.acts, seqs, temperature)
    }
}
