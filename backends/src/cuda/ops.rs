//! One launcher per PTX entry, named and shaped like `cpu::ops` (and the wgpu launchers).
//!
//! Each launcher checks every buffer against the extent its kernel touches (the file's
//! **Arguments** section), derives the grid from [`plan`](super::plan), packs the arguments
//! and launches on the context's stream; launches over zero elements are skipped. Unlike
//! some WGSL twins, the PTX backward kernels always **accumulate** (`+=`) into their
//! gradients, like the CPU reference; a caller that wants fresh gradients clears first.

use rolloutpipe_kernels::Kernel;

use super::abi::Arg;
use super::device::{Cuda, DBuf};
use super::plan::{self, AdamScalars, GemmF32, LaunchDims};
use crate::error::Result;
use crate::model::Loss;

fn n32(n: usize, what: &str) -> Result<Arg> {
    Arg::count(n, what)
}

/// `out[n, d] = table[ids[n], :]` (also a row gather: `table` any `[rows, d]`).
pub fn embedding_fwd(
    c: &Cuda,
    out: &DBuf<f32>,
    table: &DBuf<f32>,
    ids: &DBuf<u32>,
    n: usize,
    d: usize,
    vocab: usize,
) -> Result<()> {
    if n == 0 || d == 0 {
        return Ok(());
    }
    let args = [
        out.arg(n * d, "embedding_fwd out")?,
        table.arg(vocab * d, "embedding_fwd table")?,
        ids.arg(n, "embedding_fwd ids")?,
        n32(n, "embedding_fwd n")?,
        n32(d, "embedding_fwd d")?,
        n32(vocab, "embedding_fwd vocab")?,
    ];
    let dims = LaunchDims::per_row(n, 256, "embedding_fwd")?;
    c.launch(Kernel::EmbeddingFwd, "embedding_fwd", dims, &args)
}

/// `dtable[ids[t], :] += dout[t, :]` in token order (also a row scatter-add).
pub fn embedding_bwd(
    c: &Cuda,
    dtable: &DBuf<f32>,
    dout: &DBuf<f32>,
    ids: &DBuf<u32>,
    n: usize,
    d: usize,
    vocab: usize,
) -> Result<()> {
    if n == 0 || d == 0 {
        return Ok(());
    }
    let args = [
        dtable.arg(vocab * d, "embedding_bwd dtable")?,
        dout.arg(n * d, "embedding_bwd dout")?,
        ids.arg(n, "embedding_bwd ids")?,
        n32(n, "embedding_bwd n")?,
        n32(d, "embedding_bwd d")?,
        n32(vocab, "embedding_bwd vocab")?,
    ];
    let dims = LaunchDims::per_thread(d, 64, "embedding_bwd")?;
    c.launch(Kernel::EmbeddingBwd, "embedding_bwd", dims, &args)
}

/// RMSNorm of `rows` rows of width `d`, saving `rstd[rows]`.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_fwd(
    c: &Cuda,
    out: &DBuf<f32>,
    rstd: &DBuf<f32>,
    x: &DBuf<f32>,
    w: &DBuf<f32>,
    rows: usize,
    d: usize,
    eps: f64,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let args = [
        out.arg(rows * d, "rmsnorm_fwd out")?,
        rstd.arg(rows, "rmsnorm_fwd rstd")?,
        x.arg(rows * d, "rmsnorm_fwd x")?,
        w.arg(d, "rmsnorm_fwd w")?,
        n32(rows, "rmsnorm_fwd rows")?,
        n32(d, "rmsnorm_fwd d")?,
        Arg::F32(eps as f32),
    ];
    let dims = LaunchDims::per_row(rows, 128, "rmsnorm_fwd")?;
    c.launch(Kernel::RmsnormFwd, "rmsnorm_fwd", dims, &args)
}

