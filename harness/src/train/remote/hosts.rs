//! The remote hosts: each owns one worker's state wherever the work runs (a Ray actor, another
//! thread) and answers `protocol` messages, bytes in and bytes out, by calling the same worker
//! code as the in-process threads. Worker failures are answered as `Fatal`; only a malformed or
//! out-of-order message is an `Err`.
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, anyhow};
use rolloutpipe_backends::{ModelConfig, Weights};

use super::protocol::{
    EngineInit, EngineMsg, EngineReply, TrainerAnswer, TrainerInit, TrainerMsg, VerifierMsg,
    VerifierReply,
};
use super::wire::{self, WireError};
use crate::tasks::{Task, Tokenizer};
use crate::train::data;
use crate::train::msg::{EngineOut, RefDone, RefPass, TrainCmd};
use crate::train::workers::{
    EngineReference, EngineStep, TrainerStep, make_engine, make_trainer, trainer_setup, verify,
};

fn model_config(v: &serde_json::Value) -> anyhow::Result<ModelConfig> {
    ModelConfig::from_json_str(&v.to_string()).context("the model's config.json")
}

fn not_ready(who: &str) -> anyhow::Error {
    anyhow!("the {who} host has not been initialised (send Init first)")
}

/// A rollout engine that answers [`EngineMsg`]s.
#[derive(Default)]
pub struct EngineHost {
    step: Option<EngineStep>,
    /// Tail multiplexing: the engine's reference model.
    reference: Option<EngineReference>,
}

impl EngineHost {
    /// A host with no engine yet (the first message is `Init`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Answers one message. `published` is the last published weights blob (`Init` and
    /// `Sync` read it).
    pub fn handle(&mut self, msg: &[u8], published: Option<&[u8]>) -> anyhow::Result<Vec<u8>> {
        let (msg, parts): (EngineMsg, _) = wire::decode(msg)?;
        let reply = match msg {
            EngineMsg::Init(init) => self.init(&init, published, &parts)?,
            EngineMsg::RefLogprobs(pass) => self.ref_pass(pass)?,
            EngineMsg::Step {
                adds,
                resumes,
                cancels,
                decode,
            } => {
                let step = self.step.as_mut().ok_or_else(|| not_ready("engine"))?;
                let run = || -> anyhow::Result<Vec<EngineOut>> {
                    let mut outs = Vec::new();
                    for a in adds {
                        outs.extend(step.add(a.rid, a.prompt.to_vec(), a.params)?);
                    }
                    for m in resumes {
                        outs.extend(step.resume(m.rid, m.state)?);
                    }
                    for rid in cancels {
                        outs.extend(step.cancel(rid)?);
                    }
                    if decode {
                        outs.extend(step.decode()?);
                    }
                    Ok(outs)
                };
                match run() {
                    Ok(outs) => EngineReply::Stepped {
                        outs,
                        active: step.active(),
                        reprefilled: step.take_reprefilled(),
                    },
                    Err(e) => EngineReply::Fatal(e.to_string()),
                }
            }
            EngineMsg::Migrate { min_generated } => {
                let step = self.step.as_mut().ok_or_else(|| not_ready("engine"))?;
                match step.migrate_out(min_generated) {
                    Ok(moved) => EngineReply::Migrated { moved },
                    Err(e) => EngineReply::Fatal(e.to_string()),
                }
            }
            EngineMsg::Sync { version } => {
                let step = self.step.as_mut().ok_or_else(|| not_ready("engine"))?;
                let blob = published.ok_or(WireError::Missing("published weights"))?;
                let w = wire::weights_from(blob, "weights")?;
                match step.sync_master(&w, version) {
                    Ok(decode) => EngineReply::Synced { decode },
                    Err(e) => EngineReply::Fatal(e.to_string()),
                }
            }
        };
        Ok(wire::encode(&reply, &[]))
    }

    /// Builds the engine (and its reference model) from the published weights.
    fn init(
        &mut self,
        init: &EngineInit,
        published: Option<&[u8]>,
        parts: &[&[u8]],
    ) -> anyhow::Result<EngineReply> {
        let blob = published.ok_or(WireError::Missing("published weights"))?;
        let w = wire::weights_from(blob, "weights")?;
        let mc = model_config(&init.model)?;
        let ref_w = match init.reference {
            true => Some(wire::weights_from(
                parts
                    .first()
                    .ok_or(WireError::Missing("reference weights"))?,
                "reference weights",
            )?),
            false => None,
        };
        let engine = init.engine;
        let made = make_engine(&init.backend, &mc, &w, &init.options).and_then(|be| {
            let r = ref_w
                .map(|r| -> anyhow::Result<EngineReference> {
                    Ok(EngineReference {
                        backend: make_trainer("cpu", &mc, &r, init.options.threads, false)?,
                        perturb: init.perturb_mux,
                    })
                })
                .transpose()?;
            Ok((be, r))
        });
        Ok(match made {
            Ok((be, r)) => {
                self.step = Some(EngineStep::new(engine, be, init.fail_at_request));
                self.reference = r;
                EngineReply::Ready
            }
            Err(e) => EngineReply::Fatal(format!("rollout engine {engine}: {e:#}")),
        })
    }

