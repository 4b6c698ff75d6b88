//! Kernel sources of RolloutPipe, embedded as strings; no dependencies.
//!
//! Each op also has a hand-written PTX file in `kernels/ptx/<op>.ptx` for the CUDA backend
//! ([`Kernel::ptx`], [`Kernel::ptx_entry_points`]); `tests/ptx.rs` checks their listing and
//! headers, `scripts/ci.d/ptx.sh` assembles them with `ptxas` and checks their resources
//! against `kernels/ptx/resources.toml` (docs/cuda.md).
//!
//! Every op of the Qwen3 forward and backward, sampling, log-probs, the GRPO loss and AdamW
//! has one WGSL file in `kernels/wgsl/<op>.wgsl`, named like the CPU reference's function
//! (`rmsnorm_fwd` in `cpu/ops.rs`, `fn rmsnorm_fwd` in WGSL, [`Kernel::RmsnormFwd`] here).
//! Backends load them through [`Kernel::wgsl`]; this crate knows no device, so it builds
//! everywhere and a broken kernel is caught on the CPU by `tests/naga.rs`.
//!
//! Helpers that several kernels need are written once, in `kernels/wgsl/prelude/` (`gemm`:
//! the tiled GEMM body of `matmul_fwd` and `matmul_bwd`; `reduce`: workgroup tree
//! reductions; `lse`: per-row max and shifted exponential sums), and [`Kernel::wgsl`] prepends the ones a
//! kernel lists ([`Kernel::preludes`]) to its file.
//!
//! The two kernels that read a parameter matrix, `embedding_fwd` and `matmul_fwd`
//! ([`Kernel::reads_weights`]), read it through one hook, `weight(i)`, that a `weight_<format>`
//! prelude defines together with the binding: [`Kernel::wgsl`] is their f32 source and
//! [`Kernel::wgsl_as`] the same source with the bf16 or f16 prelude instead ([`WeightFormat`]:
//! pairs of 16-bit values packed in `array<u32>`, widened exactly in registers, on any
//! adapter). Nothing else of the kernel differs between formats.
//!
//! Two files are not ops of their own: `matmul_fwd_coop.wgsl` and `matmul_bwd_coop.wgsl`,
//! the forward and backward products on cooperative matrices (tensor cores; f16 operands,
//! f32 sums), which the wgpu backend runs in place of `matmul_fwd` and `matmul_bwd` where the
//! adapter has them and the backend asks for them. Their sources are [`matmul_coop_wgsl`]
//! and [`matmul_bwd_coop_wgsl`]: a `coop8` or `coop16` prelude for the adapter's fragment
//! shape ([`CoopTile`]), the `coop_tile` prelude (the tiling both share), for the forward a
//! weight prelude, then the file.
//!
//! Binding convention shared by every file (the wgpu backend builds its layouts from it):
//! `@group(0) @binding(0)` is a `Params` uniform of at most [`PARAMS_BYTES`] bytes (bound
//! with a dynamic offset into one arena), and bindings `1..=storage_bindings()` are storage
//! buffers, never more than [`MAX_STORAGE_BINDINGS`]: `read` where no entry point of the
//! file writes them ([`Kernel::read_only_bindings`]), `read_write` otherwise. All entry
//! points of a file share that layout.
//!
//! ```
//! use rolloutpipe_kernels::Kernel;
//! let k = Kernel::MatmulBwd;
//! assert_eq!(k.name(), "matmul_bwd");
//! assert_eq!(k.entry_points(), &["matmul_bwd_dx", "matmul_bwd_dw"]);
//! assert!(k.wgsl().contains("fn matmul_bwd_dw"));
//! ```
#![no_std]
#![deny(unsafe_code, missing_docs)]

/// Largest `Params` uniform of any kernel, in bytes; also the stride a backend may use
/// when it packs many dispatches' parameters into one buffer (with 256-byte alignment).
pub const PARAMS_BYTES: u64 = 64;

/// Most storage buffers any kernel binds. WebGPU's default per-stage limit is 8; only
/// `attention_bwd` needs more (10), which every native adapter (Vulkan, Metal, DX12) and
/// lavapipe offer; a backend requests this limit when it creates its device.
pub const MAX_STORAGE_BINDINGS: u32 = 10;