/// RMSNorm backward, accumulated: `dx += ...` per row, then `dw += ...` per column.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_bwd(
    c: &Cuda,
    dx: &DBuf<f32>,
    dw: &DBuf<f32>,
    dout: &DBuf<f32>,
    x: &DBuf<f32>,
    w: &DBuf<f32>,
    rstd: &DBuf<f32>,
    rows: usize,
    d: usize,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let args = [
        dx.arg(rows * d, "rmsnorm_bwd dx")?,
        dw.arg(d, "rmsnorm_bwd dw")?,
        dout.arg(rows * d, "rmsnorm_bwd dout")?,
        x.arg(rows * d, "rmsnorm_bwd x")?,
        w.arg(d, "rmsnorm_bwd w")?,
        rstd.arg(rows, "rmsnorm_bwd rstd")?,
        n32(rows, "rmsnorm_bwd rows")?,
        n32(d, "rmsnorm_bwd d")?,
    ];
    let dims = LaunchDims::per_row(rows, 128, "rmsnorm_bwd")?;
    c.launch(Kernel::RmsnormBwd, "rmsnorm_bwd", dims, &args)?;
    let dims = LaunchDims::per_thread(d, 128, "rmsnorm_bwd_dw")?;
    c.launch(Kernel::RmsnormBwd, "rmsnorm_bwd_dw", dims, &args)
}

/// An f32 GEMM operand: a buffer and the element offset its matrix starts at.
pub type At<'a> = (&'a DBuf<f32>, usize);

/// One strided f32 GEMM (`matmul_fwd_f32`): `C (=|+=) A . B` as planned by `g`.
pub fn gemm_f32(c: &Cuda, out: At, a: At, b: At, g: GemmF32) -> Result<()> {
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    if g.k == 0 {
        // An empty reduction: C = 0 (or unchanged when accumulating).
        return if g.accumulate {
            Ok(())
        } else {
            Err(crate::error::BackendError::invalid(
                "matmul_fwd_f32",
                "a product over an empty reduction",
            ))
        };
    }
    let (ea, eb) = g.extents();
    let args = [
        out.0.at(out.1, g.m * g.n, "matmul_fwd_f32 C")?,
        a.0.at(a.1, ea, "matmul_fwd_f32 A")?,
        b.0.at(b.1, eb, "matmul_fwd_f32 B")?,
        n32(g.m, "matmul m")?,
        n32(g.n, "matmul n")?,
        n32(g.k, "matmul k")?,
        n32(g.rsa, "matmul rsa")?,
        n32(g.csa, "matmul csa")?,
        n32(g.rsb, "matmul rsb")?,
        n32(g.csb, "matmul csb")?,
        Arg::U32(g.accumulate as u32),
    ];
    c.launch(Kernel::MatmulFwd, "matmul_fwd_f32", g.dims()?, &args)
}

/// `y[rows, dout] = x[rows, din] . w[dout, din]^T` in f32.
pub fn matmul_fwd(
    c: &Cuda,
    y: &DBuf<f32>,
    x: &DBuf<f32>,
    w: &DBuf<f32>,
    rows: usize,
    din: usize,
    dout: usize,
) -> Result<()> {
    gemm_f32(c, (y, 0), (x, 0), (w, 0), GemmF32::fwd(rows, din, dout))
}

/// `dx += dy . w` (when `dx` is given) and `dw += dy^T . x`, in f32.
#[allow(clippy::too_many_arguments)]
pub fn matmul_bwd(
    c: &Cuda,
    dx: Option<&DBuf<f32>>,
    dw: &DBuf<f32>,
    dy: &DBuf<f32>,
    x: &DBuf<f32>,
    w: &DBuf<f32>,
    rows: usize,
    din: usize,
    dout: usize,
) -> Result<()> {
    if let Some(dx) = dx {
        gemm_f32(
            c,
            (dx, 0),
            (dy, 0),
            (w, 0),
            GemmF32::bwd_dx(rows, din, dout),
        )?;
    }
    gemm_f32(
        c,
        (dw, 0),
        (dy, 0),
        (x, 0),
        GemmF32::bwd_dw(rows, din, dout),
    )
}

