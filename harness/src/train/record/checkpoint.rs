//! Checkpoints of a training run: `checkpoints/step-N` holds the weights, the optimizer
//! moments and the scheduler side's state (data position, seed, one-step-off's pending
//! batch; `state.json`, versioned by [`FORMAT`]), written atomically so that an interrupted
//! save never replaces a good checkpoint.
use std::path::Path;

use anyhow::{Context, bail, ensure};
use rolloutpipe_backends::optim::AdamState;
use rolloutpipe_backends::{ModelConfig, Tensor, Weights, load_model_dir};
use serde::{Deserialize, Serialize};

use crate::driver::plan::FilterEstimate;
use crate::rundir::save_model;
use crate::train::data;
use crate::train::msg::GroupBatch;

/// The format of `state.json` this binary writes: 2 stores the pending groups in the run's
/// message form ([`GroupBatch`], floats as bit patterns). A state without a `format` is
/// format 1, whose floats are plain JSON numbers; [`load_checkpoint`] reads both.
pub const FORMAT: u32 = 2;

/// Saved in each checkpoint beside the weights and optimizer moments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct CheckpointState {
    /// The format this state is written in ([`FORMAT`]).
    #[serde(default = "format_1")]
    pub(crate) format: u32,
    /// First step the resumed run executes.
    pub(crate) next_step: u64,
    /// Prompts drawn so far.
    pub(crate) data_pos: u64,
    /// The run's seed (per-request sampling seeds are a pure function of it and the request).
    pub(crate) seed: u64,
    /// Weights version the rollout engines hold.
    pub(crate) engine_version: u64,
    /// One-step-off: the rolled-out batch not trained yet, with its optimizer-step marks.
    pub(crate) pending: Vec<(Vec<GroupBatch>, bool)>,
    /// One-step-off: the step that pending batch belongs to.
    pub(crate) pending_step: Option<u64>,
    /// Pool indices of problems evicted from later epochs (Pilot-Commit's solved prompts).
    #[serde(default)]
    pub(crate) evicted: Vec<usize>,
    /// FGD's filter estimate for `next_step` (absent: the prior).
    #[serde(default)]
    pub(crate) filter: Option<FilterEstimate>,
}

fn format_1() -> u32 {
    1
}

impl CheckpointState {
    /// The state of a run that has not run a step, with seed `seed`.
    pub(crate) fn fresh(seed: u64) -> Self {
        CheckpointState {
            format: FORMAT,
            next_step: 0,
            data_pos: 0,
            seed,
            engine_version: 0,
            pending: Vec::new(),
            pending_step: None,
            evicted: Vec::new(),
            filter: None,
        }
    }

    /// Reads a `state.json` of any format this binary knows.
    pub(crate) fn from_json(text: &str) -> anyhow::Result<Self> {
        let mut v: serde_json::Value = serde_json::from_str(text)?;
        let format = v.get("format").map_or(Some(1), serde_json::Value::as_u64);
        match format {
            Some(1) => upgrade_format_1(&mut v),
            Some(f) if f == u64::from(FORMAT) => {}
            _ => bail!(
                "its format {} is not one this binary reads (1..={FORMAT})",
                v["format"]
            ),
        }
        let mut st: CheckpointState = serde_json::from_value(v)?;
        st.format = FORMAT;
        Ok(st)
    }
}

/// Format 1 stored each pending sample's log-probs and reward as JSON numbers; format 2 as
/// bit patterns. The number is read as serde reads an `f32` (the nearest `f32` to it).
fn upgrade_format_1(v: &mut serde_json::Value) {
    use serde_json::Value;
    let to_bits = |x: &mut Value| {
        if let Some(f) = x.as_f64() {
            *x = Value::from((f as f32).to_bits());
        }
    };
    let batches = v.get_mut("pending").and_then(Value::as_array_mut);
    for batch in batches.into_iter().flatten() {
        let groups = batch.get_mut(0).and_then(Value::as_array_mut);
        for group in groups.into_iter().flatten() {
            let samples = group.get_mut("samples").and_then(Value::as_array_mut);
            for s in samples.into_iter().flatten() {
                if let Some(lps) = s.get_mut("logprobs").and_then(Value::as_array_mut) {
                    lps.iter_mut().for_each(to_bits);
                }
                if let Some(r) = s.get_mut("reward") {
                    to_bits(r);
                }
            }
        }
    }
}

/// Writes `checkpoints/step-N` (into a temporary directory renamed at the end, then the
/// `latest` pointer), so an interrupted save never replaces a good checkpoint.
pub(crate) fn save_checkpoint(
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

pub(crate) fn load_checkpoint(
    dir: &Path,
    cfg: &ModelConfig,
) -> anyhow::Result<(Weights, CheckpointState, Option<AdamState>)> {
    let (ccfg, w) = load_model_dir(dir)?;
    ensure!(
        &ccfg == cfg,
        "the checkpoint's model shape differs from the configured model"
    );
    let st = CheckpointState::from_json(&data::read(&dir.join("state.json"))?)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A format-1 state (an older binary's `state.json`, from the fixture run directory)
    /// reads with each pending float the nearest `f32` to its JSON number, as that binary
    /// read it; the state then writes and reads back as format 2, bit for bit.
    #[test]
    fn format_1_states_read_with_their_floats_and_round_trip_as_format_2() {
        let v1 = include_str!(
            "../../../tests/fixtures/checkpoint-format-1/checkpoints/step-000002/state.json"
        );
        let st = CheckpointState::from_json(v1).unwrap();
        assert_eq!(
            (st.format, st.next_step, st.pending_step),
            (FORMAT, 2, Some(1))
        );
        let (groups, ends_opt) = &st.pending[0];
        assert!(*ends_opt);
        let s = &groups[0].samples;
        assert_eq!(s[0].logprobs, [-0.960_185_05_f32, -0.002_633_690_4]);
        assert_eq!(s[2].logprobs, [-0.961_026_2_f32, -0.007_549_65]);
        assert_eq!((s[0].reward, s[2].reward), (1.0, 0.0));
        let json = serde_json::to_string(&st).unwrap();
        assert!(json.starts_with("{\"format\":2,"), "{json}");
        assert_eq!(CheckpointState::from_json(&json).unwrap(), st);
        // A format this binary does not know is refused, naming it.
        let v3 = json.replacen("\"format\":2", "\"format\":3", 1);
        let e = CheckpointState::from_json(&v3).unwrap_err().to_string();
        assert_eq!(e, "its format 3 is not one this binary reads (1..=2)");
    }
}
