//! Callers waiting on a handshake or a target, and what refused them.

use foldhash::fast::FixedState;

type Map<K, V> = std::collections::HashMap<K, V, FixedState>;
use crate::NodeError;
use kvferry_core::SessionId;
use tokio::sync::oneshot;

/// Why a peer refused a session at its handshake, kept so that every waiter learns it.
#[derive(Clone)]
pub(crate) enum Refusal {
    /// The peer's error frame: its code and explanation.
    Peer(kvferry_core::codec::ErrorCode, String),
    /// This side refused the peer.
    Rejected(kvferry_core::RejectReason),
    /// This side requires the same-host path and the session could not take it: why.
    SameHost(&'static str),
}

impl Refusal {
    pub(crate) fn error(&self) -> NodeError {
        match self {
            Refusal::Peer(code, detail) => NodeError::Refused {
                code: *code,
                detail: detail.clone(),
            },
            Refusal::Rejected(r) => NodeError::Rejected(*r),
            Refusal::SameHost(why) => {
                NodeError::Unsupported(crate::Unsupported::SameHostDeclined(why))
            }
        }
    }
}

/// Where a caller waiting for a session is told how the wait ended.
/// Where a caller waiting for a handshake or a target hears how it ended.
pub type Answer = oneshot::Sender<Result<SessionId, NodeError>>;

/// The callers waiting on one key, and the refusal seen so far.
#[derive(Default)]
pub(crate) struct Waiting {
    pub(crate) callers: Vec<Answer>,
    pub(crate) refusal: Option<Refusal>,
}

/// Callers waiting for a session (by handshake or by target), by key.
pub(crate) struct Waits<K> {
    pub(crate) waiting: Map<K, Waiting>,
}

impl<K: std::hash::Hash + Eq> Waits<K> {
    pub(crate) fn new() -> Self {
        Waits {
            waiting: Map::default(),
        }
    }

    pub(crate) fn add(&mut self, key: K, tx: Answer) {
        self.waiting.entry(key).or_default().callers.push(tx);
    }

    /// Remembers a refusal for `key`'s waiters, also those still to come (`first`: keep one
    /// already noted).
    pub(crate) fn note(&mut self, key: &K, refusal: Refusal, first: bool)
    where
        K: Clone,
    {
        let w = self.waiting.entry(key.clone()).or_default();
        if !(first && w.refusal.is_some()) {
            w.refusal = Some(refusal);
        }
    }

    /// The refusal noted for `key`, as the error its waiters get.
    pub(crate) fn noted(&self, key: &K) -> Option<NodeError> {
        self.waiting
            .get(key)
            .and_then(|w| w.refusal.as_ref())
            .map(Refusal::error)
    }

    /// Tells every waiter, whatever it waits for, that the node shut down.
    pub(crate) fn shut_down(&mut self) {
        for (_, w) in self.waiting.drain() {
            for tx in w.callers {
                let _ = tx.send(Err(NodeError::ShutDown));
            }
        }
    }

    /// Tells every waiter for `key` its session.
    pub(crate) fn succeed(&mut self, key: &K, session: SessionId) {
        for tx in self
            .waiting
            .remove(key)
            .map(|w| w.callers)
            .unwrap_or_default()
        {
            let _ = tx.send(Ok(session));
        }
    }

    /// Tells every waiter for `key` the refusal noted, else `otherwise`, and keeps the
    /// refusal for those who ask later (a target refused before anyone waited for it).
    pub(crate) fn fail_keeping(&mut self, key: &K, otherwise: impl Fn() -> NodeError) {
        let Some(w) = self.waiting.get_mut(key) else {
            return;
        };
        for tx in std::mem::take(&mut w.callers) {
            let why = w.refusal.as_ref().map_or_else(&otherwise, Refusal::error);
            let _ = tx.send(Err(why));
        }
    }

    /// Tells every waiter for `key` the refusal noted, else `otherwise`.
    pub(crate) fn fail(&mut self, key: &K, otherwise: impl Fn() -> NodeError) {
        let Some(w) = self.waiting.remove(key) else {
            return;
        };
        for tx in w.callers {
            let why = w.refusal.as_ref().map_or_else(&otherwise, Refusal::error);
            let _ = tx.send(Err(why));
        }
    }
}