/// `dst[n] = bf16(src[n])` (round to nearest even), bf16 stored as `u16`.
pub fn cast_bf16(c: &Cuda, dst: &DBuf<u16>, src: &DBuf<f32>, n: usize) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let args = [
        dst.arg(n, "matmul_fwd_cast dst")?,
        src.arg(n, "matmul_fwd_cast src")?,
        n32(n, "matmul_fwd_cast n")?,
    ];
    let dims = LaunchDims::grid_stride(n.div_ceil(2), "matmul_fwd_cast")?;
    c.launch(Kernel::MatmulFwd, "matmul_fwd_cast", dims, &args)
}

/// Tensor cores: `y[rows, dout] = x[rows, din] . w[dout, din]^T`, bf16 inputs, f32 out.
pub fn matmul_fwd_tc(
    c: &Cuda,
    y: &DBuf<f32>,
    x: &DBuf<u16>,
    w: &DBuf<u16>,
    rows: usize,
    din: usize,
    dout: usize,
) -> Result<()> {
    if rows == 0 || dout == 0 {
        return Ok(());
    }
    plan::check_tensor_core("matmul_fwd", &[din])?;
    let args = [
        y.arg(rows * dout, "matmul_fwd y")?,
        x.arg(rows * din, "matmul_fwd x")?,
        w.arg(dout * din, "matmul_fwd w")?,
        n32(rows, "matmul_fwd M")?,
        n32(dout, "matmul_fwd N")?,
        n32(din, "matmul_fwd K")?,
    ];
    let dims = LaunchDims::tiles(dout, rows, 128, "matmul_fwd")?;
    c.launch(Kernel::MatmulFwd, "matmul_fwd", dims, &args)
}

/// Tensor cores: `dx[rows, din] += dy . w` and `dw[dout, din] += dy^T . x`, bf16 inputs.
#[allow(clippy::too_many_arguments)]
pub fn matmul_bwd_tc(
    c: &Cuda,
    dx: Option<&DBuf<f32>>,
    dw: &DBuf<f32>,
    dy: &DBuf<u16>,
    x: &DBuf<u16>,
    w: &DBuf<u16>,
    rows: usize,
    din: usize,
    dout: usize,
) -> Result<()> {
    if rows == 0 || dout == 0 || din == 0 {
        return Ok(());
    }
    plan::check_tensor_core("matmul_bwd", &[din, dout])?;
    if let Some(dx) = dx {
        // Product shape (m, n, k) = (rows, din, dout).
        let args = [
            dx.arg(rows * din, "matmul_bwd_dx dx")?,
            dy.arg(rows * dout, "matmul_bwd_dx dy")?,
            w.arg(dout * din, "matmul_bwd_dx w")?,
            n32(rows, "matmul_bwd_dx m")?,
            n32(din, "matmul_bwd_dx n")?,
            n32(dout, "matmul_bwd_dx k")?,
        ];
        let dims = LaunchDims::tiles(din, rows, 128, "matmul_bwd_dx")?;
        c.launch(Kernel::MatmulBwd, "matmul_bwd_dx", dims, &args)?;
    }
    // Product shape (m, n, k) = (dout, din, rows).
    let args = [
        dw.arg(dout * din, "matmul_bwd_dw dw")?,
        dy.arg(rows * dout, "matmul_bwd_dw dy")?,
        x.arg(rows * din, "matmul_bwd_dw x")?,
        n32(dout, "matmul_bwd_dw m")?,
        n32(din, "matmul_bwd_dw n")?,
        n32(rows, "matmul_bwd_dw k")?,
    ];
    let dims = LaunchDims::tiles(din, dout, 128, "matmul_bwd_dw")?;
    c.launch(Kernel::MatmulBwd, "matmul_bwd_dw", dims, &args)
}

