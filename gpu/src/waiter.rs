//! Layer readiness from GPU events, learnt without blocking any runtime thread: one dedicated
//! thread polls the events the embedder recorded after each layer's forward pass.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvferry_core::RoomId;

use crate::GpuError;

/// Something recorded on a GPU stream after a layer's work (a CUDA event).
pub trait LayerEvent: Send + 'static {
    /// Whether everything recorded before the event has finished (never blocks). An error is
    /// a failed kernel or copy.
    fn poll_complete(&mut self) -> Result<bool, GpuError>;
}

/// How the waiter polls: spin (re-poll at once) for `spin` after work arrives or completes,
/// then sleep `interval` between polls. Spinning costs a core and buys latency; the default
/// spins 50 us.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PollPolicy {
    /// How long to re-poll without sleeping.
    pub spin: Duration,
    /// Sleep between polls after that.
    pub interval: Duration,
}

impl Default for PollPolicy {
    fn default() -> Self {
        PollPolicy {
            spin: Duration::from_micros(50),
            interval: Duration::from_micros(50),
        }
    }
}

/// What the waiter tells the embedder about one watched layer.
#[derive(Debug, PartialEq, Eq)]
pub enum Readiness {
    /// The layer's work finished: mark it ready in the core.
    Ready {
        /// The rooms the layer belongs to.
        rooms: Vec<RoomId>,
        /// The layer.
        layer: u16,
        /// From `watch` to the completion being seen.
        waited: Duration,
    },
    /// The layer's work failed: fail the rooms.
    Failed {
        /// The rooms the layer belongs to.
        rooms: Vec<RoomId>,
        /// The layer.
        layer: u16,
        /// What failed.
        error: GpuError,
    },
}

struct Job {
    rooms: Vec<RoomId>,
    layer: u16,
    event: Box<dyn LayerEvent>,
    since: Instant,
}

/// The thread that turns completed layer events into [`Readiness`] for the embedder.
/// Dropping it stops the thread (watched layers not yet complete are dropped unreported).
pub struct LayerWaiter {
    tx: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for LayerWaiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerWaiter").finish_non_exhaustive()
    }
}

impl LayerWaiter {
    /// Starts the waiter; `deliver` runs on its thread for every watched layer, once.
    pub fn spawn(policy: PollPolicy, deliver: impl FnMut(Readiness) + Send + 'static) -> Self {
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("kvferry-gpu-waiter".into())
            .spawn(move || run(rx, policy, deliver))
            .ok();
        LayerWaiter {
            tx: Some(tx),
            thread,
        }
    }

    /// Watches `event`, recorded after layer `layer` of `rooms`.
    pub fn watch(
        &self,
        rooms: Vec<RoomId>,
        layer: u16,
        event: Box<dyn LayerEvent>,
    ) -> Result<(), GpuError> {
        let job = Job {
            rooms,
            layer,
            event,
            since: Instant::now(),
        };
        self.tx
            .as_ref()
            .ok_or(GpuError::Stopped)?
            .send(job)
            .map_err(|_| GpuError::Stopped)
    }
}

impl Drop for LayerWaiter {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(rx: Receiver<Job>, policy: PollPolicy, mut deliver: impl FnMut(Readiness)) {
    let mut pending: Vec<Job> = Vec::new();
    let mut busy_since = Instant::now();
    loop {
        // Take new work: block when idle, otherwise just drain what is queued.
        if pending.is_empty() {
            match rx.recv() {
                Ok(job) => {
                    pending.push(job);
                    busy_since = Instant::now();
                }
                Err(_) => return,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(job) => pending.push(job),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        }
        // Deliver every completed layer, in the order they were watched.
        let mut progressed = false;
        let mut i = 0;
        while i < pending.len() {
            match pending[i].event.poll_complete() {
                Ok(false) => i += 1,
                Ok(true) => {
                    let job = pending.remove(i);
                    deliver(Readiness::Ready {
                        rooms: job.rooms,
                        layer: job.layer,
                        waited: job.since.elapsed(),
                    });
                    progressed = true;
                }
                Err(error) => {
                    let job = pending.remove(i);
                    deliver(Readiness::Failed {
                        rooms: job.rooms,
                        layer: job.layer,
                        error,
                    });
                    progressed = true;
                }
            }
        }
        if progressed {
            busy_since = Instant::now();
        }
        if pending.is_empty() {
            continue;
        }
        if busy_since.elapsed() < policy.spin {
            std::hint::spin_loop();
            continue;
        }
        // Sleep, but wake for new work.
        match rx.recv_timeout(policy.interval) {
            Ok(job) => pending.push(job),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}
