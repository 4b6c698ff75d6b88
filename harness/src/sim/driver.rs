//! The simulation loop: events in time order, every decision from `rolloutpipe-core`.
//!
//! The loop owns time, engines, the verifier and the trainer; the core owns the step protocol.
//! Each event reports what happened to the core (`on_*`) and then asks it what to do next
//! (`poll_abort`, `poll_draw`, `poll_admit`, `poll_dispatch`, `poll_micro_batch`). Nothing here
//! decides which request runs, which group is filtered, trained or aborted.
//!
//! Step timing: on-policy modes start the rollout of step k+1 when step k's last optimizer step
//! is done plus the weight sync. `one-step-off` instead rolls out step k+1 with the weights of
//! step k-1 while the trainer trains step k; both sides meet at a barrier, sync, and go on.
use std::collections::HashMap;

use anyhow::{Context, anyhow, bail, ensure};
use rolloutpipe_core::{
    AdmissionPolicy, Completion, DispatchPolicy, GroupId, GroupSlot, GroupState, Plan,
    PolicyVersion, RequestId, RequestSlot, Scheduler, StepId, SubmitOrder, Tick,
};

use super::config::{Mode, SimConfig, SubmitOrderConfig};
use super::engine::{Engine, Ns};
use super::metrics::{RunResult, StepMetrics, secs};
use super::queue::EventQueue;
use super::trainer::TrainerModel;
use super::workload::{GroupDraw, Workload, name_hash};

/// What happened, for the trace and the Gantt plot (recorded only when asked).
#[derive(Debug, Default, Clone)]
pub struct Recording {
    /// Requests: (step, engine, group, sample, start, end, tokens, finished normally).
    pub requests: Vec<RequestSpan>,
    /// Trainer work: (step, label, start, end).
    pub trainer: Vec<(u64, String, Ns, Ns)>,
    /// Weight syncs: (start, end).
    pub syncs: Vec<(Ns, Ns)>,
    /// Group materializations of trained groups: (step, group, time).
    pub completions: Vec<(u64, u32, Ns)>,
    /// Requests held per engine after each change: (time, engine, held).
    pub held: Vec<(Ns, u16, u32)>,
}

/// One request's life on an engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestSpan {
    /// Step.
    pub step: u64,
    /// Engine index.
    pub engine: u16,
    /// Group (draw order).
    pub group: u32,
    /// Sample index.
    pub sample: u16,
    /// Admission time.
    pub start: Ns,
    /// Generation end or abort.
    pub end: Ns,
    /// Tokens generated.
    pub tokens: u32,
    /// False when aborted.
    pub finished: bool,
}

/// The result of one run plus, if asked, its recording.
#[derive(Debug, Clone)]
pub struct Simulated {
    /// Metrics.
    pub result: RunResult,
    /// Recording (empty unless asked).
    pub recording: Recording,
}

