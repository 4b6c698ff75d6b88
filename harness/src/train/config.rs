//! The run configuration of `rolloutpipe train`: TOML with unknown keys rejected, the embedded
//! default (`harness/configs/train/default.toml`) underneath, a user file and `--set
//! section.key=value` overrides on top, then [`TrainConfig::validate`] refuses combinations that
//! cannot work and says why.
use std::path::PathBuf;

use anyhow::{Context, bail, ensure};
use rolloutpipe_backends::{Aggregation, DType, ModelConfig, StdMode};
use rolloutpipe_core::{AdmissionPolicy, DispatchPolicy, Plan, SubmitOrder};
use serde::{Deserialize, Serialize};

/// The embedded default run (SFT warm start, then GRPO on 2-digit addition).
pub const DEFAULT_TOML: &str = include_str!("../../configs/train/default.toml");

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

/// A scheduling mode (which core policies the run uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Slime's baseline: FIFO admission, the batch goes to the trainer once final.
    Sync,
    /// Complete-group pipelining: FIFO admission, each trainable group trains as it completes.
    Cgp,
    /// CGP plus frontier-group dispatch.
    Rolloutpipe,
    /// Rollout of step k+1 (weights `v_k`) overlaps training of step k: one version stale.
    OneStepOff,
}

impl Mode {
    /// The name used on the command line, in configs and in tables.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Sync => "sync",
            Mode::Cgp => "cgp",
            Mode::Rolloutpipe => "rolloutpipe",
            Mode::OneStepOff => "one-step-off",
        }
    }

    /// Parses a command-line name.
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        Ok(match s {
            "sync" => Mode::Sync,
            "cgp" => Mode::Cgp,
            "rolloutpipe" => Mode::Rolloutpipe,
            "one-step-off" => Mode::OneStepOff,
            _ => bail!("unknown mode {s:?}; valid: sync, cgp, rolloutpipe, one-step-off"),
        })
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
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
    pub operands: String,
    /// Generated training problems (ignored with `jsonl`): the RL stream cycles through this
    /// pool in order, so a small pool makes the run multi-epoch (Pilot-Commit's eviction of
    /// solved prompts then matters). 1..=1,048,576.
    #[serde(default = "default_train_pool")]
    pub train_pool: usize,
}

fn default_train_pool() -> usize {
    8192
}

fn default_operands() -> String {
    "digits".into()
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

/// How `logπ_old` is obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OldLogprobs {
    /// The trainer's own forward pass (exact only while the weights are still `v_k`, i.e. with
    /// one optimizer step per rollout).
    Recompute,
    /// The log-probs the rollout engine returned with each token.
    Rollout,
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
    /// Advantage scaling: `sample`, `population` or `none`.
    pub std: String,
    /// Loss aggregation: `token_mean` or `seq_mean`.
    pub aggregation: String,
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
    /// Queue order of the baseline FIFO: `group_major`, `interleaved` or `shuffled`.
    pub submit_order: String,
    /// FGD: extra frontier groups.
    pub frontier_width: u32,
    /// FGD: expected share of groups filtered at the first step, in [0, 1); later steps take
    /// the previous step's observed share (`driver::plan::FilterEstimate`, as `simulate` does).
    pub expected_filter: f64,
    /// Storage of the engines' weights: `f32`, `bf16` or `f16` (the trainer keeps f32 master
    /// weights and moments whatever this is; each sync rounds them to it). Half storage halves
    /// an engine's weight memory; compute stays f32. `bf16` and `f16` need `run.backend = "cpu"`.
    /// Absent from run directories written before it existed, which used f32.
    #[serde(default = "default_engine_dtype")]
    pub dtype: String,
    /// Tail multiplexing (`rl.beta > 0`, on-policy modes): an engine with no request running
    /// and none waiting to be admitted computes the KL reference log-probs of a dispatched
    /// group whose micro-batch has not started, with its own f32 CPU copy of the reference
    /// weights; the trainer skips its reference pass for those samples. Absent from run
    /// directories written before it existed, which did not multiplex.
    #[serde(default)]
    pub multiplex: bool,
    /// Long-tail migration (cpu backend, local transport, 2+ engines): when no request waits to
    /// be admitted and an engine runs fewer than `migrate_receiver_max` requests, the engine
    /// with the largest batch (more than twice the receiver's) hands over its request that has
    /// generated the most tokens (at least `migrate_min_generated`); the receiver re-prefills
    /// prompt + generated tokens and continues the same seeded stream, so samples are those of
    /// a run without it. Absent from run directories written before it existed (off).
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
    /// Absent from run directories written before it existed (off).
    #[serde(default)]
    pub tensor_cores: bool,
    /// Look-ahead decoding for the rollout engines (`run.backend = "wgpu"` only): each decode
    /// iteration also queues the next one on the device, its input tokens copied there from
    /// the step before (`WgpuBackend::set_lookahead`), so that the device decodes while the
    /// host collects, scores and admits. Samples are the same bits as without it; a request
    /// admitted after a submission joins one decode iteration later. Absent from run
    /// directories written before it existed (off).
    #[serde(default)]
    pub lookahead: bool,
}

