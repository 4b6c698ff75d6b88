//! The step loop: each phase, the step driver (`crate::driver`) runs the rollout and the
//! training against the core ([`Steps::phase`]); then come the step boundary's hooks in order:
//! weight sync, the metrics lines, evaluation, and the checkpoint.
use std::collections::VecDeque;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use rolloutpipe_backends::Weights;
use rolloutpipe_backends::optim::AdamState;
use rolloutpipe_core::{
    AdmissionPolicy, Counters, GroupSlot, Plan, PolicyVersion, RequestSlot, Scheduler, StepSummary,
};

use super::ctx::Ctx;
use super::migrate::Migration;
use super::phase::{Phase, Rollout, TrainAgg};
use super::setup::{Evaluator, tok_src};
use crate::driver::metrics::{self, Occupancy};
use crate::driver::plan::FilterEstimate;
use crate::driver::{self, Report};
use crate::rundir::save_model;
use crate::train::msg::GroupBatch;
use crate::train::record::checkpoint::{CheckpointState, save_checkpoint};
use crate::train::record::metrics::{StepMetrics, Window, fill_train, open_metrics, read_metrics};
use crate::train::record::plots::gantt;

/// What the step loop ends with.
pub(super) struct Ended {
    /// The metrics lines this invocation wrote.
    pub(super) metrics: Vec<StepMetrics>,
    /// The core's counters per step.
    pub(super) counters: Vec<Counters>,
    /// The final weights.
    pub(super) weights: Arc<Weights>,
    /// The last held-out accuracy (NaN when none was measured).
    pub(super) accuracy: f64,
    /// The last test-set accuracy.
    pub(super) test_accuracy: Option<f64>,
}

/// One-step-off: a rolled-out batch's micro-batches, each with whether an optimizer step
/// follows it, trained in the next phase.
pub(super) type Pending = VecDeque<(Vec<GroupBatch>, bool)>;

/// What a phase left behind for its step boundary.
struct PhaseEnd {
    ro: Rollout,
    cur: TrainAgg,
    prev: TrainAgg,
    buffer: Vec<(Vec<GroupBatch>, bool)>,
    occupancy: Occupancy,
    mux_groups: u32,
    mux_s: f64,
    mig: Migration,
}

/// The step loop's state across steps.
struct Steps<'a, 'c> {
    ctx: &'a mut Ctx<'c>,
    state: &'a mut CheckpointState,
    out: &'a Path,
    eval: &'a mut Evaluator,
    started: Instant,
    plan: Plan,
    /// FGD's filter estimate: the config's prior for the first step, then the previous
    /// step's observed share (the rule `simulate` uses), carried across a resume.
    filter: FilterEstimate,
    one_off: bool,
    steps: u64,
    last_phase: u64,
    /// Rollouts of every step before the one being written (across resumptions).
    rollouts_cum: u64,
    file: std::fs::File,
    bar: indicatif::ProgressBar,
    metrics: Vec<StepMetrics>,
    counters: Vec<Counters>,
    weights: Option<Arc<Weights>>,
    accuracy: f64,
    test_accuracy: Option<f64>,
    /// One-step-off: the previous rollout's batch...
    pending: Pending,
    /// ...and its half-filled metrics, with its rollout's start.
    pending_metrics: Option<(StepMetrics, Instant)>,
    engine_version: PolicyVersion,
    /// Slime's wait window starts at the previous step's train end.
    last_train_end: Instant,
}

/// When the step boundary of phase `k` stops, checkpoints and evaluates.
#[derive(Debug, Clone, Copy)]
struct Boundary {
    k: u64,
    is_last: bool,
    /// A signal stops the run here, with a checkpoint.
    stop: bool,
    checkpoint: bool,
}

impl Ctx<'_> {
    /// Runs the steps from `state` on.
    pub(super) fn run_steps(
        &mut self,
        state: &mut CheckpointState,
        out: &Path,
        eval: &mut Evaluator,
        started: Instant,
    ) -> anyhow::Result<Ended> {
        let first = state.next_step;
        let mut s = Steps::new(self, state, out, eval, started)?;
        let cfg = s.ctx.cfg;
        let mut gslots = vec![GroupSlot::EMPTY; s.plan.max_groups as usize];
        let capacity = cfg.alloc.request_capacity(&s.ctx.allocator, &s.plan);
        let mut rslots = vec![RequestSlot::EMPTY; capacity];
        let mut sched = Scheduler::new(&mut gslots, &mut rslots);
        for k in first..=s.last_phase {
            if !s.step(&mut sched, k)? {
                s.bar.abandon();
                return s.ended();
            }
        }
        s.bar.finish_and_clear();
        let w = s.weights.clone().context("no step ran")?;
        // The final weights as a model directory (for one-step-off they are past the last
        // checkpoint, which precedes the final drain so that a resume continues the schedule).
        save_model(&out.join("final"), &s.ctx.model_cfg, &w, tok_src(cfg))?;
        s.ended()
    }
}

