//! Worker events of a phase: trainer replies and engine/verifier events, recorded (trace,
//! timings, samples) and turned into the step driver's reports for the core.
use std::time::Instant;

use anyhow::{bail, ensure};
use rolloutpipe_core::{PolicyVersion, RequestId};

use super::ctx::{PID_ENGINES, PID_TRAINER};
use super::phase::{Busy, Phase};
use crate::driver::Report;
use crate::train::msg::{
    EngineOut, Event, MicroBatchDone, OptDone, Sample, Score, TrainCmd, TrainerReply,
};

impl Phase<'_, '_> {
    /// A trainer reply that took `started..ended`: its trace span and timings, and the report
    /// for the core.
    pub(super) fn on_trainer(
        &mut self,
        reply: TrainerReply,
        started: Instant,
        ended: Instant,
        reports: &mut Vec<Report>,
    ) -> anyhow::Result<()> {
        let s = (ended - started).as_secs_f64();
        let (t0, t1) = (self.ctx.us(started), self.ctx.us(ended));
        match reply {
            TrainerReply::MicroBatch(done) => {
                self.ctx.busy.push((started, ended));
                self.on_micro_batch(done, s, (t0, t1), reports)
            }
            TrainerReply::Opt(done) => {
                self.ctx.busy.push((started, ended));
                self.on_opt(done, s, (t0, t1), ended, reports)
            }
            TrainerReply::Exported(..) => bail!("unrequested weight export"),
        }
    }

    fn on_micro_batch(
        &mut self,
        done: MicroBatchDone,
        s: f64,
        (t0, t1): (f64, f64),
        reports: &mut Vec<Report>,
    ) -> anyhow::Result<()> {
        let MicroBatchDone {
            tokens, all_tokens, ..
        } = done;
        self.ctx
            .measured
            .micro_batches
            .push((tokens, all_tokens, s));
        self.ctx.trace.complete(
            "micro-batch",
            "train",
            PID_TRAINER,
            0,
            t0,
            t1 - t0,
            serde_json::json!({"tokens": tokens}),
        );
        match self.busy {
            Busy::CoreMb => {
                self.cur.on_mb(s);
                reports.push(Report::MicroBatchConsumed { step: self.k });
                self.busy = Busy::Idle;
            }
            Busy::PrevMb { ends_opt } => {
                self.prev.on_mb(s);
                if ends_opt {
                    self.ctx.send_trainer(TrainCmd::OptStep)?;
                    self.busy = Busy::PrevOpt;
                } else {
                    self.busy = Busy::Idle;
                }
            }
            _ => bail!("trainer reported a micro-batch it was not given"),
        }
        Ok(())
    }

    fn on_opt(
        &mut self,
        done: OptDone,
        s: f64,
        (t0, t1): (f64, f64),
        ended: Instant,
        reports: &mut Vec<Report>,
    ) -> anyhow::Result<()> {
        self.ctx.measured.opt_s.push(s);
        self.ctx.trace.complete(
            "optimizer step",
            "train",
            PID_TRAINER,
            0,
            t0,
            t1 - t0,
            serde_json::json!({"grad_norm": done.stats.grad_norm}),
        );
        let core = self.busy == Busy::CoreOpt;
        ensure!(
            core || self.busy == Busy::PrevOpt,
            "trainer reported an optimizer step it was not given"
        );
        let agg = if core { &mut self.cur } else { &mut self.prev };
        agg.on_opt(&done.accum, done.normalizer, done.stats.grad_norm, s, ended);
        if core {
            reports.push(Report::OptimizerStepDone { step: self.k });
        }
        self.busy = Busy::Idle;
        Ok(())
    }

    /// A worker event other than the trainer's: bookkeeping, then the report for the core.
    pub(super) fn on_event(&mut self, ev: Event, reports: &mut Vec<Report>) -> anyhow::Result<()> {
        match ev {
            Event::Engine {
                engine,
                out,
                started,
            } => self.on_engine(engine, out, started, reports)?,
            Event::Rewarded(score) => self.on_score(score, reports)?,
            Event::RefLogprobs {
                engine,
                done,
                started,
                ended,
            } => {
                let span = (self.ctx.us(started), self.ctx.us(ended));
                self.on_ref_logprobs(engine, done, span);
            }
            // The pass stays `Sent`, so its group's micro-batch overtakes it.
            Event::RefLost { engine } => self.ctx.engine_mux(engine as usize, false),
            Event::Migrated { engine, moved } => self.on_migrated(engine, moved, reports),
            Event::Resumed {
                engine,
                done,
                ended,
            } => {
                let t1 = self.ctx.us(ended);
                self.on_resumed(engine, done, t1);
            }
            Event::Synced { .. } => bail!("an engine synced in the middle of a step"),
            Event::Trainer { .. } | Event::Fatal(_) => bail!("unexpected worker event"),
        }
        Ok(())
    }