/// Rotates `x[n, heads, 2*half]` in place (`fwd`) or by the transposed rotation.
#[allow(clippy::too_many_arguments)]
pub fn rope(
    c: &Cuda,
    fwd: bool,
    x: &DBuf<f32>,
    pos: &DBuf<u32>,
    cos: &DBuf<f32>,
    sin: &DBuf<f32>,
    n: usize,
    heads: usize,
    hd: usize,
    max_pos: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let (entry, kernel) = if fwd {
        ("rope_fwd", Kernel::RopeFwd)
    } else {
        ("rope_bwd", Kernel::RopeBwd)
    };
    let half = hd / 2;
    let args = [
        x.arg(n * heads * hd, "rope x")?,
        pos.arg(n, "rope pos")?,
        cos.arg(max_pos * half, "rope cos")?,
        sin.arg(max_pos * half, "rope sin")?,
        n32(n, "rope n")?,
        n32(heads, "rope heads")?,
        n32(half, "rope half")?,
        n32(max_pos, "rope max_pos")?,
    ];
    c.launch(kernel, entry, LaunchDims::per_row(n, 256, entry)?, &args)
}

/// Shapes of one attention launch.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Query rows.
    pub n_q: usize,
    /// Key rows of `k`/`v` (a packed batch or a whole KV cache).
    pub n_k: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dim of the buffers (32, 64, 96 or 128).
    pub hd: usize,
    /// Score scale (`model head_dim^-1/2`; differs from `hd` only for a padded head).
    pub scale: f32,
}

impl AttnShape {
    fn args(&self, ptrs: impl IntoIterator<Item = Arg>, what: &str) -> Result<Vec<Arg>> {
        plan::check_head_dim(self.hd)?;
        let mut a: Vec<Arg> = ptrs.into_iter().collect();
        a.extend([
            n32(self.n_q, what)?,
            n32(self.heads, what)?,
            n32(self.kv_heads, what)?,
            n32(self.hd, what)?,
            n32(self.n_k, what)?,
            Arg::F32(self.scale),
        ]);
        Ok(a)
    }
}

/// Causal GQA attention: `out[n_q, heads*hd]`, `stats[..n_q*heads]` = lse; query `i`
/// attends key rows `qmeta[2i] ..= qmeta[2i] + qmeta[2i+1]`.
#[allow(clippy::too_many_arguments)]
pub fn attention_fwd(
    c: &Cuda,
    out: &DBuf<f32>,
    stats: &DBuf<f32>,
    q: &DBuf<f32>,
    k: &DBuf<f32>,
    v: &DBuf<f32>,
    qmeta: &DBuf<u32>,
    s: AttnShape,
) -> Result<()> {
    if s.n_q == 0 {
        return Ok(());
    }
    let (qd, kd) = (s.heads * s.hd, s.kv_heads * s.hd);
    let args = s.args(
        [
            out.arg(s.n_q * qd, "attention out")?,
            stats.arg(2 * s.n_q * s.heads, "attention stats")?,
            q.arg(s.n_q * qd, "attention q")?,
            k.arg(s.n_k * kd, "attention k")?,
            v.arg(s.n_k * kd, "attention v")?,
            qmeta.arg(2 * s.n_q, "attention qmeta")?,
        ],
        "attention_fwd",
    )?;
    let dims = LaunchDims::warp_per_pair(s.n_q * s.heads, "attention_fwd")?;
    c.launch(Kernel::AttentionFwd, "attention_fwd", dims, &args)
}

/// Attention backward, accumulated into `dq`, `dk`, `dv`; `stats` holds the forward's lse
/// (its second half receives D).
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd(
    c: &Cuda,
    dq: &DBuf<f32>,
    dk: &DBuf<f32>,
    dv: &DBuf<f32>,
    stats: &DBuf<f32>,
    dout: &DBuf<f32>,
    out: &DBuf<f32>,
    q: &DBuf<f32>,
    k: &DBuf<f32>,
    v: &DBuf<f32>,
    qmeta: &DBuf<u32>,
    s: AttnShape,
) -> Result<()> {
    if s.n_q == 0 {
        return Ok(());
    }
    let (qd, kd) = (s.heads * s.hd, s.kv_heads * s.hd);
    let args = s.args(
        [
            dq.arg(s.n_q * qd, "attention dq")?,
            dk.arg(s.n_k * kd, "attention dk")?,
            dv.arg(s.n_k * kd, "attention dv")?,
            stats.arg(2 * s.n_q * s.heads, "attention stats")?,
            dout.arg(s.n_q * qd, "attention dout")?,
            out.arg(s.n_q * qd, "attention out")?,
            q.arg(s.n_q * qd, "attention q")?,
            k.arg(s.n_k * kd, "attention k")?,
            v.arg(s.n_k * kd, "attention v")?,
            qmeta.arg(2 * s.n_q, "attention qmeta")?,
        ],
        "attention_bwd",
    )?;
    let dims = LaunchDims::warp_per_pair(s.n_q * s.heads, "attention_bwd_dq")?;
    c.launch(Kernel::AttentionBwd, "attention_bwd_dq", dims, &args)?;
    let dims = LaunchDims::warp_per_pair(s.n_k * s.kv_heads, "attention_bwd_dkv")?;
    c.launch(Kernel::AttentionBwd, "attention_bwd_dkv", dims, &args)
}

