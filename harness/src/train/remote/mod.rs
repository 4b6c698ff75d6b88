//! Remote workers: hosts that own a worker's state and answer wire messages (bytes in, bytes
//! out), and the [`Forwarding`] transport that drives them through any `send` function.
//!
//! A host ([`EngineHost`], [`TrainerHost`], [`VerifierHost`]; `hosts`) lives wherever the work
//! runs (a Ray actor, another thread) and calls the same worker code as the in-process
//! threads. The scheduler side puts a proxy thread behind each of the run's channels
//! (`proxies`, `engine_proxy`); a proxy batches the run's messages into `protocol` messages,
//! frames them (`wire`), hands them to the caller's `send(route, bytes) -> bytes`, and turns
//! the replies back into scheduler events, so the scheduler cannot tell the transports apart.
//!
//! Weight sync is "put once": at a step boundary the master weights are serialised once and
//! handed to `send(Route::Publish, blob)` (Ray: one `ray.put`); each engine is then sent a
//! small `Sync` on `Route::EngineSync(i)`, whose host reads the published blob (Ray: one get
//! per engine).
//!
//! A `send` that fails for an engine means the engine is gone (its process died, its node
//! left): its in-flight requests come back as preempted and the scheduler re-admits them
//! elsewhere with the same ids. A failing trainer or verifier stops the run (a trainer is
//! recovered by resuming from the last checkpoint).
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context, anyhow};
use rolloutpipe_backends::Weights;

use super::workers::transport::{Links, Start, Transport};

mod engine_proxy;
mod hosts;
pub mod protocol;
mod proxies;
pub mod wire;

pub use hosts::{EngineHost, TrainerHost, VerifierHost};

/// Where a message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// Engine i's control messages (`engine/i`).
    Engine(u16),
    /// Engine i's messages that read the published weights (`engine/i/sync`: init and sync).
    EngineSync(u16),
    /// Verifier i (`verifier/i`).
    Verifier(usize),
    /// The trainer (`trainer`).
    Trainer,
    /// The weights blob every engine of the next `EngineSync` reads (`publish`).
    Publish,
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Route::Engine(i) => write!(f, "engine/{i}"),
            Route::EngineSync(i) => write!(f, "engine/{i}/sync"),
            Route::Verifier(i) => write!(f, "verifier/{i}"),
            Route::Trainer => write!(f, "trainer"),
            Route::Publish => write!(f, "publish"),
        }
    }
}
/// The caller's transport: delivers `bytes` to the host at `route` and returns its reply.
pub type SendFn = dyn Fn(&Route, Vec<u8>) -> anyhow::Result<Vec<u8>> + Send + Sync;

/// What crossed the transport so far (both directions, every route).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WireCounts {
    /// Messages sent (publishes included).
    pub calls: u64,
    /// Bytes sent, publishes excluded.
    pub bytes_out: u64,
    /// Bytes received.
    pub bytes_in: u64,
    /// Weight blobs published.
    pub publishes: u64,
    /// Bytes published.
    pub published_bytes: u64,
}

#[derive(Default)]
struct Counts {
    calls: AtomicU64,
    bytes_out: AtomicU64,
    bytes_in: AtomicU64,
    publishes: AtomicU64,
    published_bytes: AtomicU64,
}

#[derive(Clone)]
struct Link {
    send: Arc<SendFn>,
    counts: Arc<Counts>,
}

impl Link {
    fn call(&self, route: &Route, msg: Vec<u8>) -> anyhow::Result<Vec<u8>> {
        let c = &self.counts;
        c.calls.fetch_add(1, Ordering::Relaxed);
        if *route == Route::Publish {
            c.publishes.fetch_add(1, Ordering::Relaxed);
            c.published_bytes
                .fetch_add(msg.len() as u64, Ordering::Relaxed);
        } else {
            c.bytes_out.fetch_add(msg.len() as u64, Ordering::Relaxed);
        }
        let reply = (self.send)(route, msg).with_context(|| format!("{route}"))?;
        c.bytes_in.fetch_add(reply.len() as u64, Ordering::Relaxed);
        Ok(reply)
    }
}

/// Serialises and publishes each new master weights once, however many engines sync from it.
struct Publisher {
    link: Link,
    last: Mutex<Option<Arc<Weights>>>,
}

impl Publisher {
    fn publish(&self, w: &Arc<Weights>) -> anyhow::Result<()> {
        // Held while serialising: the other engines' proxies wait and then find it published.
        let mut last = self
            .last
            .lock()
            .map_err(|_| anyhow!("publisher poisoned"))?;
        if last.as_ref().is_some_and(|l| Arc::ptr_eq(l, w)) {
            return Ok(());
        }
        let blob = wire::weights_blob(w)?;
        self.link.call(&Route::Publish, blob)?;
        *last = Some(w.clone());
        Ok(())
    }
}
/// The workers are remote hosts reached through a caller-supplied `send`; see the module
/// documentation.
pub struct Forwarding {
    link: Link,
}

impl Forwarding {
    /// A transport over `send`.
    pub fn new(
        send: impl Fn(&Route, Vec<u8>) -> anyhow::Result<Vec<u8>> + Send + Sync + 'static,
    ) -> Self {
        Forwarding {
            link: Link {
                send: Arc::new(send),
                counts: Arc::default(),
            },
        }
    }

    /// What has crossed the transport so far.
    pub fn counts(&self) -> WireCounts {
        let c = &self.link.counts;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        WireCounts {
            calls: g(&c.calls),
            bytes_out: g(&c.bytes_out),
            bytes_in: g(&c.bytes_in),
            publishes: g(&c.publishes),
            published_bytes: g(&c.published_bytes),
        }
    }
}
impl Transport for Forwarding {
    fn start(&self, s: Start<'_>) -> anyhow::Result<Links> {
        let publisher = Arc::new(Publisher {
            link: self.link.clone(),
            last: Mutex::new(None),
        });
        publisher.publish(s.weights)?;
        let mut handles = Vec::new();
        let engines = proxies::start_engines(&self.link, &publisher, &s, &mut handles)?;
        let verify = proxies::start_verifiers(&self.link, &s, &mut handles)?;
        let trainer = proxies::start_trainer(&self.link, s, &mut handles)?;
        Ok(Links {
            engines,
            verify,
            trainer,
            handles,
        })
    }
}
