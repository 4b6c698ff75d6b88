//! The step loop: for each phase, the step driver (`crate::driver`) runs the rollout and the
//! training against the core; at each step boundary come the weight sync, the metrics line,
//! evaluation and the checkpoint.
use std::collections::VecDeque;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use rolloutpipe_backends::{CpuBackend, Weights};
use rolloutpipe_core::{
    AdmissionPolicy, Counters, GroupSlot, PolicyVersion, RequestSlot, Scheduler,
};

use super::checkpoint::{CheckpointState, restore_group, save_checkpoint, save_group};
use super::config::{Mode, TrainConfig};
use super::ctx::Ctx;
use super::metrics::{StepMetrics, Window, fill_train, open_metrics, read_metrics};
use super::phase::{Phase, TrainAgg};
use super::plots::gantt;
use super::run::tok_src;
use super::workers::GroupBatch;
use crate::driver::plan::FilterEstimate;
use crate::driver::{self, Report, metrics};
use crate::rundir::save_model;
use crate::tasks::Problem;

pub(super) type EvalFn<'a> =
    dyn Fn(&mut CpuBackend, &Weights, &[Problem]) -> anyhow::Result<f64> + 'a;
/// Accuracy on the run's independent test set, `None` when it has none.
pub(super) type TestEvalFn<'a> =
    dyn Fn(&mut CpuBackend, &Weights) -> anyhow::Result<Option<f64>> + 'a;
pub(super) type StepsResult = (
    Vec<StepMetrics>,
    Vec<Counters>,
    Arc<Weights>,
    f64,
    Option<f64>,
);