/// `out = silu(gate) * up`.
pub fn swiglu_fwd(
    c: &Cuda,
    out: &DBuf<f32>,
    gate: &DBuf<f32>,
    up: &DBuf<f32>,
    n: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let args = [
        out.arg(n, "swiglu out")?,
        gate.arg(n, "swiglu gate")?,
        up.arg(n, "swiglu up")?,
        n32(n, "swiglu n")?,
    ];
    let dims = LaunchDims::grid_stride(n, "swiglu_fwd")?;
    c.launch(Kernel::SwigluFwd, "swiglu_fwd", dims, &args)
}

/// `dgate += ...`, `dup += ...` of `silu(gate) * up`.
pub fn swiglu_bwd(
    c: &Cuda,
    dgate: &DBuf<f32>,
    dup: &DBuf<f32>,
    dout: &DBuf<f32>,
    gate: &DBuf<f32>,
    up: &DBuf<f32>,
    n: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let args = [
        dgate.arg(n, "swiglu dgate")?,
        dup.arg(n, "swiglu dup")?,
        dout.arg(n, "swiglu dout")?,
        gate.arg(n, "swiglu gate")?,
        up.arg(n, "swiglu up")?,
        n32(n, "swiglu n")?,
    ];
    let dims = LaunchDims::grid_stride(n, "swiglu_bwd")?;
    c.launch(Kernel::SwigluBwd, "swiglu_bwd", dims, &args)
}

/// `out = a + b` (out may alias a or b).
pub fn residual_fwd(
    c: &Cuda,
    out: &DBuf<f32>,
    a: &DBuf<f32>,
    b: &DBuf<f32>,
    n: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let args = [
        out.arg(n, "residual out")?,
        a.arg(n, "residual a")?,
        b.arg(n, "residual b")?,
        n32(n, "residual n")?,
    ];
    let dims = LaunchDims::grid_stride(n, "residual_fwd")?;
    c.launch(Kernel::ResidualFwd, "residual_fwd", dims, &args)
}

/// Folds one vocabulary chunk's logits `[rows, chunk]` (tokens `v0..v0+chunk`) into the
/// per-row online log-sum-exp state `[rows, 4]` (`first` starts it fresh).
#[allow(clippy::too_many_arguments)]
pub fn logprob_fwd_chunk(
    c: &Cuda,
    state: &DBuf<f32>,
    logits: &DBuf<f32>,
    targets: &DBuf<u32>,
    rows: usize,
    chunk: usize,
    v0: usize,
    first: bool,
    temperature: f64,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let args = [
        state.arg(4 * rows, "logprob state")?,
        logits.arg(rows * chunk, "logprob logits")?,
        targets.arg(rows, "logprob targets")?,
        n32(rows, "logprob rows")?,
        n32(chunk, "logprob chunk")?,
        n32(v0, "logprob v0")?,
        Arg::U32(first as u32),
        Arg::F32((1.0 / temperature) as f32),
    ];
    let dims = LaunchDims::per_row(rows, 256, "logprob_fwd")?;
    c.launch(Kernel::LogprobFwd, "logprob_fwd", dims, &args)
}

