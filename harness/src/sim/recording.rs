//! What one simulated run returns: its metrics and, when asked, a recording of every span for
//! the trace and the Gantt plot.
use super::engine::Ns;
use super::metrics::RunResult;

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
    /// Multiplexed log-prob work on rollout engines: (step, engine, group, start, end).
    pub mux: Vec<(u64, u16, u32, Ns, Ns)>,
    /// Migrations: (step, group, sample, from, to, time, tokens moved).
    pub migrations: Vec<(u64, u32, u16, u16, u16, Ns, u32)>,
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