macro_rules! kernels {
    // A kernel's PTX file, or `None` for one without a CUDA twin (an empty entry list).
    (@ptx $name:literal []) => { None };
    (@count []) => { 0usize };
    (@count [$($ptx_entry:literal),+]) => { 1usize };
    (@ptx $name:literal [$($ptx_entry:literal),+]) => {
        Some(include_str!(concat!("../ptx/", $name, ".ptx")))
    };
    ($( $(#[$doc:meta])* $variant:ident => $name:literal $(+ $pre:literal)*, [$($entry:literal),+], $storage:literal, ro [$($ro:literal),*], $wg:expr, [$($ptx_entry:literal),*]; )+) => {
        /// One kernel source file: one op of the model, named as the CPU reference names it.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Kernel {
            $( $(#[$doc])* $variant, )+
        }

        impl Kernel {
            /// Every kernel, in a fixed order.
            pub const ALL: &'static [Kernel] = &[$(Kernel::$variant),+];

            /// The kernels with a PTX twin (`kernels/ptx/<name>.ptx`), in the same order.
            pub const CUDA: &'static [Kernel] = &{
                const N: usize = 0 $(+ kernels!(@count [$($ptx_entry),*]))+;
                let all = [$(Kernel::$variant),+];
                let has = [$(kernels!(@count [$($ptx_entry),*]) == 1),+];
                let mut out = [Kernel::EmbeddingFwd; N];
                let (mut i, mut n) = (0, 0);
                while i < all.len() {
                    if has[i] {
                        out[n] = all[i];
                        n += 1;
                    }
                    i += 1;
                }
                out
            };

            /// The op's name: the WGSL file stem and the CPU reference's function name.
            pub const fn name(self) -> &'static str {
                match self { $(Kernel::$variant => $name,)+ }
            }

            /// The WGSL source of the op: its preludes ([`Kernel::preludes`]), then its file.
            pub const fn wgsl(self) -> &'static str {
                match self {
                    $(Kernel::$variant => concat!(
                        $(include_str!(concat!("../wgsl/prelude/", $pre, ".wgsl")), "\n",)*
                        include_str!(concat!("../wgsl/", $name, ".wgsl"))
                    ),)+
                }
            }

            /// The shared WGSL files (`kernels/wgsl/prelude/<name>.wgsl`) prepended to the
            /// op's file, in order; helpers used by several kernels live there, once.
            pub const fn preludes(self) -> &'static [&'static str] {
                match self { $(Kernel::$variant => &[$($pre),*],)+ }
            }

            /// The compute entry points of the file; the first is the op itself, further
            /// ones are the parts of its computation that need another launch geometry.
            pub const fn entry_points(self) -> &'static [&'static str] {
                match self { $(Kernel::$variant => &[$($entry),+],)+ }
            }

            /// Number of storage buffers, bound at `1..=storage_bindings()`.
            pub const fn storage_bindings(self) -> u32 {
                match self { $(Kernel::$variant => $storage,)+ }
            }

            /// The storage bindings that no entry point writes: declared `var<storage, read>`
            /// in the WGSL and bound read-only by the backend (`tests/naga.rs` checks both
            /// ways: these are not written, and every other binding is).
            pub const fn read_only_bindings(self) -> &'static [u32] {
                match self { $(Kernel::$variant => &[$($ro),*],)+ }
            }

            /// `@workgroup_size` of every entry point of the file.
            pub const fn workgroup_size(self) -> [u32; 3] {
                match self { $(Kernel::$variant => $wg,)+ }
            }

            /// The PTX source of the op (`kernels/ptx/<name>.ptx`, PTX ISA 8.0, sm_80; it
            /// also assembles for sm_90). Its header comment documents the launch layout
            /// and the arguments, which the CUDA host side follows. `None` for a kernel only
            /// the wgpu backend runs (see [`Kernel::CUDA`]).
            pub const fn ptx(self) -> Option<&'static str> {
                match self {
                    $(Kernel::$variant => kernels!(@ptx $name [$($ptx_entry),*]),)+
                }
            }

            /// The `.entry` functions of the PTX file, in file order, each prefixed with the
            /// op's name (a single launch is the op itself). They can differ from the WGSL entry points where the CUDA version
            /// splits an op differently (an f32 fallback beside a tensor-core product, a
            /// separate weight-gradient pass).
            pub const fn ptx_entry_points(self) -> &'static [&'static str] {
                match self { $(Kernel::$variant => &[$($ptx_entry),*],)+ }
            }
        }
    };
}