impl<'a, 'c> Steps<'a, 'c> {
    fn new(
        ctx: &'a mut Ctx<'c>,
        state: &'a mut CheckpointState,
        out: &'a Path,
        eval: &'a mut Evaluator,
        started: Instant,
    ) -> anyhow::Result<Self> {
        let cfg = ctx.cfg;
        let one_off = cfg.run.mode.stale();
        let steps = u64::from(cfg.run.steps);
        // One-step-off's checkpoint precedes the training of its pending batch, so that step's
        // line (written by the stopped run's final drain) is redone too.
        let redo_from = (state.pending_step.unwrap_or(state.next_step)).min(state.next_step);
        let written = read_metrics(out).ok();
        // Rollouts before the first step this invocation (re)writes.
        let rollouts_cum = (written.iter().flatten())
            .rev()
            .find(|m| m.step < redo_from)
            .map_or(0, |m| m.rollouts_cum);
        let pending_metrics = state.pending_step.map(|s| {
            // The boundary step's rollout half (reward, tokens, counts) was measured by the
            // stopped run; only its training is redone, so keep those fields.
            let rolled = (written.iter().flatten()).rev().find(|m| m.step == s);
            let m = match rolled {
                Some(m) => StepMetrics {
                    heldout_accuracy: None,
                    ..m.clone()
                },
                None => StepMetrics {
                    step: s,
                    mode: cfg.run.mode.name().into(),
                    ..Default::default()
                },
            };
            (m, Instant::now())
        });
        Ok(Steps {
            plan: cfg.plan(),
            filter: state
                .filter
                .unwrap_or_else(|| FilterEstimate::prior(cfg.rollout.expected_filter)),
            one_off,
            steps,
            last_phase: if one_off { steps } else { steps - 1 },
            rollouts_cum,
            file: open_metrics(out, redo_from)?,
            bar: progress_bar(ctx, steps, state.next_step),
            metrics: Vec::new(),
            counters: Vec::new(),
            weights: None,
            accuracy: f64::NAN,
            test_accuracy: None,
            pending: std::mem::take(&mut state.pending).into_iter().collect(),
            pending_metrics,
            engine_version: PolicyVersion(state.engine_version),
            last_train_end: ctx.clock,
            ctx,
            state,
            out,
            eval,
            started,
        })
    }

    /// Phase `k` and its step boundary; `false` when a signal stopped the run there.
    fn step(&mut self, sched: &mut Scheduler<'_>, k: u64) -> anyhow::Result<bool> {
        let end = self.phase(sched, k)?;
        let b = self.boundary(k);
        let (w, adam) = self.ctx.export(b.checkpoint && k < self.steps)?;
        let sync_s = self.sync(k, &w)?;
        let summary = if k < self.steps {
            sched.poll_step_done()
        } else {
            None
        };
        let mut lines = self.lines(k, summary, end, sync_s);
        self.evaluate(k, b, &w, &mut lines)?;
        self.write(&mut lines)?;
        self.metrics.extend(lines);
        if k < self.steps {
            self.bar.inc(1);
        }
        self.checkpoint(b, &w, adam.as_ref())?;
        self.weights = Some(w);
        if b.stop {
            self.ctx.interrupted = Some(k + 1);
        }
        Ok(!b.stop)
    }

    /// Phase `k` through the step driver: step k's rollout and training (for one-step-off,
    /// step k's rollout beside step k-1's training).
    fn phase(&mut self, sched: &mut Scheduler<'_>, k: u64) -> anyhow::Result<PhaseEnd> {
        let rollout_this = k < self.steps;
        let cores = std::slice::from_mut(sched);
        let mut phase = Phase::new(
            self.ctx,
            k,
            self.engine_version,
            rollout_this,
            &mut self.pending,
        );
        if rollout_this {
            if let AdmissionPolicy::Frontier {
                expected_filter_ppm,
                ..
            } = &mut self.plan.admission
            {
                *expected_filter_ppm = self.filter.ppm();
            }
            let begin = Report::Begin {
                step: k,
                version: self.engine_version,
                plan: self.plan,
            };
            driver::report(cores, &mut phase, begin)?;
        }
        driver::drive(cores, &mut phase)?;
        let Phase {
            ro,
            cur,
            prev,
            buffer,
            occupancy,
            mux_groups,
            mux_s,
            mig,
            ..
        } = phase;
        Ok(PhaseEnd {
            ro,
            cur,
            prev,
            buffer,
            occupancy,
            mux_groups,
            mux_s,
            mig,
        })
    }

