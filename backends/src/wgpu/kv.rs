//! The paged KV memory of generation on the device: per layer one key and one value buffer
//! of fixed-size pages (the engine's [`Paged`](crate::engine::Paged) store hands the pages
//! out), and the launchers of the `attention_decode` kernel (the in-place KV-append and the
//! decode attention over pages).
//!
//! A request's page table lists the pages of its positions in order: position `j` lives at
//! pool row `table[j / PAGE] * PAGE + j % PAGE`. The buffers grow to cover the highest page
//! in use, copying the pool once per growth (never per step), up to the most rows one
//! binding can hold.

use wgpu::Buffer;

use super::gpu::{Exec, Gpu, Params, groups, linear};
use super::ops::attention_scale;
use crate::config::ModelConfig;
pub use crate::engine::kv::{PAGE, pages_for};
use crate::error::{BackendError, Result};
use rolloutpipe_kernels::Kernel;

/// Most query heads per KV head `attention_decode` serves (its `GMAX`).
pub const MAX_GQA_GROUP: usize = 8;

/// Refuses a model whose GQA groups the decode attention cannot serve.
pub fn check_gqa(cfg: &ModelConfig) -> Result<()> {
    let g = cfg.num_attention_heads / cfg.num_key_value_heads.max(1);
    if g > MAX_GQA_GROUP {
        return Err(BackendError::invalid(
            "num_attention_heads / num_key_value_heads",
            format!("{g} exceeds the decode attention's {MAX_GQA_GROUP} heads per KV head"),
        ));
    }
    Ok(())
}

/// Pages of `cfg`'s keys (or values) of one layer that one storage binding of `gpu` holds.
pub fn device_pages(gpu: &Gpu, cfg: &ModelConfig) -> usize {
    let limits = gpu.device().limits();
    let bind = limits
        .max_storage_buffer_binding_size
        .min(limits.max_buffer_size);
    let page_bytes = (PAGE * cfg.kv_dim() * 4) as u64;
    (bind / page_bytes).min(u32::MAX as u64) as usize
}

/// The pool's buffers.
#[derive(Debug, Default)]
pub struct KvPool {
    /// Pages the buffers hold now (grown on demand before a step).
    built: usize,
    /// Per layer `[built · PAGE, kv_dim]`.
    k: Vec<Buffer>,
    v: Vec<Buffer>,
}

impl KvPool {
    /// Rows each layer's buffers hold now.
    pub fn rows(&self) -> usize {
        self.built * PAGE
    }

    /// Grows the buffers to hold `pages` pages (doubling, within `max_pages`), copying the
    /// pool's contents after the steps already queued; a no-op when they already do. The
    /// caller drops cached bind groups after a growth (`true`).
    pub fn ensure_built(
        &mut self,
        gpu: &Gpu,
        ex: &mut Exec,
        cfg: &ModelConfig,
        pages: usize,
        max_pages: usize,
    ) -> bool {
        if pages <= self.built {
            return false;
        }
        let pages = pages.max(self.built * 2).max(16).min(max_pages.max(pages));
        let len = pages * PAGE * cfg.kv_dim();
        let mk = |name: &str, l: usize| gpu.buffer(&format!("layer {l} {name} pool"), len);
        let k: Vec<Buffer> = (0..cfg.num_hidden_layers).map(|l| mk("k", l)).collect();
        let v: Vec<Buffer> = (0..cfg.num_hidden_layers).map(|l| mk("v", l)).collect();
        let old = (self.rows() * cfg.kv_dim() * 4) as u64;
        for (from, to) in self.k.iter().zip(&k).chain(self.v.iter().zip(&v)) {
            ex.copy(from, 0, to, 0, old);
        }
        self.k = k;
        self.v = v;
        self.built = pages;
        true
    }

    /// Layer `l`'s key and value buffers.
    pub fn layer(&self, l: usize) -> Result<(&Buffer, &Buffer)> {
        match (self.k.get(l), self.v.get(l)) {
            (Some(k), Some(v)) => Ok((k, v)),
            _ => Err(BackendError::Device(format!("KV pool has no layer {l}"))),
        }
    }
}

