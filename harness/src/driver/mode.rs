//! The scheduling vocabulary every command shares: a [`Mode`] (which core policies a step
//! runs with) and a [`Schedule`] (a mode plus the bound-moving tail policies). `simulate`,
//! `train` and `compare` name, parse and plan modes only through these types.
use std::fmt;

use anyhow::bail;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A scheduling mode: which admission and dispatch policies the core runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Slime's baseline: FIFO admission, the batch goes to the trainer once final.
    Sync,
    /// Complete-group pipelining: FIFO admission, each trainable group trains as it completes.
    Cgp,
    /// CGP plus frontier-group dispatch (FGD) admission.
    Rolloutpipe,
    /// Rollout of step k+1 (weights `v_(k-1)`) overlaps training of step k: one version stale.
    OneStepOff,
}

impl Mode {
    /// Every mode, in table order.
    pub const ALL: [Mode; 4] = [Mode::Sync, Mode::Cgp, Mode::Rolloutpipe, Mode::OneStepOff];

    /// The name used on the command line, in configs and in tables.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Sync => "sync",
            Mode::Cgp => "cgp",
            Mode::Rolloutpipe => "rolloutpipe",
            Mode::OneStepOff => "one-step-off",
        }
    }

    /// Parses a command-line name.
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        match Mode::ALL.into_iter().find(|m| m.name() == s) {
            Some(m) => Ok(m),
            None => bail!("unknown mode {s:?}; valid: sync, cgp, rolloutpipe, one-step-off"),
        }
    }

    /// Whether complete groups go to the trainer at once (CGP dispatch). One-step-off trains
    /// the whole batch during the next rollout, so it waits for it.
    pub fn pipelined(self) -> bool {
        matches!(self, Mode::Cgp | Mode::Rolloutpipe)
    }

    /// Whether admission follows the frontier (FGD) rather than FIFO.
    pub fn frontier(self) -> bool {
        self == Mode::Rolloutpipe
    }

    /// Whether each rollout runs on the weights before the previous step's training (one
    /// version stale) instead of the newest.
    pub fn stale(self) -> bool {
        self == Mode::OneStepOff
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A mode plus the tail policies that move its bound: tail multiplexing (idle rollout engines
/// compute the trainer's forward-only log-prob work) and long-tail migration (a crowded
/// engine's longest request moves to an idle one). `train` sets them with `run.mode`,
/// `rollout.multiplex` and `rollout.migrate`; `simulate` names the combinations it runs
/// (`cgp-mux`, `cgp-migrate`, `cgp-mux-migrate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Schedule {
    /// The core's policies.
    pub mode: Mode,
    /// Tail multiplexing.
    pub multiplex: bool,
    /// Long-tail migration.
    pub migrate: bool,
}

impl Schedule {
    /// CGP with tail multiplexing.
    pub const CGP_MUX: Schedule = Schedule::tail(Mode::Cgp, true, false);
    /// CGP with long-tail migration.
    pub const CGP_MIGRATE: Schedule = Schedule::tail(Mode::Cgp, false, true);
    /// CGP with both.
    pub const CGP_MUX_MIGRATE: Schedule = Schedule::tail(Mode::Cgp, true, true);

    /// The schedules `simulate` has names for, in table order.
    pub const NAMED: [Schedule; 7] = [
        Schedule::of(Mode::Sync),
        Schedule::of(Mode::Cgp),
        Schedule::of(Mode::Rolloutpipe),
        Schedule::of(Mode::OneStepOff),
        Schedule::CGP_MUX,
        Schedule::CGP_MIGRATE,
        Schedule::CGP_MUX_MIGRATE,
    ];

    /// `mode` without tail policies.
    pub const fn of(mode: Mode) -> Self {
        Self::tail(mode, false, false)
    }

    /// `mode` with the tail policies given.
    pub const fn tail(mode: Mode, multiplex: bool, migrate: bool) -> Self {
        Schedule {
            mode,
            multiplex,
            migrate,
        }
    }

    /// The name used in configs, tables and plots: the mode's, then `-mux`, then `-migrate`.
    pub fn name(self) -> &'static str {
        match (self.mode, self.multiplex, self.migrate) {
            (m, false, false) => m.name(),
            (Mode::Cgp, true, false) => "cgp-mux",
            (Mode::Cgp, false, true) => "cgp-migrate",
            (Mode::Cgp, true, true) => "cgp-mux-migrate",
            (Mode::Sync, true, false) => "sync-mux",
            (Mode::Sync, false, true) => "sync-migrate",
            (Mode::Sync, true, true) => "sync-mux-migrate",
            (Mode::Rolloutpipe, true, false) => "rolloutpipe-mux",
            (Mode::Rolloutpipe, false, true) => "rolloutpipe-migrate",
            (Mode::Rolloutpipe, true, true) => "rolloutpipe-mux-migrate",
            (Mode::OneStepOff, true, false) => "one-step-off-mux",
            (Mode::OneStepOff, false, true) => "one-step-off-migrate",
            (Mode::OneStepOff, true, true) => "one-step-off-mux-migrate",
        }
    }

    /// Parses one of the [`NAMED`](Self::NAMED) schedules.
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        match Self::NAMED.into_iter().find(|m| m.name() == s) {
            Some(m) => Ok(m),
            None => bail!("unknown mode {s:?}; valid: {}", NAMES.join(", ")),
        }
    }
}

impl From<Mode> for Schedule {
    fn from(mode: Mode) -> Self {
        Schedule::of(mode)
    }
}

impl PartialEq<Mode> for Schedule {
    fn eq(&self, mode: &Mode) -> bool {
        *self == Schedule::of(*mode)
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for Schedule {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Schedule {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::NAMED
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| serde::de::Error::unknown_variant(&s, &NAMES))
    }
}

/// The names of [`Schedule::NAMED`], in its order (serde's error lists them).
const NAMES: [&str; 7] = [
    "sync",
    "cgp",
    "rolloutpipe",
    "one-step-off",
    "cgp-mux",
    "cgp-migrate",
    "cgp-mux-migrate",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_serialise_as_names() {
        for m in Mode::ALL {
            assert_eq!(Mode::parse(m.name()).unwrap(), m);
        }
        assert_eq!(Schedule::NAMED.map(Schedule::name), NAMES);
        for s in Schedule::NAMED {
            assert_eq!(Schedule::parse(s.name()).unwrap(), s);
            let json = serde_json::to_string(&s).unwrap();
            assert_eq!(json, format!("\"{}\"", s.name()));
            assert_eq!(serde_json::from_str::<Schedule>(&json).unwrap(), s);
        }
        assert_eq!(Schedule::of(Mode::Cgp), Mode::Cgp);
        assert_ne!(Schedule::tail(Mode::Cgp, true, false), Mode::Cgp);
        let e = Mode::parse("async").unwrap_err().to_string();
        assert_eq!(
            e,
            "unknown mode \"async\"; valid: sync, cgp, rolloutpipe, one-step-off"
        );
        assert!(serde_json::from_str::<Schedule>("\"cgp-fast\"").is_err());
        assert!(!Mode::OneStepOff.pipelined() && Mode::Rolloutpipe.frontier());
    }
}
