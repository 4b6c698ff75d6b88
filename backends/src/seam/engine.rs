//! The rollout-engine interface: continuous-batching generation with capacity limits, group
//! prefix sharing and submit/poll decoding.

use super::BackendInfo;
use super::sync::{SyncPath, SyncTarget, WeightSnapshot};
use super::tensor::DType;
use super::types::{GenOutput, GenRequest, GroupRequest, RequestKey, ResumeState};
use crate::error::{BackendError, Result};

/// How much an engine accepts at once. A request or group that would exceed either limit is
/// handed back ([`BackendError::EngineFull`]) instead of being queued without bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineLimits {
    /// Most requests active at once.
    pub max_requests: usize,
    /// Most KV-cache positions reserved at once, over all requests (a request reserves its
    /// prompt plus `max_new_tokens`; a group reserves its shared prompt once).
    pub max_kv_tokens: usize,
}

impl Default for EngineLimits {
    /// No limit: the engine takes whatever fits in memory (the caller schedules).
    fn default() -> Self {
        Self {
            max_requests: usize::MAX,
            max_kv_tokens: usize::MAX,
        }
    }
}

impl EngineLimits {
    /// Limits an engine can work under: at least one request and one KV position. Every
    /// backend's `set_limits` checks through here, so the rule is stated once.
    pub fn validate(self) -> Result<Self> {
        if self.max_requests == 0 || self.max_kv_tokens == 0 {
            return Err(BackendError::invalid(
                "engine limits",
                "max_requests and max_kv_tokens must be at least 1",
            ));
        }
        Ok(self)
    }
}

/// What an engine holds now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineLoad {
    /// Active requests (queued for the next step included).
    pub requests: usize,
    /// KV positions reserved.
    pub kv_tokens: usize,
}

impl EngineLoad {
    /// Whether `requests` more requests reserving `kv_tokens` positions fit within `limits`.
    pub fn admits(&self, limits: &EngineLimits, requests: usize, kv_tokens: usize) -> bool {
        self.requests.saturating_add(requests) <= limits.max_requests
            && self.kv_tokens.saturating_add(kv_tokens) <= limits.max_kv_tokens
    }

    /// Refuses with the submission (made by `rejected`, only on refusal) handed back when
    /// `requests` more requests reserving `kv_tokens` positions do not fit.
    pub fn admit(
        &self,
        limits: &EngineLimits,
        requests: usize,
        kv_tokens: usize,
        rejected: impl FnOnce() -> Rejected,
    ) -> Result<()> {
        if self.admits(limits, requests, kv_tokens) {
            return Ok(());
        }
        Err(BackendError::EngineFull {
            reason: format!(
                "{requests} request(s) needing {kv_tokens} KV positions do not fit: {} of {} requests and {} of {} KV positions in use",
                self.requests,
                fmt_limit(limits.max_requests),
                self.kv_tokens,
                fmt_limit(limits.max_kv_tokens)
            ),
            rejected: Box::new(rejected()),
        })
    }
}

fn fmt_limit(n: usize) -> String {
    if n == usize::MAX {
        "unlimited".into()
    } else {
        n.to_string()
    }
}

/// A submission an engine handed back because it was full; resubmit it later.
#[derive(Debug, Clone, PartialEq)]
pub enum Rejected {
    /// A single request.
    Request(GenRequest),
    /// A group.
    Group(GroupRequest),
    /// An exported request being resumed ([`RolloutEngine::resume_request`]), progress included.
    Resume(Box<ResumeState>),
}

/// A rollout engine: generates continuations of prompts under one weights version.
///
/// Decoding is split into [`submit_step`](RolloutEngine::submit_step), which starts one engine
/// step (prefill of newly added requests and one token for every active request), and
/// [`poll_step`](RolloutEngine::poll_step), which collects its finished requests. Between the
/// two the host may add and cancel requests for the next step; they take effect at the next
/// submission. A backend that cannot overlap runs the step inside `submit_step`. One that
/// decodes ahead (wgpu with `set_lookahead`, opt-in) also queues the following step at each
/// submission; a request added after a submission then joins one step later, and its outputs
/// are the same, since they depend only on the request and the weights.
pub trait RolloutEngine: BackendInfo {
    /// The storage type of the engine's weights (what a snapshot for it is converted to).
    fn weight_dtype(&self) -> DType;