    fn on_engine(
        &mut self,
        engine: u16,
        out: EngineOut,
        started: Instant,
        reports: &mut Vec<Report>,
    ) -> anyhow::Result<()> {
        match out {
            EngineOut::Generated {
                rid,
                version,
                tokens,
                logprobs,
            } => {
                let sample = Sample {
                    sample: rid.sample,
                    attempt: rid.attempt,
                    version,
                    tokens,
                    logprobs,
                    reward: 0.0,
                    correct: false,
                };
                self.on_generated(engine, rid, sample, started, reports);
            }
            EngineOut::Aborted(rid) => {
                if let Some((e, _)) = self.ro.inflight.remove(&rid) {
                    self.released(e as usize);
                }
                self.mig.declined = false;
                reports.push(Report::AbortAcked { id: rid });
            }
            EngineOut::Lost(lost) => self.on_engine_lost(engine, lost, false, reports)?,
            EngineOut::Preempted(lost) => self.on_engine_lost(engine, lost, true, reports)?,
        }
        Ok(())
    }

    /// A finished response: its span, and the sample kept until the core answers (accepted,
    /// it goes to a verifier).
    fn on_generated(
        &mut self,
        engine: u16,
        rid: RequestId,
        sample: Sample,
        started: Instant,
        reports: &mut Vec<Report>,
    ) {
        self.released(engine as usize);
        self.mig.declined = false;
        let ro = &mut self.ro;
        ro.inflight.remove(&rid);
        let n = sample.tokens.len();
        ro.tokens += n as u64;
        self.ctx.measured.response_tokens.push(n as u32);
        let (t0, t1) = (self.ctx.us(started), self.ctx.us(Instant::now()));
        ro.spans.push((
            engine,
            (started - ro.start).as_secs_f64(),
            ro.start.elapsed().as_secs_f64(),
        ));
        let id = ((rid.step.0) << 40)
            | ((rid.group.0 as u64) << 16)
            | ((rid.sample as u64) << 4)
            | rid.attempt as u64;
        self.ctx.trace.async_span(
            &format!("{}/s{}", rid.group, rid.sample),
            "request",
            PID_ENGINES,
            engine as u32,
            id,
            t0,
            t1,
            serde_json::json!({"tokens": n, "attempt": rid.attempt}),
        );
        let version: PolicyVersion = sample.version;
        ro.generated.insert(rid, sample);
        reports.push(Report::Generated {
            id: rid,
            version,
            tokens: n as u32,
        });
    }

    fn on_score(&mut self, score: Score, reports: &mut Vec<Report>) -> anyhow::Result<()> {
        let Score {
            rid,
            reward,
            correct,
            secs,
        } = score;
        self.ctx.measured.verify_s.push(secs);
        if rid.step.0 != self.ro.step {
            // The verifier finished a response of an earlier step's aborted group.
            return Ok(());
        }
        let Some(s) = self.ro.generated.remove(&rid) else {
            bail!("a reward for {rid}, which was not generated");
        };
        self.scoring.insert(rid, (s, correct));
        reports.push(Report::Scored { id: rid, reward });
        Ok(())
    }

    /// Engine `engine` failed (`preempted`: it is gone, not its requests) and lost `lost`.
    fn on_engine_lost(
        &mut self,
        engine: u16,
        lost: Vec<RequestId>,
        preempted: bool,
        reports: &mut Vec<Report>,
    ) -> anyhow::Result<()> {
        let e = engine as usize;
        if self.ctx.engines[e].live {
            tracing::warn!(
                engine,
                "rollout engine failed; re-admitting its requests elsewhere"
            );
        }
        self.ctx.engines[e].live = false;
        ensure!(
            self.ctx.engines.iter().any(|e| e.live),
            "every rollout engine failed"
        );
        for rid in lost {
            if self.ro.inflight.remove(&rid).is_none() {
                continue;
            }
            self.released(e);
            // Preempted: the engine is gone, not the request; it waits for a slot on another
            // engine with the same id (and so the same sampling seed).
            reports.push(if preempted {
                Report::Preempted { id: rid }
            } else {
                Report::Failed {
                    id: rid,
                    version: self.ro.version,
                }
            });
        }
        let held = i64::from(self.ctx.engines[e].running);
        self.ctx.engine_running(e, -held);
        Ok(())
    }
}
