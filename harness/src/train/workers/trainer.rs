//! The trainer worker: [`TrainerStep`] is the trainer's work (micro-batches, optimizer
//! steps, exports), shared by the in-process thread ([`trainer_thread`]) and the remote
//! `TrainerHost`.
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

use anyhow::anyhow;
use rolloutpipe_backends::optim::AdamState;
use rolloutpipe_backends::{
    AccumStats, AdamW, Aggregation, ModelConfig, Objective, Sequence, StdMode, TrainBatch,
    TrainSequence, Weights, advantages, normalizer,
};

use super::backend::{TrainerBackend, make_trainer};
use crate::train::config::{OldLogprobs, TrainConfig};
use crate::train::msg::{Event, GroupBatch, MicroBatchDone, OptDone, TrainCmd, TrainerReply};

/// What the trainer needs besides its backend.
pub struct TrainerSetup {
    /// AdamW settings.
    pub opt: AdamW,
    /// The GRPO objective.
    pub objective: Objective,
    /// Aggregation.
    pub agg: Aggregation,
    /// Advantage scaling.
    pub std: StdMode,
    /// Use the rollout's log-probs as `logπ_old`.
    pub rollout_logprobs: bool,
    /// Reference model for the KL term (beta > 0).
    pub reference: Option<TrainerBackend>,
    /// Sampling temperature (for the reference's log-probs).
    pub temperature: f32,
}

/// The trainer: its backend, its settings and the micro-batches since the last optimizer step.
pub struct TrainerStep {
    backend: TrainerBackend,
    setup: TrainerSetup,
    since_opt: Vec<TrainBatch>,
    accum: AccumStats,
}

impl TrainerStep {
    /// A trainer with zeroed gradients.
    pub fn new(mut backend: TrainerBackend, setup: TrainerSetup) -> anyhow::Result<Self> {
        backend
            .as_dyn()
            .zero_grad()
            .map_err(|e| anyhow!("trainer: {e}"))?;
        Ok(TrainerStep {
            backend,
            setup,
            since_opt: Vec::new(),
            accum: AccumStats::default(),
        })
    }

    /// Forward/backward of one micro-batch, accumulating unnormalised gradient sums.
    pub fn micro_batch(&mut self, groups: Vec<GroupBatch>) -> anyhow::Result<MicroBatchDone> {
        let (batch, stats) = train_micro_batch(&mut self.backend, &mut self.setup, groups)
            .map_err(|e| anyhow!("trainer: {e:#}"))?;
        let tokens = batch.response_tokens();
        let all_tokens = batch
            .sequences
            .iter()
            .map(|s| s.prompt.len() + s.response.len())
            .sum();
        self.accum.merge(&stats);
        self.since_opt.push(batch);
        Ok(MicroBatchDone {
            stats,
            tokens,
            all_tokens,
        })
    }

    /// Normalises, clips and applies AdamW over the micro-batches since the last step.
    pub fn opt_step(&mut self) -> anyhow::Result<OptDone> {
        // The normaliser of the whole optimizer step, known only now (the sum of the weights
        // of every micro-batch since the last step).
        let norm = normalizer(self.setup.agg, &self.since_opt);
        let be = self.backend.as_dyn();
        let stats = be
            .optimizer_step(norm, &self.setup.opt)
            .and_then(|st| be.zero_grad().map(|()| st))
            .map_err(|e| anyhow!("trainer optimizer step: {e}"))?;
        self.since_opt.clear();
        Ok(OptDone {
            stats,
            accum: std::mem::take(&mut self.accum),
            normalizer: norm,
        })
    }

    /// The f32 master weights, and the AdamW moments when `optimizer` (checkpoints only: the
    /// moments do not cross the seam every step).
    pub fn export(&mut self, optimizer: bool) -> anyhow::Result<(Weights, Option<AdamState>)> {
        let be = self.backend.as_dyn();
        let w = be
            .export_weights()
            .map_err(|e| anyhow!("trainer export: {e}"))?;
        let adam = if optimizer {
            Some(
                be.checkpoint_optimizer()
                    .map_err(|e| anyhow!("trainer export: {e}"))?,
            )
        } else {
            None
        };
        Ok((w, adam))
    }
}

