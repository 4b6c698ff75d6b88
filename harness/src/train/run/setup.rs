//! A run's setup: the model and its tokenizer, the evaluator, and where RL starts (a
//! checkpoint, or the SFT warm start from the initial weights).
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, ensure};
use rolloutpipe_backends::optim::AdamState;
use rolloutpipe_backends::{
    BackendInfo, CpuBackend, ModelConfig, RolloutEngine, WeightSnapshot, Weights, load_model_dir,
};

use crate::rundir::save_model;
use crate::tasks::{CharTokenizer, Problem, Task, Tokenizer};
use crate::train::config::TrainConfig;
use crate::train::data::{self, Problems};
use crate::train::guard;
use crate::train::record::checkpoint::{CheckpointState, load_checkpoint};
use crate::train::workers::make_trainer;

/// The model's shape, its initial weights and its tokenizer.
pub(super) struct Model {
    pub(super) cfg: ModelConfig,
    pub(super) weights: Weights,
    pub(super) tok: Arc<dyn Tokenizer>,
}

/// The configured model: a fresh one of `[model]`'s shape, or a model directory's.
pub(super) fn load_model(cfg: &TrainConfig) -> anyhow::Result<Model> {
    let model = if cfg.model.dir.as_os_str().is_empty() {
        let tok = CharTokenizer;
        let mc = cfg.model_config(tok.vocab_size());
        mc.validate().context("model shape")?;
        let w = Weights::random(&mc, cfg.model.init_seed)?;
        Model {
            cfg: mc,
            weights: w,
            tok: Arc::new(tok),
        }
    } else {
        let dir = &cfg.model.dir;
        let (mc, w) = load_model_dir(dir)
            .with_context(|| format!("loading model directory {}", dir.display()))?;
        Model {
            cfg: mc,
            weights: w,
            tok: data::tokenizer(cfg)?,
        }
    };
    ensure!(
        model.tok.vocab_size() <= model.cfg.vocab_size,
        "the tokenizer has {} ids but the model's vocabulary is {}",
        model.tok.vocab_size(),
        model.cfg.vocab_size
    );
    crate::limits::check_model_fits(
        &model.cfg,
        7 + u128::from(cfg.rollout.engines),
        "the model's size",
    )?;
    Ok(model)
}

/// Refuses `rl.max_new_tokens` (and SFT answers) that, after the longest prompt, would run
/// past the model's position limit: found here, before any SFT or RL step runs.
pub(super) fn check_positions(
    cfg: &TrainConfig,
    problems: &Problems,
    tok: &dyn Tokenizer,
    mc: &ModelConfig,
) -> anyhow::Result<()> {
    let limit = mc.max_position_embeddings;
    let mut longest = problems.train.longest_prompt();
    for p in &problems.heldout {
        longest = longest.max(tok.encode_prompt(&p.prompt)?.len());
    }
    ensure!(
        longest + cfg.rl.max_new_tokens <= limit,
        "rl.max_new_tokens = {} after the longest prompt ({longest} tokens) exceeds the model's position limit max_position_embeddings = {limit}; lower it to at most {}",
        cfg.rl.max_new_tokens,
        limit.saturating_sub(longest)
    );
    Ok(())
}

/// Greedy accuracy on the held-out set and on the independent test set, on a CPU backend of
/// its own.
pub(crate) struct Evaluator {
    backend: CpuBackend,
    task: Arc<dyn Task>,
    tok: Arc<dyn Tokenizer>,
    heldout: Vec<Problem>,
    /// The independent test set (uniform operands from their own seed, beside the held-out
    /// split, which follows the training generator), evaluated wherever the held-out set is.
    test: Option<Vec<Problem>>,
    max_new: usize,
}

impl Evaluator {
    /// An evaluator of `heldout` and `test` for `model`.
    pub(super) fn new(
        cfg: &TrainConfig,
        model: &Model,
        task: Arc<dyn Task>,
        heldout: Vec<Problem>,
        test: Option<Vec<Problem>>,
    ) -> anyhow::Result<Self> {
        Ok(Evaluator {
            backend: CpuBackend::new(&model.cfg, &model.weights, cfg.trainer.threads)?,
            task,
            tok: model.tok.clone(),
            heldout,
            test,
            max_new: cfg.rl.max_new_tokens,
        })
    }

    fn accuracy(&mut self, w: &Weights, test: bool) -> anyhow::Result<f64> {
        let be = &mut self.backend;
        let snap = WeightSnapshot::host(be.config(), w, be.weight_dtype())?;
        be.load_weights(&snap)?;
        let problems = match (test, &self.test) {
            (true, Some(t)) => t,
            _ => &self.heldout,
        };
        data::evaluate(
            be,
            self.task.as_ref(),
            self.tok.as_ref(),
            problems,
            self.max_new,
        )
    }