    fn boundary(&self, k: u64) -> Boundary {
        let every = u64::from(self.ctx.cfg.run.checkpoint_every);
        let is_last = k == self.last_phase;
        let stop = !is_last && k < self.steps && crate::interrupt::requested();
        Boundary {
            k,
            is_last,
            stop,
            checkpoint: is_last || stop || (every > 0 && (k + 1).is_multiple_of(every)),
        }
    }

    /// Weight sync after phase `k`: the engines load the weights the next rollout uses.
    fn sync(&mut self, k: u64, w: &Arc<Weights>) -> anyhow::Result<f64> {
        let sync_s = if self.one_off {
            // Phase 0 trains nothing, so the engines keep v0 for step 1's rollout; from
            // phase k >= 1 on the trainer holds v_k, which step k+1's rollout uses.
            if k == 0 {
                0.0
            } else {
                self.engine_version = PolicyVersion(k);
                self.ctx.sync_engines(w.clone(), self.engine_version)?
            }
        } else {
            self.engine_version = PolicyVersion(k + 1);
            self.ctx.sync_engines(w.clone(), self.engine_version)?
        };
        self.ctx.measured.sync_s.push(sync_s);
        Ok(sync_s)
    }

    /// The metrics lines phase `k` completes: its step's (on-policy modes), or the previous
    /// step's, whose training this phase did (one-step-off).
    fn lines(
        &mut self,
        k: u64,
        summary: Option<StepSummary>,
        mut end: PhaseEnd,
        sync_s: f64,
    ) -> Vec<StepMetrics> {
        let train_end = if self.one_off {
            end.prev.end
        } else {
            end.cur.end
        };
        let mut lines = Vec::new();
        if let Some(sum) = summary {
            let (m, start) = self.rollout_line(k, &sum, &mut end, sync_s);
            if self.one_off {
                // Training of this batch happens in the next phase.
                let prev_m = self.pending_metrics.replace((m, start));
                self.pending.extend(end.buffer.drain(..));
                if let Some((mut pm, start)) = prev_m {
                    self.fill(&mut pm, &end.prev, start, train_end);
                    lines.push(pm);
                }
            } else {
                let mut m = m;
                self.fill(&mut m, &end.cur, start, train_end);
                lines.push(m);
            }
        } else if let Some((mut pm, start)) = self.pending_metrics.take() {
            self.fill(&mut pm, &end.prev, start, train_end);
            lines.push(pm);
        }
        lines
    }

