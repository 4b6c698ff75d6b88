//! The run configuration of `rolloutpipe train`: typed sections read from TOML with unknown
//! keys rejected, the embedded default (`harness/configs/train/default.toml`) underneath, a
//! user file and `--set section.key=value` overrides on top (`load`), then
//! [`TrainConfig::validate`] refuses combinations that cannot work and says why (`validate`).
//! Every value that is one of a set of names is a type here, parsed once.
use std::path::PathBuf;

use rolloutpipe_backends::{Aggregation, DType, ModelConfig, StdMode};
use rolloutpipe_core::Plan;
use serde::{Deserialize, Serialize};

pub use crate::driver::mode::{Mode, Schedule};
use crate::driver::plan::{FilterEstimate, PlanSpec, QueueOrder};

mod load;
mod validate;

/// The embedded default run (SFT warm start, then GRPO on 2-digit addition).
pub const DEFAULT_TOML: &str = include_str!("../../../configs/train/default.toml");

/// Everything one training run needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// What to run and where.
    pub run: RunSection,
    /// Which problems and verifier.
    pub task: TaskSection,
    /// The policy model.
    pub model: ModelSection,
    /// The supervised warm start.
    pub sft: SftSection,
    /// The GRPO objective, batch shape and optimizer.
    pub rl: RlSection,
    /// The rollout pool and scheduler parameters.
    pub rollout: RolloutSection,
    /// The trainer.
    pub trainer: TrainerSection,
    /// Test-only fault injection.
    pub fault: FaultSection,
    /// The allocation policy (samples per prompt); fixed G when absent.
    #[serde(default)]
    pub alloc: crate::alloc::AllocSection,
}

/// `[run]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSection {
    /// Seed of every random draw (data, initial weights, sampling).
    pub seed: u64,
    /// RL steps (the run ends after step `steps - 1`).
    pub steps: u32,
    /// Scheduling mode.
    pub mode: Mode,
    /// `cpu`, `wgpu` or `cuda` (the last two need their cargo features; `cuda` also an NVIDIA
    /// driver at run time).
    pub backend: String,
    /// Run directory.
    pub out: PathBuf,
    /// Save a checkpoint every this many steps (and always at the end); 0 = only at the end.
    pub checkpoint_every: u32,
    /// Evaluate held-out accuracy every this many steps (and at start and end); 0 = start and
    /// end only.
    pub eval_every: u32,
    /// Held-out problems per evaluation.
    pub eval_problems: u32,
    /// `add`/`mul`: size of the independent test set evaluated beside the held-out split
    /// (both operands uniform in `0..10^digits`, from `test_seed`, not filtered by the split);
    /// 0 = none. Generated tasks only.
    #[serde(default)]
    pub test_problems: u32,
    /// Seed of the independent test set (fixed, so every run is scored on the same problems).
    #[serde(default = "default_test_seed")]
    pub test_seed: u64,
    /// Show the progress bar (off in tests).
    pub progress: bool,
}

fn default_test_seed() -> u64 {
    20_261_201
}

/// `[task]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskSection {
    /// Built-in task (`add`, `mul`, `countdown`); with `jsonl`, the verifier's name.
    pub name: String,
    /// `add`/`mul`: digits per operand; `countdown`: how many numbers.
    pub digits: u32,
    /// A JSONL file of `{"prompt", "answer"}` problems to train on instead of generated ones
    /// (empty = generate). Its held-out set is every `1000 / heldout_per_mille`-th line.
    pub jsonl: PathBuf,
    /// Field of `jsonl` holding the prompt (Slime's `--input-key`).
    #[serde(default = "default_input_key")]
    pub input_key: String,
    /// Field of `jsonl` holding the answer (Slime's `--label-key`).
    #[serde(default = "default_label_key")]
    pub label_key: String,
    /// Share of problems held out for evaluation, per mille.
    pub heldout_per_mille: u32,
    /// Reward of a malformed response is minus this.
    pub format_penalty: f32,
    /// `add`/`mul`: answers written least-significant digit first (see tasks::arith).
    #[serde(default)]
    pub reverse: bool,
    /// `add`/`mul` operand distribution of the training (SFT and RL) problems: `digits` (the
    /// digit count uniform in 1..=digits, then the value; half of 2-digit operands have one
    /// digit) or `uniform` (uniform in 0..10^digits, the independent test set's distribution).
    #[serde(default = "default_operands")]
    pub operands: Operands,
    /// Generated training problems (ignored with `jsonl`): the RL stream cycles through this
    /// pool in order, so a small pool makes the run multi-epoch (Pilot-Commit's eviction of
    /// solved prompts then matters). 1..=1,048,576.
    #[serde(default = "default_train_pool")]
    pub train_pool: usize,
}

