//! The simulator's side of the step driver (`crate::driver`): time, engines, the verifier and
//! the trainer, as `driver::Workers` over a virtual clock and an event queue.
//!
//! The driver owns the core calls and their order: each event is reported to the core
//! (`on_*`), then the driver asks it what to do next (allocation, draw, abort, admit, dispatch,
//! optimizer step, micro-batch, step done). Nothing here decides which request runs, which
//! group is filtered, trained or aborted; what is the simulator's own is the SGLang engine
//! model, the router, multiplexing and migration.
//!
//! Step timing: on-policy modes start the rollout of step k+1 when step k's last optimizer step
//! is done plus the weight sync. `one-step-off` instead rolls out step k+1 with the weights of
//! step k-1 while the trainer trains step k; both sides meet at a barrier, sync, and go on.
mod policies;
mod state;
mod workers;

use std::collections::{HashMap, VecDeque};

use anyhow::{Context, ensure};
use rolloutpipe_core::{Plan, PolicyVersion, RequestId, Scheduler, StepSummary, Tick};

pub use super::recording::{Recording, RequestSpan, Simulated};

use super::config::{MigrateVia, Mode, Routing, Schedule, SimConfig};
use super::engine::{Engine, Ns, Waiting, secs_to_ns};
use super::metrics::{RunResult, StepRecord, secs};
use super::queue::EventQueue;
use super::trainer::TrainerModel;
use super::workload::{Workload, name_hash};
use crate::driver::Report;
use crate::driver::metrics::{self, Occupancy};
use crate::driver::plan::{FilterEstimate, PlanSpec};
use state::{CoreStorage, Ev, ReqInfo, ReqStatus, StepCtx};

struct Sim<'c> {
    cfg: &'c SimConfig,
    schedule: Schedule,
    setting_name: &'c str,
    profile_name: &'c str,
    steps: u64,
    slots: u32,
    prompt_tokens: u32,
    verifier_ns: Ns,
    trainer_model: TrainerModel,
    now: Ns,
    queue: EventQueue<Ev>,
    engines: Vec<Engine>,
    dirty: Vec<bool>,
    reqs: Vec<ReqInfo>,
    inflight: HashMap<RequestId, usize>,
    ctxs: Vec<StepCtx>,
    rolling: Option<u64>,
    training: Option<u64>,
    trainer_busy: bool,
    /// Requests the engines hold.
    held_total: u64,
    filter: FilterEstimate,
    /// The link that ships rollout data to the trainer is free from this time.
    link_free: Ns,
    /// Cache-aware routing: the engine holding each live group's prompt prefix.
    prefix_home: HashMap<(u64, u32), u16>,
    /// Train end of the previous step (Slime's wait_time_ratio window starts there).
    last_train_end: Ns,
    events: u64,
    conserved: bool,
    record: bool,
    rec: Recording,
    /// The `[alloc]` policy.
    allocator: crate::alloc::Allocator,
    /// Most samples one group can end with (responses drawn per prompt).
    max_samples: u32,
    /// Requests reported generated to the core, in report order, awaiting its answer.
    generated_keys: VecDeque<usize>,
}

/// Simulates `profile` x `setting` in `schedule` (a [`Mode`] or a mode with tail policies);
/// `record` keeps every span for traces and plots.
pub fn simulate(
    cfg: &SimConfig,
    profile: &str,
    setting: &str,
    schedule: impl Into<Schedule>,
    record: bool,
) -> anyhow::Result<Simulated> {
    let schedule = schedule.into();
    cfg.profile
        .get(profile)
        .with_context(|| format!("unknown profile `{profile}`"))?;
    let s = cfg
        .setting
        .get(setting)
        .with_context(|| format!("unknown setting `{setting}`"))?;
    let max_groups = crate::driver::plan::max_groups(s.batch, cfg.scheduler.max_groups_factor);
    let allocator = cfg.alloc.allocator(s.batch, s.group as u16)?;
    let mut alloc_plan = Plan::new(s.batch, s.group as u16);
    alloc_plan.max_groups = max_groups;
    cfg.alloc.configure(&allocator, &mut alloc_plan);
    let max_samples = u32::from(cfg.alloc.max_group_samples(&allocator, &alloc_plan));
    let mut storage = CoreStorage::new(
        max_groups,
        cfg.alloc.request_capacity(&allocator, &alloc_plan),
    );
    let [g0, g1] = &mut storage.groups;
    let [r0, r1] = &mut storage.requests;
    let mut scheds = [Scheduler::new(g0, r0), Scheduler::new(g1, r1)];
    let mut sim = Sim::new(cfg, (profile, setting), schedule, allocator, record)?;
    sim.max_samples = max_samples;
    sim.queue.push(0, Ev::StartRollout { step: 0 });
    crate::driver::drive(&mut scheds, &mut sim)?;
    let steps: Vec<StepRecord> = sim.ctxs.iter().filter_map(|c| c.metrics.clone()).collect();
    ensure!(
        steps.len() as u64 == sim.steps,
        "{profile}/{setting}/{schedule}: simulation stalled after {} of {} steps at t = {:.3} s",
        steps.len(),
        sim.steps,
        secs(sim.now)
    );
    let makespan = steps.last().map_or(0.0, |s| s.train_end);
    Ok(Simulated {
        result: RunResult {
            profile: profile.to_owned(),
            setting: setting.to_owned(),
            mode: schedule,
            steps,
            makespan,
            events: sim.events,
            conserved: sim.conserved,
        },
        recording: sim.rec,
    })
}

