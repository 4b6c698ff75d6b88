//! Worker events of a phase: trainer replies and engine/verifier events, recorded (trace,
//! timings, samples) and turned into the step driver's reports for the core.
use std::time::Instant;

use anyhow::{bail, ensure};

use super::ctx::{PID_ENGINES, PID_TRAINER};
use super::phase::{Busy, Phase};
use super::workers::{Event, Sample, TrainCmd, TrainerReply};
use crate::driver::Report;

impl Phase<'_, '_> {
    /// A trainer reply: its trace span and timings, and the report for the core.
    pub(super) fn on_trainer(
        &mut self,
        r: TrainerReply,
        reports: &mut Vec<Report>,
    ) -> anyhow::Result<()> {
        match r {
            TrainerReply::MicroBatchDone {
                started,
                ended,
                tokens,
                all_tokens,
                ..
            } => {
                let s = (ended - started).as_secs_f64();
                self.ctx.busy.push((started, ended));
                self.ctx
                    .measured
                    .micro_batches
                    .push((tokens, all_tokens, s));
                let (t0, t1) = (self.ctx.us(started), self.ctx.us(ended));
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
            }
            TrainerReply::OptDone {
                stats,
                accum,
                normalizer,
                started,
                ended,
            } => {
                let s = (ended - started).as_secs_f64();
                self.ctx.busy.push((started, ended));
                self.ctx.measured.opt_s.push(s);
                let (t0, t1) = (self.ctx.us(started), self.ctx.us(ended));
                self.ctx.trace.complete(
                    "optimizer step",
                    "train",
                    PID_TRAINER,
                    0,
                    t0,
                    t1 - t0,
                    serde_json::json!({"grad_norm": stats.grad_norm}),
                );
                let core = self.busy == Busy::CoreOpt;
                ensure!(
                    core || self.busy == Busy::PrevOpt,
                    "trainer reported an optimizer step it was not given"
                );
                let agg = if core { &mut self.cur } else { &mut self.prev };
                agg.on_opt(&accum, normalizer, stats.grad_norm, s, ended);
                if core {
                    reports.push(Report::OptimizerStepDone { step: self.k });
                }
                self.busy = Busy::Idle;
            }
            TrainerReply::Exported(..) => bail!("unrequested weight export"),
        }
        Ok(())
    }

    /// A worker event other than the trainer's: bookkeeping, then the report for the core.
    pub(super) fn on_event(&mut self, ev: Event, reports: &mut Vec<Report>) -> anyhow::Result<()> {
        match ev {
            Event::Generated {
                engine,
                rid,
                version,
                tokens,
                logprobs,
                started,
            } => {
                self.released(engine as usize);
                self.mig.declined = false;
                let ro = &mut self.ro;
                ro.inflight.remove(&rid);
                ro.tokens += tokens.len() as u64;
                self.ctx.measured.response_tokens.push(tokens.len() as u32);
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
                    serde_json::json!({"tokens": tokens.len(), "attempt": rid.attempt}),
                );
                let n = tokens.len() as u32;
                // Kept until the core answers: accepted, it goes to a verifier.
                ro.generated.insert(
                    rid,
                    Sample {
                        sample: rid.sample,
                        attempt: rid.attempt,
                        version,
                        tokens,
                        logprobs,
                        reward: 0.0,
                        correct: false,
                    },
                );
                reports.push(Report::Generated {
                    id: rid,
                    version,
                    tokens: n,
                });
            }
            Event::Rewarded {
                rid,
                reward,
                correct,
                latency,
            } => {
                self.ctx.measured.verify_s.push(latency.as_secs_f64());
                if rid.step.0 != self.ro.step {
                    // The verifier finished a response of an earlier step's aborted group.
                    return Ok(());
                }
                let Some(s) = self.ro.generated.remove(&rid) else {
                    bail!("a reward for {rid}, which was not generated");
                };
                self.scoring.insert(rid, (s, correct));
                reports.push(Report::Scored { id: rid, reward });
            }
            Event::Aborted { rid } => {
                if let Some((e, _)) = self.ro.inflight.remove(&rid) {
                    self.released(e as usize);
                }
                self.mig.declined = false;
                reports.push(Report::AbortAcked { id: rid });
            }
            Event::EngineFailed {
                engine,
                lost,
                preempted,
            } => {
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
                    // Preempted: the engine is gone, not the request; it waits for a slot on
                    // another engine with the same id (and so the same sampling seed).
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
            }
            Event::RefLogprobs {
                engine,
                step,
                index,
                logprobs,
                started,
                ended,
            } => {
                let span = (self.ctx.us(started), self.ctx.us(ended));
                self.on_ref_logprobs(engine, step, index, logprobs, span);
            }
            // The pass stays `Sent`, so its group's micro-batch overtakes it.
            Event::RefLost { engine } => self.ctx.engine_mux(engine as usize, false),
            Event::Migrated { engine, moved } => self.on_migrated(engine, moved, reports),
            Event::Resumed {
                engine,
                rid,
                tokens,
                secs,
                ended,
            } => {
                let t1 = self.ctx.us(ended);
                self.on_resumed(engine, rid, tokens, secs, t1);
            }
            Event::Synced { .. } => bail!("an engine synced in the middle of a step"),
            Event::Trainer(_) | Event::Fatal(_) => bail!("unexpected worker event"),
        }
        Ok(())
    }
}
