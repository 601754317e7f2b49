//! A room as the embedder holds it: its state, and the handle that awaits it.

use kvferry_core::{FailureReason, KvPoll, RoomId};
use tokio::sync::watch;

/// A room's state as seen through a [`RoomHandle`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoomView {
    /// Current state.
    pub state: KvPoll,
    /// Whether the pages may be reused.
    pub releasable: bool,
    /// Prefill: the highest layer that, with every owned layer before it, decode holds
    /// (see [`kvferry_core::Event::LayerDelivered`]).
    pub delivered_through: Option<u16>,
}

/// Awaits one room's progress. Cancel-safe: dropping a wait loses nothing.
#[derive(Debug, Clone)]
pub struct RoomHandle {
    room: RoomId,
    rx: watch::Receiver<RoomView>,
}

impl RoomHandle {
    /// A handle that follows `rx` (drivers create them through [`crate::RoomBook::watch`]).
    pub fn new(room: RoomId, rx: watch::Receiver<RoomView>) -> Self {
        RoomHandle { room, rx }
    }

    /// The room.
    pub fn room(&self) -> RoomId {
        self.room
    }

    /// The latest view.
    pub fn view(&self) -> RoomView {
        *self.rx.borrow()
    }

    /// Waits for `Success` or `Failed`.
    pub async fn terminal(&mut self) -> KvPoll {
        match self.rx.wait_for(|v| v.state.is_terminal()).await {
            Ok(v) => v.state,
            Err(_) => KvPoll::Failed(FailureReason::Shutdown),
        }
    }

    /// Prefill: waits until `layer` (and every owned layer before it) sits in decode's
    /// memory; `Err` with the room's state if it failed first.
    pub async fn layer_delivered(&mut self, layer: u16) -> Result<(), KvPoll> {
        let reached = |v: &RoomView| v.delivered_through.is_some_and(|d| d >= layer);
        match self
            .rx
            .wait_for(|v| reached(v) || matches!(v.state, KvPoll::Failed(_)))
            .await
        {
            Ok(v) if reached(&v) => Ok(()),
            Ok(v) => Err(v.state),
            Err(_) => Err(KvPoll::Failed(FailureReason::Shutdown)),
        }
    }

    /// Waits until the room's pages may be reused; returns its terminal state.
    pub async fn releasable(&mut self) -> KvPoll {
        match self.rx.wait_for(|v| v.releasable).await {
            Ok(v) => v.state,
            Err(_) => KvPoll::Failed(FailureReason::Shutdown),
        }
    }
}