impl<'c> Sim<'c> {
    /// A simulation of `profile` x `setting` in `schedule` at time 0, nothing run yet.
    fn new(
        cfg: &'c SimConfig,
        (profile, setting): (&'c str, &'c str),
        schedule: Schedule,
        allocator: crate::alloc::Allocator,
        record: bool,
    ) -> anyhow::Result<Self> {
        let p = cfg
            .profile
            .get(profile)
            .with_context(|| format!("unknown profile `{profile}`"))?;
        let s = &cfg.setting[setting];
        let max_running = s.max_running(&cfg.rollout);
        Ok(Sim {
            cfg,
            schedule,
            setting_name: setting,
            profile_name: profile,
            steps: u64::from(cfg.run.steps),
            slots: cfg.rollout.engines * max_running,
            prompt_tokens: p.prompt_tokens,
            verifier_ns: secs_to_ns(cfg.rollout.verifier_latency_s),
            trainer_model: TrainerModel::from_config(&cfg.trainer),
            now: 0,
            queue: EventQueue::default(),
            engines: (0..cfg.rollout.engines)
                .map(|_| Engine::new(&cfg.rollout, max_running, s.cap))
                .collect(),
            dirty: vec![false; cfg.rollout.engines as usize],
            reqs: Vec::new(),
            inflight: HashMap::new(),
            ctxs: Vec::new(),
            rolling: None,
            training: None,
            trainer_busy: false,
            held_total: 0,
            filter: FilterEstimate::prior(cfg.scheduler.expected_filter),
            link_free: 0,
            prefix_home: HashMap::new(),
            last_train_end: 0,
            events: 0,
            conserved: true,
            record,
            rec: Recording::default(),
            allocator,
            max_samples: 0,
            generated_keys: VecDeque::new(),
        })
    }
}

fn tick(ns: Ns) -> Tick {
    Tick(ns)
}

