//! The rollout-engine role of every backend, written once over the [`Engine`]: a backend
//! implements [`EngineHost`] (its store, its decoder, its weights) and gets
//! [`RolloutEngine`] from the blanket implementation here.

use super::{Decoder, Engine, KvStore};
use crate::error::{BackendError, Result};
use crate::model::check::refuse_while_generating;
use crate::seam::{
    BackendInfo, DType, EngineLimits, EngineLoad, GenOutput, GenRequest, GroupRequest, RequestKey,
    ResumeState, RolloutEngine, SyncPath, WeightSnapshot,
};

/// A backend running the one [`Engine`]: what is its own about generation.
pub trait EngineHost: BackendInfo {
    /// Its KV store.
    type Store: KvStore;
    /// A step its decoder submitted.
    type Run: Send;
    /// Its decoder, over its device and weights.
    type Dec<'a>: Decoder<Run = Self::Run>
    where
        Self: 'a;

    /// The engine.
    fn engine(&self) -> &Engine<Self::Store, Self::Run>;
    /// The engine, mutably.
    fn engine_mut(&mut self) -> &mut Engine<Self::Store, Self::Run>;
    /// The engine and the decoder.
    fn engine_and_decoder(&mut self) -> (&mut Engine<Self::Store, Self::Run>, Self::Dec<'_>);
    /// The storage type of the weights ([`RolloutEngine::weight_dtype`]).
    fn stored_dtype(&self) -> DType;
    /// Replaces the weights with a snapshot ([`RolloutEngine::load_weights`]), once the
    /// engine has checked that no request holds a cache of the old ones.
    fn load_snapshot(&mut self, snapshot: &WeightSnapshot) -> Result<SyncPath>;
    /// Whether look-ahead decoding is possible here.
    fn can_look_ahead(&self) -> bool {
        false
    }
    /// Refuses generation with a model this backend's decoding cannot run (checked at
    /// admission).
    fn can_generate(&self) -> Result<()> {
        Ok(())
    }
}

impl<B: EngineHost> RolloutEngine for B {
    fn weight_dtype(&self) -> DType {
        self.stored_dtype()
    }

    fn load_weights(&mut self, snapshot: &WeightSnapshot) -> Result<SyncPath> {
        if self.engine().in_flight() {
            return Err(BackendError::StepInFlight("load_weights"));
        }
        refuse_while_generating(self.engine().active())?;
        // A look-ahead step queued behind the last one holds only rows of finished requests;
        // the new weights are written after it has run.
        self.engine_mut().drop_ahead();
        self.load_snapshot(snapshot)
    }

    fn limits(&self) -> EngineLimits {
        self.engine().limits()
    }

    fn set_limits(&mut self, limits: EngineLimits) -> Result<()> {
        self.engine_mut().set_limits(limits)
    }

    fn load(&self) -> EngineLoad {
        self.engine().load()
    }

    fn add_request(&mut self, req: GenRequest) -> Result<()> {
        self.can_generate()?;
        self.engine_mut().add_request(req)
    }

    fn add_group(&mut self, group: GroupRequest) -> Result<()> {
        self.can_generate()?;
        self.engine_mut().add_group(group)
    }

    fn cancel_request(&mut self, id: RequestKey) -> Result<()> {
        self.engine_mut().cancel(id)
    }

    fn export_request(&mut self, id: RequestKey) -> Result<ResumeState> {
        self.engine_mut().export(id)
    }

    fn resume_request(&mut self, state: ResumeState) -> Result<()> {
        self.can_generate()?;
        self.engine_mut().resume(state)
    }

    fn submit_step(&mut self) -> Result<()> {
        let (engine, mut dec) = self.engine_and_decoder();
        engine.submit(&mut dec)
    }

    fn poll_step(&mut self, wait: bool) -> Result<Option<Vec<GenOutput>>> {
        let (engine, mut dec) = self.engine_and_decoder();
        engine.poll(&mut dec, wait)
    }

    fn set_lookahead(&mut self, on: bool) -> Result<()> {
        if on && !self.can_look_ahead() {
            return Err(BackendError::Unsupported {
                what: "look-ahead decoding",
                backend: self.name(),
            });
        }
        self.engine_mut().set_lookahead(on);
        Ok(())
    }

    fn admission_lag(&self) -> u64 {
        self.engine().admission_lag()
    }
}