    /// Where and how a weight snapshot for this engine should be made.
    fn sync_target(&self) -> SyncTarget {
        SyncTarget {
            device: self.device(),
            dtype: self.weight_dtype(),
        }
    }

    /// Replaces the weights with a snapshot (validated against the config); a device snapshot
    /// of this engine's device is copied on the device. Refused while requests are active or a
    /// step is in flight, since their KV caches belong to the old weights.
    fn load_weights(&mut self, snapshot: &WeightSnapshot) -> Result<SyncPath>;

    /// The engine's admission limits.
    fn limits(&self) -> EngineLimits;
    /// Sets the admission limits (requests already admitted stay).
    fn set_limits(&mut self, limits: EngineLimits) -> Result<()>;
    /// What the engine holds now.
    fn load(&self) -> EngineLoad;

    /// Queues a request for the next step. A full engine answers
    /// [`BackendError::EngineFull`] carrying the request; an invalid one, its own error.
    fn add_request(&mut self, req: GenRequest) -> Result<()>;
    /// Queues a group: its prompt is prefilled once and its KV prefix shared by the samples.
    /// All or nothing: a full engine hands the whole group back.
    fn add_group(&mut self, group: GroupRequest) -> Result<()>;
    /// Aborts a request (queued or active) and frees its KV cache.
    fn cancel_request(&mut self, id: RequestKey) -> Result<()>;
    /// Requests added and not yet finished or cancelled.
    fn active_requests(&self) -> usize {
        self.load().requests
    }

    /// Long-tail migration: removes running request `id`, freeing its KV cache, and hands back
    /// its state for [`resume_request`](RolloutEngine::resume_request) on another engine.
    /// Refused while a step is in flight and for a request that has not generated a token yet
    /// (re-add it instead). Backends without it (CUDA) answer
    /// [`BackendError::Unsupported`].
    fn export_request(&mut self, id: RequestKey) -> Result<ResumeState> {
        let _ = id;
        Err(BackendError::Unsupported {
            what: "export_request",
            backend: self.name(),
        })
    }
    /// Queues an exported request for the next step: that step prefills its prompt and
    /// generated tokens and samples its next token from the same stream position. Admission is
    /// as [`add_request`](RolloutEngine::add_request)'s (a full engine hands the state back as
    /// [`Rejected::Resume`]).
    fn resume_request(&mut self, state: ResumeState) -> Result<()> {
        let _ = state;
        Err(BackendError::Unsupported {
            what: "resume_request",
            backend: self.name(),
        })
    }

    /// Starts one engine step. Refused while the previous step has not been polled.
    fn submit_step(&mut self) -> Result<()>;
    /// The requests that finished in the submitted step, once it has run: `None` while it is
    /// still running and `wait` is false. With no step in flight, `Some(vec![])`.
    fn poll_step(&mut self, wait: bool) -> Result<Option<Vec<GenOutput>>>;

    /// Look-ahead decoding (off by default): each submission also queues the step after it,
    /// so that the device never waits for the host between steps; a request added after a
    /// submission then joins one step later, with the same outputs. Backends that run one
    /// step at a time answer [`BackendError::Unsupported`] to turning it on.
    fn set_lookahead(&mut self, on: bool) -> Result<()> {
        if on {
            return Err(BackendError::Unsupported {
                what: "look-ahead decoding",
                backend: self.name(),
            });
        }
        Ok(())
    }

    /// Steps by which a request added after a submission starts later than one added before
    /// it: 1 while look-ahead queues the next step at each submission, else 0. A caller that
    /// counts a request's decode steps from its admission adds this.
    fn admission_lag(&self) -> u64 {
        0
    }

    /// One whole engine step: submit, then wait for it.
    fn decode_step(&mut self) -> Result<Vec<GenOutput>> {
        self.submit_step()?;
        match self.poll_step(true)? {
            Some(out) => Ok(out),
            None => Err(BackendError::Device(
                "a waited-for decode step did not complete".into(),
            )),
        }
    }
}