#[derive(Debug, Clone, Copy)]
enum Ev {
    Boundary { engine: usize, epoch: u64 },
    Reward { key: usize },
    MicroBatchDone { step: u64 },
    OptimizerDone { step: u64 },
    StartRollout { step: u64 },
    StartTrain { step: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReqStatus {
    Running,
    Generated,
    Done,
    Aborted,
}

#[derive(Debug, Clone, Copy)]
struct ReqInfo {
    id: RequestId,
    version: PolicyVersion,
    engine: u16,
    start: Ns,
    tokens: u32,
    reward: f32,
    status: ReqStatus,
}

/// Per-step bookkeeping on the simulator's side (the core holds the protocol state).
#[derive(Debug)]
struct StepCtx {
    version: u64,
    workload: Workload,
    groups: Vec<GroupDraw>,
    completed: Vec<bool>,
    dispatched: Vec<GroupId>,
    start: Ns,
    rollout_end: Option<Ns>,
    train_end: Option<Ns>,
    trainer_busy: Ns,
    last_mb: Ns,
    last_opt: Ns,
    tokens_generated: u64,
    occupancy_area: f64,
    retractions_at_start: u64,
    retractions: u64,
    completions: Vec<Ns>,
    metrics: Option<StepMetrics>,
    /// One-step-off: the barrier after this step's rollout has fired.
    barrier_passed: bool,
}

struct Sim<'c> {
    cfg: &'c SimConfig,
    mode: Mode,
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
    held_total: u64,
    held_since: Ns,
    expected_filter_ppm: u32,
    events: u64,
    conserved: bool,
    record: bool,
    rec: Recording,
}

/// Storage for the core: two schedulers, so one-step-off can train step k while rolling out k+1.
struct CoreStorage {
    groups: [Vec<GroupSlot>; 2],
    requests: [Vec<RequestSlot>; 2],
}

impl CoreStorage {
    fn new(max_groups: u32, group_size: u32) -> Self {
        let g = max_groups as usize;
        let r = g * group_size as usize;
        Self {
            groups: [vec![GroupSlot::EMPTY; g], vec![GroupSlot::EMPTY; g]],
            requests: [vec![RequestSlot::EMPTY; r], vec![RequestSlot::EMPTY; r]],
        }
    }
}

/// Simulates `profile` x `setting` in `mode`; `record` keeps every span for traces and plots.
pub fn simulate(
    cfg: &SimConfig,
    profile: &str,
    setting: &str,
    mode: Mode,
    record: bool,
) -> anyhow::Result<Simulated> {
    let p = cfg
        .profile
        .get(profile)
        .with_context(|| format!("unknown profile `{profile}`"))?;
    let s = cfg
        .setting
        .get(setting)
        .with_context(|| format!("unknown setting `{setting}`"))?;
    let max_running = s.max_running(&cfg.rollout);
    let max_groups =
        ((f64::from(s.batch) * cfg.scheduler.max_groups_factor).ceil() as u32).max(s.batch);
    let mut storage = CoreStorage::new(max_groups, s.group);
    let [g0, g1] = &mut storage.groups;
    let [r0, r1] = &mut storage.requests;
    let mut scheds = [Scheduler::new(g0, r0), Scheduler::new(g1, r1)];
    let mut sim = Sim {
        cfg,
        mode,
        setting_name: setting,
        profile_name: profile,
        steps: u64::from(cfg.run.steps),
        slots: cfg.rollout.engines * max_running,
        prompt_tokens: p.prompt_tokens,
        verifier_ns: super::engine::secs_to_ns(cfg.rollout.verifier_latency_s),
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
        held_since: 0,
        expected_filter_ppm: 0,
        events: 0,
        conserved: true,
        record,
        rec: Recording::default(),
    };
    sim.queue.push(0, Ev::StartRollout { step: 0 });
    while let Some((at, ev)) = sim.queue.pop() {
        ensure!(
            at >= sim.now,
            "event queue went back in time ({at} < {})",
            sim.now
        );
        sim.now = at;
        sim.events += 1;
        sim.handle(&mut scheds, ev, max_groups)?;
        if sim.ctxs.len() as u64 == sim.steps && sim.ctxs.iter().all(|c| c.metrics.is_some()) {
            break;
        }
    }
    let steps: Vec<StepMetrics> = sim.ctxs.iter().filter_map(|c| c.metrics.clone()).collect();
    ensure!(
        steps.len() as u64 == sim.steps,
        "{profile}/{setting}/{mode}: simulation stalled after {} of {} steps at t = {:.3} s",
        steps.len(),
        sim.steps,
        secs(sim.now)
    );
    let makespan = steps.last().map_or(0.0, |s| s.train_end);
    Ok(Simulated {
        result: RunResult {
            profile: profile.to_owned(),
            setting: setting.to_owned(),
            mode,
            steps,
            makespan,
            events: sim.events,
            conserved: sim.conserved,
        },
        recording: sim.rec,
    })
}

fn tick(ns: Ns) -> Tick {
    Tick(ns)
}

impl<'c> Sim<'c> {
    fn setting(&self) -> &'c super::config::Setting {
        &self.cfg.setting[self.setting_name]
    }