    /// Held-out accuracy of `w`.
    pub(crate) fn heldout(&mut self, w: &Weights) -> anyhow::Result<f64> {
        self.accuracy(w, false)
    }

    /// Test-set accuracy of `w`, `None` without a test set.
    pub(crate) fn test(&mut self, w: &Weights) -> anyhow::Result<Option<f64>> {
        match self.test {
            Some(_) => Ok(Some(self.accuracy(w, true)?)),
            None => Ok(None),
        }
    }
}

/// Where RL starts.
pub(super) struct StartPoint {
    pub(super) weights: Weights,
    /// The trainer's AdamW moments (a resumed run's).
    pub(super) adam: Option<AdamState>,
    /// The KL reference weights (`rl.beta > 0`).
    pub(super) reference: Option<Weights>,
    /// The scheduler side's state.
    pub(super) state: CheckpointState,
    /// Held-out and test accuracy before SFT, if SFT ran here.
    pub(super) accuracy_initial: Option<f64>,
    pub(super) test_initial: Option<f64>,
}

/// The run's latest checkpoint, checked against `cfg`; only then may the run's config change.
pub(super) fn resume_point(
    cfg: &TrainConfig,
    out: &Path,
    mc: &ModelConfig,
) -> anyhow::Result<StartPoint> {
    let root = out.join("checkpoints");
    let name =
        data::read(&root.join("latest")).context("the run has no checkpoint to resume from")?;
    let dir = root.join(name.trim());
    let (w, st, adam) = load_checkpoint(&dir, mc)
        .with_context(|| format!("loading checkpoint {}", dir.display()))?;
    ensure!(
        st.seed == cfg.run.seed,
        "checkpoint seed {} differs from run.seed {}",
        st.seed,
        cfg.run.seed
    );
    let last_phase = cfg.run.steps as u64 - u64::from(!cfg.run.mode.stale());
    ensure!(
        st.next_step <= last_phase,
        "the checkpoint is already at step {} of run.steps = {}; raise run.steps (--set run.steps=N) to continue",
        st.next_step,
        cfg.run.steps
    );
    // Every resume check has passed: only now may the run's config change.
    guard::write_config(cfg, out)?;
    let reference = if cfg.rl.beta > 0.0 {
        Some(load_model_dir(&out.join("reference"))?.1)
    } else {
        None
    };
    tracing::info!(step = st.next_step, dir = %dir.display(), "resuming");
    Ok(StartPoint {
        weights: w,
        adam,
        reference,
        state: st,
        accuracy_initial: None,
        test_initial: None,
    })
}

/// A fresh run's start: the SFT warm start on `sft` from `model`'s weights (when
/// `sft.steps > 0`, evaluated before it), and the KL reference saved.
pub(super) fn fresh_point(
    cfg: &TrainConfig,
    out: &Path,
    model: Model,
    eval: &mut Evaluator,
    sft: &[Problem],
) -> anyhow::Result<StartPoint> {
    let mut w = model.weights;
    let (mut accuracy_initial, mut test_initial) = (None, None);
    if cfg.sft.steps > 0 {
        let mut be = make_trainer(
            &cfg.run.backend,
            &model.cfg,
            &w,
            cfg.trainer.threads,
            cfg.trainer.tensor_cores,
        )?;
        accuracy_initial = Some(eval.heldout(&w)?);
        test_initial = eval.test(&w)?;
        let t = Instant::now();
        let loss = data::sft(cfg, be.as_dyn(), model.tok.as_ref(), sft)?;
        w = be.as_dyn().export_weights()?;
        tracing::info!(
            steps = cfg.sft.steps,
            loss,
            secs = t.elapsed().as_secs_f64(),
            "SFT warm start done"
        );
        save_model(&out.join("sft"), &model.cfg, &w, tok_src(cfg))?;
    }
    let reference = if cfg.rl.beta > 0.0 {
        save_model(&out.join("reference"), &model.cfg, &w, tok_src(cfg))?;
        Some(w.clone())
    } else {
        None
    };
    Ok(StartPoint {
        weights: w,
        adam: None,
        reference,
        state: CheckpointState::fresh(cfg.run.seed),
        accuracy_initial,
        test_initial,
    })
}

/// The model directory whose tokenizer files every model directory of the run carries.
pub(crate) fn tok_src(cfg: &TrainConfig) -> Option<&Path> {
    Some(cfg.model.dir.as_path()).filter(|d| !d.as_os_str().is_empty())
}
