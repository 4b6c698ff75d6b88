//! The scheduler thread's context across steps: the workers' channels and handles, the clock,
//! the trace, the weight sync and each request's sampling parameters.
use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use anyhow::bail;
use rolloutpipe_backends::optim::AdamState;
use rolloutpipe_backends::{ModelConfig, SamplingParams, SyncTarget, WeightSnapshot, Weights};
use rolloutpipe_core::{PolicyVersion, RequestId, Tick};

use crate::plot::GanttRow;
use crate::tasks::Tokenizer;
use crate::trace::ChromeTrace;
use crate::train::config::TrainConfig;
use crate::train::data::DataSource;
use crate::train::msg::{
    EngineCmd, EngineOut, Event, GroupBatch, TrainCmd, TrainerReply, VerifyJob,
};
use crate::train::record::checkpoint::CheckpointState;
use crate::train::record::metrics::{Measured, TrainedRecord};
use crate::train::record::summary::SummaryBase;
use crate::train::workers::transport::{EngineLink, Links};

/// Trace process ids.
pub(super) const PID_ENGINES: u32 = 1;
pub(super) const PID_TRAINER: u32 = 2;
pub(super) const PID_GROUPS: u32 = 3;

/// The scheduler thread's view of one rollout engine.
pub(super) struct EngineHandle {
    /// The device and dtype its weight snapshots are made for; `None`: it is sent the master
    /// weights (a remote engine converts them itself).
    pub(super) target: Option<SyncTarget>,
    pub(super) tx: Sender<EngineCmd>,
    pub(super) live: bool,
    /// Requests it holds.
    pub(super) running: u32,
    /// Busy (holding a request or computing a multiplexed reference pass) since (for the
    /// engines' busy time).
    pub(super) busy_from: Option<Instant>,
    /// Computing a multiplexed reference pass (`rollout.multiplex`).
    pub(super) mux_busy: bool,
    /// Asked to export a request (`rollout.migrate`), no answer yet.
    pub(super) migrating: bool,
}

impl EngineHandle {
    /// A live engine holding nothing yet, reached through `tx`.
    pub(super) fn new(target: Option<SyncTarget>, tx: Sender<EngineCmd>) -> Self {
        Self {
            target,
            tx,
            live: true,
            running: 0,
            busy_from: None,
            mux_busy: false,
            migrating: false,
        }
    }

    /// Whether it works: holds a request or computes a multiplexed pass.
    fn busy(&self) -> bool {
        self.running > 0 || self.mux_busy
    }

    /// Applies `f` at `now`: opens its busy interval when it starts working, and returns the
    /// interval when it stops.
    fn change(
        &mut self,
        now: Instant,
        f: impl FnOnce(&mut EngineHandle),
    ) -> Option<(Instant, Instant)> {
        let before = self.busy();
        f(self);
        match (before, self.busy()) {
            (false, true) => {
                self.busy_from = Some(now);
                None
            }
            (true, false) => self.busy_from.take().map(|from| (from, now)),
            _ => None,
        }
    }
}

/// The scheduler thread's state across steps: the workers' channels, the data, the trace and
/// what the run measures.
pub(super) struct Ctx<'c> {
    pub(super) cfg: &'c TrainConfig,
    pub(super) clock: Instant,
    pub(super) events: Receiver<Event>,
    pub(super) engines: Vec<EngineHandle>,
    pub(super) verify: Option<Sender<VerifyJob>>,
    pub(super) trainer: Sender<TrainCmd>,
    pub(super) data: DataSource,
    pub(super) trace: ChromeTrace,
    pub(super) measured: Measured,
    /// The trainer's busy intervals.
    pub(super) busy: Vec<(Instant, Instant)>,
    /// The rollout engines' busy intervals (at least one request held).
    pub(super) engine_busy: Vec<(Instant, Instant)>,
    pub(super) trained: Vec<TrainedRecord>,
    pub(super) timeline: Option<Vec<GanttRow>>,
    pub(super) model_cfg: ModelConfig,
    pub(super) tok: Arc<dyn Tokenizer>,
    /// An earlier invocation's trace events and the offset this one's are placed at.
    pub(super) trace_base: (Vec<serde_json::Value>, f64),
    /// What `summary.json` carries over from earlier invocations and the start of this one.
    pub(super) summary: SummaryBase,
    /// Set when a signal stopped the run: the step a resume continues at.
    pub(super) interrupted: Option<u64>,
    /// The `[alloc]` policy: how many samples each prompt gets.
    pub(super) allocator: crate::alloc::Allocator,
    /// Pool indices of problems evicted from later epochs.
    pub(super) evicted: HashSet<usize>,
}

/// What the scheduler thread's context is made of, besides the config.
pub(super) struct Parts {
    /// Where every worker reports.
    pub(super) events: Receiver<Event>,
    /// The channels to the started workers (their threads are the caller's to join).
    pub(super) links: Links,
    /// The training stream.
    pub(super) data: DataSource,
    /// The model's shape.
    pub(super) model_cfg: ModelConfig,
    /// The tokenizer.
    pub(super) tok: Arc<dyn Tokenizer>,
}