    fn plan(&self, max_groups: u32) -> Plan {
        let s = self.setting();
        let order = match self.cfg.scheduler.submit_order {
            SubmitOrderConfig::GroupMajor => SubmitOrder::GroupMajor,
            SubmitOrderConfig::Interleaved => SubmitOrder::Interleaved,
            SubmitOrderConfig::Shuffled => SubmitOrder::Shuffled {
                seed: self.cfg.run.seed,
            },
        };
        let mut plan = Plan::new(s.batch, s.group as u16);
        plan.micro_batch = s.micro_batch;
        plan.opt_steps = s.opt_steps;
        plan.slots = self.slots;
        plan.max_attempts = self.cfg.scheduler.max_attempts;
        plan.max_groups = max_groups;
        plan.draw_batch = s.draw_batch;
        plan.draw_ahead = 0;
        plan.admission = match self.mode {
            Mode::Rolloutpipe => AdmissionPolicy::Frontier {
                width: self.cfg.scheduler.frontier_width,
                expected_filter_ppm: self.expected_filter_ppm,
                fallback: order,
            },
            _ => AdmissionPolicy::Fifo { order },
        };
        plan.dispatch = match self.mode {
            Mode::Cgp | Mode::Rolloutpipe => DispatchPolicy::Pipelined,
            Mode::Sync | Mode::OneStepOff => DispatchPolicy::Sync,
        };
        plan
    }

    fn ctx(&mut self, step: u64) -> &mut StepCtx {
        &mut self.ctxs[step as usize]
    }

