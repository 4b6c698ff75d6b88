//! The trainer interface: scoring, GRPO/SFT gradient accumulation, AdamW on f32 master
//! weights, weight snapshots for engines, and optimizer state for checkpoints only.

use super::BackendInfo;
use super::engine::RolloutEngine;
use super::sync::{SyncPath, SyncTarget, WeightSnapshot};
use super::types::{AccumStats, Objective, Sequence, TrainBatch};
use crate::error::Result;
use crate::optim::{AdamState, AdamW, OptStats};
use crate::weights::Weights;

/// Hands `w`'s tensors to `visit` in `cfg`'s parameter order.
fn visit_in_order(
    cfg: &crate::config::ModelConfig,
    w: &Weights,
    visit: &mut dyn FnMut(&str, &[f32]) -> Result<()>,
) -> Result<()> {
    for (name, _) in crate::weights::param_specs(cfg) {
        visit(&name, &w.get(&name)?.data)?;
    }
    Ok(())
}

/// A trainer: a Qwen3 model with f32 master weights, gradient sums and f32 AdamW moments.
///
/// `accumulate` adds unnormalised gradient sums until `optimizer_step` applies the
/// normaliser (SPEC §2, §6). The moments never leave the trainer in the training loop: they
/// are exported only for a checkpoint ([`Trainer::checkpoint_optimizer`]).
pub trait Trainer: BackendInfo {
    /// Per response token of each sequence, `log_softmax(logits / temperature)` at that token.
    fn logprobs(&mut self, seqs: &[Sequence], temperature: f32) -> Result<Vec<Vec<f32>>>;
    /// Logits at every position of one sequence, `[ids.len(), vocab]` row-major (inspection and
    /// parity checks only: training and scoring never build them).
    fn logits(&mut self, ids: &[u32]) -> Result<Vec<f32>>;

    /// Clears the gradient sums.
    fn zero_grad(&mut self) -> Result<()>;
    /// Forward and backward of `obj` on a micro-batch, adding the unnormalised gradient of
    /// Σ weight·loss to the gradient sums.
    fn accumulate(&mut self, batch: &TrainBatch, obj: &Objective) -> Result<AccumStats>;
    /// Divides the gradient sums by `normalizer`, clips, applies AdamW; returns the pre-clip
    /// norm. The sums are left as they were (call `zero_grad` before the next step).
    fn optimizer_step(&mut self, normalizer: f64, opt: &AdamW) -> Result<OptStats>;
    /// The raw gradient sums under the parameters' names (before normalising and clipping).
    fn gradients(&self) -> Result<Weights>;

    /// Hands the raw gradient sums to `visit` one tensor at a time (name, values), in
    /// [`param_specs`](crate::weights::param_specs) order, holding at most one tensor besides
    /// the trainer's own (saving a large model's gradient).
    fn visit_gradients(&self, visit: &mut dyn FnMut(&str, &[f32]) -> Result<()>) -> Result<()> {
        visit_in_order(self.config(), &self.gradients()?, visit)
    }

    /// The f32 master weights on the host (saving, checkpoints, parity tests).
    fn export_weights(&self) -> Result<Weights>;
    /// Hands the f32 master weights to `visit` one tensor at a time, as
    /// [`Trainer::visit_gradients`] does the gradients (saving a large model).
    fn visit_weights(&self, visit: &mut dyn FnMut(&str, &[f32]) -> Result<()>) -> Result<()> {
        visit_in_order(self.config(), &self.export_weights()?, visit)
    }
    /// Replaces the master weights (restoring a checkpoint). The optimizer state and gradient
    /// sums are kept: restoring a checkpoint restores them too.
    fn import_weights(&mut self, w: &Weights) -> Result<()>;

    /// A copy of the weights for an engine described by `target`: on the device when the
    /// trainer shares it (and supports the dtype), else host tensors in `target.dtype`.
    fn snapshot_weights(&self, target: SyncTarget) -> Result<WeightSnapshot>;

    /// Weight sync to an engine of this thread: snapshot for it, then load.
    fn sync_to(&self, engine: &mut dyn RolloutEngine) -> Result<SyncPath> {
        let snap = self.snapshot_weights(engine.sync_target())?;
        engine.load_weights(&snap)
    }

    /// The AdamW moments and step count in the flat layout every backend shares, for a
    /// checkpoint (a fresh optimizer has empty moments).
    fn checkpoint_optimizer(&self) -> Result<AdamState>;
    /// Restores a state from any backend's [`Trainer::checkpoint_optimizer`] (empty moments
    /// mean a fresh optimizer); a state of another model's size is a shape error.
    fn restore_optimizer(&mut self, state: AdamState) -> Result<()>;
}