fn default_train_pool() -> usize {
    8192
}

fn default_operands() -> Operands {
    Operands::Digits
}

fn default_input_key() -> String {
    "prompt".into()
}

fn default_label_key() -> String {
    "answer".into()
}

/// `[model]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// A Hugging Face model directory (`config.json`, `model.safetensors`, optionally
    /// `tokenizer.json`) to start from; empty = a fresh model of the shape below.
    pub dir: PathBuf,
    /// Seed of the fresh model's initial weights.
    pub init_seed: u64,
    /// Residual width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

/// `[sft]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SftSection {
    /// Optimizer steps of supervised warm start (0 = none).
    pub steps: u32,
    /// Problems per SFT step.
    pub batch: u32,
    /// SFT learning rate.
    pub lr: f64,
    /// `add`/`mul`: most digits per operand of the SFT problems (0 = `task.digits`); fewer
    /// than `task.digits` makes the warm start deliberately partial, leaving the longer
    /// problems to RL.
    #[serde(default)]
    pub digits: u32,
    /// `add`: the SFT targets come from an imperfect teacher that forgets each carry with this
    /// probability (0 = the true answers). RL's reward and every evaluation use the true answers,
    /// so the warm start is deliberately flawed and RL has something to correct.
    #[serde(default)]
    pub carry_drop: f64,
}

crate::named! {
    /// How `logπ_old` is obtained (`rl.old_logprobs`).
    pub enum OldLogprobs {
        /// The trainer's own forward pass (exact only while the weights are still `v_k`, i.e.
        /// with one optimizer step per rollout).
        Recompute = "recompute",
        /// The log-probs the rollout engine returned with each token.
        Rollout = "rollout",
    }
}

crate::named! {
    /// Advantage scaling (`rl.std`).
    pub enum StdScaling {
        /// Divide by the group's sample standard deviation.
        Sample = "sample",
        /// Divide by the group's population standard deviation.
        Population = "population",
        /// Centre only.
        None = "none",
    }
}

impl StdScaling {
    /// The backends' advantage mode.
    pub fn mode(self) -> StdMode {
        match self {
            StdScaling::Sample => StdMode::Sample,
            StdScaling::Population => StdMode::Population,
            StdScaling::None => StdMode::None,
        }
    }
}

crate::named! {
    /// Loss aggregation (`rl.aggregation`).
    pub enum LossAggregation {
        /// Every token of the optimizer step weighs the same.
        TokenMean = "token_mean",
        /// Every sequence weighs the same.
        SeqMean = "seq_mean",
    }
}

impl LossAggregation {
    /// The backends' aggregation.
    pub fn aggregation(self) -> Aggregation {
        match self {
            LossAggregation::TokenMean => Aggregation::TokenMean,
            LossAggregation::SeqMean => Aggregation::SeqMean,
        }
    }
}

crate::named! {
    /// Storage of the rollout engines' weights (`rollout.dtype`).
    pub enum WeightDType {
        /// f32.
        F32 = "f32",
        /// bfloat16.
        Bf16 = "bf16",
        /// IEEE half.
        F16 = "f16",
    }
}

impl WeightDType {
    /// The backends' dtype.
    pub fn dtype(self) -> DType {
        match self {
            WeightDType::F32 => DType::F32,
            WeightDType::Bf16 => DType::Bf16,
            WeightDType::F16 => DType::F16,
        }
    }
}

crate::named! {
    /// `add`/`mul` operand distribution of the training problems (`task.operands`).
    pub enum Operands {
        /// The digit count uniform in 1..=digits, then the value (half of 2-digit operands
        /// have one digit).
        Digits = "digits",
        /// Uniform in 0..10^digits (the independent test set's distribution).
        Uniform = "uniform",
    }
}

/// `[rl]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RlSection {
    /// B: trainable groups per step.
    pub batch_groups: u32,
    /// G: responses per prompt.
    pub group_size: u16,
    /// m: groups per micro-batch.
    pub micro_batch: u32,
    /// Optimizer steps per rollout.
    pub opt_steps: u32,
    /// Response cap in tokens.
    pub max_new_tokens: usize,
    /// Sampling temperature (> 0: GRPO needs a stochastic policy).
    pub temperature: f32,
    /// Top-k (0 = off).
    pub top_k: usize,
    /// Top-p (1 = off).
    pub top_p: f32,
    /// RL learning rate.
    pub lr: f64,
    /// AdamW weight decay.
    pub weight_decay: f64,
    /// Global-norm clip (0 = off).
    pub max_grad_norm: f64,
    /// Lower clip range of the ratio.
    pub eps_low: f64,
    /// Upper clip range of the ratio.
    pub eps_high: f64,
    /// k3 KL weight against the RL starting weights (0 = no reference model).
    pub beta: f64,
    /// Advantage scaling.
    pub std: StdScaling,
    /// Loss aggregation.
    pub aggregation: LossAggregation,
    /// Source of `logπ_old`.
    pub old_logprobs: OldLogprobs,
}

