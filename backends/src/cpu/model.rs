//! Qwen3 forward and backward over a packed batch of sequences, parameters in one flat buffer.
//!
//! Sequences of a micro-batch are concatenated into `N` token rows so every projection is one
//! GEMM over all tokens (llm.c's `B×T`, without padding); attention runs per sequence, in
//! parallel across sequences. Logits are computed only at the rows that predict a scored token,
//! so prompts cost no `lm_head` work. The model is generic over [`Float`] so the f64 instance
//! checks the f32 one's gradients by finite differences on the very same code.

use std::collections::HashMap;
use std::ops::Range;

use rayon::prelude::*;

use super::lm_head::{lm_head_logprob_bwd, lm_head_logprob_fwd};
use super::ops::*;
use super::store::{HalfData, HalfStore};
use crate::config::ModelConfig;
use crate::error::{BackendError, Result};
use crate::optim::ParamGroup;
use crate::seam::{AccumStats, Objective, TrainBatch};
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

/// Offsets of one decoder layer's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct LayerOffsets {
    pub input_norm: usize,
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub o: usize,
    pub q_norm: usize,
    pub k_norm: usize,
    pub post_norm: usize,
    pub gate: usize,
    pub up: usize,
    pub down: usize,
}

/// Where every parameter lives in the flat buffer (the order of [`param_specs`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    /// All tensors in buffer order.
    pub entries: Vec<ParamEntry>,
    /// `model.embed_tokens.weight`.
    pub embed: usize,
    /// `lm_head.weight`, or the embedding's offset when tied (both uses then add their
    /// gradients into one tensor, as SPEC §6 requires).
    pub lm_head: usize,
    /// `model.norm.weight`.
    pub final_norm: usize,
    /// Per layer.
    pub layers: Vec<LayerOffsets>,
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
            .map(|e| (e.name.as_str(), e.offset))
            .collect();
        let at = |n: &str| by[n];
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let p = format!("model.layers.{i}.");
                LayerOffsets {
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
        Self {
            lm_head: if cfg.tie_word_embeddings {
                embed
            } else {
                at("lm_head.weight")
            },
            embed,
            final_norm: at("model.norm.weight"),
            layers,
            total: off,
            entries,
        }
    }

    /// Copies a validated [`Weights`] into a flat buffer.
    pub fn flatten<T: Float>(&self, w: &Weights) -> Result<Vec<T>> {
        let mut buf = vec![T::ZERO; self.total];
        for e in &self.entries {
            let t = w.get(&e.name)?;
            if t.data.len() != e.len {
                return Err(BackendError::shape(e.name.clone(), e.len, t.data.len()));
            }
            for (d, s) in buf[e.offset..e.offset + e.len].iter_mut().zip(&t.data) {
                *d = T::from_f64(*s as f64);
            }
        }
        Ok(buf)
    }

    /// A flat buffer (parameters or gradients) as named f32 tensors.
    pub fn to_weights<T: Float>(&self, buf: &[T]) -> Weights {
        let tensors = self
            .entries
            .iter()
            .map(|e| {
                let data = buf[e.offset..e.offset + e.len]
                    .iter()
                    .map(|x| x.to_f64() as f32)
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

/// Sequences packed into token rows, with the rows whose logits are needed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PackedBatch {
    /// Token ids of all sequences, concatenated.
    pub ids: Vec<u32>,
    /// Position of each token within its sequence.
    pub pos: Vec<u32>,
    /// Row range of each sequence.
    pub seqs: Vec<Range<usize>>,
    /// Rows whose logits are computed (the position before each scored token).
    pub rows: Vec<usize>,
    /// The token each selected row predicts.
    pub targets: Vec<u32>,
}

impl PackedBatch {
    /// Packs `(prompt, response)` pairs; the selected rows predict every response token.
    pub fn scored(seqs: &[(&[u32], &[u32])]) -> Self {
        let mut b = Self::default();
        for (prompt, response) in seqs {
            let start = b.ids.len();
            b.ids.extend_from_slice(prompt);
            b.ids.extend_from_slice(response);
            let n = prompt.len() + response.len();
            b.pos.extend(0..n as u32);
            for (t, tok) in response.iter().enumerate() {
                b.rows.push(start + prompt.len() + t - 1);
                b.targets.push(*tok);
            }
            b.seqs.push(start..start + n);
        }
        b
    }

    /// One sequence whose logits are wanted at every position (targets are unused zeros).
    // One sequence is exactly a one-element list of row ranges here.
    #[allow(clippy::single_range_in_vec_init)]
    pub fn all_positions(ids: &[u32]) -> Self {
        Self {
            ids: ids.to_vec(),
            pos: (0..ids.len() as u32).collect(),
            seqs: vec![0..ids.len()],
            rows: (0..ids.len()).collect(),
            targets: vec![0; ids.len()],
        }
    }
}

/// Saved activations of one layer.
#[derive(Debug, Clone, Default)]
#[allow(missing_docs)]
pub struct LayerActs<T> {
    pub ln1: Vec<T>,
    pub ln1_rstd: Vec<T>,
    pub q_pre: Vec<T>,
    pub q_rstd: Vec<T>,
    pub q: Vec<T>,
    pub k_pre: Vec<T>,
    pub k_rstd: Vec<T>,
    pub k: Vec<T>,
    pub v: Vec<T>,
    /// Log-sum-exp of each attention row, `[h, n]` per sequence (the probabilities are
    /// recomputed in the backward).
    pub att_lse: Vec<T>,
    pub att_out: Vec<T>,
    pub x_mid: Vec<T>,
    pub ln2: Vec<T>,
    pub ln2_rstd: Vec<T>,
    pub gate: Vec<T>,
    pub up: Vec<T>,
    pub h: Vec<T>,
}

/// Activations of a forward pass plus backward scratch, reused across calls (grow-only).
#[derive(Debug, Clone, Default)]
pub struct Activations<T> {
    /// Residual stream: `resid[0]` embeddings, `resid[l + 1]` output of layer `l`.
    pub resid: Vec<Vec<T>>,
    /// Per layer.
    pub layers: Vec<LayerActs<T>>,
    /// Offsets of each sequence's rows within a layer's `att_lse`.
    pub att_off: Vec<usize>,
    /// Final norm output, `[N, D]`.
    pub lnf: Vec<T>,
    /// Final norm rstd.
    pub lnf_rstd: Vec<T>,
    /// Final norm rows at the selected positions, `[M, D]`.
    pub hsel: Vec<T>,
    /// Logits at the selected rows, `[M, V]`: only [`Model::forward`] fills them; training and
    /// scoring go through the fused, chunked `lm_head` and never hold them.
    pub logits: Vec<T>,
    /// Per selected row: log-prob of its target, entropy and log-sum-exp (after
    /// [`Model::forward_scored`]).
    pub logp: Vec<T>,
    #[allow(missing_docs)]
    pub entropy: Vec<T>,
    #[allow(missing_docs)]
    pub lse: Vec<T>,
    lm_scratch: Vec<T>,
    /// The one set of recomputed buffers (`ln1`, `q`, `k`, `ln2`, `h`) that the layers lend
    /// each other: see [`Recomputed`].
    spare: Recomputed<T>,
    tmp: Vec<T>,
    dres: Vec<T>,
    dbig: Vec<T>,
    dgate: Vec<T>,
    dup: Vec<T>,
    dln: Vec<T>,
    datt: Vec<T>,
    dq: Vec<T>,
    dk: Vec<T>,
    dv: Vec<T>,
    dqk_pre: Vec<T>,
    dhsel: Vec<T>,
}

/// The activations that are cheap to recompute from what a layer keeps (`ln1` from its input,
/// `q`/`k` from `q_pre`/`k_pre`, `ln2` from `x_mid`, `h` from `gate`/`up`, each with the saved
/// rstd): 8,192 of the 21,504 values per token and layer at Qwen3-0.6B's shapes. Only one set
/// exists: a layer borrows it for its forward, and the backward refills it per layer with the
/// very same ops (so the values are bit-identical) before using it.
#[derive(Debug, Clone, Default)]
struct Recomputed<T> {
    ln1: Vec<T>,
    q: Vec<T>,
    k: Vec<T>,
    ln2: Vec<T>,
    h: Vec<T>,
}

impl<T> Recomputed<T> {
    fn lend(&mut self, la: &mut LayerActs<T>) {
        la.ln1 = std::mem::take(&mut self.ln1);
        la.q = std::mem::take(&mut self.q);
        la.k = std::mem::take(&mut self.k);
        la.ln2 = std::mem::take(&mut self.ln2);
        la.h = std::mem::take(&mut self.h);
    }

    fn reclaim(&mut self, la: &mut LayerActs<T>) {
        self.ln1 = std::mem::take(&mut la.ln1);
        self.q = std::mem::take(&mut la.q);
        self.k = std::mem::take(&mut la.k);
        self.ln2 = std::mem::take(&mut la.ln2);
        self.h = std::mem::take(&mut la.h);
    }
}

/// Resizes to `n` zeros without giving back capacity.
pub(crate) fn fit<T: Float>(v: &mut Vec<T>, n: usize) {
    v.clear();
    v.resize(n, T::ZERO);
}

/// Borrowed weights of one layer.
#[allow(missing_docs)]
pub struct LayerW<'a, T> {
    pub input_norm: &'a [T],
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub o: &'a [T],
    pub q_norm: &'a [T],
    pub k_norm: &'a [T],
    pub post_norm: &'a [T],
    pub gate: &'a [T],
    pub up: &'a [T],
    pub down: &'a [T],
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
            rope: RopeTable::new(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings),
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
            rope: RopeTable::new(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings),
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

    /// The tensor at `off..off + len` as the forward reads it.
    fn mat(&self, off: usize, len: usize) -> Mat<'_, T> {
        match &self.half {
            Some(h) => h.mat(off, len),
            None => Mat::Full(&self.params[off..off + len]),
        }
    }

    /// The 1-D tensor at `off..off + len` in the compute type.
    fn small(&self, off: usize, len: usize) -> &[T] {
        match &self.half {
            Some(h) => h.small(off, len),
            None => &self.params[off..off + len],
        }
    }

    /// The weights of layer `l` as the forward reads them (any storage).
    pub fn layer_fwd(&self, l: usize) -> LayerFwd<'_, T> {
        let c = &self.cfg;
        let o = &self.layout.layers[l];
        let (d, f, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
        LayerFwd {
            input_norm: self.small(o.input_norm, d),
            q: self.mat(o.q, c.q_dim() * d),
            k: self.mat(o.k, c.kv_dim() * d),
            v: self.mat(o.v, c.kv_dim() * d),
            o: self.mat(o.o, d * c.q_dim()),
            q_norm: self.small(o.q_norm, hd),
            k_norm: self.small(o.k_norm, hd),
            post_norm: self.small(o.post_norm, d),
            gate: self.mat(o.gate, f * d),
            up: self.mat(o.up, f * d),
            down: self.mat(o.down, d * f),
        }
    }

    /// `[vocab, hidden]` embedding as the forward reads it.
    pub fn embed_fwd(&self) -> Mat<'_, T> {
        self.mat(
            self.layout.embed,
            self.cfg.vocab_size * self.cfg.hidden_size,
        )
    }

    /// `[vocab, hidden]` output projection as the forward reads it.
    pub fn lm_head_fwd(&self) -> Mat<'_, T> {
        self.mat(
            self.layout.lm_head,
            self.cfg.vocab_size * self.cfg.hidden_size,
        )
    }

    /// The weights of layer `l` in the compute type (training).
    ///
    /// # Panics
    /// On a 16-bit model ([`Model::is_half`]), which has no compute-type copy.
    pub fn layer(&self, l: usize) -> LayerW<'_, T> {
        let c = &self.cfg;
        let o = &self.layout.layers[l];
        let (d, f, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
        let p = |off: usize, len: usize| &self.params[off..off + len];
        LayerW {
            input_norm: p(o.input_norm, d),
            q: p(o.q, c.q_dim() * d),
            k: p(o.k, c.kv_dim() * d),
            v: p(o.v, c.kv_dim() * d),
            o: p(o.o, d * c.q_dim()),
            q_norm: p(o.q_norm, hd),
            k_norm: p(o.k_norm, hd),
            post_norm: p(o.post_norm, d),
            gate: p(o.gate, f * d),
            up: p(o.up, f * d),
            down: p(o.down, d * f),
        }
    }

    /// `[vocab, hidden]` embedding.
    pub fn embed(&self) -> &[T] {
        let n = self.cfg.vocab_size * self.cfg.hidden_size;
        &self.params[self.layout.embed..self.layout.embed + n]
    }

    /// `[vocab, hidden]` output projection (the embedding when tied).
    pub fn lm_head(&self) -> &[T] {
        let n = self.cfg.vocab_size * self.cfg.hidden_size;
        &self.params[self.layout.lm_head..self.layout.lm_head + n]
    }

    /// `[hidden]` final norm weight.
    pub fn final_norm(&self) -> &[T] {
        self.small(self.layout.final_norm, self.cfg.hidden_size)
    }

    /// Forward pass over a packed batch; leaves the full logits of `b.rows` in `a.logits` (for
    /// the `logits` call; training and scoring use [`Model::forward_scored`]).
    ///
    /// # Panics
    /// As [`Model::forward_hidden`].
    pub fn forward(&self, b: &PackedBatch, a: &mut Activations<T>) {
        self.forward_hidden(b, a);
        let (m, d, v) = (b.rows.len(), self.cfg.hidden_size, self.cfg.vocab_size);
        fit(&mut a.logits, m * v);
        matmul_fwd(&mut a.logits, &a.hsel, self.lm_head_fwd(), m, d, v);
    }

    /// Forward pass to the log-probs of `b.targets` at `temperature`: leaves them, the entropy
    /// and the log-sum-exp per selected row in `a.logp`, `a.entropy`, `a.lse`, through the
    /// fused chunked `lm_head` (no `[rows × vocab]` tensor), and keeps every activation the
    /// backward needs.
    ///
    /// # Panics
    /// As [`Model::forward_hidden`].
    pub fn forward_scored(&self, b: &PackedBatch, a: &mut Activations<T>, temperature: f64) {
        self.forward_hidden(b, a);
        let (m, d, v) = (b.rows.len(), self.cfg.hidden_size, self.cfg.vocab_size);
        fit(&mut a.logp, m);
        fit(&mut a.entropy, m);
        fit(&mut a.lse, m);
        // A `logits` call's [rows × vocab] buffer is not kept alive through training.
        a.logits = Vec::new();
        lm_head_logprob_fwd(
            &mut a.logp,
            &mut a.entropy,
            &mut a.lse,
            &a.hsel,
            self.lm_head_fwd(),
            &b.targets,
            m,
            d,
            v,
            temperature,
            &mut a.lm_scratch,
        );
    }

    /// Forward pass through the final norm: leaves the normalised rows `b.rows` in `a.hsel`
    /// and keeps every activation the backward needs.
    ///
    /// # Panics
    /// On token ids not below the vocabulary or positions not below `max_position_embeddings`;
    /// [`Model::accumulate`], [`Model::logprobs`] and the backend check them first.
    pub fn forward_hidden(&self, b: &PackedBatch, a: &mut Activations<T>) {
        let c = &self.cfg;
        let (n, d, f) = (b.ids.len(), c.hidden_size, c.intermediate_size);
        let (h, kvh, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let (qd, kd) = (c.q_dim(), c.kv_dim());
        let nl = c.num_hidden_layers;
        a.resid.resize_with(nl + 1, Vec::new);
        a.layers.resize_with(nl, LayerActs::default);
        a.att_off.clear();
        let mut att_total = 0;
        for s in &b.seqs {
            a.att_off.push(att_total);
            att_total += h * s.len();
        }
        fit(&mut a.resid[0], n * d);
        embedding_fwd(&mut a.resid[0], &b.ids, self.embed_fwd(), d);
        fit(&mut a.tmp, n * d);
        for l in 0..nl {
            let w = self.layer_fwd(l);
            let (lo, hi) = a.resid.split_at_mut(l + 1);
            let (x_in, x_out) = (&lo[l], &mut hi[0]);
            let la = &mut a.layers[l];
            a.spare.lend(la);
            fit(&mut la.ln1, n * d);
            fit(&mut la.ln1_rstd, n);
            rmsnorm_fwd(
                &mut la.ln1,
                &mut la.ln1_rstd,
                x_in,
                w.input_norm,
                d,
                c.rms_norm_eps,
            );
            fit(&mut la.q_pre, n * qd);
            fit(&mut la.k_pre, n * kd);
            fit(&mut la.v, n * kd);
            matmul_fwd(&mut la.q_pre, &la.ln1, w.q, n, d, qd);
            matmul_fwd(&mut la.k_pre, &la.ln1, w.k, n, d, kd);
            matmul_fwd(&mut la.v, &la.ln1, w.v, n, d, kd);
            fit(&mut la.q, n * qd);
            fit(&mut la.q_rstd, n * h);
            fit(&mut la.k, n * kd);
            fit(&mut la.k_rstd, n * kvh);
            rmsnorm_fwd(
                &mut la.q,
                &mut la.q_rstd,
                &la.q_pre,
                w.q_norm,
                hd,
                c.rms_norm_eps,
            );
            rmsnorm_fwd(
                &mut la.k,
                &mut la.k_rstd,
                &la.k_pre,
                w.k_norm,
                hd,
                c.rms_norm_eps,
            );
            rope_fwd(&mut la.q, &b.pos, h, &self.rope);
            rope_fwd(&mut la.k, &b.pos, kvh, &self.rope);
            fit(&mut la.att_lse, att_total);
            fit(&mut la.att_out, n * qd);
            {
                let LayerActs {
                    q,
                    k,
                    v: vv,
                    att_lse,
                    att_out,
                    ..
                } = la;
                let mut tasks = Vec::with_capacity(b.seqs.len());
                let (mut out_rest, mut att_rest) = (&mut att_out[..], &mut att_lse[..]);
                for s in &b.seqs {
                    let m = s.len();
                    let (o, r) = std::mem::take(&mut out_rest).split_at_mut(m * qd);
                    out_rest = r;
                    let (p, r) = std::mem::take(&mut att_rest).split_at_mut(h * m);
                    att_rest = r;
                    tasks.push((s.clone(), o, p));
                }
                let (q, k, vv) = (&q[..], &k[..], &vv[..]);
                tasks.into_par_iter().for_each(|(s, o, p)| {
                    let m = s.len();
                    let mut scratch = vec![T::ZERO; m];
                    attention_fwd_lse(
                        o,
                        p,
                        &mut scratch,
                        &q[s.start * qd..s.end * qd],
                        &k[s.start * kd..s.end * kd],
                        &vv[s.start * kd..s.end * kd],
                        m,
                        m,
                        h,
                        kvh,
                        hd,
                    );
                });
            }
            matmul_fwd(&mut a.tmp, &la.att_out, w.o, n, qd, d);
            fit(&mut la.x_mid, n * d);
            residual_fwd(&mut la.x_mid, x_in, &a.tmp);
            fit(&mut la.ln2, n * d);
            fit(&mut la.ln2_rstd, n);
            rmsnorm_fwd(
                &mut la.ln2,
                &mut la.ln2_rstd,
                &la.x_mid,
                w.post_norm,
                d,
                c.rms_norm_eps,
            );
            fit(&mut la.gate, n * f);
            fit(&mut la.up, n * f);
            fit(&mut la.h, n * f);
            matmul_fwd(&mut la.gate, &la.ln2, w.gate, n, d, f);
            matmul_fwd(&mut la.up, &la.ln2, w.up, n, d, f);
            swiglu_fwd(&mut la.h, &la.gate, &la.up);
            matmul_fwd(&mut a.tmp, &la.h, w.down, n, f, d);
            fit(x_out, n * d);
            residual_fwd(x_out, &la.x_mid, &a.tmp);
            a.spare.reclaim(la);
        }
        fit(&mut a.lnf, n * d);
        fit(&mut a.lnf_rstd, n);
        rmsnorm_fwd(
            &mut a.lnf,
            &mut a.lnf_rstd,
            &a.resid[nl],
            self.final_norm(),
            d,
            c.rms_norm_eps,
        );
        let m = b.rows.len();
        fit(&mut a.hsel, m * d);
        for (i, &r) in b.rows.iter().enumerate() {
            a.hsel[i * d..(i + 1) * d].copy_from_slice(&a.lnf[r * d..(r + 1) * d]);
        }
    }

    /// Backward pass after [`Model::forward_scored`] on the same batch at the same
    /// `temperature`: adds the gradient of the loss whose derivative with respect to the
    /// selected rows' log-probs `a.logp` is `dlogp` into `grads` (flat, same layout).
    ///
    /// # Panics
    /// When `dlogp` or `grads` are shorter than the batch and layout require, or on a bf16
    /// model ([`Model::accumulate`] refuses those with an error).
    pub fn backward(
        &self,
        b: &PackedBatch,
        a: &mut Activations<T>,
        dlogp: &[T],
        temperature: f64,
        grads: &mut [T],
    ) {
        let c = &self.cfg;
        let (n, d, f, v) = (
            b.ids.len(),
            c.hidden_size,
            c.intermediate_size,
            c.vocab_size,
        );
        let (h, kvh, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let (qd, kd) = (c.q_dim(), c.kv_dim());
        let nl = c.num_hidden_layers;
        let lay = &self.layout;
        let m = b.rows.len();
        // lm_head and the row gather
        fit(&mut a.dhsel, m * d);
        lm_head_logprob_bwd(
            &mut a.dhsel,
            &mut grads[lay.lm_head..lay.lm_head + v * d],
            dlogp,
            &a.hsel,
            self.lm_head(),
            &b.targets,
            &a.lse,
            m,
            d,
            v,
            temperature,
            &mut a.lm_scratch,
        );
        fit(&mut a.dbig, n * d);
        for (i, &r) in b.rows.iter().enumerate() {
            for (x, y) in a.dbig[r * d..(r + 1) * d]
                .iter_mut()
                .zip(&a.dhsel[i * d..(i + 1) * d])
            {
                *x += *y;
            }
        }
        fit(&mut a.dres, n * d);
        rmsnorm_bwd(
            &mut a.dres,
            &mut grads[lay.final_norm..lay.final_norm + d],
            &a.dbig,
            &a.resid[nl],
            self.final_norm(),
            &a.lnf_rstd,
            d,
        );
        for l in (0..nl).rev() {
            let w = self.layer(l);
            let o = lay.layers[l];
            let la = &mut a.layers[l];
            a.spare.lend(la);
            self.recompute(la, &a.resid[l], b, l);
            let la = &a.layers[l];
            // MLP: resid[l+1] = x_mid + down(swiglu(gate(ln2), up(ln2)))
            fit(&mut a.dbig, n * f);
            matmul_bwd(
                Some(&mut a.dbig),
                &mut grads[o.down..o.down + d * f],
                &a.dres,
                &la.h,
                w.down,
                n,
                f,
                d,
            );
            fit(&mut a.dgate, n * f);
            fit(&mut a.dup, n * f);
            swiglu_bwd(&mut a.dgate, &mut a.dup, &a.dbig, &la.gate, &la.up);
            fit(&mut a.dln, n * d);
            matmul_bwd(
                Some(&mut a.dln),
                &mut grads[o.gate..o.gate + f * d],
                &a.dgate,
                &la.ln2,
                w.gate,
                n,
                d,
                f,
            );
            matmul_bwd(
                Some(&mut a.dln),
                &mut grads[o.up..o.up + f * d],
                &a.dup,
                &la.ln2,
                w.up,
                n,
                d,
                f,
            );
            rmsnorm_bwd(
                &mut a.dres,
                &mut grads[o.post_norm..o.post_norm + d],
                &a.dln,
                &la.x_mid,
                w.post_norm,
                &la.ln2_rstd,
                d,
            );
            // attention: x_mid = resid[l] + o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v))
            fit(&mut a.datt, n * qd);
            matmul_bwd(
                Some(&mut a.datt),
                &mut grads[o.o..o.o + d * qd],
                &a.dres,
                &la.att_out,
                w.o,
                n,
                qd,
                d,
            );
            fit(&mut a.dq, n * qd);
            fit(&mut a.dk, n * kd);
            fit(&mut a.dv, n * kd);
            {
                let mut tasks = Vec::with_capacity(b.seqs.len());
                let (mut dq_r, mut dk_r, mut dv_r) = (&mut a.dq[..], &mut a.dk[..], &mut a.dv[..]);
                for (si, s) in b.seqs.iter().enumerate() {
                    let ml = s.len();
                    let (x, r) = std::mem::take(&mut dq_r).split_at_mut(ml * qd);
                    dq_r = r;
                    let (y, r) = std::mem::take(&mut dk_r).split_at_mut(ml * kd);
                    dk_r = r;
                    let (z, r) = std::mem::take(&mut dv_r).split_at_mut(ml * kd);
                    dv_r = r;
                    tasks.push((si, s.clone(), x, y, z));
                }
                let (datt, att_off) = (&a.datt[..], &a.att_off[..]);
                tasks.into_par_iter().for_each(|(si, s, dq, dk, dv)| {
                    let ml = s.len();
                    let mut scratch = vec![T::ZERO; 2 * ml];
                    attention_bwd_lse(
                        dq,
                        dk,
                        dv,
                        &mut scratch,
                        &datt[s.start * qd..s.end * qd],
                        &la.att_lse[att_off[si]..att_off[si] + h * ml],
                        &la.q[s.start * qd..s.end * qd],
                        &la.k[s.start * kd..s.end * kd],
                        &la.v[s.start * kd..s.end * kd],
                        ml,
                        ml,
                        h,
                        kvh,
                        hd,
                    );
                });
            }
            rope_bwd(&mut a.dq, &b.pos, h, &self.rope);
            rope_bwd(&mut a.dk, &b.pos, kvh, &self.rope);
            fit(&mut a.dln, n * d);
            fit(&mut a.dqk_pre, n * qd);
            rmsnorm_bwd(
                &mut a.dqk_pre,
                &mut grads[o.q_norm..o.q_norm + hd],
                &a.dq,
                &la.q_pre,
                w.q_norm,
                &la.q_rstd,
                hd,
            );
            matmul_bwd(
                Some(&mut a.dln),
                &mut grads[o.q..o.q + qd * d],
                &a.dqk_pre,
                &la.ln1,
                w.q,
                n,
                d,
                qd,
            );
            fit(&mut a.dqk_pre, n * kd);
            rmsnorm_bwd(
                &mut a.dqk_pre,
                &mut grads[o.k_norm..o.k_norm + hd],
                &a.dk,
                &la.k_pre,
                w.k_norm,
                &la.k_rstd,
                hd,
            );
            matmul_bwd(
                Some(&mut a.dln),
                &mut grads[o.k..o.k + kd * d],
                &a.dqk_pre,
                &la.ln1,
                w.k,
                n,
                d,
                kd,
            );
            matmul_bwd(
                Some(&mut a.dln),
                &mut grads[o.v..o.v + kd * d],
                &a.dv,
                &la.ln1,
                w.v,
                n,
                d,
                kd,
            );
            rmsnorm_bwd(
                &mut a.dres,
                &mut grads[o.input_norm..o.input_norm + d],
                &a.dln,
                &a.resid[l],
                w.input_norm,
                &la.ln1_rstd,
                d,
            );
            a.spare.reclaim(&mut a.layers[l]);
        }
        embedding_bwd(&mut grads[lay.embed..lay.embed + v * d], &a.dres, &b.ids, d);
    }

    /// Refills layer `l`'s recomputed activations (see [`Recomputed`]) from what it saved,
    /// with the forward's own ops and saved rstd values, so they are bit-identical.
    fn recompute(&self, la: &mut LayerActs<T>, x_in: &[T], b: &PackedBatch, l: usize) {
        let c = &self.cfg;
        let w = self.layer_fwd(l);
        let (n, d, f) = (b.ids.len(), c.hidden_size, c.intermediate_size);
        let (h, kvh, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let eps = c.rms_norm_eps;
        fit(&mut la.ln1, n * d);
        rmsnorm_fwd(&mut la.ln1, &mut la.ln1_rstd, x_in, w.input_norm, d, eps);
        fit(&mut la.q, n * c.q_dim());
        rmsnorm_fwd(&mut la.q, &mut la.q_rstd, &la.q_pre, w.q_norm, hd, eps);
        rope_fwd(&mut la.q, &b.pos, h, &self.rope);
        fit(&mut la.k, n * c.kv_dim());
        rmsnorm_fwd(&mut la.k, &mut la.k_rstd, &la.k_pre, w.k_norm, hd, eps);
        rope_fwd(&mut la.k, &b.pos, kvh, &self.rope);
        fit(&mut la.ln2, n * d);
        rmsnorm_fwd(
            &mut la.ln2,
            &mut la.ln2_rstd,
            &la.x_mid,
            w.post_norm,
            d,
            eps,
        );
        fit(&mut la.h, n * f);
        swiglu_fwd(&mut la.h, &la.gate, &la.up);
    }

    /// Forward and backward of `obj` on a micro-batch (checked with [`validate_train_batch`]),
    /// adding the gradient of Σ weight·loss to `grads` (skipped when `None`). A non-finite loss
    /// is an error and skips the backward.
    pub fn accumulate(
        &self,
        batch: &TrainBatch,
        obj: &Objective,
        a: &mut Activations<T>,
        grads: Option<&mut [T]>,
    ) -> Result<AccumStats> {
        validate_train_batch(&self.cfg, batch, obj)?;
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
        let pairs: Vec<(&[u32], &[u32])> = batch
            .sequences
            .iter()
            .map(|s| (&s.prompt[..], &s.response[..]))
            .collect();
        let b = PackedBatch::scored(&pairs);
        let m = b.rows.len();
        let temperature = match obj {
            Objective::Grpo { temperature, .. } => *temperature,
            Objective::Sft => 1.0,
        };
        self.forward_scored(&b, a, temperature);
        let (logp, ent) = (&a.logp[..], &a.entropy[..]);
        let mut stats = AccumStats {
            tokens: m,
            sequences: batch.sequences.len(),
            entropy_sum: ent.iter().map(|x| x.to_f64()).sum(),
            ..Default::default()
        };
        let mut dlogp = vec![T::ZERO; m];
        match *obj {
            Objective::Sft => {
                let mut t = 0;
                for s in &batch.sequences {
                    let w = T::from_f64(s.weight);
                    for _ in 0..s.response.len() {
                        stats.loss_sum -= (w * logp[t]).to_f64();
                        dlogp[t] = -w;
                        t += 1;
                    }
                }
            }
            Objective::Grpo {
                eps_low,
                eps_high,
                beta,
                ..
            } => {
                let (mut old, mut refp, mut adv, mut w) = (
                    Vec::with_capacity(m),
                    Vec::with_capacity(m),
                    Vec::with_capacity(m),
                    Vec::with_capacity(m),
                );
                let mut t = 0;
                for s in &batch.sequences {
                    let n = s.response.len();
                    // None: the current weights' log-probs, detached (constants of the backward).
                    match &s.old_logprobs {
                        Some(o) => old.extend(o.iter().map(|x| T::from_f64(*x as f64))),
                        None => old.extend_from_slice(&logp[t..t + n]),
                    }
                    match &s.ref_logprobs {
                        Some(r) => refp.extend(r.iter().map(|x| T::from_f64(*x as f64))),
                        None => refp.extend_from_slice(&logp[t..t + n]),
                    }
                    adv.extend(std::iter::repeat_n(T::from_f64(s.advantage), n));
                    w.extend(std::iter::repeat_n(T::from_f64(s.weight), n));
                    t += n;
                }
                let coefs = GrpoCoefs {
                    eps_low,
                    eps_high,
                    beta,
                };
                let (mut loss, mut kl, mut clipped) =
                    (vec![T::ZERO; m], vec![T::ZERO; m], vec![false; m]);
                grpo_loss_fwd(
                    &mut loss,
                    &mut kl,
                    &mut clipped,
                    logp,
                    &old,
                    &refp,
                    &adv,
                    &w,
                    coefs,
                );
                grpo_loss_bwd(&mut dlogp, logp, &old, &refp, &adv, &w, coefs);
                stats.loss_sum = loss.iter().map(|x| x.to_f64()).sum();
                stats.kl_sum = kl.iter().map(|x| x.to_f64()).sum();
                stats.clipped = clipped.iter().filter(|c| **c).count();
            }
        }
        if !stats.loss_sum.is_finite() {
            return Err(BackendError::non_finite("loss of the micro-batch"));
        }
        if let Some(grads) = grads {
            self.backward(&b, a, &dlogp, temperature, grads);
        }
        Ok(stats)
    }

    /// Per response token log-probs at `temperature` (sequences and temperature are checked).
    pub fn logprobs(
        &self,
        seqs: &[(&[u32], &[u32])],
        temperature: f64,
        a: &mut Activations<T>,
    ) -> Result<Vec<Vec<f32>>> {
        if seqs.is_empty() {
            return Err(BackendError::EmptyBatch("no sequences to score".into()));
        }
        if !(temperature.is_finite() && temperature > 0.0) {
            return Err(BackendError::invalid(
                "temperature",
                format!("{temperature} must be positive"),
            ));
        }
        for (i, (p, r)) in seqs.iter().enumerate() {
            check_sequence(&self.cfg, p, r, &format!("sequence {i}"))?;
        }
        let b = PackedBatch::scored(seqs);
        self.forward_scored(&b, a, temperature);
        let logp = &a.logp;
        let mut out = Vec::with_capacity(seqs.len());
        let mut t = 0;
        for (_, r) in seqs {
            out.push(
                logp[t..t + r.len()]
                    .iter()
                    .map(|x| x.to_f64() as f32)
                    .collect(),
            );
            t += r.len();
        }
        Ok(out)
    }
}

/// Checks token ids against the vocabulary.
pub fn check_tokens(cfg: &ModelConfig, ids: &[u32], what: &str) -> Result<()> {
    match ids.iter().find(|&&id| id as usize >= cfg.vocab_size) {
        Some(&id) => Err(BackendError::UnknownToken {
            id,
            vocab: cfg.vocab_size,
            what: what.to_string(),
        }),
        None => Ok(()),
    }
}

/// Checks a scored `(prompt, response)` pair: both non-empty, known tokens, within the
/// position limit.
pub fn check_sequence(
    cfg: &ModelConfig,
    prompt: &[u32],
    response: &[u32],
    what: &str,
) -> Result<()> {
    if prompt.is_empty() {
        return Err(BackendError::EmptyBatch(format!("{what}: empty prompt")));
    }
    if response.is_empty() {
        return Err(BackendError::EmptyBatch(format!("{what}: empty response")));
    }
    check_tokens(cfg, prompt, &format!("{what} prompt"))?;
    check_tokens(cfg, response, &format!("{what} response"))?;
    let n = prompt.len() + response.len();
    if n > cfg.max_position_embeddings {
        return Err(BackendError::shape(
            format!("{what} length"),
            format!(
                "at most max_position_embeddings = {}",
                cfg.max_position_embeddings
            ),
            n,
        ));
    }
    Ok(())
}

fn finite_or(x: f64, what: impl FnOnce() -> String) -> Result<()> {
    if x.is_finite() {
        Ok(())
    } else {
        Err(BackendError::non_finite(what()))
    }
}

/// Checks a training micro-batch and objective before any computation.
pub fn validate_train_batch(cfg: &ModelConfig, batch: &TrainBatch, obj: &Objective) -> Result<()> {
    if batch.sequences.is_empty() {
        return Err(BackendError::EmptyBatch(
            "training batch has no sequences".into(),
        ));
    }
    if let Objective::Grpo {
        eps_low,
        eps_high,
        beta,
        temperature,
    } = *obj
    {
        for (what, x) in [("eps_low", eps_low), ("eps_high", eps_high), ("beta", beta)] {
            if !(x.is_finite() && x >= 0.0) {
                return Err(BackendError::invalid(
                    what,
                    format!("{x} is not a finite number ≥ 0"),
                ));
            }
        }
        if eps_low >= 1.0 {
            return Err(BackendError::invalid(
                "eps_low",
                format!("{eps_low} must be below 1"),
            ));
        }
        if !(temperature.is_finite() && temperature > 0.0) {
            return Err(BackendError::invalid(
                "temperature",
                format!("{temperature} must be positive"),
            ));
        }
    }
    for (i, s) in batch.sequences.iter().enumerate() {
        let what = format!("sequence {i}");
        check_sequence(cfg, &s.prompt, &s.response, &what)?;
        finite_or(s.advantage, || format!("{what} advantage"))?;
        finite_or(s.weight, || format!("{what} loss weight"))?;
        if s.weight < 0.0 {
            return Err(BackendError::invalid(
                format!("{what} loss weight"),
                "negative",
            ));
        }
        for (name, lp) in [
            ("old_logprobs", &s.old_logprobs),
            ("ref_logprobs", &s.ref_logprobs),
        ] {
            if let Some(lp) = lp {
                if lp.len() != s.response.len() {
                    return Err(BackendError::shape(
                        format!("{what} {name}"),
                        s.response.len(),
                        lp.len(),
                    ));
                }
                if let Some(j) = lp.iter().position(|x| !x.is_finite() || *x > 1e-3) {
                    return Err(if lp[j].is_finite() {
                        // a log-prob above 0 (beyond rounding) means the caller passed something else
                        BackendError::invalid(
                            format!("{what} {name}[{j}]"),
                            format!("{} is a positive log-prob", lp[j]),
                        )
                    } else {
                        BackendError::non_finite(format!("{what} {name}[{j}]"))
                    });
                }
            }
        }
    }
    Ok(())
}