kernels! {
    /// `out[n, d] = table[tokens[n], :]`.
    EmbeddingFwd => "embedding_fwd" + "weight_f32", ["embedding_fwd"], 3, ro [1, 2], [256, 1, 1], ["embedding_fwd"];
    /// `dtable[tokens[n], :] += dout[n, :]`: each workgroup takes 64 columns of a run of
    /// touched rows and sums each row's positions in order, from a host-sorted index.
    EmbeddingBwd => "embedding_bwd", ["embedding_bwd"], 4, ro [1, 2, 3], [64, 1, 1], ["embedding_bwd"];
    /// RMSNorm of rows (also per head for q_norm/k_norm), saving `rstd`.
    RmsnormFwd => "rmsnorm_fwd", ["rmsnorm_fwd"], 4, ro [1, 2], [64, 1, 1], ["rmsnorm_fwd"];
    /// RMSNorm backward: `dx` per row; `dw` in two fixed-order stages (partial sums per
    /// chunk of rows and column, then per column).
    RmsnormBwd => "rmsnorm_bwd", ["rmsnorm_bwd", "rmsnorm_bwd_dw", "rmsnorm_bwd_dw_reduce"], 7, ro [1, 2, 3, 4], [64, 1, 1], ["rmsnorm_bwd", "rmsnorm_bwd_dw"];
    /// `y = x·Wᵀ`, tiled 128x128 per 16x16 workgroup (the `gemm` prelude); a split-K GEMV
    /// for ≤ 8 rows that sums in the tiled body's order.
    MatmulFwd => "matmul_fwd" + "gemm" + "weight_f32", ["matmul_fwd", "matmul_fwd_gemv"], 3, ro [1, 2], [16, 16, 1], ["matmul_fwd", "matmul_fwd_f32", "matmul_fwd_cast"];
    /// `dx = dy·W` and `dW += dyᵀ·x`, the same GEMM body.
    MatmulBwd => "matmul_bwd" + "gemm", ["matmul_bwd_dx", "matmul_bwd_dw"], 5, ro [1, 2, 3], [16, 16, 1], ["matmul_bwd_dx", "matmul_bwd_dw"];
    /// Rotate-half RoPE in place from cos/sin tables.
    RopeFwd => "rope_fwd", ["rope_fwd"], 4, ro [2, 3, 4], [256, 1, 1], ["rope_fwd"];
    /// Transposed rotation of a gradient, in place.
    RopeBwd => "rope_bwd", ["rope_bwd"], 4, ro [2, 3, 4], [256, 1, 1], ["rope_bwd"];
    /// Generation attention against the paged KV pool, one workgroup per (row, kv head) for
    /// every head of its GQA group, and the KV-append that writes a step's rows in place.
    /// wgpu only: no PTX twin.
    AttentionDecode => "attention_decode", ["attention_decode", "attention_decode_append"], 9, ro [1, 2, 3, 4, 5], [64, 1, 1], [];
    /// Causal GQA attention with online softmax, per (query tile, kv head) with K/V chunks
    /// staged once in workgroup memory for the tile's rows and the group's heads, head_dim
    /// split over several threads per (row, head); saves log-sum-exp.
    AttentionFwd => "attention_fwd", ["attention_fwd", "attention_fwd_window"], 6, ro [1, 2, 3, 4], [128, 1, 1], ["attention_fwd"];
    /// Attention backward: `dq` per (query tile, kv head) with K/V chunks staged once for
    /// the tile, then `dk, dv` per (key tile, kv head) with q/dout chunks staged once.
    AttentionBwd => "attention_bwd", ["attention_bwd_dq", "attention_bwd_dkv"], 9, ro [1, 2, 3, 4, 6, 9], [128, 1, 1], ["attention_bwd_dq", "attention_bwd_dkv"];
    /// `silu(gate) * up`.
    SwigluFwd => "swiglu_fwd", ["swiglu_fwd"], 3, ro [1, 2], [256, 1, 1], ["swiglu_fwd"];
    /// Gradients of `silu(gate) * up` with respect to gate and up.
    SwigluBwd => "swiglu_bwd", ["swiglu_bwd"], 5, ro [1, 2, 3], [256, 1, 1], ["swiglu_bwd"];
    /// `out = a + b`.
    ResidualFwd => "residual_fwd", ["residual_fwd"], 3, ro [1, 2], [256, 1, 1], ["residual_fwd"];
    /// `log_softmax(logits / T)` at the targets, the entropy and the log-sum-exp per row,
    /// over the vocabulary in chunks: each chunk's logits folded into a running state, then
    /// the outputs written from it.
    LogprobFwd => "logprob_fwd" + "reduce" + "lse", ["logprob_fwd", "logprob_fwd_finish"], 6, ro [1, 2], [256, 1, 1], ["logprob_fwd", "logprob_fwd_finish"];
    /// Gradient of the log-probs with respect to one vocabulary chunk of the logits, in place.
    LogprobBwd => "logprob_bwd", ["logprob_bwd"], 4, ro [1, 2, 3], [256, 1, 1], ["logprob_bwd"];
    /// Sums of the weighted clipped GRPO objective (or SFT), KL, clip count and entropy.
    GrpoLossFwd => "grpo_loss_fwd", ["grpo_loss_fwd"], 8, ro [1, 2, 3, 4, 5, 6, 8], [256, 1, 1], ["grpo_loss_fwd"];
    /// Per-token gradient of the weighted objective with respect to the log-probs.
    GrpoLossBwd => "grpo_loss_bwd", ["grpo_loss_bwd"], 7, ro [1, 2, 3, 4, 5, 7], [256, 1, 1], ["grpo_loss_bwd"];
    /// One AdamW update of one tensor, torch semantics.
    AdamwStep => "adamw_step", ["adamw_step"], 4, ro [2], [256, 1, 1], ["adamw_step"];
    /// Sum of squares: per-workgroup partials, then one final reduction.
    GradNorm => "grad_norm" + "reduce", ["grad_norm", "grad_norm_reduce"], 3, ro [1], [256, 1, 1], ["grad_norm", "grad_norm_reduce"];
    /// Temperature / top-k / top-p sampling from a host-drawn uniform, with the log-prob.
    Sample => "sample" + "reduce", ["sample"], 4, ro [1, 2], [256, 1, 1], ["sample"];
    /// An f32 tensor rounded to bf16 or f16 (nearest-even, as `cpu::store::round_to_bf16` /
    /// `round_to_f16`), packed in pairs or widened back to f32, for a same-device sync to a
    /// 16-bit engine; flags an f16 overflow per tensor. wgpu only: no PTX twin.
    WeightCast => "weight_cast", ["weight_cast", "weight_cast_round"], 3, ro [1], [256, 1, 1], [];
}