/// `[rollout]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutSection {
    /// E: rollout engine threads.
    pub engines: u16,
    /// S: requests each engine batches at once.
    pub slots: u32,
    /// Threads of each engine's backend.
    pub threads_per_engine: usize,
    /// Verifier threads.
    pub verifiers: usize,
    /// Attempts per request before its group is filtered.
    pub max_attempts: u8,
    /// Over-sampling cap: at most this times B prompts per step.
    pub max_groups_factor: f64,
    /// Prompts drawn per draw decision (Slime's over-sampling batch).
    pub draw_batch: u32,
    /// Groups kept in progress beyond B.
    pub draw_ahead: u32,
    /// Queue order of the baseline FIFO (a shuffle is seeded by `run.seed`).
    pub submit_order: QueueOrder,
    /// FGD: extra frontier groups.
    pub frontier_width: u32,
    /// FGD: expected share of groups filtered at the first step, in [0, 1); later steps take
    /// the previous step's observed share (`driver::plan::FilterEstimate`, as `simulate` does).
    pub expected_filter: f64,
    /// Storage of the engines' weights (the trainer keeps f32 master weights and moments
    /// whatever this is; each sync rounds them to it). Half storage halves an engine's weight
    /// memory; compute stays f32. `bf16` and `f16` need the cpu or wgpu backend. f32 when
    /// absent.
    #[serde(default = "default_engine_dtype")]
    pub dtype: WeightDType,
    /// Tail multiplexing (`rl.beta > 0`, on-policy modes): an engine with no request running
    /// and none waiting to be admitted computes the KL reference log-probs of a dispatched
    /// group whose micro-batch has not started, with its own f32 CPU copy of the reference
    /// weights; the trainer skips its reference pass for those samples. Off when absent.
    #[serde(default)]
    pub multiplex: bool,
    /// Long-tail migration (cpu or wgpu backend, 2+ engines): when no request waits to
    /// be admitted and an engine runs fewer than `migrate_receiver_max` requests, the engine
    /// with the largest batch (more than twice the receiver's) hands over its request that has
    /// generated the most tokens (at least `migrate_min_generated`); the receiver re-prefills
    /// prompt + generated tokens and continues the same seeded stream, so samples are those of
    /// a run without it. Off when absent.
    #[serde(default)]
    pub migrate: bool,
    /// Only requests that have generated at least this many tokens move (a long-running
    /// request is the likeliest long tail).
    #[serde(default = "default_migrate_min_generated")]
    pub migrate_min_generated: u32,
    /// An engine running fewer requests than this receives migrated ones.
    #[serde(default = "default_migrate_receiver_max")]
    pub migrate_receiver_max: u32,
    /// Tensor cores for the rollout engines (`run.backend = "wgpu"` only): every forward
    /// product of generation and of the engines' log-prob scoring runs on cooperative matrices
    /// (`WgpuBackend::set_tensor_cores`: f16 operands, f32 sums); the trainer stays f32.
    /// Results move by the f16 rounding of the operands and stay batch-invariant. Refused before
    /// the run directory is touched where the adapter has no tensor cores, naming what it lacks.
    /// Off when absent.
    #[serde(default)]
    pub tensor_cores: bool,
    /// Look-ahead decoding for the rollout engines (`run.backend = "wgpu"` only): each decode
    /// iteration also queues the next one on the device, its input tokens copied there from
    /// the step before (`WgpuBackend::set_lookahead`), so that the device decodes while the
    /// host collects, scores and admits. Samples are the same bits as without it; a request
    /// admitted after a submission joins one decode iteration later. Off when absent.
    #[serde(default)]
    pub lookahead: bool,
}

fn default_migrate_min_generated() -> u32 {
    8
}

fn default_migrate_receiver_max() -> u32 {
    1
}

fn default_engine_dtype() -> WeightDType {
    WeightDType::F32
}

/// `[trainer]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainerSection {
    /// Threads of the trainer's backend.
    pub threads: usize,
    /// Tensor cores for the trainer (`run.backend = "wgpu"` only): every product of the SFT
    /// warm start and of each GRPO step, forward and backward (dx and dW), runs on cooperative
    /// matrices (`WgpuBackend::set_tensor_cores`: f16 operands, f32 sums, the gradient scaled
    /// by a power of two per product so that small gradients keep f16's precision); master
    /// weights, moments and every other kernel stay f32. Refused before the run directory is
    /// touched where the adapter has no tensor cores, naming what it lacks. Off when absent.
    #[serde(default)]
    pub tensor_cores: bool,
}