    /// The rollout half of step `k`'s metrics line (and the run's Gantt timeline of it).
    fn rollout_line(
        &mut self,
        k: u64,
        sum: &StepSummary,
        end: &mut PhaseEnd,
        sync_s: f64,
    ) -> (StepMetrics, Instant) {
        let cfg = self.ctx.cfg;
        let c = &sum.counters;
        self.counters.push(*c);
        self.filter.observe(c);
        let ro = &end.ro;
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
            extended: ro.extended,
            skipped: c.filtered_skipped,
            mux_groups: end.mux_groups,
            mux_s: end.mux_s,
            migrations: end.mig.moves,
            migrated_tokens: end.mig.tokens,
            reprefill_s: end.mig.reprefill_s,
            ..Default::default()
        };
        m.timing.first_micro_batch_ready_s =
            metrics::first_micro_batch_ready(&ro.group_done, self.plan.micro_batch as usize);
        end.occupancy.stop(final_at);
        let slots = u32::from(cfg.rollout.engines) * cfg.rollout.slots;
        m.timing.slot_occupancy = metrics::slot_occupancy(
            end.occupancy.area(),
            final_at.saturating_sub(sum.began_at.0) as f64,
            slots,
        );
        self.rollouts_cum += m.rollouts;
        m.rollouts_cum = self.rollouts_cum;
        let ctx = &mut *self.ctx;
        ctx.timeline = Some(gantt(ctx.engines.len(), &ro.spans, ro.start, &ctx.busy));
        (m, ro.start)
    }

    /// Training fields of a step's metrics ([`fill_train`]) over `[start, end]`; moves the
    /// Slime window's start to the end.
    fn fill(&mut self, m: &mut StepMetrics, t: &TrainAgg, start: Instant, end: Option<Instant>) {
        let engines = self.ctx.engine_busy_now();
        let w = Window {
            start,
            end,
            prev_end: self.last_train_end,
            trainer: &self.ctx.busy,
            engines: &engines,
            engine_count: self.ctx.engines.len(),
        };
        self.last_train_end = fill_train(m, t, &w);
    }

    /// Held-out and test accuracy of `w` on the last step and every `run.eval_every` steps;
    /// the last line of the phase carries them.
    fn evaluate(
        &mut self,
        k: u64,
        b: Boundary,
        w: &Weights,
        lines: &mut [StepMetrics],
    ) -> anyhow::Result<()> {
        let every = u64::from(self.ctx.cfg.run.eval_every);
        let done_steps = if self.one_off { k } else { k + 1 };
        let due = every > 0 && done_steps > 0 && done_steps % every == 0 && !lines.is_empty();
        if !(b.is_last || due) {
            return Ok(());
        }
        self.accuracy = self.eval.heldout(w)?;
        self.test_accuracy = self.eval.test(w)?;
        if let Some(m) = lines.last_mut() {
            m.heldout_accuracy = Some(self.accuracy);
            m.test_accuracy = self.test_accuracy;
        }
        Ok(())
    }

    /// Appends the lines to `metrics.jsonl` and reports them.
    fn write(&mut self, lines: &mut [StepMetrics]) -> anyhow::Result<()> {
        for m in lines {
            m.elapsed_s = self.started.elapsed().as_secs_f64();
            writeln!(self.file, "{}", serde_json::to_string(m)?)?;
            self.file.flush()?;
            self.report(m);
        }
        Ok(())
    }

    /// One step's line on the log, and on the progress bar.
    fn report(&self, m: &StepMetrics) {
        // With the progress bar on, per-step lines would tear it; they go to debug.
        macro_rules! step_line {
            ($lvl:ident) => {
                tracing::$lvl!(
                    step = m.step,
                    reward = format_args!("{:.3}", m.reward),
                    acc = format_args!("{:.3}", m.train_accuracy),
                    heldout = ?m.heldout_accuracy,
                    r2t = format_args!("{:.2}s", m.timing.rollout_to_train_end_s),
                    wait = format_args!("{:.2}", m.timing.trainer_wait_ratio),
                    "step"
                )
            };
        }
        if self.ctx.cfg.run.progress {
            self.bar.suspend(|| step_line!(debug));
        } else {
            step_line!(info);
        }
        self.bar.set_message(format!(
            "reward {:.2} acc {:.2}{}",
            m.reward,
            m.train_accuracy,
            m.heldout_accuracy
                .map(|a| format!(" held-out {a:.2}"))
                .unwrap_or_default()
        ));
    }

    /// The scheduler side's state after phase `b.k`, saved with the weights (and the moments)
    /// when the boundary checkpoints.
    fn checkpoint(
        &mut self,
        b: Boundary,
        w: &Weights,
        adam: Option<&AdamState>,
    ) -> anyhow::Result<()> {
        let st = &mut *self.state;
        st.next_step = b.k + 1;
        st.data_pos = self.ctx.data.pos;
        st.evicted = self.ctx.evicted.iter().copied().collect();
        st.evicted.sort_unstable();
        st.engine_version = self.engine_version.0;
        st.filter = Some(self.filter);
        if !b.checkpoint || b.k >= self.steps {
            return Ok(());
        }
        st.pending = self.pending.iter().cloned().collect();
        st.pending_step = self.pending_metrics.as_ref().map(|(m, _)| m.step);
        let (cfg, out) = (self.ctx.cfg, self.out);
        save_checkpoint(out, tok_src(cfg), &self.ctx.model_cfg, w, adam, st)?;
        // What a `kill -9` after this point would otherwise lose.
        self.ctx.write_trace(out)?;
        self.ctx.summary.write(out, None, None, false)
    }

    fn ended(&mut self) -> anyhow::Result<Ended> {
        Ok(Ended {
            metrics: std::mem::take(&mut self.metrics),
            counters: std::mem::take(&mut self.counters),
            weights: self.weights.clone().context("no step ran")?,
            accuracy: self.accuracy,
            test_accuracy: self.test_accuracy,
        })
    }
}

fn progress_bar(ctx: &Ctx<'_>, steps: u64, done: u64) -> indicatif::ProgressBar {
    let cfg = ctx.cfg;
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