/// How a kernel that reads weights ([`Kernel::reads_weights`]) stores them in its binding 2.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WeightFormat {
    /// One f32 per value (`array<f32>`).
    F32,
    /// bfloat16, two values per `u32` (the even index in the low half); widened by a shift.
    Bf16,
    /// IEEE half, two values per `u32` (the even index in the low half); widened by core
    /// WGSL's `unpack2x16float`: no `shader-f16` needed, only the downlevel capability
    /// `SHADER_F16_IN_F32` that every Vulkan, Metal and DX12 adapter has.
    F16,
}

impl WeightFormat {
    /// Every format, f32 first.
    pub const ALL: [WeightFormat; 3] = [WeightFormat::F32, WeightFormat::Bf16, WeightFormat::F16];

    /// The prelude (`kernels/wgsl/prelude/<name>.wgsl`) that declares the binding and its
    /// `weight(i)` hook.
    pub const fn prelude(self) -> &'static str {
        match self {
            WeightFormat::F32 => "weight_f32",
            WeightFormat::Bf16 => "weight_bf16",
            WeightFormat::F16 => "weight_f16",
        }
    }

    /// Bytes of one value in the buffer.
    pub const fn bytes(self) -> usize {
        match self {
            WeightFormat::F32 => 4,
            WeightFormat::Bf16 | WeightFormat::F16 => 2,
        }
    }
}

