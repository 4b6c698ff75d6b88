//! A submitted call that has not been collected yet: non-blocking submission.
//!
//! [`Exec::submit_async`](super::Exec::submit_async) encodes and submits, then hands back an
//! [`InFlight`] that owns the call's staging buffer and has already asked for it to be
//! mapped. [`InFlight::poll`] checks the device once (or waits) and returns the bytes once the
//! work is done, so the host is free between the two: the generation engine's `submit_step`
//! returns here and its `poll_step` collects.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, TryRecvError, channel};

use super::gpu::{Gpu, Readback, dev_err};
use crate::error::Result;

/// What signals the end of the submitted work: the staging buffer's mapping when the call
/// reads bytes back, else the queue's work-done callback.
#[derive(Debug)]
enum Done {
    Mapped(Receiver<std::result::Result<(), wgpu::BufferAsyncError>>),
    Worked(Receiver<()>),
    Collected,
}

/// The callback's message: blocking when `wait`, else `None` while it has not come.
fn receive<T>(rx: &Receiver<T>, wait: bool) -> Result<Option<T>> {
    if wait {
        return rx
            .recv()
            .map(Some)
            .map_err(|_| dev_err("a submission's callback was dropped"));
    }
    match rx.try_recv() {
        Ok(v) => Ok(Some(v)),
        Err(TryRecvError::Empty) => Ok(None),
        Err(TryRecvError::Disconnected) => Err(dev_err("a submission's callback was dropped")),
    }
}

/// A submission in flight (see the module docs).
#[derive(Debug)]
pub struct InFlight {
    gpu: Arc<Gpu>,
    /// The submission, so that waiting for it does not wait for later ones (a decode step
    /// queued behind it, a trainer call).
    index: wgpu::SubmissionIndex,
    staging: Option<wgpu::Buffer>,
    read_bytes: usize,
    done: Done,
}

impl InFlight {
    /// Tracks submission `index` just made on `gpu`, reading `read_bytes` of `staging` back.
    pub(super) fn start(
        gpu: Arc<Gpu>,
        index: wgpu::SubmissionIndex,
        staging: Option<wgpu::Buffer>,
        read_bytes: usize,
    ) -> Self {
        let done = match &staging {
            Some(buf) if read_bytes > 0 => {
                let (tx, rx) = channel();
                buf.slice(..read_bytes as u64)
                    .map_async(wgpu::MapMode::Read, move |r| {
                        let _ = tx.send(r);
                    });
                Done::Mapped(rx)
            }
            _ => {
                let (tx, rx) = channel();
                gpu.queue().on_submitted_work_done(move || {
                    let _ = tx.send(());
                });
                Done::Worked(rx)
            }
        };
        Self {
            gpu,
            index,
            staging,
            read_bytes,
            done,
        }
    }

    /// The bytes read back once the work has run: `None` while it is still running and
    /// `wait` is false. Collecting twice is an error.
    pub fn poll(&mut self, wait: bool) -> Result<Option<Readback>> {
        let kind = if wait {
            wgpu::PollType::Wait {
                submission_index: Some(self.index.clone()),
                timeout: None,
            }
        } else {
            wgpu::PollType::Poll
        };
        self.gpu
            .device()
            .poll(kind)
            .map_err(|e| dev_err(format!("poll: {e}")))?;
        // Another thread's poll may be running the callbacks: waiting blocks on the channel.
        let out = match &self.done {
            Done::Collected => return Err(dev_err("a submission was collected twice")),
            Done::Worked(rx) => match receive(rx, wait)? {
                Some(()) => Readback::default(),
                None => return Ok(None),
            },
            Done::Mapped(rx) => {
                match receive(rx, wait)? {
                    Some(r) => r.map_err(|e| dev_err(format!("map: {e}")))?,
                    None => return Ok(None),
                }
                let staging = self
                    .staging
                    .as_ref()
                    .ok_or_else(|| dev_err("readback staging missing"))?;
                let slice = staging.slice(..self.read_bytes as u64);
                let bytes = {
                    let view = slice
                        .get_mapped_range()
                        .map_err(|e| dev_err(format!("mapped range: {e}")))?;
                    view.to_vec()
                };
                staging.unmap();
                Readback::from_bytes(bytes)
            }
        };
        self.done = Done::Collected;
        self.gpu.check()?;
        Ok(Some(out))
    }

    /// The staging buffer, once collected (for reuse by the recorder).
    pub(super) fn take_staging(&mut self) -> Option<wgpu::Buffer> {
        match self.done {
            Done::Collected => self.staging.take(),
            _ => None,
        }
    }
}
