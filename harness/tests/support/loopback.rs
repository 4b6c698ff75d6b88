//! Every remote host in this process behind the wire: what a Ray deployment runs, without Ray.
#![allow(dead_code)] // each test crate uses a subset

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::anyhow;
use rolloutpipe_harness::train::TrainConfig;
use rolloutpipe_harness::train::remote::{
    EngineHost, Forwarding, Route, TrainerHost, VerifierHost,
};

fn poisoned<T>(route: &Route) -> impl FnOnce(std::sync::PoisonError<T>) -> anyhow::Error + '_ {
    move |_| anyhow!("{route}: host poisoned")
}

/// Every host in this process behind the wire: what a Ray deployment runs, without Ray. Each
/// message is encoded, handed over as bytes and decoded by its host, so tests exercise the
/// real protocol. `kill_engine` makes an engine vanish as a killed actor does.
pub struct Loopback {
    engines: Vec<Mutex<Option<EngineHost>>>,
    verifiers: Vec<Mutex<VerifierHost>>,
    trainer: Mutex<TrainerHost>,
    published: Mutex<Option<Arc<Vec<u8>>>>,
    /// Per engine: kill it when its `Step` message number n arrives (0: never).
    kill_at_step: Vec<AtomicU64>,
    steps_seen: Vec<AtomicU64>,
}

impl Loopback {
    /// Hosts for the engines and verifiers of `cfg`, and the trainer.
    pub fn new(cfg: &TrainConfig) -> Arc<Self> {
        let e = cfg.rollout.engines as usize;
        Arc::new(Loopback {
            engines: (0..e)
                .map(|_| Mutex::new(Some(EngineHost::new())))
                .collect(),
            verifiers: (0..cfg.rollout.verifiers)
                .map(|_| Mutex::new(VerifierHost::new()))
                .collect(),
            trainer: Mutex::new(TrainerHost::new()),
            published: Mutex::new(None),
            kill_at_step: (0..e).map(|_| AtomicU64::new(0)).collect(),
            steps_seen: (0..e).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// A [`Forwarding`] transport whose `send` calls these hosts.
    pub fn transport(self: &Arc<Self>) -> Forwarding {
        let me = self.clone();
        Forwarding::new(move |route, msg| me.call(route, msg))
    }

    /// Engine `i` is gone from now on (its state dropped, every message to it fails).
    pub fn kill_engine(&self, i: u16) {
        if let Some(e) = self.engines.get(i as usize)
            && let Ok(mut g) = e.lock()
        {
            *g = None;
        }
    }

    /// Engine `i` dies when its `n`-th `Step` message arrives (that message fails): a kill in
    /// the middle of a rollout, at a reproducible point.
    pub fn kill_engine_at_step(&self, i: u16, n: u64) {
        if let Some(k) = self.kill_at_step.get(i as usize) {
            k.store(n, Ordering::Relaxed);
        }
    }

    /// Whether engine `i` still runs.
    pub fn engine_alive(&self, i: u16) -> bool {
        self.engines
            .get(i as usize)
            .and_then(|e| e.lock().ok().map(|g| g.is_some()))
            .unwrap_or(false)
    }

    fn call(&self, route: &Route, msg: Vec<u8>) -> anyhow::Result<Vec<u8>> {
        match *route {
            Route::Publish => {
                *self.published.lock().map_err(poisoned(route))? = Some(Arc::new(msg));
                Ok(Vec::new())
            }
            Route::Engine(i) | Route::EngineSync(i) => {
                let slot = self
                    .engines
                    .get(i as usize)
                    .ok_or_else(|| anyhow!("no engine {i}"))?;
                if let Route::Engine(_) = route {
                    let n = self.steps_seen[i as usize].fetch_add(1, Ordering::Relaxed) + 1;
                    if self.kill_at_step[i as usize].load(Ordering::Relaxed) == n {
                        self.kill_engine(i);
                    }
                }
                let published = match route {
                    Route::EngineSync(_) => self.published.lock().map_err(poisoned(route))?.clone(),
                    _ => None,
                };
                let mut g = slot.lock().map_err(poisoned(route))?;
                let host = g.as_mut().ok_or_else(|| anyhow!("engine {i} is gone"))?;
                host.handle(&msg, published.as_deref().map(Vec::as_slice))
            }
            Route::Verifier(i) => self
                .verifiers
                .get(i)
                .ok_or_else(|| anyhow!("no verifier {i}"))?
                .lock()
                .map_err(poisoned(route))?
                .handle(&msg),
            Route::Trainer => self.trainer.lock().map_err(poisoned(route))?.handle(&msg),
        }
    }
}