impl<'c> Sim<'c> {
    fn setting(&self) -> &'c super::config::Setting {
        &self.cfg.setting[self.setting_name]
    }

    /// The next step's plan: the rule `train` shares, FGD's frontier widened by the
    /// previous step's filter rate.
    fn plan(&self) -> Plan {
        let (s, c) = (self.setting(), self.cfg);
        let spec = PlanSpec {
            mode: self.schedule.mode,
            batch: s.batch,
            group: s.group as u16,
            micro_batch: s.micro_batch,
            opt_steps: s.opt_steps,
            slots: self.slots,
            max_attempts: c.scheduler.max_attempts,
            max_groups_factor: c.scheduler.max_groups_factor,
            draw_batch: s.draw_batch,
            draw_ahead: 0,
            frontier_width: c.scheduler.frontier_width,
            order: c.scheduler.submit_order.with_seed(c.run.seed),
        };
        let mut plan = spec.plan(self.filter);
        c.alloc.configure(&self.allocator, &mut plan);
        plan
    }

    fn ctx(&mut self, step: u64) -> &mut StepCtx {
        &mut self.ctxs[step as usize]
    }

    /// The weights version step `step`'s rollout uses.
    fn version(&self, step: u64) -> u64 {
        if self.schedule.mode.stale() {
            // One step stale: the rollout of step k uses the weights step k-1 trained from.
            step.saturating_sub(1)
        } else {
            step
        }
    }

    /// After the core began `step`: its workload and bookkeeping.
    fn start_rollout(&mut self, step: u64) -> anyhow::Result<()> {
        let version = self.version(step);
        let progress = if self.steps > 1 {
            step as f64 / (self.steps - 1) as f64
        } else {
            0.0
        };
        let seed = self.cfg.run.seed
            ^ name_hash(self.profile_name)
            ^ name_hash(self.setting_name).rotate_left(17);
        let workload = Workload::new(
            seed,
            &self.cfg.profile[self.profile_name],
            self.setting(),
            progress,
        )?
        .with_samples(self.max_samples);
        let retractions: u64 = self.engines.iter().map(Engine::retractions).sum();
        let engine_busy_at_start: Ns = self.engines.iter().map(Engine::busy_ns).sum();
        ensure!(
            self.ctxs.len() as u64 == step,
            "step {step} started out of order"
        );
        self.ctxs.push(StepCtx {
            version,
            workload,
            groups: Vec::new(),
            completed: Vec::new(),
            dispatched: Vec::new(),
            start: self.now,
            rollout_end: None,
            train_end: None,
            trainer_busy: 0,
            last_mb: 0,
            last_opt: 0,
            tokens_generated: 0,
            occupancy: Occupancy::start(self.now),
            retractions_at_start: retractions,
            retractions: 0,
            completions: Vec::new(),
            data_ready: Vec::new(),
            logprob_ready: Vec::new(),
            mb_started: Vec::new(),
            engine_busy_at_start,
            mux_ns: 0,
            mux_groups: 0,
            migrations: 0,
            trained_samples: 0,
            extended: 0,
            metrics: None,
            barrier_passed: false,
        });
        // Requests still held (a surplus not yet aborted) count from the start.
        let (now, held) = (self.now, self.held_total as i64);
        self.ctx(step).occupancy.change(now, held);
        self.rolling = Some(step);
        if !self.schedule.mode.stale() {
            self.training = Some(step);
        }
        Ok(())
    }

    fn held_changed(&mut self, engine: u16, delta: i64) {
        if let Some(r) = self.rolling {
            self.ctxs[r as usize].occupancy.change(self.now, delta);
        }
        self.held_total = (self.held_total as i64 + delta) as u64;
        if self.record {
            let held = self.engines[engine as usize].held() as u32;
            self.rec.held.push((self.now, engine, held));
        }
    }

    /// A request finished on its engine: everything but the core's part.
    fn finished_request(&mut self, key: usize) -> Report {
        let r = self.reqs[key];
        self.inflight.remove(&r.id);
        self.held_changed(r.engine, -1);
        let step = r.id.step.0;
        self.ctx(step).tokens_generated += u64::from(r.tokens);
        if self.record {
            self.rec.requests.push(RequestSpan {
                step,
                engine: r.engine,
                group: r.id.group.0,
                sample: r.id.sample,
                start: r.start,
                end: self.now,
                tokens: r.tokens,
                finished: true,
            });
        }
        self.generated_keys.push_back(key);
        Report::Generated {
            id: r.id,
            version: r.version,
            tokens: r.tokens,
        }
    }

    /// A group turned trainable (at its last reward, or when a held group was committed).
    fn completed(&mut self, step: u64, group: u32) {
        let now = self.now;
        let c = &mut self.ctxs[step as usize];
        let gi = group as usize;
        if !c.completed[gi] {
            c.completed[gi] = true;
            c.completions.push(now - c.start);
            if self.record {
                self.rec.completions.push((step, group, now));
            }
        }
    }

    /// Puts an admitted request on engine `e`: straight into the batch (`now`, central queue)
    /// or at the back of the engine's waiting queue.
    fn place(
        &mut self,
        step: u64,
        e: usize,
        id: RequestId,
        version: PolicyVersion,
        now: bool,
    ) -> anyhow::Result<()> {
        let c = &self.ctxs[step as usize];
        let draw = c
            .groups
            .get(id.group.0 as usize)
            .and_then(|g| {
                g.samples
                    .get(usize::from(id.sample))
                    .map(|s| (g.prompt_tokens, *s))
            })
            .with_context(|| format!("{id}: admitted a request that was never drawn"))?;
        let key = self.reqs.len();
        self.reqs.push(ReqInfo {
            id,
            version,
            engine: e as u16,
            start: self.now,
            tokens: draw.1.response_tokens,
            reward: draw.1.reward,
            status: ReqStatus::Running,
        });
        self.inflight.insert(id, key);
        if now {
            self.engines[e].admit(key as u64, draw.0, draw.1.response_tokens);
        } else {
            self.engines[e].advance_to(self.now);
            self.engines[e].enqueue(Waiting {
                key: key as u64,
                prompt: draw.0,
                target: draw.1.response_tokens,
                generated: 0,
                resident: false,
            });
        }
        self.dirty[e] = true;
        self.held_changed(e as u16, 1);
        Ok(())
    }

    fn rollout_ended(&mut self, step: u64) {
        let now = self.now;
        let retractions: u64 = self.engines.iter().map(Engine::retractions).sum();
        let c = &mut self.ctxs[step as usize];
        c.occupancy.stop(now);
        c.rollout_end = Some(now);
        c.retractions = retractions - c.retractions_at_start;
        if self.schedule.mode.stale() {
            self.barrier();
        }
    }

    /// One-step-off: when the rollout of step r is final and the trainer finished step r-1,
    /// sync weights, then train step r and roll out step r+1 together.
    fn barrier(&mut self) {
        let Some(r) = self.rolling else { return };
        let rolled = self.ctxs[r as usize].rollout_end.is_some();
        let prev_trained = r == 0 || self.ctxs[(r - 1) as usize].train_end.is_some();
        if !(rolled && prev_trained) || self.ctxs[r as usize].barrier_passed {
            return;
        }
        self.ctxs[r as usize].barrier_passed = true;
        // Step 0's rollout used the initial weights, which the engines already have.
        let sync = if r == 0 {
            0
        } else {
            self.trainer_model.sync_ns()
        };
        if sync > 0 && self.record {
            self.rec.syncs.push((self.now, self.now + sync));
        }
        self.queue.push(self.now + sync, Ev::StartTrain { step: r });
        if r + 1 < self.steps {
            self.queue
                .push(self.now + sync, Ev::StartRollout { step: r + 1 });
        } else {
            self.rolling = None;
        }
    }

    /// The core says `step` is done: its metrics, then the next step's start.
    fn step_end(&mut self, step: u64, summary: StepSummary) -> anyhow::Result<()> {
        let now = self.now;
        let m_groups = self.setting().micro_batch as usize;
        let counters = summary.counters;
        self.conserved &= counters.is_conserved();
        let engine_busy: Ns = self.engines.iter().map(Engine::busy_ns).sum();
        let engines = self.engines.len() as f64;
        let prev_train_end = self.last_train_end;
        self.last_train_end = now;
        let c = &mut self.ctxs[step as usize];
        let rollout_end = c.rollout_end.unwrap_or(now);
        c.train_end = Some(now);
        // Engines' busy time counts everything they did in the window, work of the next step's
        // rollout included (one-step-off), so idle is clamped at 0.
        let busy = engine_busy.saturating_sub(c.engine_busy_at_start) as f64;
        let rollout_idle = metrics::rollout_idle((now - c.start) as f64, busy, engines) * 1e-9;
        let slot_occupancy = metrics::slot_occupancy(
            c.occupancy.area(),
            (rollout_end - c.start) as f64,
            self.slots,
        );
        let completions: Vec<f64> = c.completions.iter().map(|&t| secs(t)).collect();
        c.metrics = Some(StepRecord {
            step,
            version: c.version,
            rollout_start: secs(c.start),
            rollout_end: secs(rollout_end),
            train_end: secs(now),
            trainer_busy: secs(c.trainer_busy),
            last_tail: secs(c.last_mb + c.last_opt),
            first_micro_batch_ready: metrics::first_micro_batch_ready(&completions, m_groups),
            tokens_generated: c.tokens_generated,
            slot_occupancy,
            drawn: counters.drawn,
            trained: counters.trained,
            filtered: counters.filtered(),
            aborted_groups: counters.aborted,
            aborted_requests: counters.requests_aborted as u32,
            retractions: c.retractions,
            group_completion: completions,
            staleness: step - c.version,
            prev_train_end: secs(prev_train_end),
            rollout_idle,
            mux_s: secs(c.mux_ns),
            mux_groups: c.mux_groups,
            migrations: c.migrations,
            rollouts: metrics::rollouts(&counters),
            trained_samples: c.trained_samples,
            extended: c.extended,
            skipped: counters.filtered_skipped,
        });
        // FGD widens the next step's frontier by this step's filter rate (the rule `train` uses).
        self.filter.observe(&counters);
        self.training = None;
        match self.schedule.mode {
            Mode::OneStepOff => self.barrier(),
            _ => {
                if step + 1 < self.steps {
                    let sync = self.trainer_model.sync_ns();
                    if self.record {
                        self.rec.syncs.push((now, now + sync));
                    }
                    self.queue
                        .push(now + sync, Ev::StartRollout { step: step + 1 });
                }
                self.rolling = None;
            }
        }
        Ok(())
    }
}