/// The buffers of one layer's decode attention: the step's rows and their page tables, as
/// the kernels read them. The KV-append and the attention bind the same set (each entry point
/// ignores what it does not use), so they share one bind group.
#[derive(Debug, Clone, Copy)]
pub struct StepRows<'a> {
    /// `[n, q_dim]` queries.
    pub q: &'a Buffer,
    /// `[n, q_dim]` attention output.
    pub out: &'a Buffer,
    /// `[n, heads, 2]` scratch: each (row, head)'s running max and sum between the launches
    /// of a split decode attention ([`decode_window`]).
    pub state: &'a Buffer,
    /// `[n, kv_dim]` new keys of the step (appended in place).
    pub k: &'a Buffer,
    /// `[n, kv_dim]` new values of the step.
    pub v: &'a Buffer,
    /// `(page-table offset, position)` per row.
    pub meta: &'a Buffer,
    /// The concatenated page tables.
    pub pages: &'a Buffer,
    /// Rows of the step.
    pub n: usize,
    /// Entries of `pages`.
    pub pages_len: usize,
    /// The largest position of the step's rows.
    pub max_pos: usize,
}

/// A window covering every key (the kernel's `kw` is a u32 multiple of 64).
const ALL_KEYS: usize = u32::MAX as usize & !63;

/// Keys per `attention_decode` launch for `c` on `ex`'s adapter: every key in one launch,
/// unless the adapter caps loop iterations ([`Gpu::loop_cap`]). Then as many 64-key chunks
/// as keep one invocation's loop iterations under half the cap: about `g·(head_dim + 400)`
/// a chunk for `g` query heads a kv head (measured on llvmpipe: GQA 8:1 at head_dim 128 went
/// wrong past about 1,250 keys in one launch, 2:1 past about 5,500).
pub fn decode_window(ex: &Exec, c: &ModelConfig) -> usize {
    if let Some(w) = ex.forced_decode_window() {
        return w;
    }
    match ex.gpu().loop_cap() {
        None => usize::MAX,
        Some(cap) => {
            let g = (c.num_attention_heads / c.num_key_value_heads.max(1)).clamp(1, MAX_GQA_GROUP);
            let per_chunk = g * (c.head_dim + 400) + 32;
            64 * (cap / 2 / per_chunk).max(1)
        }
    }
}

impl StepRows<'_> {
    /// One dispatch of `entry` (0: attention over keys `k0 .. k0 + kw`, 1: the append).
    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        ex: &mut Exec,
        pool: &KvPool,
        l: usize,
        c: &ModelConfig,
        entry: usize,
        k0: usize,
        kw: usize,
    ) -> Result<()> {
        let (kp, vp) = pool.layer(l)?;
        let grid = match entry {
            0 => groups(self.n * c.num_key_value_heads),
            _ => linear(self.n * c.kv_dim(), 64),
        };
        let p = Params::new()
            .u(self.n)
            .u(c.num_attention_heads)
            .u(c.num_key_value_heads)
            .u(c.head_dim)
            .u(pool.rows())
            .u(PAGE)
            .u(self.pages_len.max(1))
            .f(attention_scale(c.head_dim))
            .u(k0)
            .u(kw);
        ex.dispatch(
            Kernel::AttentionDecode,
            entry,
            &[
                self.q, self.k, self.v, self.meta, self.pages, kp, vp, self.out, self.state,
            ],
            p,
            grid,
        );
        Ok(())
    }

    /// Writes the step's new keys and values into layer `l`'s pool, each row at its own
    /// position (the KV-append).
    pub fn kv_append(&self, ex: &mut Exec, pool: &KvPool, l: usize, c: &ModelConfig) -> Result<()> {
        self.launch(ex, pool, l, c, 1, 0, ALL_KEYS)
    }

    /// `out`: each row's attention over positions `0 ..= pos` of its pages in layer `l`
    /// (after [`StepRows::kv_append`] of the step's rows).
    pub fn attention_decode(
        &self,
        ex: &mut Exec,
        pool: &KvPool,
        l: usize,
        c: &ModelConfig,
    ) -> Result<()> {
        // One launch per window of keys: one unless the adapter caps loops.
        let window = decode_window(ex, c).min(ALL_KEYS);
        for k0 in (0..=self.max_pos).step_by(window) {
            self.launch(ex, pool, l, c, 0, k0, window)?;
        }
        Ok(())
    }
}