impl<'c> Ctx<'c> {
    /// The context of a run in `out` whose workers just started, from `state` (a fresh
    /// run's, or the checkpoint a resume starts from); the trace and the summary continue
    /// an earlier invocation's when `resume`.
    pub(super) fn new(
        cfg: &'c TrainConfig,
        out: &Path,
        resume: bool,
        started: Instant,
        parts: Parts,
        state: &CheckpointState,
    ) -> anyhow::Result<Self> {
        let engines = (parts.links.engines.into_iter())
            .map(|EngineLink { tx, target }| EngineHandle::new(target, tx))
            .collect();
        let mut ctx = Ctx {
            cfg,
            clock: Instant::now(),
            events: parts.events,
            engines,
            verify: Some(parts.links.verify),
            trainer: parts.links.trainer,
            data: parts.data,
            trace: ChromeTrace::new(),
            measured: Measured {
                slots: cfg.rollout.slots,
                engines: cfg.rollout.engines,
                ..Measured::default()
            },
            busy: Vec::new(),
            engine_busy: Vec::new(),
            trained: Vec::new(),
            timeline: None,
            model_cfg: parts.model_cfg,
            tok: parts.tok,
            trace_base: if resume {
                crate::trace::read_events(&out.join("trace.json"))
            } else {
                (Vec::new(), 0.0)
            },
            summary: SummaryBase::read(out, resume, started),
            interrupted: None,
            allocator: cfg.allocator()?,
            evicted: state.evicted.iter().copied().collect(),
        };
        ctx.trace_header();
        Ok(ctx)
    }

    /// Writes `trace.json`: earlier invocations' events, then this one's.
    pub(super) fn write_trace(&self, out: &Path) -> anyhow::Result<()> {
        let (base, offset) = &self.trace_base;
        self.trace
            .write_merged(&out.join("trace.json"), base, *offset)
    }

    pub(super) fn now(&self) -> Tick {
        Tick(self.clock.elapsed().as_micros() as u64)
    }