/// `logp`, `entropy`, `lse` per row from the folded state.
pub fn logprob_fwd_finish(
    c: &Cuda,
    logp: &DBuf<f32>,
    entropy: &DBuf<f32>,
    lse: &DBuf<f32>,
    state: &DBuf<f32>,
    rows: usize,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let args = [
        logp.arg(rows, "logprob logp")?,
        entropy.arg(rows, "logprob entropy")?,
        lse.arg(rows, "logprob lse")?,
        state.arg(4 * rows, "logprob state")?,
        n32(rows, "logprob rows")?,
    ];
    let dims = LaunchDims::per_thread(rows, 256, "logprob_fwd_finish")?;
    c.launch(Kernel::LogprobFwd, "logprob_fwd_finish", dims, &args)
}

/// Turns one chunk's logits `[rows, chunk]` into `dlogits` in place (and a bf16 copy when
/// `bf16` is given).
#[allow(clippy::too_many_arguments)]
pub fn logprob_bwd_chunk(
    c: &Cuda,
    logits: &DBuf<f32>,
    bf16: Option<&DBuf<u16>>,
    dlogp: &DBuf<f32>,
    lse: &DBuf<f32>,
    targets: &DBuf<u32>,
    rows: usize,
    chunk: usize,
    v0: usize,
    temperature: f64,
) -> Result<()> {
    if rows == 0 || chunk == 0 {
        return Ok(());
    }
    let args = [
        logits.arg(rows * chunk, "logprob_bwd logits")?,
        match bf16 {
            Some(b) => b.arg(rows * chunk, "logprob_bwd bf16")?,
            None => Arg::Ptr(0),
        },
        dlogp.arg(rows, "logprob_bwd dlogp")?,
        lse.arg(rows, "logprob_bwd lse")?,
        targets.arg(rows, "logprob_bwd targets")?,
        n32(rows, "logprob_bwd rows")?,
        n32(chunk, "logprob_bwd chunk")?,
        n32(v0, "logprob_bwd v0")?,
        Arg::F32((1.0 / temperature) as f32),
    ];
    let dims = LaunchDims::row_chunks(rows, chunk, "logprob_bwd")?;
    c.launch(Kernel::LogprobBwd, "logprob_bwd", dims, &args)
}

/// The per-token loss inputs on the device, `n` tokens each.
#[derive(Debug, Clone, Copy)]
pub struct LossBufs<'a> {
    /// Current log-probs.
    pub logp: &'a DBuf<f32>,
    /// Stored old log-probs (read where flagged).
    pub old: &'a DBuf<f32>,
    /// Stored reference log-probs (read where flagged).
    pub refp: &'a DBuf<f32>,
    /// Advantages.
    pub adv: &'a DBuf<f32>,
    /// Token weights.
    pub w: &'a DBuf<f32>,
    /// [`plan::flags`] per token.
    pub flags: &'a DBuf<u32>,
}

/// `stats[4] = [sum w*L, sum KL, #clipped, sum entropy]` of `loss`.
pub fn grpo_loss_fwd(
    c: &Cuda,
    stats: &DBuf<f32>,
    x: LossBufs,
    entropy: &DBuf<f32>,
    n: usize,
    loss: Loss,
) -> Result<()> {
    let (obj, lo, hi, beta) = plan::loss_scalars(loss);
    let args = [
        x.logp.arg(n, "loss logp")?,
        x.old.arg(n, "loss old")?,
        x.refp.arg(n, "loss ref")?,
        x.adv.arg(n, "loss adv")?,
        x.w.arg(n, "loss weight")?,
        entropy.arg(n, "loss entropy")?,
        x.flags.arg(n, "loss flags")?,
        stats.arg(4, "loss stats")?,
        n32(n, "loss n")?,
        Arg::U32(obj),
        Arg::F32(lo),
        Arg::F32(hi),
        Arg::F32(beta),
    ];
    let dims = LaunchDims::new(1, 1, 256, "grpo_loss_fwd")?;
    c.launch(Kernel::GrpoLossFwd, "grpo_loss_fwd", dims, &args)
}

