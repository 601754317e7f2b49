//! The completion hand-off of one data connection: the writer, the acknowledgement reader
//! and whoever closes the connection all report operations, and each operation must be
//! reported to the core exactly once.

use std::collections::VecDeque;

use kvferry_core::TransferId;

use crate::loom::{lock, Mutex};

#[derive(Debug, Default)]
struct State {
    /// Handed to the writer, not yet on the wire.
    queued: VecDeque<TransferId>,
    /// On the wire, waiting for the acknowledgement (in order).
    pending: VecDeque<TransferId>,
    closed: bool,
}

/// Which operations of a data connection are queued, on the wire, or already reported.
///
/// Every operation given to [`OpLedger::enqueue`] comes out exactly once: from
/// [`OpLedger::start`] as [`Start::Closed`], from [`OpLedger::acked`], or from
/// [`OpLedger::close`]; whoever gets it reports it.
#[derive(Debug, Default)]
pub struct OpLedger {
    state: Mutex<State>,
}

/// What the writer does with an operation it dequeued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// Write it: it now waits for its acknowledgement.
    Write,
    /// The connection closed first: report it as transient (the writer owns it now).
    Closed,
    /// Already reported by a close: drop it.
    Gone,
}

/// What an acknowledgement matched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acked {
    /// The oldest operation on the wire: report it with the acknowledgement's outcome.
    InOrder,
    /// Not the oldest: the connection is broken. The oldest (if any) is handed out to be
    /// reported as transient; close the connection.
    OutOfOrder(Option<TransferId>),
}

impl OpLedger {
    /// A ledger for a new connection.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records an operation handed to the writer; `false` (not recorded) once closed.
    pub fn enqueue(&self, id: TransferId) -> bool {
        let mut s = lock(&self.state);
        if s.closed {
            return false;
        }
        s.queued.push_back(id);
        true
    }

    /// Takes back an operation that could not be handed to the writer after all.
    pub fn unqueue(&self, id: TransferId) {
        lock(&self.state).queued.retain(|q| *q != id);
    }

    /// The writer is about to put `id` on the wire. With `failed`, the writer could not
    /// prepare it: it is handed out like a closed one (the caller reports it as fatal).
    pub fn start(&self, id: TransferId, failed: bool) -> Start {
        let mut s = lock(&self.state);
        let Some(pos) = s.queued.iter().position(|q| *q == id) else {
            return Start::Gone;
        };
        s.queued.remove(pos);
        if s.closed || failed {
            return Start::Closed;
        }
        s.pending.push_back(id);
        Start::Write
    }

    /// An acknowledgement for `id` arrived.
    pub fn acked(&self, id: TransferId) -> Acked {
        let mut s = lock(&self.state);
        match s.pending.front() {
            Some(first) if *first == id => {
                s.pending.pop_front();
                Acked::InOrder
            }
            _ => Acked::OutOfOrder(s.pending.pop_front()),
        }
    }

    /// Marks the connection closed and hands out every operation not yet reported.
    pub fn close(&self) -> Vec<TransferId> {
        let mut s = lock(&self.state);
        s.closed = true;
        let mut all: Vec<TransferId> = s.pending.drain(..).collect();
        all.extend(s.queued.drain(..));
        all
    }

    /// Whether [`OpLedger::close`] ran.
    pub fn is_closed(&self) -> bool {
        lock(&self.state).closed
    }

    /// Operations on the wire, waiting for their acknowledgement.
    pub fn in_flight(&self) -> usize {
        lock(&self.state).pending.len()
    }
}