impl Ctx<'_> {
    /// Runs the steps from `state` on; returns the metrics lines written, the core's counters,
    /// the final weights and the last held-out and test accuracies.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_steps(
        &mut self,
        state: &mut CheckpointState,
        out: &Path,
        eval_be: &mut CpuBackend,
        heldout: &[Problem],
        eval: &EvalFn<'_>,
        test_eval: &TestEvalFn<'_>,
        started: Instant,
    ) -> anyhow::Result<StepsResult> {
        let cfg = self.cfg;
        let mut plan = cfg.plan();
        // FGD's filter estimate: the config's prior for the first step, then the previous
        // step's observed share (the rule `simulate` uses), carried across a resume.
        let mut filter = state
            .filter
            .unwrap_or_else(|| FilterEstimate::prior(cfg.rollout.expected_filter));
        let groups_cap = plan.max_groups as usize;
        let mut gslots = vec![GroupSlot::EMPTY; groups_cap];
        let mut rslots = vec![RequestSlot::EMPTY; cfg.alloc.request_capacity(&self.policy, &plan)];
        let mut sched = Scheduler::new(&mut gslots, &mut rslots);
        let one_off = cfg.run.mode == Mode::OneStepOff;
        let steps = cfg.run.steps as u64;
        // One-step-off's checkpoint precedes the training of its pending batch, so that step's
        // line (written by the stopped run's final drain) is redone too.
        let redo_from = state
            .pending_step
            .unwrap_or(state.next_step)
            .min(state.next_step);
        // The boundary step's rollout half (reward, tokens, counts) was measured by the stopped
        // run; only its training is redone, so keep those fields instead of zeros.
        let boundary: Option<StepMetrics> = state.pending_step.and_then(|s| {
            read_metrics(out)
                .ok()?
                .into_iter()
                .rev()
                .find(|m| m.step == s)
        });
        // Rollouts before the first step this invocation (re)writes.
        let mut rollouts_cum = read_metrics(out)
            .ok()
            .and_then(|ms| ms.iter().rev().find(|m| m.step < redo_from).cloned())
            .map_or(0, |m| m.rollouts_cum);
        let mut metrics_file = open_metrics(out, redo_from)?;
        let bar = progress_bar(cfg, steps, state.next_step);
        let mut metrics = Vec::new();
        let mut counters = Vec::new();
        let mut weights: Option<Arc<Weights>> = None;
        let mut acc_end = f64::NAN;
        let mut test_end = None;
        // One-step-off: the previous rollout's batch and its half-filled metrics.
        let mut pending: VecDeque<(Vec<GroupBatch>, bool)> = state
            .pending
            .drain(..)
            .map(|(gs, e)| (gs.into_iter().map(restore_group).collect(), e))
            .collect();
        let mut pending_metrics: Option<(StepMetrics, Instant)> = state.pending_step.map(|s| {
            let m = match boundary {
                Some(m) => StepMetrics {
                    heldout_accuracy: None,
                    ..m
                },
                None => StepMetrics {
                    step: s,
                    mode: cfg.run.mode.name().into(),
                    ..Default::default()
                },
            };
            (m, Instant::now())
        });
        let mut engine_version = PolicyVersion(state.engine_version);
        let last_phase = if one_off { steps } else { steps - 1 };
        // Slime's wait window of the invocation's first step starts when its workers did.
        let mut last_train_end = self.clock;
        for k in state.next_step..=last_phase {
            let rollout_this = k < steps;
            let cores = std::slice::from_mut(&mut sched);
            let mut phase = Phase::new(self, k, engine_version, rollout_this, &mut pending);
            if rollout_this {
                if let AdmissionPolicy::Frontier {
                    expected_filter_ppm,
                    ..
                } = &mut plan.admission
                {
                    *expected_filter_ppm = filter.ppm();
                }
                let begin = Report::Begin {
                    step: k,
                    version: engine_version,
                    plan,
                };
                driver::report(cores, &mut phase, begin)?;
            }
            driver::drive(cores, &mut phase)?;
            let Phase {
                ro,
                cur,
                prev,
                mut buffer,
                mut occupancy,
                mux_groups,
                mux_s,
                mig,
                ..
            } = phase;
            // Step boundary: weight sync, then metrics, evaluation and checkpoint.
            let trainer_version = PolicyVersion(k + 1);
            let is_last = k == last_phase;
            // A signal stops the run here, at a step boundary, with a checkpoint.
            let stop = !is_last && k < steps && crate::interrupt::requested();
            let ckpt_now = is_last
                || stop
                || (cfg.run.checkpoint_every > 0 && (k + 1) % cfg.run.checkpoint_every as u64 == 0);
            let (w, adam) = self.export(ckpt_now && k < steps)?;
            let train_end = if one_off { prev.end } else { cur.end };
            let sync_s = if one_off {
                // Phase 0 trains nothing, so the engines keep v0 for step 1's rollout; from
                // phase k >= 1 on the trainer holds v_k, which step k+1's rollout uses.
                if k == 0 {
                    0.0
                } else {
                    engine_version = PolicyVersion(k);
                    self.sync_engines(w.clone(), engine_version)?
                }
            } else {
                engine_version = trainer_version;
                self.sync_engines(w.clone(), engine_version)?
            };
            self.measured.sync_s.push(sync_s);
            let summary = if rollout_this {
                sched.poll_step_done()
            } else {
                None
            };
            let mut finished: Vec<StepMetrics> = Vec::new();
            if let Some(sum) = summary {
                counters.push(sum.counters);
                filter.observe(&sum.counters);
                let c = &sum.counters;
                let final_at = sum.batch_final_at.map(|t| t.0).unwrap_or(sum.began_at.0);
                let rollout_s = final_at.saturating_sub(sum.began_at.0) as f64 * 1e-6;
                let (rsum, rn, rc) = ro.rewards;
                let mut m = StepMetrics {
                    step: k,
                    mode: cfg.run.mode.name().into(),
                    rollout_version: ro.version.0,
                    reward: if rn > 0 { rsum / rn as f64 } else { 0.0 },
                    train_accuracy: if rn > 0 { rc as f64 / rn as f64 } else { 0.0 },
                    rollout_s,
                    sync_s,
                    tokens: ro.tokens,
                    tokens_per_s: ro.tokens as f64 / rollout_s.max(1e-9),
                    drawn: c.drawn,
                    trained: c.trained,
                    filtered: c.filtered(),
                    aborted: c.aborted,
                    requests_failed: c.requests_failed,
                    rollouts: metrics::rollouts(c),
                    first_micro_batch_ready_s: metrics::first_micro_batch_ready(
                        &ro.group_done,
                        plan.micro_batch as usize,
                    ),
                    extended: ro.extended,
                    skipped: c.filtered_skipped,
                    mux_groups,
                    mux_s,
                    migrations: mig.moves,
                    migrated_tokens: mig.tokens,
                    reprefill_s: mig.reprefill_s,
                    ..Default::default()
                };
                occupancy.stop(final_at);
                let slots = u32::from(cfg.rollout.engines) * cfg.rollout.slots;
                m.slot_occupancy = metrics::slot_occupancy(
                    occupancy.area(),
                    final_at.saturating_sub(sum.began_at.0) as f64,
                    slots,
                );
                rollouts_cum += m.rollouts;
                m.rollouts_cum = rollouts_cum;
                self.timeline = Some(gantt(self.engines.len(), &ro.spans, ro.start, &self.busy));
                if one_off {
                    // Training of this batch happens in the next phase.
                    let prev_m = pending_metrics.replace((m, ro.start));
                    pending.extend(buffer.drain(..));
                    if let Some((mut pm, start)) = prev_m {
                        self.fill(&mut pm, &prev, start, train_end, &mut last_train_end);
                        finished.push(pm);
                    }
                } else {
                    self.fill(&mut m, &cur, ro.start, train_end, &mut last_train_end);
                    finished.push(m);
                }
            } else if let Some((mut pm, start)) = pending_metrics.take() {
                self.fill(&mut pm, &prev, start, train_end, &mut last_train_end);
                finished.push(pm);
            }
            let done_steps = if one_off { k } else { k + 1 };
            let eval_now = is_last
                || (cfg.run.eval_every > 0
                    && done_steps > 0
                    && done_steps % cfg.run.eval_every as u64 == 0
                    && !finished.is_empty());
            if eval_now {
                let acc = eval(eval_be, &w, heldout)?;
                acc_end = acc;
                test_end = test_eval(eval_be, &w)?;
                if let Some(m) = finished.last_mut() {
                    m.heldout_accuracy = Some(acc);
                    m.test_accuracy = test_end;
                }
            }
            for m in &mut finished {
                m.elapsed_s = started.elapsed().as_secs_f64();
                writeln!(metrics_file, "{}", serde_json::to_string(m)?)?;
                metrics_file.flush()?;
                // With the progress bar on, per-step lines would tear it; they go to debug.
                macro_rules! step_line {
                    ($lvl:ident) => {
                        tracing::$lvl!(
                            step = m.step,
                            reward = format_args!("{:.3}", m.reward),
                            acc = format_args!("{:.3}", m.train_accuracy),
                            heldout = ?m.heldout_accuracy,
                            r2t = format_args!("{:.2}s", m.rollout_to_train_end_s),
                            wait = format_args!("{:.2}", m.trainer_wait_ratio),
                            "step"
                        )
                    };
                }
                if cfg.run.progress {
                    bar.suspend(|| step_line!(debug));
                } else {
                    step_line!(info);
                }
                bar.set_message(format!(
                    "reward {:.2} acc {:.2}{}",
                    m.reward,
                    m.train_accuracy,
                    m.heldout_accuracy
                        .map(|a| format!(" held-out {a:.2}"))
                        .unwrap_or_default()
                ));
            }
            metrics.extend(finished);
            if rollout_this {
                bar.inc(1);
            }
            state.next_step = k + 1;
            state.data_pos = self.data.pos;
            state.evicted = self.evicted.iter().copied().collect();
            state.evicted.sort_unstable();
            state.engine_version = engine_version.0;
            state.filter = Some(filter);
            if ckpt_now && k < steps {
                state.pending = pending
                    .iter()
                    .map(|(gs, e)| (gs.iter().map(save_group).collect(), *e))
                    .collect();
                state.pending_step = pending_metrics.as_ref().map(|(m, _)| m.step);
                save_checkpoint(out, tok_src(cfg), &self.model_cfg, &w, adam.as_ref(), state)?;
                // What a `kill -9` after this point would otherwise lose.
                self.write_trace(out)?;
                self.summary.write(out, None, None, false)?;
            }
            weights = Some(w);
            if stop {
                self.interrupted = Some(k + 1);
                bar.abandon();
                return Ok((
                    metrics,
                    counters,
                    weights.context("no step ran")?,
                    acc_end,
                    test_end,
                ));
            }
        }
        bar.finish_and_clear();
        let w = weights.context("no step ran")?;
        // The final weights as a model directory (for one-step-off they are past the last
        // checkpoint, which precedes the final drain so that a resume continues the schedule).
        save_model(&out.join("final"), &self.model_cfg, &w, tok_src(cfg))?;
        Ok((metrics, counters, w, acc_end, test_end))
    }

    /// Training fields of a step's metrics ([`fill_train`]) over `[start, end]`; moves
    /// `last_train_end` (Slime's window) to the end.
    fn fill(
        &self,
        m: &mut StepMetrics,
        t: &TrainAgg,
        start: Instant,
        end: Option<Instant>,
        last_train_end: &mut Instant,
    ) {
        let engines = self.engine_busy_now();
        let w = Window {
            start,
            end,
            prev_end: *last_train_end,
            trainer: &self.busy,
            engines: &engines,
            engine_count: self.engines.len(),
        };
        *last_train_end = fill_train(m, t, &w);
    }
}

fn progress_bar(cfg: &TrainConfig, steps: u64, done: u64) -> indicatif::ProgressBar {
    if !cfg.run.progress {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(steps);
    bar.set_position(done);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{prefix} step {pos}/{len} [{bar:30}] {msg} (ETA {eta})",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(cfg.run.mode.name());
    crate::logging::add(bar)
}