    /// A reference pass with the engine's reference model.
    fn ref_pass(&mut self, pass: RefPass) -> anyhow::Result<EngineReply> {
        self.step.as_ref().ok_or_else(|| not_ready("engine"))?;
        let r = self
            .reference
            .as_mut()
            .ok_or(WireError::Missing("reference model (Init had none)"))?;
        Ok(match r.logprobs(&pass.seqs, pass.temperature) {
            Ok(logprobs) => EngineReply::RefLogprobs(RefDone {
                step: pass.step,
                index: pass.index,
                logprobs,
            }),
            Err(e) => EngineReply::Fatal(format!("reference pass: {e:#}")),
        })
    }
}

/// The trainer, answering [`TrainerMsg`]s.
#[derive(Default)]
pub struct TrainerHost {
    step: Option<TrainerStep>,
}

impl TrainerHost {
    /// A host with no trainer yet (the first message is `Init`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Answers one message (see [`EngineHost::handle`] for what is an error).
    pub fn handle(&mut self, msg: &[u8]) -> anyhow::Result<Vec<u8>> {
        let (msg, parts): (TrainerMsg, _) = wire::decode(msg)?;
        let t = Instant::now();
        let cmd = match msg {
            TrainerMsg::Init(init) => {
                let answer = match self.init(&init, &parts)? {
                    Ok(()) => TrainerAnswer::Ready,
                    Err(e) => fatal(e),
                };
                return Ok(wire::encode(&answer, &[]));
            }
            TrainerMsg::Cmd(cmd) => cmd,
        };
        let step = self.step.as_mut().ok_or_else(|| not_ready("trainer"))?;
        let answer = match cmd {
            TrainCmd::MicroBatch(groups) => match step.micro_batch(groups) {
                Ok(done) => TrainerAnswer::MicroBatchDone {
                    done,
                    secs: t.elapsed().as_secs_f64(),
                },
                Err(e) => fatal(e),
            },
            TrainCmd::OptStep => match step.opt_step() {
                Ok(done) => TrainerAnswer::OptDone {
                    done,
                    secs: t.elapsed().as_secs_f64(),
                },
                Err(e) => fatal(e),
            },
            TrainCmd::Export { optimizer } => {
                let (w, adam) = match step.export(optimizer) {
                    Ok(x) => x,
                    Err(e) => return Ok(wire::encode(&fatal(e), &[])),
                };
                let wb = wire::weights_blob(&w)?;
                let answer = TrainerAnswer::Exported {
                    adam_step: adam.as_ref().map(|a| a.step),
                };
                return Ok(match adam {
                    Some(a) => wire::encode(&answer, &[&wb, &wire::adam_blob(&a)?]),
                    None => wire::encode(&answer, &[&wb]),
                });
            }
            TrainCmd::Shutdown => anyhow::bail!("a trainer host is not shut down by message"),
        };
        Ok(wire::encode(&answer, &[]))
    }

    /// Builds the trainer from its parts; the outer error is a malformed message, the inner
    /// one a worker failure.
    fn init(&mut self, init: &TrainerInit, parts: &[&[u8]]) -> anyhow::Result<anyhow::Result<()>> {
        let mut parts = parts.iter();
        let w = wire::weights_from(
            parts.next().ok_or(WireError::Missing("weights"))?,
            "weights",
        )?;
        let adam = match init.adam_step {
            Some(step) => Some(wire::adam_from(
                parts.next().ok_or(WireError::Missing("optimizer"))?,
                step,
            )?),
            None => None,
        };
        let reference: Option<Weights> = if init.reference {
            Some(wire::weights_from(
                parts.next().ok_or(WireError::Missing("reference"))?,
                "reference",
            )?)
        } else {
            None
        };
        let mc = model_config(&init.model)?;
        let config = &init.config;
        let built = (|| {
            let t = &config.trainer;
            let mut be = make_trainer(&config.run.backend, &mc, &w, t.threads, t.tensor_cores)?;
            if let Some(a) = adam {
                be.set_optimizer_state(a)?;
            }
            let setup = trainer_setup(config, &mc, reference.as_ref())?;
            TrainerStep::new(be, setup)
        })();
        Ok(built.map(|s| self.step = Some(s)))
    }
}

/// A trainer failure as its answer: the whole chain (`trainer.tensor_cores: adapter … lacks
/// …`), on one line.
fn fatal(e: anyhow::Error) -> TrainerAnswer {
    TrainerAnswer::Fatal(format!("trainer: {e:#}"))
}

/// A verifier, answering [`VerifierMsg`]s.
#[derive(Default)]
pub struct VerifierHost {
    task: Option<(Arc<dyn Task>, Arc<dyn Tokenizer>)>,
}

impl VerifierHost {
    /// A host with no task yet (the first message is `Init`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Answers one message (see [`EngineHost::handle`] for what is an error).
    pub fn handle(&mut self, msg: &[u8]) -> anyhow::Result<Vec<u8>> {
        let (msg, _): (VerifierMsg, _) = wire::decode(msg)?;
        let reply = match msg {
            VerifierMsg::Init { config } => {
                match data::tokenizer(&config).and_then(|tok| Ok((data::task(&config)?, tok))) {
                    Ok(t) => {
                        self.task = Some(t);
                        VerifierReply::Ready
                    }
                    Err(e) => VerifierReply::Fatal(format!("verifier: {e:#}")),
                }
            }
            VerifierMsg::Score(jobs) => {
                let (task, tok) = self.task.as_ref().ok_or_else(|| not_ready("verifier"))?;
                VerifierReply::Scored(
                    (jobs.iter())
                        .map(|j| verify(task.as_ref(), tok.as_ref(), j))
                        .collect(),
                )
            }
        };
        Ok(wire::encode(&reply, &[]))
    }
}
