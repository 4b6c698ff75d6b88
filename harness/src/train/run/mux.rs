//! Tail multiplexing in real runs (`rollout.multiplex`): when no request waits to be admitted,
//! a rollout engine with nothing running computes the KL reference log-probs of a dispatched
//! group whose micro-batch the trainer has not started, most recently dispatched first (the
//! trainer takes groups in dispatch order, so work from the back is the least likely to be
//! overtaken), as the simulator's `multiplex` does.
//!
//! Each engine holds an f32 CPU copy of the trainer's reference weights and runs the same
//! batch-invariant kernels, so its values are the trainer's bit for bit and the run stays
//! on-policy and exact. A group whose pass has not come back when its micro-batch starts is
//! computed by the trainer itself, and the engine's late result is dropped: the trainer never
//! waits on an engine, and each sequence's reference log-probs enter the update once.
use rolloutpipe_backends::Sequence;
use rolloutpipe_core::MicroBatch;

use super::ctx::PID_ENGINES;
use super::phase::Phase;
use crate::train::msg::{EngineCmd, GroupBatch, RefDone, RefPass};

/// A dispatched group's multiplexed reference pass.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum MuxPass {
    /// Not handed to an engine.
    Free,
    /// An engine is computing it.
    Sent,
    /// Its per-sample reference log-probs, waiting for the group's micro-batch.
    Done(Vec<Vec<f32>>),
    /// Used by the trainer, or overtaken by it (the trainer computed it).
    Over,
}

impl Phase<'_, '_> {
    /// Hands one reference pass to each idle engine (live, no request held, no pass running),
    /// while dispatched groups the trainer has not started remain. The caller knows that no
    /// request is waiting to be admitted.
    pub(super) fn multiplex(&mut self) -> anyhow::Result<()> {
        if !self.ctx.cfg.rollout.multiplex
            || self.one_off
            || !self.rollout_this
            || self.migration_pending()
        {
            return Ok(());
        }
        for e in 0..self.ctx.engines.len() {
            let h = &self.ctx.engines[e];
            if !h.live || h.running > 0 || h.mux_busy {
                continue;
            }
            let Some(i) = (self.started_upto..self.dispatched.len())
                .rev()
                .find(|&i| self.mux[i] == MuxPass::Free)
            else {
                return Ok(());
            };
            let g = &self.dispatched[i];
            let seqs = g
                .samples
                .iter()
                .map(|s| Sequence {
                    prompt: g.prompt.to_vec(),
                    response: s.tokens.clone(),
                })
                .collect();
            let cmd = EngineCmd::RefLogprobs(RefPass {
                step: self.k,
                index: i,
                seqs,
                temperature: self.ctx.cfg.rl.temperature,
            });
            if self.ctx.engines[e].tx.send(cmd).is_err() {
                return Err(self.ctx.worker_stopped(&format!("rollout engine {e}")));
            }
            self.ctx.engine_mux(e, true);
            self.mux[i] = MuxPass::Sent;
        }
        Ok(())
    }

    /// Engine `engine` finished the pass of dispatched group `index` of `step`: kept for the
    /// group's micro-batch unless the trainer already started it (then it is dropped).
    pub(super) fn on_ref_logprobs(&mut self, engine: u16, done: RefDone, (t0, t1): (f64, f64)) {
        let RefDone {
            step,
            index,
            logprobs,
        } = done;
        self.ctx.engine_mux(engine as usize, false);
        self.mux_s += (t1 - t0) * 1e-6;
        let used = step == self.k
            && index >= self.started_upto
            && self.mux.get(index) == Some(&MuxPass::Sent);
        if used {
            self.mux[index] = MuxPass::Done(logprobs);
        }
        let group = self.dispatched.get(index).map_or(0, |g| g.group.0);
        self.ctx.trace.complete(
            &format!("ref log-probs s{step}/g{group}"),
            "multiplexed",
            PID_ENGINES,
            engine as u32,
            t0,
            t1 - t0,
            serde_json::json!({"step": step, "group": group, "used": used}),
        );
    }

    /// The trainer starts micro-batch `mb`: its groups take the reference log-probs engines
    /// computed for them; passes still running are overtaken.
    pub(super) fn take_mux(&mut self, mb: MicroBatch, groups: &mut [GroupBatch]) {
        let a = mb.first_seq as usize;
        for (i, g) in groups.iter_mut().enumerate() {
            let Some(p) = self.mux.get_mut(a + i) else {
                continue;
            };
            if let MuxPass::Done(lps) = std::mem::replace(p, MuxPass::Over) {
                g.ref_logprobs = Some(lps);
                self.mux_groups += 1;
            }
        }
        self.started_upto = self.started_upto.max(a + groups.len());
    }
}
