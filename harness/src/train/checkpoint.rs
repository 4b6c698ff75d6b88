//! Checkpoints of a training run: `checkpoints/step-N` holds the weights, the optimizer
//! moments and the scheduler side's state (data position, seed, one-step-off's pending
//! batch), written atomically so that an interrupted save never replaces a good checkpoint.
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, ensure};
use rolloutpipe_backends::optim::AdamState;
use rolloutpipe_backends::{ModelConfig, Tensor, Weights, load_model_dir};
use rolloutpipe_core::{GroupId, PolicyVersion};
use serde::{Deserialize, Serialize};

use super::data;
use super::workers::{GroupBatch, Sample};
use crate::driver::plan::FilterEstimate;
use crate::rundir::save_model;

/// Saved in each checkpoint beside the weights and optimizer moments.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct CheckpointState {
    /// First step the resumed run executes.
    pub(super) next_step: u64,
    /// Prompts drawn so far.
    pub(super) data_pos: u64,
    /// The run's seed (per-request sampling seeds are a pure function of it and the request).
    pub(super) seed: u64,
    /// Weights version the rollout engines hold.
    pub(super) engine_version: u64,
    /// One-step-off: the rolled-out batch not trained yet, with its optimizer-step marks.
    pub(super) pending: Vec<(Vec<SavedGroup>, bool)>,
    /// One-step-off: the step that pending batch belongs to.
    pub(super) pending_step: Option<u64>,
    /// Pool indices of problems evicted from later epochs (Pilot-Commit's solved prompts).
    #[serde(default)]
    pub(super) evicted: Vec<usize>,
    /// FGD's filter estimate for `next_step` (absent in older checkpoints: the prior).
    #[serde(default)]
    pub(super) filter: Option<FilterEstimate>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct SavedGroup {
    pub(super) step: u64,
    pub(super) group: u32,
    pub(super) prompt: Vec<u32>,
    pub(super) samples: Vec<SavedSample>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct SavedSample {
    pub(super) sample: u16,
    pub(super) attempt: u8,
    pub(super) version: u64,
    pub(super) tokens: Vec<u32>,
    pub(super) logprobs: Vec<f32>,
    pub(super) reward: f32,
    pub(super) correct: bool,
}

pub(super) fn save_group(g: &GroupBatch) -> SavedGroup {
    SavedGroup {
        step: g.step,
        group: g.group.0,
        prompt: g.prompt.to_vec(),
        samples: g
            .samples
            .iter()
            .map(|s| SavedSample {
                sample: s.sample,
                attempt: s.attempt,
                version: s.version.0,
                tokens: s.tokens.clone(),
                logprobs: s.logprobs.clone(),
                reward: s.reward,
                correct: s.correct,
            })
            .collect(),
    }
}

pub(super) fn restore_group(g: SavedGroup) -> GroupBatch {
    GroupBatch {
        step: g.step,
        group: GroupId(g.group),
        prompt: Arc::new(g.prompt),
        samples: g
            .samples
            .into_iter()
            .map(|s| Sample {
                sample: s.sample,
                attempt: s.attempt,
                version: PolicyVersion(s.version),
                tokens: s.tokens,
                logprobs: s.logprobs,
                reward: s.reward,
                correct: s.correct,
            })
            .collect(),
        // One-step-off's pending batches: that mode does not multiplex.
        ref_logprobs: None,
    }
}

/// Writes `checkpoints/step-N` (into a temporary directory renamed at the end, then the
/// `latest` pointer), so an interrupted save never replaces a good checkpoint.
pub(super) fn save_checkpoint(
    out: &Path,
    tok: Option<&Path>,
    cfg: &ModelConfig,
    w: &Weights,
    adam: Option<&AdamState>,
    st: &CheckpointState,
) -> anyhow::Result<()> {
    let root = out.join("checkpoints");
    let name = format!("step-{:06}", st.next_step);
    let tmp = root.join(format!(".{name}.tmp"));
    let _ = std::fs::remove_dir_all(&tmp);
    save_model(&tmp, cfg, w, tok)?;
    if let Some(a) = adam {
        let mut o = Weights::default();
        let n = a.m.len();
        o.tensors
            .insert("adam.m".into(), Tensor::new(vec![n], a.m.clone())?);
        o.tensors
            .insert("adam.v".into(), Tensor::new(vec![a.v.len()], a.v.clone())?);
        o.tensors.insert(
            "adam.step".into(),
            Tensor::new(vec![1], vec![a.step as f32])?,
        );
        o.save_safetensors(&tmp.join("optimizer.safetensors"))?;
        // f32 cannot hold every u64 step count exactly; the JSON holds the exact one.
        std::fs::write(
            tmp.join("optimizer_step.json"),
            serde_json::to_string(&a.step)?,
        )?;
    }
    std::fs::write(tmp.join("state.json"), serde_json::to_string(st)?)?;
    let dst = root.join(&name);
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::rename(&tmp, &dst).with_context(|| format!("renaming into {}", dst.display()))?;
    let ptr_tmp = root.join(".latest.tmp");
    std::fs::write(&ptr_tmp, &name)?;
    std::fs::rename(&ptr_tmp, root.join("latest"))?;
    tracing::info!(dir = %dst.display(), "checkpoint saved");
    Ok(())
}

pub(super) fn load_checkpoint(
    dir: &Path,
    cfg: &ModelConfig,
) -> anyhow::Result<(Weights, CheckpointState, Option<AdamState>)> {
    let (ccfg, w) = load_model_dir(dir)?;
    ensure!(
        &ccfg == cfg,
        "the checkpoint's model shape differs from the configured model"
    );
    let st: CheckpointState = serde_json::from_str(&data::read(&dir.join("state.json"))?)
        .context("state.json is not a valid checkpoint state")?;
    let opt_path = dir.join("optimizer.safetensors");
    let adam = if opt_path.exists() {
        let o = Weights::load_safetensors(&opt_path)?;
        let step: u64 = serde_json::from_str(&data::read(&dir.join("optimizer_step.json"))?)
            .context("optimizer_step.json")?;
        Some(AdamState {
            m: o.get("adam.m")?.data.clone(),
            v: o.get("adam.v")?.data.clone(),
            step,
        })
    } else {
        tracing::warn!(
            "checkpoint has no optimizer state (its backend did not expose it); AdamW restarts"
        );
        None
    };
    Ok((w, st, adam))
}
