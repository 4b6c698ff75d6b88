//! The operations a backend supplies to the one Qwen3 model: llm.c's names, one `*_fwd` /
//! `*_bwd` pair per operation, over the backend's own buffers.
//!
//! The layer loops ([`super::forward`], [`super::backward`], [`super::decode`]) are written
//! once against this trait; a backend implements it with its kernels (the CPU reference's
//! plain ops, WGSL launches recorded into a submission, PTX launches on a stream) and so
//! never writes a layer loop of its own. Weights and their gradient sums are named by
//! [`ParamId`] and live with the backend (a flat buffer, a buffer per tensor, 16-bit storage:
//! its choice). Fused operations a backend needs are methods with a default made of the plain
//! ones: the lm_head with the log-probs (`lm_head_logprob_*`) by default computes the full
//! logits and runs `logprob_*` on them, and the CPU, wgpu and CUDA backends override it with
//! their chunked versions that never hold `[rows × vocab]` values.
//!
//! Conventions: row-major; `n` token rows, `d`/`din`/`dout` widths, `h` query heads, `kvh`
//! key/value heads, `hd` head width, `v` vocabulary, `m` scored rows. Every gradient of a
//! weight is **added** to its sum (tied weights and micro-batches accumulate). An activation
//! gradient is written or added as its [`Acc`] says; ops without one write.

use super::layout::ParamId;
use super::loss::{Loss, LossSums};
use crate::error::Result;

/// Whether an op's output replaces what its buffer holds or adds to it (BLAS's β of 0 or 1):
/// the backward adds a residual branch's gradient into the stream's with `Add`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acc {
    /// Overwrite.
    Set,
    /// Add to the values there.
    Add,
}

/// The attention geometry: `h` query heads sharing `kvh` key/value heads of width `hd`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    /// Query heads.
    pub h: usize,
    /// Key/value heads (divides `h`).
    pub kvh: usize,
    /// Head width.
    pub hd: usize,
}

impl Heads {
    /// The geometry of `cfg`.
    pub fn of(cfg: &crate::config::ModelConfig) -> Self {
        Self {
            h: cfg.num_attention_heads,
            kvh: cfg.num_key_value_heads,
            hd: cfg.head_dim,
        }
    }
}

/// A training batch's per-token loss inputs on the device (see
/// [`LossInputs`](super::loss::LossInputs)).
#[derive(Debug)]
pub struct LossBufs<B, I> {
    /// Stored old log-probs (read where flagged).
    pub old: B,
    /// Stored reference log-probs (read where flagged).
    pub refp: B,
    /// Advantages.
    pub adv: B,
    /// Token weights.
    pub wts: B,
    /// [`flags`](super::loss::flags) per token.
    pub flags: I,
}

/// The outputs of the log-prob ops per scored row.
#[derive(Debug)]
pub struct LogProbs<'a, B> {
    /// Log-prob of the row's target.
    pub logp: &'a mut B,
    /// Entropy of the row's distribution.
    pub entropy: &'a mut B,
    /// Log-sum-exp of the row's scaled logits (the backward reads it).
    pub lse: &'a mut B,
}

/// The operations of the model on one backend. See the module docs.
#[allow(clippy::too_many_arguments)]
pub trait Ops {
    /// A buffer of values (f32; the CPU reference's f64 instance checks gradients).
    type Buf;
    /// A buffer of `u32` indices (token ids, positions, rows).
    type Idx;
    /// Where each row of a packed batch finds its keys (the CPU: sequence ranges; the
    /// devices: per-row windows).
    type Seqs;

    /// Whether a training forward keeps one set of the cheap activations for all layers and
    /// the backward recomputes them per layer ([`Recomputed`](super::acts::Recomputed)),
    /// instead of keeping a set per layer.
    const RECOMPUTE: bool = false;

    /// A buffer of `len` values, zeroed.
    fn buf(&mut self, len: usize) -> Result<Self::Buf>;
    /// A buffer of `len` indices.
    fn idx(&mut self, len: usize) -> Result<Self::Idx>;
    /// Attention windows for up to `n` rows.
    fn seqs(&mut self, n: usize) -> Result<Self::Seqs>;
    /// The rows to allocate for when a batch needs `n`: the CPU allocates exactly what the
    /// largest batch needs, the devices round up so that buffers are rarely replaced.
    fn capacity(&self, n: usize) -> usize;
    /// Told that the activation buffers are being replaced by a set for `cap_n` rows and
    /// `cap_m` scored rows: a device drops what it cached about the old ones and sizes its
    /// own scratch to match.
    fn replaced(&mut self, cap_n: usize, cap_m: usize) -> Result<()> {
        let _ = (cap_n, cap_m);
        Ok(())
    }
    /// Writes `src` at the start of `dst`.
    fn write_buf(&mut self, dst: &mut Self::Buf, src: &[f32]) -> Result<()>;
    /// Writes `src` at the start of `dst`. `scatter`: the indices are rows of a
    /// `scatter`-row table that a backward adds into (a backend may index them for that).
    fn write_idx(&mut self, dst: &mut Self::Idx, src: &[u32], scatter: Option<usize>)
    -> Result<()>;
    /// Writes the attention windows of `seqs` (row ranges of a packed batch).
    fn write_seqs(&mut self, dst: &mut Self::Seqs, seqs: &[std::ops::Range<usize>]) -> Result<()>;
    /// The first `len` values of `src` (waits for what is queued).
    fn read(&mut self, src: &Self::Buf, len: usize) -> Result<Vec<f32>>;

