//! Long-tail migration in real runs (`rollout.migrate`), the simulator's `cgp-migrate` policy
//! on real engines: when no request waits to be admitted, what is left on the engines is the
//! rollout's tail. An engine running fewer than `migrate_receiver_max` requests (and no
//! multiplexed pass) receives, one move at a time, the request that has generated the most
//! tokens (at least `migrate_min_generated`) on the engine with the largest batch, when that
//! batch is more than twice its own: in a small batch it decodes faster than in the crowded one.
//!
//! A move goes through the core's migration event: the source engine exports the request
//! (`RolloutEngine::export_request`: prompt, generated tokens, stream position), the core is
//! told it was preempted (`on_request_preempted`: same id, same attempt, front of the queue),
//! and its re-admission, which goes to the least loaded engine, resumes it there
//! (`resume_request`): one re-prefill of prompt + generated tokens, then the same seeded
//! stream. Its tokens and log-probs are those it would have generated where it was, so the
//! run stays on-policy and its samples are bit-identical to a run without migration.
use std::collections::HashMap;

use rolloutpipe_backends::ResumeState;
use rolloutpipe_core::{RequestId, RequestState, Scheduler};

use super::ctx::PID_ENGINES;
use super::phase::Phase;
use crate::driver::Report;
use crate::train::msg::{EngineCmd, Moved, Reprefilled};

/// A phase's migrations: the exported states waiting for their re-admission, and the counts.
#[derive(Debug, Default)]
pub(crate) struct Migration {
    /// Exported, preempted in the core, not yet re-admitted.
    pub(super) waiting: HashMap<RequestId, ResumeState>,
    /// Requests moved.
    pub(super) moves: u32,
    /// Their prompt + generated tokens (what the targets re-prefilled).
    pub(super) tokens: u64,
    /// Seconds of the target iterations that ran the re-prefills.
    pub(super) reprefill_s: f64,
    /// The last ask found nothing long enough: no new ask until a request ends.
    pub(super) declined: bool,
}

impl Phase<'_, '_> {
    /// An export is asked for or a state waits for its re-admission (multiplexing leaves the
    /// idle engines to it meanwhile).
    pub(super) fn migration_pending(&self) -> bool {
        !self.mig.waiting.is_empty() || self.ctx.engines.iter().any(|e| e.migrating)
    }

    /// Asks for one move when an engine is light and another crowded (see the module docs).
    /// The caller knows that no request is waiting to be admitted.
    pub(super) fn migrate(&mut self) -> anyhow::Result<()> {
        let ro = &self.ctx.cfg.rollout;
        if !ro.migrate || !self.rollout_this || self.mig.declined || self.migration_pending() {
            return Ok(());
        }
        let engines = &self.ctx.engines;
        let Some(dst) = (0..engines.len())
            .filter(|&e| {
                let h = &engines[e];
                h.live && !h.mux_busy && h.running < ro.migrate_receiver_max
            })
            .min_by_key(|&e| (engines[e].running, e))
        else {
            return Ok(());
        };
        let floor = 2 * (engines[dst].running + 1);
        let Some(src) = (0..engines.len())
            .filter(|&e| e != dst && engines[e].live && engines[e].running > floor)
            .max_by_key(|&e| (engines[e].running, std::cmp::Reverse(e)))
        else {
            return Ok(());
        };
        let cmd = EngineCmd::Migrate {
            min_generated: ro.migrate_min_generated,
        };
        if self.ctx.engines[src].tx.send(cmd).is_err() {
            return Err(self.ctx.worker_stopped(&format!("rollout engine {src}")));
        }
        self.ctx.engines[src].migrating = true;
        Ok(())
    }

    /// Engine `engine` answered a [`EngineCmd::Migrate`]: an exported request leaves it and
    /// is preempted in the core (a request the core is aborting takes that as the abort's
    /// acknowledgement, and is never re-admitted).
    pub(super) fn on_migrated(
        &mut self,
        engine: u16,
        moved: Option<Box<Moved>>,
        reports: &mut Vec<Report>,
    ) {
        let e = engine as usize;
        if let Some(h) = self.ctx.engines.get_mut(e) {
            h.migrating = false;
        }
        let Some(m) = moved else {
            // Nothing on it is long enough yet: asked again after the next request ends.
            self.mig.declined = true;
            return;
        };
        let Moved { rid, state: st } = *m;
        if self.ro.inflight.remove(&rid).is_some() {
            self.released(e);
        }
        let tokens = st.reprefill_tokens();
        let t = self.ctx.us(std::time::Instant::now());
        self.ctx.trace.instant(
            &format!(
                "migrate {}/s{} from e{engine} ({tokens} tokens)",
                rid.group, rid.sample
            ),
            "migration",
            PID_ENGINES,
            engine as u32,
            t,
        );
        self.mig.waiting.insert(rid, st);
        reports.push(Report::Preempted { id: rid });
    }

    /// Forgets the states of requests the core will not re-admit (their group ended while they
    /// waited, or the preemption acknowledged an abort).
    pub(super) fn prune_migrations(&mut self, sched: &Scheduler<'_>) {
        self.mig.waiting.retain(|rid, _| {
            sched.request_state(rid.group, rid.sample) == Some((RequestState::Pending, rid.attempt))
        });
    }

    /// The admitted request's exported state, when it is a migrated one.
    pub(super) fn take_resume(&mut self, rid: RequestId) -> Option<ResumeState> {
        let st = self.mig.waiting.remove(&rid)?;
        self.mig.moves += 1;
        self.mig.tokens += st.reprefill_tokens() as u64;
        Some(st)
    }

    /// A resumed request's re-prefill ran on `engine` in an iteration ending at `t1` (µs on
    /// the trace clock).
    pub(super) fn on_resumed(&mut self, engine: u16, done: Reprefilled, t1: f64) {
        let Reprefilled { rid, tokens, secs } = done;
        self.mig.reprefill_s += secs;
        self.ctx.trace.complete(
            &format!("re-prefill {}/s{}", rid.group, rid.sample),
            "migration",
            PID_ENGINES,
            engine as u32,
            t1 - secs * 1e6,
            secs * 1e6,
            serde_json::json!({"generated": tokens, "attempt": rid.attempt}),
        );
    }
}