/// `dlogp[n]` (written) of the weighted loss.
pub fn grpo_loss_bwd(c: &Cuda, dlogp: &DBuf<f32>, x: LossBufs, n: usize, loss: Loss) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let (obj, lo, hi, beta) = plan::loss_scalars(loss);
    let args = [
        dlogp.arg(n, "loss dlogp")?,
        x.logp.arg(n, "loss logp")?,
        x.old.arg(n, "loss old")?,
        x.refp.arg(n, "loss ref")?,
        x.adv.arg(n, "loss adv")?,
        x.w.arg(n, "loss weight")?,
        x.flags.arg(n, "loss flags")?,
        n32(n, "loss n")?,
        Arg::U32(obj),
        Arg::F32(lo),
        Arg::F32(hi),
        Arg::F32(beta),
    ];
    let dims = LaunchDims::grid_stride(n, "grpo_loss_bwd")?;
    c.launch(Kernel::GrpoLossBwd, "grpo_loss_bwd", dims, &args)
}

/// One AdamW step of `n` values in place.
pub fn adamw_step(
    c: &Cuda,
    p: &DBuf<f32>,
    g: &DBuf<f32>,
    m: &DBuf<f32>,
    v: &DBuf<f32>,
    n: usize,
    s: AdamScalars,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let args = [
        p.arg(n, "adamw p")?,
        g.arg(n, "adamw grad")?,
        m.arg(n, "adamw m")?,
        v.arg(n, "adamw v")?,
        n32(n, "adamw n")?,
        Arg::F32(s.grad_scale),
        Arg::F32(s.decay),
        Arg::F32(s.step_size),
        Arg::F32(s.one_minus_beta1),
        Arg::F32(s.beta2),
        Arg::F32(s.one_minus_beta2),
        Arg::F32(s.sqrt_bc2),
        Arg::F32(s.eps),
    ];
    let dims = LaunchDims::grid_stride(n, "adamw_step")?;
    c.launch(Kernel::AdamwStep, "adamw_step", dims, &args)
}

/// Sum of squares of `g[n]` (f64) into `partials[base .. base + grad_norm_partials(n)]`.
pub fn grad_norm(
    c: &Cuda,
    partials: &DBuf<f64>,
    g: &DBuf<f32>,
    n: usize,
    base: usize,
) -> Result<()> {
    let blocks = plan::grad_norm_partials(n);
    let args = [
        g.arg(n, "grad_norm g")?,
        partials.arg(base + blocks, "grad_norm partials")?,
        n32(n, "grad_norm n")?,
        n32(base, "grad_norm base")?,
    ];
    let dims = LaunchDims::new(blocks as u64, 1, 256, "grad_norm")?;
    c.launch(Kernel::GradNorm, "grad_norm", dims, &args)
}

/// `total[0] = sum partials[0..count]` in a fixed order.
pub fn grad_norm_reduce(
    c: &Cuda,
    total: &DBuf<f64>,
    partials: &DBuf<f64>,
    count: usize,
) -> Result<()> {
    let args = [
        partials.arg(count, "grad_norm_reduce partials")?,
        total.arg(1, "grad_norm_reduce total")?,
        n32(count, "grad_norm_reduce count")?,
    ];
    let dims = LaunchDims::new(1, 1, 256, "grad_norm_reduce")?;
    c.launch(Kernel::GradNorm, "grad_norm_reduce", dims, &args)
}

/// One token per row of `logits[rows, vocab]` with `rowp[rows]` from
/// [`plan::sample_row`] (stored flat, 4 floats per row).
pub fn sample(
    c: &Cuda,
    tokens: &DBuf<u32>,
    logp: &DBuf<f32>,
    logits: &DBuf<f32>,
    rowp: &DBuf<f32>,
    rows: usize,
    vocab: usize,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let args = [
        logits.arg(rows * vocab, "sample logits")?,
        rowp.arg(4 * rows, "sample rowp")?,
        tokens.arg(rows, "sample tokens")?,
        logp.arg(rows, "sample logp")?,
        n32(rows, "sample rows")?,
        n32(vocab, "sample vocab")?,
    ];
    let dims = LaunchDims::per_row(rows, 256, "sample")?;
    c.launch(Kernel::Sample, "sample", dims, &args)
}