    /// `out[n, d] = table[ids[t], :]`.
    fn embedding_fwd(
        &mut self,
        out: &mut Self::Buf,
        ids: &Self::Idx,
        table: ParamId,
        n: usize,
        d: usize,
    ) -> Result<()>;
    /// `table`'s gradient `[ids[t], :] += dout[t, :]`.
    fn embedding_bwd(
        &mut self,
        table: ParamId,
        dout: &Self::Buf,
        ids: &Self::Idx,
        n: usize,
        d: usize,
    ) -> Result<()>;
    /// `out[i, :] = x[rows[i], :]` for `m` rows of an `[n, d]` buffer.
    fn gather_rows(
        &mut self,
        out: &mut Self::Buf,
        x: &Self::Buf,
        rows: &Self::Idx,
        m: usize,
        n: usize,
        d: usize,
    ) -> Result<()>;
    /// Backward of [`Ops::gather_rows`] for distinct rows: `dx = 0`, then
    /// `dx[rows[i], :] += dout[i, :]`.
    fn scatter_rows(
        &mut self,
        dx: &mut Self::Buf,
        dout: &Self::Buf,
        rows: &Self::Idx,
        m: usize,
        n: usize,
        d: usize,
    ) -> Result<()>;
    /// RMSNorm of `rows` rows of width `d` with weight `w`, keeping `rstd[rows]`.
    fn rmsnorm_fwd(
        &mut self,
        out: &mut Self::Buf,
        rstd: &mut Self::Buf,
        x: &Self::Buf,
        w: ParamId,
        rows: usize,
        d: usize,
        eps: f64,
    ) -> Result<()>;
    /// Backward of [`Ops::rmsnorm_fwd`]: `dx` (per `acc`), and `w`'s gradient.
    fn rmsnorm_bwd(
        &mut self,
        dx: &mut Self::Buf,
        acc: Acc,
        dout: &Self::Buf,
        x: &Self::Buf,
        w: ParamId,
        rstd: &Self::Buf,
        rows: usize,
        d: usize,
    ) -> Result<()>;
    /// `out[n, dout] = x[n, din] · wᵀ`, `w` stored `[dout, din]`.
    fn matmul_fwd(
        &mut self,
        out: &mut Self::Buf,
        x: &Self::Buf,
        w: ParamId,
        n: usize,
        din: usize,
        dout: usize,
    ) -> Result<()>;
    /// Backward of [`Ops::matmul_fwd`]: `dx = dy·w` (per its `Acc`; skipped when `None`),
    /// and `w`'s gradient `+= dyᵀ·x`.
    fn matmul_bwd(
        &mut self,
        dx: Option<(&mut Self::Buf, Acc)>,
        dy: &Self::Buf,
        x: &Self::Buf,
        w: ParamId,
        n: usize,
        din: usize,
        dout: usize,
    ) -> Result<()>;
    /// Rotate-half RoPE in place on `x[rows, heads·hd]` at positions `pos[rows]`.
    fn rope_fwd(
        &mut self,
        x: &mut Self::Buf,
        pos: &Self::Idx,
        rows: usize,
        heads: usize,
        hd: usize,
    ) -> Result<()>;
    /// Backward of [`Ops::rope_fwd`], in place on the gradient.
    fn rope_bwd(
        &mut self,
        dx: &mut Self::Buf,
        pos: &Self::Idx,
        rows: usize,
        heads: usize,
        hd: usize,
    ) -> Result<()>;
    /// Values of the attention statistics a training forward saves for `n` rows.
    fn attention_stats_len(&self, n: usize, heads: Heads) -> usize;
    /// Causal GQA attention of `n` packed rows, each over its sequence's earlier rows
    /// (`seqs`): `out`, and the statistics the backward needs in `stats`.
    fn attention_fwd(
        &mut self,
        out: &mut Self::Buf,
        stats: &mut Self::Buf,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        seqs: &Self::Seqs,
        n: usize,
        heads: Heads,
    ) -> Result<()>;
    /// Backward of [`Ops::attention_fwd`]: writes `dq`, `dk`, `dv` (`stats` may be used as
    /// scratch).
    fn attention_bwd(
        &mut self,
        dq: &mut Self::Buf,
        dk: &mut Self::Buf,
        dv: &mut Self::Buf,
        stats: &mut Self::Buf,
        dout: &Self::Buf,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        out: &Self::Buf,
        seqs: &Self::Seqs,
        n: usize,
        heads: Heads,
    ) -> Result<()>;
    /// `out = silu(gate)·up` over `len` values.
    fn swiglu_fwd(
        &mut self,
        out: &mut Self::Buf,
        gate: &Self::Buf,
        up: &Self::Buf,
        len: usize,
    ) -> Result<()>;
    /// Backward of [`Ops::swiglu_fwd`]: writes `dgate` and `dup`.
    fn swiglu_bwd(
        &mut self,
        dgate: &mut Self::Buf,
        dup: &mut Self::Buf,
        dout: &Self::Buf,
        gate: &Self::Buf,
        up: &Self::Buf,
        len: usize,
    ) -> Result<()>;
    /// `out = a + b` over `len` values.
    fn residual_fwd(
        &mut self,
        out: &mut Self::Buf,
        a: &Self::Buf,
        b: &Self::Buf,
        len: usize,
    ) -> Result<()>;