/// `[fault]`: test-only switches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSection {
    /// Engine 0 fails (loses every request it runs and stops) when it is handed its N-th
    /// request; 0 = never.
    pub fail_engine_at_request: u64,
    /// Engines add 1e-3 to the first reference log-prob of every group they multiplex (to show
    /// that the equivalence test sees a wrong engine pass); needs `rollout.multiplex`.
    #[serde(default)]
    pub perturb_mux: bool,
}
impl TrainConfig {
    /// The config keys that ask for tensor cores (`rollout.tensor_cores`,
    /// `trainer.tensor_cores`), for a refusal to name.
    pub fn tensor_core_keys(&self) -> Vec<&'static str> {
        let mut keys = Vec::new();
        if self.rollout.tensor_cores {
            keys.push("rollout.tensor_cores");
        }
        if self.trainer.tensor_cores {
            keys.push("trainer.tensor_cores");
        }
        keys
    }

    /// The run's mode with its tail policies (`rollout.multiplex`, `rollout.migrate`).
    pub fn schedule(&self) -> Schedule {
        Schedule::tail(self.run.mode, self.rollout.multiplex, self.rollout.migrate)
    }

    /// What the core's per-step plan is derived from (the rule `simulate` shares).
    pub fn plan_spec(&self) -> PlanSpec {
        let (rl, ro) = (&self.rl, &self.rollout);
        PlanSpec {
            mode: self.run.mode,
            batch: rl.batch_groups,
            group: rl.group_size,
            micro_batch: rl.micro_batch,
            opt_steps: rl.opt_steps,
            slots: u32::from(ro.engines).saturating_mul(ro.slots),
            max_attempts: ro.max_attempts,
            max_groups_factor: ro.max_groups_factor,
            draw_batch: ro.draw_batch,
            draw_ahead: ro.draw_ahead,
            frontier_width: ro.frontier_width,
            order: ro.submit_order.with_seed(self.run.seed),
        }
    }

    /// The core's plan of the first step (FGD's filter estimate at its prior), with the
    /// allocation policy's fields.
    pub fn plan(&self) -> Plan {
        let mut p = (self.plan_spec()).plan(FilterEstimate::prior(self.rollout.expected_filter));
        // `validate` refuses a bad [alloc]; unvalidated, it falls back to fixed G.
        if let Ok(a) = self.allocator() {
            self.alloc.configure(&a, &mut p);
        }
        p
    }

    /// The `[alloc]` policy for this config's batch shape.
    pub fn allocator(&self) -> anyhow::Result<crate::alloc::Allocator> {
        self.alloc
            .allocator(self.rl.batch_groups, self.rl.group_size)
    }

    /// The fresh model's shape (vocabulary from the tokenizer).
    pub fn model_config(&self, vocab: usize) -> ModelConfig {
        let m = &self.model;
        ModelConfig {
            vocab_size: vocab,
            hidden_size: m.hidden_size,
            intermediate_size: m.intermediate_size,
            num_hidden_layers: m.layers,
            num_attention_heads: m.heads,
            num_key_value_heads: m.kv_heads,
            head_dim: m.head_dim,
            max_position_embeddings: 256,
            ..ModelConfig::small()
        }
    }
}

#[cfg(test)]
mod tests {
    use rolloutpipe_core::{AdmissionPolicy, DispatchPolicy};

    use super::*;

    #[test]
    fn default_parses_and_validates() {
        let c = TrainConfig::default_config().unwrap();
        c.validate().unwrap();
        assert_eq!(c.run.mode, Mode::Rolloutpipe);
        assert!(matches!(
            c.plan().admission,
            AdmissionPolicy::Frontier { .. }
        ));
        assert_eq!(c.plan().dispatch, DispatchPolicy::Pipelined);
        let sync = c.with_overrides(&["run.mode=sync".into()]).unwrap();
        assert_eq!(sync.plan().dispatch, DispatchPolicy::Sync);
    }

    #[test]
    fn named_values_map_to_the_backends_types() {
        assert_eq!(WeightDType::Bf16.dtype(), DType::Bf16);
        assert_eq!(StdScaling::Population.mode(), StdMode::Population);
        assert_eq!(LossAggregation::SeqMean.aggregation(), Aggregation::SeqMean);
        for d in WeightDType::ALL {
            assert_eq!(d.dtype().name().to_lowercase(), d.name());
        }
    }
}