    pub(super) fn us(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.clock).as_secs_f64() * 1e6
    }

    fn trace_header(&mut self) {
        self.trace.process(PID_ENGINES, "rollout engines");
        for e in 0..self.engines.len() {
            self.trace
                .thread(PID_ENGINES, e as u32, &format!("engine {e}"));
        }
        self.trace.process(PID_TRAINER, "trainer");
        self.trace.thread(PID_TRAINER, 0, "trainer");
        self.trace.process(PID_GROUPS, "groups");
    }

    pub(super) fn recv(&self) -> anyhow::Result<Option<Event>> {
        match self.events.recv_timeout(Duration::from_millis(200)) {
            Ok(Event::Fatal(msg)) => bail!("{msg}"),
            Ok(e) => Ok(Some(e)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => bail!("every worker thread stopped"),
        }
    }

    /// The error for a worker whose channel closed: the worker's own fatal message when it
    /// sent one before stopping, so the cause is not lost behind "stopped".
    pub(super) fn worker_stopped(&self, who: &str) -> anyhow::Error {
        for ev in self.events.try_iter() {
            if let Event::Fatal(msg) = ev {
                return anyhow::anyhow!("{who} stopped: {msg}");
            }
        }
        anyhow::anyhow!("{who} stopped without reporting an error")
    }

    pub(super) fn send_trainer(&self, cmd: TrainCmd) -> anyhow::Result<()> {
        self.trainer
            .send(cmd)
            .map_err(|_| self.worker_stopped("the trainer thread"))
    }

    /// Exports the trainer's weights, and its moments when `optimizer` (checkpoints only).
    pub(super) fn export(
        &mut self,
        optimizer: bool,
    ) -> anyhow::Result<(Arc<Weights>, Option<AdamState>)> {
        self.send_trainer(TrainCmd::Export { optimizer })?;
        loop {
            if let Some(Event::Trainer {
                reply: TrainerReply::Exported(w, a),
                ..
            }) = self.recv()?
            {
                return Ok((w, a));
            }
        }
    }

    /// Weight sync: every live engine imports `w` as version `v`; returns seconds taken.
    pub(super) fn sync_engines(
        &mut self,
        w: Arc<Weights>,
        v: PolicyVersion,
    ) -> anyhow::Result<f64> {
        let t = Instant::now();
        let mut waiting = 0;
        // Engines run in their own threads on their own devices, so they load host snapshots,
        // one per engine dtype, converted once here.
        // Remote engines are sent the master weights (`target` None), serialised once for all.
        let mut snaps: Vec<(SyncTarget, Arc<WeightSnapshot>)> = Vec::new();
        for e in self.engines.iter().filter(|e| e.live) {
            let snap = match e.target {
                None => None,
                Some(target) => Some(match snaps.iter().find(|(t, _)| t.dtype == target.dtype) {
                    Some((_, s)) => s.clone(),
                    None => {
                        let s = Arc::new(WeightSnapshot::host(&self.model_cfg, &w, target.dtype)?);
                        snaps.push((target, s.clone()));
                        s
                    }
                }),
            };
            let cmd = EngineCmd::Sync {
                snap,
                master: w.clone(),
                version: v,
            };
            if e.tx.send(cmd).is_ok() {
                waiting += 1;
            }
        }
        while waiting > 0 {
            match self.recv()? {
                Some(Event::Synced { decode, .. }) => {
                    self.measured.decode.extend(decode);
                    waiting -= 1;
                }
                // Late rewards of aborted groups and failures of idle engines change nothing.
                Some(
                    Event::Engine {
                        out: EngineOut::Lost(_) | EngineOut::Preempted(_),
                        ..
                    }
                    | Event::Rewarded(_),
                )
                | None => {}
                Some(_) => bail!("unexpected event during weight sync"),
            }
        }
        let s = t.elapsed().as_secs_f64();
        let now = self.us(Instant::now());
        self.trace.complete(
            "weight sync",
            "sync",
            PID_TRAINER,
            0,
            now - s * 1e6,
            s * 1e6,
            serde_json::json!({"version": v.0}),
        );
        Ok(s)
    }

    pub(super) fn sampling(&self, rid: RequestId) -> SamplingParams {
        let rl = &self.cfg.rl;
        // A pure function of the seed and the request, so a resumed run samples the same.
        let seed = mix(&[
            self.cfg.run.seed,
            rid.step.0,
            rid.group.0 as u64,
            rid.sample as u64,
            rid.attempt as u64,
        ]);
        SamplingParams {
            temperature: rl.temperature,
            top_k: rl.top_k,
            top_p: rl.top_p,
            max_new_tokens: rl.max_new_tokens,
            stop_tokens: self.tok.eos_id().into_iter().collect(),
            seed,
        }
    }

    /// Engine `e` took (`delta` > 0) or released requests; its busy intervals follow.
    pub(super) fn engine_running(&mut self, e: usize, delta: i64) {
        self.engine_change(e, |h| {
            h.running = u32::try_from(i64::from(h.running) + delta).unwrap_or(0);
        });
    }

    /// Engine `e` started (`true`) or finished a multiplexed reference pass: busy time too,
    /// so `rollout_idle_s` does not count it as idle.
    pub(super) fn engine_mux(&mut self, e: usize, busy: bool) {
        self.engine_change(e, |h| h.mux_busy = busy);
    }

    /// Applies `f` to engine `e`, opening or closing its busy interval as it starts or stops
    /// working.
    fn engine_change(&mut self, e: usize, f: impl FnOnce(&mut EngineHandle)) {
        if let Some(h) = self.engines.get_mut(e)
            && let Some(span) = h.change(Instant::now(), f)
        {
            self.engine_busy.push(span);
        }
    }

    /// The engines' busy intervals, the ones still open ending now.
    pub(super) fn engine_busy_now(&self) -> Vec<(Instant, Instant)> {
        let now = Instant::now();
        let open = self
            .engines
            .iter()
            .filter_map(|h| h.busy_from.map(|f| (f, now)));
        self.engine_busy.iter().copied().chain(open).collect()
    }

    /// Records which step trains each response of `groups`.
    pub(super) fn record_trained(&mut self, groups: &[GroupBatch], step: u64) {
        for g in groups {
            for s in &g.samples {
                self.trained.push(TrainedRecord {
                    step,
                    rollout_step: g.step,
                    group: g.group.0,
                    sample: s.sample,
                    version: s.version.0,
                });
            }
        }
    }
}

/// A 64-bit mix of several values (SplitMix64 finaliser over a running hash).
pub(super) fn mix(parts: &[u64]) -> u64 {
    let mut h = 0x9E37_79B9_7F4A_7C15u64;
    for &p in parts {
        h ^= p
            .wrapping_add(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(h << 6)
            .wrapping_add(h >> 2);
        h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        h ^= h >> 31;
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A multiplexed pass is busy time: an engine that finishes its requests and then computes
    /// a pass stays busy until the pass ends (`rollout_idle_s` does not count it as idle).
    #[test]
    fn a_multiplexed_pass_is_busy_time() {
        let (tx, _rx) = std::sync::mpsc::channel();
        let mut h = EngineHandle::new(None, tx);
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        assert_eq!(h.change(at(0), |h| h.running = 2), None);
        assert_eq!(h.change(at(1), |h| h.running = 0), Some((at(0), at(1))));
        assert_eq!(h.change(at(2), |h| h.mux_busy = true), None);
        // A request admitted during the pass does not split the interval.
        assert_eq!(h.change(at(3), |h| h.running = 1), None);
        assert_eq!(h.change(at(4), |h| h.mux_busy = false), None);
        assert_eq!(h.change(at(6), |h| h.running = 0), Some((at(2), at(6))));
        assert_eq!(h.busy_from, None);
    }
}