    /// Per row `r` of `logits[m, v]` at `temperature`: `logp[r] = log_softmax(z)[targets[r]]`,
    /// the entropy and `lse[r] = logsumexp(z)`, with `z = logits / temperature`.
    fn logprob_fwd(
        &mut self,
        out: LogProbs<'_, Self::Buf>,
        logits: &Self::Buf,
        targets: &Self::Idx,
        m: usize,
        v: usize,
        temperature: f64,
    ) -> Result<()>;
    /// Backward of [`Ops::logprob_fwd`]: writes `dlogits[r, j] = dlogp[r]/T ·
    /// (1[j = target] − p_j)`.
    fn logprob_bwd(
        &mut self,
        dlogits: &mut Self::Buf,
        dlogp: &Self::Buf,
        logits: &Self::Buf,
        targets: &Self::Idx,
        lse: &Self::Buf,
        m: usize,
        v: usize,
        temperature: f64,
    ) -> Result<()>;
    /// The output projection `w` fused with [`Ops::logprob_fwd`]: the log-probs of the `m`
    /// rows of `x[m, d]` over a `v`-token vocabulary. By default the full logits, then the
    /// log-probs; a backend overrides it with a chunked version.
    fn lm_head_logprob_fwd(
        &mut self,
        out: LogProbs<'_, Self::Buf>,
        x: &Self::Buf,
        w: ParamId,
        targets: &Self::Idx,
        m: usize,
        d: usize,
        v: usize,
        temperature: f64,
    ) -> Result<()> {
        let mut logits = self.buf(m * v)?;
        self.matmul_fwd(&mut logits, x, w, m, d, v)?;
        self.logprob_fwd(out, &logits, targets, m, v, temperature)
    }
    /// Backward of [`Ops::lm_head_logprob_fwd`] from `dlogp` and the forward's `lse`: writes
    /// `dx`, adds into `w`'s gradient.
    fn lm_head_logprob_bwd(
        &mut self,
        dx: &mut Self::Buf,
        dlogp: &Self::Buf,
        x: &Self::Buf,
        w: ParamId,
        targets: &Self::Idx,
        lse: &Self::Buf,
        m: usize,
        d: usize,
        v: usize,
        temperature: f64,
    ) -> Result<()> {
        let mut logits = self.buf(m * v)?;
        self.matmul_fwd(&mut logits, x, w, m, d, v)?;
        let mut dlogits = self.buf(m * v)?;
        self.logprob_bwd(
            &mut dlogits,
            dlogp,
            &logits,
            targets,
            lse,
            m,
            v,
            temperature,
        )?;
        self.matmul_bwd(Some((dx, Acc::Set)), &dlogits, x, w, m, d, v)
    }
    /// The logits `[m, v]` of the rows of `x[m, d]` through `w`, on the host (inspection).
    fn lm_head_logits(
        &mut self,
        x: &Self::Buf,
        w: ParamId,
        m: usize,
        d: usize,
        v: usize,
    ) -> Result<Vec<f32>> {
        let mut logits = self.buf(m * v)?;
        self.matmul_fwd(&mut logits, x, w, m, d, v)?;
        self.read(&logits, m * v)
    }

    /// The loss of the `m` scored tokens and its four sums (read back to the host).
    fn loss_fwd(
        &mut self,
        logp: &Self::Buf,
        entropy: &Self::Buf,
        inputs: &LossBufs<Self::Buf, Self::Idx>,
        m: usize,
        loss: Loss,
    ) -> Result<LossSums>;
    /// `dlogp = w·∂loss/∂logp` per token (written).
    fn loss_bwd(
        &mut self,
        dlogp: &mut Self::Buf,
        logp: &Self::Buf,
        inputs: &LossBufs<Self::Buf, Self::Idx>,
        m: usize,
        loss: Loss,
    ) -> Result<()>;
}