fn default_migrate_min_generated() -> u32 {
    8
}

fn default_migrate_receiver_max() -> u32 {
    1
}

/// A `rollout.dtype` value (`f32`, `bf16`, `f16`) as the backends' [`DType`].
pub fn engine_dtype(s: &str) -> anyhow::Result<DType> {
    Ok(match s {
        "f32" => DType::F32,
        "bf16" => DType::Bf16,
        "f16" => DType::F16,
        s => bail!("rollout.dtype {s:?} is not one of f32, bf16, f16"),
    })
}

fn default_engine_dtype() -> String {
    "f32".into()
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
    /// touched where the adapter has no tensor cores, naming what it lacks. Absent from run
    /// directories written before it existed (off).
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

    /// The embedded default.
    pub fn default_config() -> anyhow::Result<Self> {
        Self::from_toml_str(DEFAULT_TOML).context("the embedded default config")
    }

    /// Parses a complete config.
    pub fn from_toml_str(text: &str) -> anyhow::Result<Self> {
        Ok(toml::from_str(text)?)
    }

    /// The default with `text` (any subset of sections and keys) merged over it.
    pub fn from_partial_toml(text: &str) -> anyhow::Result<Self> {
        let mut base: toml::Table = toml::from_str(DEFAULT_TOML)?;
        let over: toml::Table = toml::from_str(text)?;
        merge(&mut base, over);
        Self::from_table(base)
    }

    fn from_table(t: toml::Table) -> anyhow::Result<Self> {
        // toml puts the offending key on a second line ("… expected u32\nin `run.steps`"):
        // one line, as every error of the binary.
        toml::Value::Table(t)
            .try_into()
            .map_err(|e: toml::de::Error| {
                anyhow::anyhow!("{}", e.to_string().trim().replace('\n', " "))
            })
    }

    /// Applies `section.key=value` overrides (the value is TOML; a bare word is a string).
    pub fn with_overrides(&self, sets: &[String]) -> anyhow::Result<Self> {
        let mut t: toml::Table = toml::Value::try_from(self)?
            .try_into()
            .context("config to table")?;
        for s in sets {
            let (path, raw) = s
                .split_once('=')
                .with_context(|| format!("--set {s:?}: expected section.key=value"))?;
            let (section, key) = path
                .trim()
                .split_once('.')
                .with_context(|| format!("--set {s:?}: the key must be section.key"))?;
            let value = parse_value(raw.trim());
            let sec = t
                .get_mut(section)
                .and_then(|v| v.as_table_mut())
                .with_context(|| format!("--set {s:?}: no section [{section}]"))?;
            ensure!(
                sec.contains_key(key),
                "--set {s:?}: [{section}] has no key {key:?}"
            );
            sec.insert(key.to_owned(), value);
        }
        Self::from_table(t).context("applying --set overrides")
    }

    /// The resolved config as TOML (written into the run directory).
    pub fn to_toml(&self) -> anyhow::Result<String> {
        Ok(toml::to_string_pretty(self)?)
    }

    /// Refuses values and combinations that cannot work, saying why.
    pub fn validate(&self) -> anyhow::Result<()> {
        let (r, rl, ro) = (&self.run, &self.rl, &self.rollout);
        ensure!(r.steps > 0, "run.steps must be at least 1");
        self.validate_numbers()?;
        ensure!(
            matches!(r.backend.as_str(), "cpu" | "wgpu" | "cuda"),
            "run.backend {:?} is not one of cpu, wgpu, cuda",
            r.backend
        );
        ensure!(
            ro.engines >= 1,
            "rollout.engines must be at least 1 (nothing would generate)"
        );
        ensure!(ro.slots >= 1, "rollout.slots must be at least 1");
        ensure!(ro.verifiers >= 1, "rollout.verifiers must be at least 1");
        ensure!(
            rl.group_size >= 2,
            "rl.group_size must be at least 2: GRPO advantages compare responses of one prompt"
        );
        ensure!(
            rl.temperature.is_finite() && rl.temperature > 0.0,
            "rl.temperature must be > 0: greedy rollouts make every group identical, so all would be filtered"
        );
        ensure!(
            (0.0..=1.0).contains(&rl.top_p) && rl.top_p > 0.0,
            "rl.top_p must be in (0, 1]"
        );
        ensure!(
            rl.max_new_tokens >= 1,
            "rl.max_new_tokens must be at least 1"
        );
        ensure!(
            rl.eps_low >= 0.0 && rl.eps_high >= 0.0,
            "rl.eps_low and rl.eps_high must be >= 0"
        );
        ensure!(rl.beta >= 0.0, "rl.beta must be >= 0");
        self.std_mode()?;
        self.aggregation()?;
        ensure!(
            !(rl.opt_steps > 1 && rl.old_logprobs == OldLogprobs::Recompute),
            "rl.opt_steps = {} with rl.old_logprobs = \"recompute\": after the first optimizer step \
             the trainer's weights are no longer v_k, so recomputed log-probs would not be the \
             rollout policy's; set rl.old_logprobs = \"rollout\"",
            rl.opt_steps
        );
        ensure!(
            !(r.mode == Mode::OneStepOff && rl.old_logprobs == OldLogprobs::Recompute),
            "run.mode = \"one-step-off\" with rl.old_logprobs = \"recompute\": the trainer holds \
             v_(k+1) while it trains samples from v_k, so logπ_old must come from the rollout; \
             set rl.old_logprobs = \"rollout\""
        );
        ensure!(
            ro.max_groups_factor.is_finite() && ro.max_groups_factor >= 1.0,
            "rollout.max_groups_factor must be >= 1 (a step must be able to draw B prompts)"
        );
        ensure!(
            (0.0..1.0).contains(&ro.expected_filter),
            "rollout.expected_filter must be in [0, 1)"
        );
        self.submit_order()?;
        let dtype = self.engine_dtype()?;
        ensure!(
            dtype == DType::F32 || matches!(r.backend.as_str(), "cpu" | "wgpu"),
            "rollout.dtype {:?} needs run.backend = \"cpu\" or \"wgpu\": the {} backend stores f32 weights",
            ro.dtype,
            r.backend
        );
        ensure!(
            self.sft.steps == 0 || (self.sft.batch > 0 && self.sft.lr > 0.0),
            "sft.batch and sft.lr must be positive when sft.steps > 0"
        );
        ensure!(
            self.task.heldout_per_mille > 0 && self.task.heldout_per_mille < 1000,
            "task.heldout_per_mille must be in 1..=999 (a held-out set and a training set are both needed)"
        );
        ensure!(r.eval_problems >= 1, "run.eval_problems must be at least 1");
        ensure!(
            (1..=1 << 20).contains(&self.task.train_pool),
            "task.train_pool is {}, must be within 1..=1048576",
            self.task.train_pool
        );
        ensure!(
            matches!(self.task.operands.as_str(), "digits" | "uniform"),
            "task.operands {:?} is not one of digits, uniform",
            self.task.operands
        );
        ensure!(
            self.trainer.threads >= 1 && ro.threads_per_engine >= 1,
            "trainer.threads and rollout.threads_per_engine must be at least 1"
        );
        if ro.multiplex {
            ensure!(
                rl.beta > 0.0,
                "rollout.multiplex needs rl.beta > 0: the KL reference pass is the only \
                 forward-only work the trainer has (old log-probs come from its training forward \
                 or from the rollout)"
            );
            ensure!(
                r.mode != Mode::OneStepOff,
                "rollout.multiplex needs an on-policy mode (sync, cgp or rolloutpipe): one-step-off \
                 buffers each micro-batch at dispatch, so no dispatched group waits for the trainer"
            );
        }
        // The switches only the wgpu backend has, and why.
        for (on, key, why) in [
            (
                self.trainer.tensor_cores,
                "trainer.tensor_cores",
                "only the wgpu trainer has the cooperative-matrix path",
            ),
            (
                ro.lookahead,
                "rollout.lookahead",
                "only wgpu engines queue a step on the device behind the running one",
            ),
            (
                ro.tensor_cores,
                "rollout.tensor_cores",
                "only wgpu engines have the cooperative-matrix path",
            ),
        ] {
            ensure!(
                !on || r.backend == "wgpu",
                "{key} = true needs run.backend = \"wgpu\" (got {:?}): {why}",
                r.backend
            );
        }
        if ro.migrate {
            ensure!(
                matches!(r.backend.as_str(), "cpu" | "wgpu"),
                "rollout.migrate needs run.backend = \"cpu\" or \"wgpu\": the {} engine cannot export a running request's state",
                r.backend
            );
            ensure!(
                ro.engines >= 2,
                "rollout.migrate needs rollout.engines >= 2: requests move between engines"
            );
        }
        ensure!(
            ro.migrate_min_generated >= 1,
            "rollout.migrate_min_generated must be at least 1 (a request moves once it has generated a token)"
        );
        ensure!(
            (1..=ro.slots).contains(&ro.migrate_receiver_max),
            "rollout.migrate_receiver_max is {}, must be within 1..=rollout.slots ({})",
            ro.migrate_receiver_max,
            ro.slots
        );
        ensure!(
            !self.fault.perturb_mux || ro.multiplex,
            "fault.perturb_mux needs rollout.multiplex = true"
        );
        if self.fault.fail_engine_at_request > 0 {
            ensure!(
                ro.engines >= 2,
                "fault.fail_engine_at_request needs rollout.engines >= 2: with one engine nothing is left to re-admit the failed requests"
            );
        }
        self.alloc.policy(rl.batch_groups, rl.group_size)?;
        self.plan()
            .validate()
            .map_err(|e| anyhow::anyhow!("rl/rollout settings: {e}"))?;
        Ok(())
    }

    /// Every float finite and in range, and every size small enough for this machine, so a
    /// typo fails here and not after the warm start or as an allocation failure.
    fn validate_numbers(&self) -> anyhow::Result<()> {
        use crate::limits::{check_fits, check_model_fits, finite_nonneg, finite_positive};
        let rl = &self.rl;
        finite_nonneg("rl.lr", rl.lr)?;
        finite_nonneg("rl.weight_decay", rl.weight_decay)?;
        finite_nonneg("rl.max_grad_norm", rl.max_grad_norm)?;
        finite_nonneg("rl.eps_low", rl.eps_low)?;
        finite_nonneg("rl.eps_high", rl.eps_high)?;
        finite_nonneg("rl.beta", rl.beta)?;
        finite_nonneg("task.format_penalty", f64::from(self.task.format_penalty))?;
        finite_nonneg("rollout.expected_filter", self.rollout.expected_filter)?;
        if self.sft.steps > 0 {
            finite_positive("sft.lr", self.sft.lr)?;
        }
        let drop = self.sft.carry_drop;
        ensure!(
            drop.is_finite() && (0.0..=1.0).contains(&drop),
            "sft.carry_drop = {drop} must be a probability in 0..=1"
        );
        ensure!(
            drop == 0.0 || (self.task.name == "add" && self.task.jsonl.as_os_str().is_empty()),
            "sft.carry_drop applies to the generated add task only (task.name = {:?}{})",
            self.task.name,
            if self.task.jsonl.as_os_str().is_empty() {
                ""
            } else {
                " with task.jsonl"
            }
        );
        // Sizes. Per-item costs are generous upper bounds of what the run keeps per item.
        let m = &self.model;
        if m.dir.as_os_str().is_empty() {
            for (name, v) in [
                ("model.hidden_size", m.hidden_size),
                ("model.intermediate_size", m.intermediate_size),
                ("model.layers", m.layers),
                ("model.heads", m.heads),
                ("model.kv_heads", m.kv_heads),
                ("model.head_dim", m.head_dim),
            ] {
                ensure!(v >= 1, "{name} must be at least 1");
            }
            // Weights, gradients and two AdamW moments in the trainer, a copy per engine, the
            // evaluator, a reference and the checkpoint being written; with multiplexing, a
            // reference per engine as well.
            let engine_copies = if self.rollout.multiplex { 2 } else { 1 };
            let copies = 4 + engine_copies * u128::from(self.rollout.engines) + 3;
            let mc = self.model_config(256);
            check_model_fits(
                &mc,
                copies,
                "model.hidden_size/intermediate_size/layers/heads",
            )?;
        }
        let tokens = rl.max_new_tokens as u128 + 64;
        let responses = u128::from(rl.batch_groups) * u128::from(rl.group_size);
        // Each response keeps tokens, log-probs and activations for the backward pass.
        check_fits("rl.batch_groups x rl.group_size", responses, tokens * 64)?;
        // The plan's own rule, so that what is checked is what runs.
        let max_groups = u128::from(crate::driver::plan::max_groups(
            rl.batch_groups,
            self.rollout.max_groups_factor,
        ));
        check_fits(
            "rollout.max_groups_factor x rl.batch_groups",
            max_groups.saturating_mul(u128::from(rl.group_size)),
            tokens * 16,
        )?;
        let sft_problems = u128::from(self.sft.steps) * u128::from(self.sft.batch);
        check_fits("sft.steps x sft.batch", sft_problems, 512)?;
        check_fits(
            "run.eval_problems",
            u128::from(self.run.eval_problems),
            1024,
        )?;
        Ok(())
    }

    /// Advantage scaling.
    pub fn std_mode(&self) -> anyhow::Result<StdMode> {
        Ok(match self.rl.std.as_str() {
            "sample" => StdMode::Sample,
            "population" => StdMode::Population,
            "none" => StdMode::None,
            s => bail!("rl.std {s:?} is not one of sample, population, none"),
        })
    }

    /// Loss aggregation.
    pub fn aggregation(&self) -> anyhow::Result<Aggregation> {
        Ok(match self.rl.aggregation.as_str() {
            "token_mean" => Aggregation::TokenMean,
            "seq_mean" => Aggregation::SeqMean,
            s => bail!("rl.aggregation {s:?} is not one of token_mean, seq_mean"),
        })
    }

    /// `rollout.dtype` as the backends' [`DType`].
    pub fn engine_dtype(&self) -> anyhow::Result<DType> {
        engine_dtype(&self.rollout.dtype)
    }

    /// The baseline queue order.
    pub fn submit_order(&self) -> anyhow::Result<SubmitOrder> {
        Ok(match self.rollout.submit_order.as_str() {
            "group_major" => SubmitOrder::GroupMajor,
            "interleaved" => SubmitOrder::Interleaved,
            "shuffled" => SubmitOrder::Shuffled {
                seed: self.run.seed,
            },
            s => {
                bail!("rollout.submit_order {s:?} is not one of group_major, interleaved, shuffled")
            }
        })
    }

    /// The core's per-step plan for this config's mode.
    pub fn plan(&self) -> Plan {
        let (rl, ro) = (&self.rl, &self.rollout);
        let mut p = Plan::new(rl.batch_groups, rl.group_size);
        p.micro_batch = rl.micro_batch;
        p.opt_steps = rl.opt_steps;
        p.slots = (ro.engines as u32).saturating_mul(ro.slots);
        p.max_attempts = ro.max_attempts;
        p.max_groups = crate::driver::plan::max_groups(rl.batch_groups, ro.max_groups_factor);
        p.draw_batch = ro.draw_batch;
        p.draw_ahead = ro.draw_ahead;
        let order = self.submit_order().unwrap_or_default();
        p.admission = match self.run.mode {
            Mode::Rolloutpipe => AdmissionPolicy::Frontier {
                width: ro.frontier_width,
                expected_filter_ppm: crate::driver::plan::FilterEstimate::prior(ro.expected_filter)
                    .ppm(),
                fallback: order,
            },
            _ => AdmissionPolicy::Fifo { order },
        };
        p.dispatch = match self.run.mode {
            Mode::Cgp | Mode::Rolloutpipe => DispatchPolicy::Pipelined,
            // One-step-off trains the whole batch during the next rollout, so it waits for it.
            Mode::Sync | Mode::OneStepOff => DispatchPolicy::Sync,
        };
        // `validate` refuses a bad [alloc]; unvalidated, it falls back to fixed G.
        if let Ok(policy) = self.alloc_policy() {
            self.alloc.configure(&policy, &mut p);
        }
        p
    }

    /// The `[alloc]` policy for this config's batch shape.
    pub fn alloc_policy(&self) -> anyhow::Result<crate::alloc::Policy> {
        self.alloc.policy(self.rl.batch_groups, self.rl.group_size)
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

fn parse_value(raw: &str) -> toml::Value {
    // `toml` parses a value only as part of a document, so wrap it in one.
    match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.to_owned())),
        Err(_) => toml::Value::String(raw.to_owned()),
    }
}

fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_mistyped_override_is_one_line_naming_the_key() {
        let e = TrainConfig::default_config()
            .unwrap()
            .with_overrides(&["run.steps=-3".into()])
            .unwrap_err();
        let msg = format!("{e:#}");
        assert_eq!(msg.lines().count(), 1, "{msg}");
        assert!(msg.contains("run.steps"), "{msg}");
    }

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
    }

    /// `c` as a run directory written before `key` existed holds it: without its line.
    fn toml_without(c: &TrainConfig, key: &str) -> String {
        let line = format!("{key} =");
        (c.to_toml().unwrap().lines())
            .filter(|l| !l.starts_with(&line))
            .map(|l| format!("{l}\n"))
            .collect()
    }

    #[test]
    fn run_directories_written_before_rollout_dtype_read_as_f32() {
        let c = TrainConfig::default_config().unwrap();
        let old = toml_without(&c, "dtype");
        assert!(!old.contains("dtype"), "{old}");
        let back = TrainConfig::from_toml_str(&old).unwrap();
        assert_eq!(back.rollout.dtype, "f32");
        assert_eq!(back.engine_dtype().unwrap(), DType::F32);
        let bf = c
            .with_overrides(&["rollout.dtype=\"bf16\"".into()])
            .unwrap();
        assert_eq!(bf.engine_dtype().unwrap(), DType::Bf16);
    }

    #[test]
    fn tensor_cores_default_off_and_need_wgpu() {
        // The embedded default has both keys, off; a config without them (run directories
        // written before they existed) reads as off.
        let table: toml::Table = toml::from_str(DEFAULT_TOML).unwrap();
        let c = TrainConfig::default_config().unwrap();
        let old = toml_without(&c, "tensor_cores");
        assert!(!old.contains("tensor_cores"), "{old}");
        let old = TrainConfig::from_toml_str(&old).unwrap();
        let get = |c: &TrainConfig, section: &str| match section {
            "rollout" => c.rollout.tensor_cores,
            _ => c.trainer.tensor_cores,
        };
        for section in ["rollout", "trainer"] {
            let key = format!("{section}.tensor_cores");
            assert_eq!(
                table[section].get("tensor_cores"),
                Some(&toml::Value::Boolean(false)),
                "default.toml's [{section}] must set tensor_cores = false"
            );
            assert!(!get(&c, section) && !get(&old, section), "{key}");
            // It parses from a file and from --set, and validates on wgpu.
            let file = TrainConfig::from_partial_toml(&format!(
                "[run]\nbackend = \"wgpu\"\n[{section}]\ntensor_cores = true\n"
            ))
            .unwrap();
            assert!(get(&file, section), "{key}");
            file.validate().unwrap();
            let on = c.with_overrides(&[format!("{key}=true")]).unwrap();
            assert!(get(&on, section), "{key}");
            let err = c.with_overrides(&[format!("{key}=\"yes\"")]).unwrap_err();
            assert!(format!("{err:#}").contains("tensor_cores"), "{err:#}");
            assert_needs_wgpu(&on, &key);
        }
        // Off, every backend validates as before.
        for backend in ["cpu", "wgpu", "cuda"] {
            c.with_overrides(&[format!("run.backend=\"{backend}\"")])
                .unwrap()
                .validate()
                .unwrap();
        }
    }

    #[test]
    fn lookahead_defaults_off_and_needs_wgpu() {
        // The embedded default sets it off; a config without it (run directories written
        // before it existed) reads as off.
        let table: toml::Table = toml::from_str(DEFAULT_TOML).unwrap();
        assert_eq!(
            table["rollout"].get("lookahead"),
            Some(&toml::Value::Boolean(false))
        );
        let c = TrainConfig::default_config().unwrap();
        let old = toml_without(&c, "lookahead");
        assert!(!old.contains("lookahead"), "{old}");
        assert!(
            !c.rollout.lookahead && !TrainConfig::from_toml_str(&old).unwrap().rollout.lookahead
        );
        let file = TrainConfig::from_partial_toml(
            "[run]\nbackend = \"wgpu\"\n[rollout]\nlookahead = true\n",
        )
        .unwrap();
        assert!(file.rollout.lookahead);
        file.validate().unwrap();
        let on = c
            .with_overrides(&["rollout.lookahead=true".into()])
            .unwrap();
        assert!(on.rollout.lookahead);
        let err = c
            .with_overrides(&["rollout.lookahead=1".into()])
            .unwrap_err();
        assert!(format!("{err:#}").contains("lookahead"), "{err:#}");
        assert_needs_wgpu(&on, "rollout.lookahead");
    }

    /// `on` (with `key` set) on any other backend is refused in one line naming the key and
    /// the backend.
    fn assert_needs_wgpu(on: &TrainConfig, key: &str) {
        for backend in ["cpu", "cuda"] {
            let bad = on
                .with_overrides(&[format!("run.backend=\"{backend}\"")])
                .unwrap();
            let e = format!("{:#}", bad.validate().unwrap_err());
            assert_eq!(e.lines().count(), 1, "{e}");
            assert!(
                e.starts_with(&format!(
                    "{key} = true needs run.backend = \"wgpu\" (got \"{backend}\")"
                )),
                "{e}"
            );
        }
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let err = TrainConfig::from_partial_toml("[rl]\nbatch_grups = 3\n").unwrap_err();
        assert!(format!("{err:#}").contains("batch_grups"), "{err:#}");
        let c = TrainConfig::default_config().unwrap();
        let err = c.with_overrides(&["rl.nope=1".into()]).unwrap_err();
        assert!(err.to_string().contains("no key \"nope\""), "{err}");
    }

    #[test]
    fn overrides_apply_typed_values() {
        let c = TrainConfig::default_config().unwrap();
        let c = c
            .with_overrides(&[
                "rl.batch_groups=4".into(),
                "run.mode=sync".into(),
                "rl.lr=0.01".into(),
            ])
            .unwrap();
        assert_eq!(c.rl.batch_groups, 4);
        assert_eq!(c.run.mode, Mode::Sync);
        assert_eq!(c.rl.lr, 0.01);
        assert_eq!(c.plan().dispatch, DispatchPolicy::Sync);
        let err = c
            .with_overrides(&["rl.batch_groups=abc".into()])
            .unwrap_err();
        assert!(format!("{err:#}").contains("batch_groups"), "{err:#}");
    }

    #[test]
    fn invalid_combinations_say_why() {
        let c = TrainConfig::default_config().unwrap();
        let bad = c.with_overrides(&["rl.opt_steps=2".into()]).unwrap();
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("old_logprobs"), "{e}");
        let bad = c.with_overrides(&["rl.micro_batch=3".into()]).unwrap();
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("not divisible"), "{e}");
        let bad = c.with_overrides(&["rl.temperature=0".into()]).unwrap();
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("temperature")
        );
        let bad = c
            .with_overrides(&[
                "rollout.engines=1".into(),
                "fault.fail_engine_at_request=3".into(),
            ])
            .unwrap();
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("engines >= 2")
        );
        let bad = c.with_overrides(&["run.backend=tpu".into()]).unwrap();
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("\"tpu\" is not one of cpu, wgpu, cuda")
        );
        for (set, says) in [
            (
                vec!["rollout.dtype=\"fp8\""],
                "\"fp8\" is not one of f32, bf16, f16",
            ),
            (
                vec!["rollout.dtype=\"bf16\"", "run.backend=\"cuda\""],
                "needs run.backend = \"cpu\" or \"wgpu\": the cuda backend stores f32 weights",
            ),
            (vec!["sft.carry_drop=1.5"], "probability"),
            (vec!["sft.carry_drop=-0.1"], "probability"),
            (vec!["sft.carry_drop=0.5", "task.name=mul"], "add task only"),
            (
                vec!["task.train_pool=0"],
                "task.train_pool is 0, must be within 1..=1048576",
            ),
        ] {
            let set: Vec<String> = set.into_iter().map(Into::into).collect();
            let e = c.with_overrides(&set).unwrap().validate().unwrap_err();
            assert!(e.to_string().contains(says), "{set:?}: {e}");
        }
        let ok = c.with_overrides(&["sft.carry_drop=1".into()]).unwrap();
        ok.validate().unwrap();
        // Half engine storage is accepted on the two backends that have it.
        for (backend, dtype) in [("cpu", "bf16"), ("wgpu", "bf16"), ("wgpu", "f16")] {
            let set = [
                format!("run.backend=\"{backend}\""),
                format!("rollout.dtype=\"{dtype}\""),
            ];
            let half = c.with_overrides(&set).unwrap();
            half.validate().unwrap();
            assert_eq!(half.engine_dtype().unwrap().name().to_lowercase(), dtype);
        }
    }

    #[test]
    fn alloc_section_is_validated_and_configures_the_plan() {
        let c = TrainConfig::default_config().unwrap();
        assert_eq!(c.alloc.policy, "fixed");
        assert_eq!(c.plan(), {
            let mut p = c.clone();
            p.alloc.policy = "fixed".into();
            p.plan()
        });
        let v = c.with_overrides(&["alloc.policy=vigor".into()]).unwrap();
        v.validate().unwrap();
        let plan = v.plan();
        assert_eq!(
            (plan.group_size, plan.sample_budget, plan.hold_scored),
            (4, 16 * 8, true)
        );
        for (set, want) in [
            ("alloc.n0=1", "alloc.n0 is 1, must be at least 2"),
            (
                "alloc.budget=10",
                "alloc.budget 10 is below n0 × batch_groups = 64 samples",
            ),
            ("alloc.policy=dapo", "alloc.policy \"dapo\" is not one of"),
        ] {
            let bad = v.with_overrides(&[set.into()]).unwrap();
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.starts_with(want), "{set}: {e}");
        }
        let p = c
            .with_overrides(&["alloc.policy=pilot_commit".into(), "alloc.upper=1.5".into()])
            .unwrap();
        let e = p.validate().unwrap_err().to_string();
        assert_eq!(e, "alloc.upper is 1.5, must be within [0, 1]");
        // Configs written before [alloc] existed still load, as fixed G.
        let old = c.to_toml().unwrap().replace("[alloc]", "[ignored]");
        let old = old.split("[ignored]").next().unwrap();
        assert_eq!(
            TrainConfig::from_toml_str(old).unwrap().alloc.policy,
            "fixed"
        );
    }

    #[test]
    fn round_trips_through_toml() {
        let c = TrainConfig::default_config().unwrap();
        let back = TrainConfig::from_toml_str(&c.to_toml().unwrap()).unwrap();
        assert_eq!(back, c);
    }
}