    fn handle(
        &mut self,
        scheds: &mut [Scheduler<'_>; 2],
        ev: Ev,
        max_groups: u32,
    ) -> anyhow::Result<()> {
        match ev {
            Ev::StartRollout { step } => self.start_rollout(scheds, step, max_groups)?,
            Ev::StartTrain { step } => self.training = Some(step),
            Ev::Boundary { engine, epoch } => {
                if epoch != self.engines[engine].epoch() {
                    return Ok(()); // superseded by a later change to this engine
                }
                let out = self.engines[engine].on_event();
                self.dirty[engine] = true;
                for key in out.finished {
                    self.on_generated(scheds, key as usize)?;
                }
            }
            Ev::Reward { key } => self.on_reward(scheds, key)?,
            Ev::MicroBatchDone { step } => {
                let sched = &mut scheds[(step % 2) as usize];
                let mb = sched
                    .on_micro_batch_consumed(tick(self.now))
                    .map_err(|e| anyhow!("step {step}: micro-batch consumed: {e}"))?;
                self.trainer_busy = false;
                if mb.ends_optimizer_step {
                    let dt = self.trainer_model.optimizer_ns();
                    self.trainer_busy = true;
                    let c = self.ctx(step);
                    c.trainer_busy += dt;
                    c.last_opt = dt;
                    if self.record {
                        self.rec
                            .trainer
                            .push((step, "optimizer".into(), self.now, self.now + dt));
                    }
                    self.queue.push(self.now + dt, Ev::OptimizerDone { step });
                }
            }
            Ev::OptimizerDone { step } => {
                scheds[(step % 2) as usize]
                    .on_optimizer_step_done(tick(self.now))
                    .map_err(|e| anyhow!("step {step}: optimizer step: {e}"))?;
                self.trainer_busy = false;
            }
        }
        self.housekeeping(scheds)
    }

    fn start_rollout(
        &mut self,
        scheds: &mut [Scheduler<'_>; 2],
        step: u64,
        max_groups: u32,
    ) -> anyhow::Result<()> {
        let version = match self.mode {
            // One step stale: the rollout of step k uses the weights step k-1 trained from.
            Mode::OneStepOff => step.saturating_sub(1),
            _ => step,
        };
        let plan = self.plan(max_groups);
        scheds[(step % 2) as usize]
            .begin_step(tick(self.now), StepId(step), PolicyVersion(version), plan)
            .map_err(|e| anyhow!("step {step}: begin_step: {e}"))?;
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
        )?;
        let retractions: u64 = self.engines.iter().map(Engine::retractions).sum();
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
            occupancy_area: 0.0,
            retractions_at_start: retractions,
            retractions: 0,
            completions: Vec::new(),
            metrics: None,
            barrier_passed: false,
        });
        self.rolling = Some(step);
        self.held_since = self.now;
        if self.mode != Mode::OneStepOff {
            self.training = Some(step);
        }
        Ok(())
    }

    fn held_changed(&mut self, engine: u16, delta: i64) {
        if let Some(r) = self.rolling {
            let now = self.now;
            let c = &mut self.ctxs[r as usize];
            if c.rollout_end.is_none() {
                c.occupancy_area += self.held_total as f64 * (now - self.held_since) as f64;
            }
        }
        self.held_since = self.now;
        self.held_total = (self.held_total as i64 + delta) as u64;
        if self.record {
            let held = self.engines[engine as usize].held() as u32;
            self.rec.held.push((self.now, engine, held));
        }
    }

    fn on_generated(&mut self, scheds: &mut [Scheduler<'_>; 2], key: usize) -> anyhow::Result<()> {
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
        let sched = &mut scheds[(step % 2) as usize];
        match sched.on_request_generated(tick(self.now), r.id, r.version, r.tokens) {
            Ok(Completion::Accepted { .. }) => {
                self.reqs[key].status = ReqStatus::Generated;
                self.queue
                    .push(self.now + self.verifier_ns, Ev::Reward { key });
            }
            // The request's group ended while it ran (an abort crossed the finish); the core
            // counted it and freed the slot.
            Ok(_) => self.reqs[key].status = ReqStatus::Done,
            Err(e) => bail!("{}: generated: {e}", r.id),
        }
        Ok(())
    }

    fn on_reward(&mut self, scheds: &mut [Scheduler<'_>; 2], key: usize) -> anyhow::Result<()> {
        let r = self.reqs[key];
        if r.status != ReqStatus::Generated {
            return Ok(());
        }
        self.reqs[key].status = ReqStatus::Done;
        let step = r.id.step.0;
        let sched = &mut scheds[(step % 2) as usize];
        if sched.step().map(|(s, _)| s) != Some(r.id.step) {
            return Ok(()); // the step is over and its scheduler reused; the core would refuse it
        }
        let g = r.id.group;
        match sched.on_reward(tick(self.now), r.id, r.reward) {
            Ok(Completion::Accepted { group_state: state }) => {
                let c = &mut self.ctxs[step as usize];
                let gi = g.0 as usize;
                if !c.completed[gi]
                    && matches!(state, GroupState::Trainable | GroupState::Dispatched)
                {
                    c.completed[gi] = true;
                    c.completions.push(self.now - c.start);
                    if self.record {
                        self.rec.completions.push((step, g.0, self.now));
                    }
                }
            }
            // Discarded: the group ended meanwhile (aborted as surplus or filtered).
            Ok(_) => {}
            Err(e) => {
                // A reward for a group that ended meanwhile (aborted as surplus) is refused by
                // the core; anything else is a simulator bug.
                let ended = sched.group(g).is_some_and(|info| info.state.is_final());
                ensure!(ended, "{}: reward refused for a live group: {e}", r.id);
            }
        }
        Ok(())
    }

    /// After every event: aborts, draws, admissions, trainer, engine schedules, step ends.
    fn housekeeping(&mut self, scheds: &mut [Scheduler<'_>; 2]) -> anyhow::Result<()> {
        if let Some(step) = self.rolling {
            let sched = &mut scheds[(step % 2) as usize];
            // Aborts of surplus (or filtered) groups' in-flight requests.
            while let Some(id) = sched.poll_abort(tick(self.now)) {
                if let Some(key) = self.inflight.remove(&id) {
                    let e = self.reqs[key].engine as usize;
                    self.engines[e].advance_to(self.now);
                    self.dirty[e] = true;
                    let generated = self.engines[e].abort(key as u64);
                    ensure!(
                        generated.is_some(),
                        "{id}: engine {e} did not hold an in-flight request"
                    );
                    self.reqs[key].status = ReqStatus::Aborted;
                    let tokens = generated.unwrap_or(0);
                    self.held_changed(e as u16, -1);
                    let c = &mut self.ctxs[step as usize];
                    c.tokens_generated += u64::from(tokens);
                    if self.record {
                        let r = self.reqs[key];
                        self.rec.requests.push(RequestSpan {
                            step,
                            engine: r.engine,
                            group: id.group.0,
                            sample: id.sample,
                            start: r.start,
                            end: self.now,
                            tokens,
                            finished: false,
                        });
                    }
                }
                sched
                    .on_abort_acked(tick(self.now), id)
                    .map_err(|e| anyhow!("{id}: abort ack: {e}"))?;
            }
            // Over-sampling draws.
            while let Some(n) = sched.poll_draw(tick(self.now)) {
                let first = sched
                    .on_prompts_drawn(tick(self.now), n)
                    .map_err(|e| anyhow!("step {step}: draw: {e}"))?;
                let c = &mut self.ctxs[step as usize];
                for i in 0..n {
                    let g = c.workload.group(step, u64::from(first.0 + i));
                    c.groups.push(g);
                    c.completed.push(false);
                }
                ensure!(
                    c.groups.len() == (first.0 + n) as usize,
                    "step {step}: core numbered groups out of draw order"
                );
            }
            self.fill(sched, step)?;
            if sched.is_batch_final() && self.ctxs[step as usize].rollout_end.is_none() {
                self.rollout_ended(step);
            }
        }
        self.kick_trainer(scheds)?;
        for e in 0..self.engines.len() {
            if std::mem::take(&mut self.dirty[e]) {
                self.engines[e].resume_retracted();
                self.engines[e].prefill();
                if let Some((at, epoch)) = self.engines[e].schedule() {
                    self.queue.push(at, Ev::Boundary { engine: e, epoch });
                }
            }
        }
        self.check_step_done(scheds)
    }

    /// Admits pending requests into engines with room, least-loaded engine first (the router).
    fn fill(&mut self, sched: &mut Scheduler<'_>, step: u64) -> anyhow::Result<()> {
        if sched.view().pending_requests() == 0 {
            return Ok(());
        }
        for e in 0..self.engines.len() {
            // Only engines with a free slot can take work; bring them to their next iteration
            // boundary so the KV check sees current occupancy.
            if self.engines[e].has_free_slot() {
                self.engines[e].advance_to(self.now);
                self.engines[e].resume_retracted();
                self.dirty[e] = true;
            }
        }
        // The router: the least-loaded engine that can take a request, lowest index on ties.
        while let Some(e) = (0..self.engines.len())
            .filter(|&e| self.engines[e].can_admit(self.prompt_tokens))
            .min_by_key(|&e| (self.engines[e].held(), e))
        {
            let Some(adm) = sched.poll_admit(tick(self.now)) else {
                break;
            };
            let c = &self.ctxs[step as usize];
            let draw = c
                .groups
                .get(adm.request.group.0 as usize)
                .and_then(|g| {
                    g.samples
                        .get(usize::from(adm.request.sample))
                        .map(|s| (g.prompt_tokens, *s))
                })
                .with_context(|| {
                    format!("{}: admitted a request that was never drawn", adm.request)
                })?;
            let key = self.reqs.len();
            self.reqs.push(ReqInfo {
                id: adm.request,
                version: adm.version,
                engine: e as u16,
                start: self.now,
                tokens: draw.1.response_tokens,
                reward: draw.1.reward,
                status: ReqStatus::Running,
            });
            self.inflight.insert(adm.request, key);
            self.engines[e].admit(key as u64, draw.0, draw.1.response_tokens);
            self.dirty[e] = true;
            self.held_changed(e as u16, 1);
        }
        Ok(())
    }

    fn rollout_ended(&mut self, step: u64) {
        let now = self.now;
        let held = self.held_total as f64;
        let since = self.held_since;
        let retractions: u64 = self.engines.iter().map(Engine::retractions).sum();
        let c = &mut self.ctxs[step as usize];
        c.occupancy_area += held * (now - since) as f64;
        c.rollout_end = Some(now);
        c.retractions = retractions - c.retractions_at_start;
        self.held_since = now;
        if self.mode == Mode::OneStepOff {
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

    fn kick_trainer(&mut self, scheds: &mut [Scheduler<'_>; 2]) -> anyhow::Result<()> {
        let Some(step) = self.training else {
            return Ok(());
        };
        let sched = &mut scheds[(step % 2) as usize];
        while let Some(d) = sched.poll_dispatch(tick(self.now)) {
            let c = &mut self.ctxs[step as usize];
            ensure!(
                d.seq as usize == c.dispatched.len(),
                "step {step}: dispatch sequence skipped"
            );
            c.dispatched.push(d.group);
        }
        if self.trainer_busy {
            return Ok(());
        }
        if let Some(mb) = sched.poll_micro_batch(tick(self.now)) {
            let c = &self.ctxs[step as usize];
            let first = mb.first_seq as usize;
            let groups = c
                .dispatched
                .get(first..first + mb.len as usize)
                .with_context(|| {
                    format!(
                        "step {step}: micro-batch {} beyond dispatched groups",
                        mb.index
                    )
                })?;
            let tokens: u64 = groups
                .iter()
                .map(|g| c.groups[g.0 as usize].train_tokens())
                .sum();
            let dt = self.trainer_model.micro_batch_ns(tokens);
            let c = self.ctx(step);
            c.trainer_busy += dt;
            c.last_mb = dt;
            self.trainer_busy = true;
            if self.record {
                self.rec
                    .trainer
                    .push((step, format!("mb {}", mb.index), self.now, self.now + dt));
            }
            self.queue.push(self.now + dt, Ev::MicroBatchDone { step });
        }
        Ok(())
    }

    fn check_step_done(&mut self, scheds: &mut [Scheduler<'_>; 2]) -> anyhow::Result<()> {
        let Some(step) = self.training else {
            return Ok(());
        };
        if self.trainer_busy {
            return Ok(());
        }
        let Some(summary) = scheds[(step % 2) as usize].poll_step_done() else {
            return Ok(());
        };
        let now = self.now;
        let m_groups = self.setting().micro_batch as usize;
        let counters = summary.counters;
        self.conserved &= counters.is_conserved();
        let c = &mut self.ctxs[step as usize];
        let rollout_end = c.rollout_end.unwrap_or(now);
        c.train_end = Some(now);
        let rollout_ns = rollout_end - c.start;
        let slot_occupancy = if rollout_ns == 0 {
            0.0
        } else {
            c.occupancy_area / (rollout_ns as f64 * f64::from(self.slots))
        };
        let observed_filter = f64::from(counters.filtered())
            / f64::from((counters.filtered() + counters.batch_filled()).max(1));
        c.metrics = Some(StepMetrics {
            step,
            version: c.version,
            rollout_start: secs(c.start),
            rollout_end: secs(rollout_end),
            train_end: secs(now),
            trainer_busy: secs(c.trainer_busy),
            last_tail: secs(c.last_mb + c.last_opt),
            first_micro_batch_ready: c
                .completions
                .get(m_groups.saturating_sub(1))
                .or(c.completions.last())
                .map_or(0.0, |&t| secs(t)),
            tokens_generated: c.tokens_generated,
            slot_occupancy,
            drawn: counters.drawn,
            trained: counters.trained,
            filtered: counters.filtered(),
            aborted_groups: counters.aborted,
            aborted_requests: counters.requests_aborted as u32,
            retractions: c.retractions,
            group_completion: c.completions.iter().map(|&t| secs(t)).collect(),
            staleness: step - c.version,
        });
        // FGD widens its frontier by the filter rate seen so far (what a live system can know).
        self.expected_filter_ppm = (observed_filter.clamp(0.0, 0.95) * 1e6) as u32;
        self.training = None;
        match self.mode {
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