/// The trainer's settings for `cfg`; `reference` is the KL reference model's weights
/// (`rl.beta > 0`), run on the CPU backend.
pub fn trainer_setup(
    cfg: &TrainConfig,
    model_cfg: &ModelConfig,
    reference: Option<&Weights>,
) -> anyhow::Result<TrainerSetup> {
    Ok(TrainerSetup {
        opt: AdamW {
            lr: cfg.rl.lr,
            weight_decay: cfg.rl.weight_decay,
            max_grad_norm: (cfg.rl.max_grad_norm > 0.0).then_some(cfg.rl.max_grad_norm),
            ..AdamW::default()
        },
        objective: Objective::Grpo {
            eps_low: cfg.rl.eps_low,
            eps_high: cfg.rl.eps_high,
            beta: cfg.rl.beta,
            temperature: cfg.rl.temperature as f64,
        },
        agg: cfg.rl.aggregation.aggregation(),
        std: cfg.rl.std.mode(),
        rollout_logprobs: cfg.rl.old_logprobs == OldLogprobs::Rollout,
        reference: match reference {
            Some(r) => Some(make_trainer(
                "cpu",
                model_cfg,
                r,
                cfg.trainer.threads,
                false,
            )?),
            None => None,
        },
        temperature: cfg.rl.temperature,
    })
}

/// Builds the micro-batch's sequences (groups in id order, so the summation order does not
/// depend on which group happened to finish first) and accumulates their gradient.
fn train_micro_batch(
    backend: &mut TrainerBackend,
    setup: &mut TrainerSetup,
    mut groups: Vec<GroupBatch>,
) -> anyhow::Result<(TrainBatch, AccumStats)> {
    groups.sort_by_key(|g| (g.step, g.group));
    let mut batch = TrainBatch::default();
    for g in &groups {
        let rewards: Vec<f64> = g.samples.iter().map(|s| s.reward as f64).collect();
        let adv = advantages(&rewards, setup.std)?;
        for (s, a) in g.samples.iter().zip(adv) {
            let mut seq = TrainSequence::new(g.prompt.to_vec(), s.tokens.clone(), a, setup.agg);
            if setup.rollout_logprobs {
                seq.old_logprobs = Some(s.logprobs.clone());
            }
            batch.sequences.push(seq);
        }
    }
    if let Some(reference) = setup.reference.as_mut() {
        // Groups a rollout engine multiplexed carry their reference log-probs (the same
        // weights and batch-invariant kernels, so the same bits); the rest are computed here,
        // in one pass. Either way each sequence's values enter the update once.
        let mut seq_of = batch.sequences.iter_mut();
        let mut missing = Vec::new();
        for g in &groups {
            for i in 0..g.samples.len() {
                let Some(seq) = seq_of.next() else { break };
                match g.ref_logprobs.as_ref().and_then(|r| r.get(i)) {
                    Some(lp) if lp.len() == seq.response.len() => {
                        seq.ref_logprobs = Some(lp.clone())
                    }
                    Some(lp) => anyhow::bail!(
                        "group {}: {} multiplexed reference log-probs for a {}-token response",
                        g.group,
                        lp.len(),
                        seq.response.len()
                    ),
                    None => missing.push(seq),
                }
            }
        }
        if !missing.is_empty() {
            let seqs: Vec<Sequence> = missing
                .iter()
                .map(|s| Sequence {
                    prompt: s.prompt.clone(),
                    response: s.response.clone(),
                })
                .collect();
            let lps = reference.as_dyn().logprobs(&seqs, setup.temperature)?;
            for (s, lp) in missing.into_iter().zip(lps) {
                s.ref_logprobs = Some(lp);
            }
        }
    }
    let stats = backend.as_dyn().accumulate(&batch, &setup.objective)?;
    Ok((batch, stats))
}

/// Runs the trainer until `Shutdown`.
pub fn trainer_thread(
    backend: TrainerBackend,
    setup: TrainerSetup,
    rx: Receiver<TrainCmd>,
    events: Sender<Event>,
) {
    let mut step = match TrainerStep::new(backend, setup) {
        Ok(s) => s,
        Err(e) => {
            let _ = events.send(Event::Fatal(e.to_string()));
            return;
        }
    };
    while let Ok(cmd) = rx.recv() {
        let started = Instant::now();
        let reply = match cmd {
            TrainCmd::Shutdown => return,
            TrainCmd::MicroBatch(groups) => step.micro_batch(groups).map(TrainerReply::MicroBatch),
            TrainCmd::OptStep => step.opt_step().map(TrainerReply::Opt),
            TrainCmd::Export { optimizer } => step
                .export(optimizer)
                .map(|(w, adam)| TrainerReply::Exported(Arc::new(w), adam)),
        };
        let ev = match reply {
            Ok(reply) => Event::Trainer {
                reply,
                started,
                ended: Instant::now(),
            },
            Err(e) => {
                let _ = events.send(Event::Fatal(e.to_string()));
                return;
            }
        };
        if events.send(ev).is_err() {
            return;
        }
    }
}