/// The source of a weight-reading kernel with its `weight_f32` prelude replaced by another
/// format's; `Kernel::wgsl_as` lists the other preludes in the order of the kernel's own
/// list, which `tests/naga.rs` checks (the result must equal `wgsl()` with that one file
/// swapped).
macro_rules! weight_variant {
    ($name:literal $(+ $pre:literal)*, $fmt:literal) => {
        concat!(
            $(include_str!(concat!("../wgsl/prelude/", $pre, ".wgsl")), "\n",)*
            include_str!(concat!("../wgsl/prelude/weight_", $fmt, ".wgsl")), "\n",
            include_str!(concat!("../wgsl/", $name, ".wgsl"))
        )
    };
}

impl Kernel {
    /// Whether the kernel's binding 2 is a parameter tensor that may be stored in 16 bits
    /// ([`Kernel::wgsl_as`]).
    pub const fn reads_weights(self) -> bool {
        matches!(self, Kernel::EmbeddingFwd | Kernel::MatmulFwd)
    }

    /// The kernel's WGSL with its weights stored as `f`: [`Kernel::wgsl`] for F32, and for
    /// bf16 and f16 the same file and preludes with `weight_bf16` / `weight_f16` in place of
    /// `weight_f32`; `None` for a 16-bit format on a kernel that reads no weights.
    pub const fn wgsl_as(self, f: WeightFormat) -> Option<&'static str> {
        match (self, f) {
            (_, WeightFormat::F32) => Some(self.wgsl()),
            (Kernel::EmbeddingFwd, WeightFormat::Bf16) => {
                Some(weight_variant!("embedding_fwd", "bf16"))
            }
            (Kernel::EmbeddingFwd, WeightFormat::F16) => {
                Some(weight_variant!("embedding_fwd", "f16"))
            }
            (Kernel::MatmulFwd, WeightFormat::Bf16) => {
                Some(weight_variant!("matmul_fwd" + "gemm", "bf16"))
            }
            (Kernel::MatmulFwd, WeightFormat::F16) => {
                Some(weight_variant!("matmul_fwd" + "gemm", "f16"))
            }
            _ => None,
        }
    }
}

/// The cooperative-matrix fragment shape an adapter offers for f16 x f16 -> f32 products,
/// which picks the prelude of [`matmul_coop_wgsl`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CoopTile {
    /// 8x8x8 fragments (`coop8`: Mesa's lavapipe, Apple simdgroup matrices).
    T8,
    /// 16x16x16 fragments (`coop16`: NVIDIA tensor cores, AMD WMMA).
    T16,
}

impl CoopTile {
    /// Both shapes, the small one first.
    pub const ALL: [CoopTile; 2] = [CoopTile::T8, CoopTile::T16];

    /// The fragment edge.
    pub const fn edge(self) -> u32 {
        match self {
            CoopTile::T8 => 8,
            CoopTile::T16 => 16,
        }
    }

    /// Rows and columns of y one workgroup of `matmul_fwd_coop` computes (4 fragments each
    /// way: 4 subgroups of 2 x 2).
    pub const fn workgroup_tile(self) -> u32 {
        4 * self.edge()
    }

    /// The prelude (`kernels/wgsl/prelude/<name>.wgsl`) that enables the extensions and
    /// names the fragment types.
    pub const fn prelude(self) -> &'static str {
        match self {
            CoopTile::T8 => "coop8",
            CoopTile::T16 => "coop16",
        }
    }
}

/// The one entry point of `kernels/wgsl/matmul_fwd_coop.wgsl`.
pub const MATMUL_COOP_ENTRY: &str = "matmul_fwd_coop";

/// Subgroups per workgroup of `matmul_fwd_coop` and `matmul_bwd_coop`; its workgroup size is this times the
/// adapter's subgroup size, which the host sets through the pipeline override `SG`.
pub const MATMUL_COOP_SUBGROUPS: u32 = 4;

macro_rules! coop_variant {
    ($tile:literal, $fmt:literal) => {
        concat!(
            include_str!(concat!("../wgsl/prelude/coop", $tile, ".wgsl")),
            "\n",
            include_str!("../wgsl/prelude/coop_tile.wgsl"),
            "\n",
            include_str!(concat!("../wgsl/prelude/weight_", $fmt, ".wgsl")),
            "\n",
            include_str!("../wgsl/matmul_fwd_coop.wgsl")
        )
    };
}

/// The entry points of `kernels/wgsl/matmul_bwd_coop.wgsl`, in launch order: the per-part
/// maxima of |dy| that pick the gradient scale, then dx, then dW.
pub const MATMUL_BWD_COOP_ENTRIES: [&str; 3] = [
    "matmul_bwd_coop_amax",
    "matmul_bwd_coop_dx",
    "matmul_bwd_coop_dw",
];

/// Storage bindings of `matmul_bwd_coop`: [`Kernel::MatmulBwd`]'s five, then `amax` (the
/// per-part maxima, at most [`MATMUL_BWD_COOP_PARTS`] `u32`s, read-write).
pub const MATMUL_BWD_COOP_STORAGE: u32 = 6;

/// Most workgroups of `matmul_bwd_coop_amax` (the product kernels reduce their maxima).
pub const MATMUL_BWD_COOP_PARTS: u32 = 256;

/// The tensor-core backward product `matmul_bwd_coop` (dx and dW of `y = x·Wᵀ` with f32
/// weights, f16 operands, f32 sums, dy scaled by a power of two per product so that small
/// gradients keep f16's precision): the `coop8`/`coop16` prelude of `tile`, the `coop_tile`
/// prelude, then the file. [`Kernel::MatmulBwd`]'s bindings and `Params` plus binding 6
/// ([`MATMUL_BWD_COOP_STORAGE`]); needs what [`matmul_coop_wgsl`] needs.
///
/// ```
/// use rolloutpipe_kernels::{matmul_bwd_coop_wgsl, CoopTile, MATMUL_BWD_COOP_ENTRIES};
/// let src = matmul_bwd_coop_wgsl(CoopTile::T8);
/// assert!(src.starts_with("// Prelude `coop8`"));
/// assert!(MATMUL_BWD_COOP_ENTRIES.iter().all(|e| src.contains(&format!("fn {e}("))));
/// ```
pub const fn matmul_bwd_coop_wgsl(tile: CoopTile) -> &'static str {
    macro_rules! bwd {
        ($tile:literal) => {
            concat!(
                include_str!(concat!("../wgsl/prelude/coop", $tile, ".wgsl")),
                "\n",
                include_str!("../wgsl/prelude/coop_tile.wgsl"),
                "\n",
                include_str!("../wgsl/matmul_bwd_coop.wgsl")
            )
        };
    }
    match tile {
        CoopTile::T8 => bwd!("8"),
        CoopTile::T16 => bwd!("16"),
    }
}

/// The tensor-core forward product `matmul_fwd_coop` (the bindings and `Params` of
/// [`Kernel::MatmulFwd`], which it replaces where an engine turns tensor cores on): the
/// `coop8`/`coop16` prelude of `tile`, the `coop_tile` prelude, the `weight_<format>`
/// prelude, then the file. It needs
/// the adapter features `shader-f16` and `wgpu-cooperative-matrix`, with f16 x f16 -> f32
/// fragments of `tile`'s shape.
///
/// ```
/// use rolloutpipe_kernels::{matmul_coop_wgsl, CoopTile, WeightFormat, MATMUL_COOP_ENTRY};
/// let src = matmul_coop_wgsl(CoopTile::T16, WeightFormat::Bf16);
/// assert!(src.starts_with("// Prelude `coop16`"));
/// assert!(src.contains("coop_mat16x16<f16, A>") && src.contains(MATMUL_COOP_ENTRY));
/// ```
pub const fn matmul_coop_wgsl(tile: CoopTile, format: WeightFormat) -> &'static str {
    match (tile, format) {
        (CoopTile::T8, WeightFormat::F32) => coop_variant!("8", "f32"),
        (CoopTile::T8, WeightFormat::Bf16) => coop_variant!("8", "bf16"),
        (CoopTile::T8, WeightFormat::F16) => coop_variant!("8", "f16"),
        (CoopTile::T16, WeightFormat::F32) => coop_variant!("16", "f32"),
        (CoopTile::T16, WeightFormat::Bf16) => coop_variant!("16", "bf16"),
        (CoopTile::T16, WeightFormat::F16) => coop_variant!("16", "f16"),
    }
}

/// A CUDA kernel outside the op list of [`Kernel`]: a detail of the CUDA backend's own
/// state (its KV cache layout) with no WGSL twin and no CPU function. Same file rules as the
/// ops' PTX (`kernels/ptx/<name>.ptx`, header sections, `resources.toml`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PtxOnly {
    /// File stem and first entry's name.
    pub name: &'static str,
    /// The PTX source.
    pub ptx: &'static str,
    /// The `.entry` functions in file order.
    pub entry_points: &'static [&'static str],
}

/// The CUDA-only kernels: `kv_append` writes a step's new K/V rows into their KV-cache rows
/// in one launch per layer.
///
/// ```
/// let k = &rolloutpipe_kernels::PTX_ONLY[0];
/// assert_eq!(k.name, "kv_append");
/// assert!(k.ptx.contains(".entry kv_append("));
/// ```
pub const PTX_ONLY: &[PtxOnly] = &[PtxOnly {
    name: "kv_append",
    ptx: include_str!("../ptx/kv_append.ptx"),
    entry_points: &["kv_append"],
}];

#[cfg(test)]
mod tests {
    use super::*;

    /// The op list fixed by the backend interface (STYLE.md: one name everywhere).
    const OPS: [&str; 22] = [
        "embedding_fwd",
        "embedding_bwd",
        "rmsnorm_fwd",
        "rmsnorm_bwd",
        "matmul_fwd",
        "matmul_bwd",
        "rope_fwd",
        "rope_bwd",
        // Generation's attention over the paged KV pool (the CPU runs `attention_fwd` on
        // each request's own cache).
        "attention_decode",
        "attention_fwd",
        "attention_bwd",
        "swiglu_fwd",
        "swiglu_bwd",
        "residual_fwd",
        "logprob_fwd",
        "logprob_bwd",
        "grpo_loss_fwd",
        "grpo_loss_bwd",
        "adamw_step",
        "grad_norm",
        "sample",
        // A same-device sync's rounding to a 16-bit engine's dtype (the CPU rounds in
        // `cpu::store`).
        "weight_cast",
    ];

    #[test]
    fn every_op_has_exactly_one_kernel() {
        assert_eq!(Kernel::ALL.len(), OPS.len());
        for op in OPS {
            assert_eq!(
                Kernel::ALL.iter().filter(|k| k.name() == op).count(),
                1,
                "{op}"
            );
        }
    }

    #[test]
    fn entry_points_carry_the_op_name() {
        for k in Kernel::ALL {
            let eps = k.entry_points();
            // Ops with a single launch use the op name itself; split ops prefix it.
            if eps.len() == 1 {
                assert_eq!(eps[0], k.name());
            }
            for ep in eps {
                assert!(ep.starts_with(k.name()), "{ep} in {}", k.name());
                let mut buf = [0u8; 64];
                let needle = concat_fn(&mut buf, ep);
                assert!(k.wgsl().contains(needle), "fn {ep} missing");
            }
            assert!(k.storage_bindings() >= 1 && k.storage_bindings() <= MAX_STORAGE_BINDINGS);
        }
    }

    // `no_std` without alloc: build "fn <name>(" in a stack buffer.
    fn concat_fn<'a>(buf: &'a mut [u8; 64], name: &str) -> &'a str {
        let parts: [&[u8]; 3] = [b"fn ", name.as_bytes(), b"("];
        let mut n = 0;
        for p in parts {
            buf[n..n + p.len()].copy_from_slice(p);
            n += p.len();
        }
        core::str::from_utf8(&buf[..n]).unwrap_or("")
    }
}
