//! The completion hand-off of one data connection: the writer, the acknowledgement reader
//! and whoever closes the connection all report operations, and each operation must be
//! reported to the core exactly once.

use std::collections::VecDeque;

use kvferry_core::{TransferId, TransferOutcome};

use crate::loom::{lock, Mutex};

/// Which operations of a data connection are queued, on the wire, or already reported: the
/// single-owner form (a thread-per-core driver keeps it in a `RefCell`; [`OpLedger`] puts it
/// behind a lock for drivers whose tasks move between threads).
///
/// Every operation given to [`LedgerState::enqueue`] comes out exactly once: from
/// [`LedgerState::start`] as [`Start::Closed`], from [`LedgerState::acked`], or from
/// [`LedgerState::close`]; whoever gets it reports it.
#[derive(Debug, Default)]
pub struct LedgerState {
    /// Handed to the writer, not yet on the wire.
    queued: VecDeque<TransferId>,
    /// On the wire, waiting for the acknowledgement (in order).
    pending: VecDeque<TransferId>,
    closed: bool,
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

impl Start {
    /// The outcome to report for an operation the writer got back as [`Start::Closed`]:
    /// fatal when it could not be prepared (`failed`), else transient (never written).
    pub fn unsent(failed: bool) -> TransferOutcome {
        if failed {
            TransferOutcome::Fatal
        } else {
            TransferOutcome::Transient
        }
    }
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

impl LedgerState {
    /// Records an operation handed to the writer; `false` (not recorded) once closed.
    pub fn enqueue(&mut self, id: TransferId) -> bool {
        if self.closed {
            return false;
        }
        self.queued.push_back(id);
        true
    }

    /// Takes back an operation that could not be handed to the writer after all.
    pub fn unqueue(&mut self, id: TransferId) {
        self.queued.retain(|q| *q != id);
    }

    /// The writer is about to put `id` on the wire. With `failed`, the writer could not
    /// prepare it: it is handed out like a closed one (the caller reports it as fatal).
    pub fn start(&mut self, id: TransferId, failed: bool) -> Start {
        let Some(pos) = self.queued.iter().position(|q| *q == id) else {
            return Start::Gone;
        };
        self.queued.remove(pos);
        if self.closed || failed {
            return Start::Closed;
        }
        self.pending.push_back(id);
        Start::Write
    }

    /// An acknowledgement for `id` arrived.
    pub fn acked(&mut self, id: TransferId) -> Acked {
        match self.pending.front() {
            Some(first) if *first == id => {
                self.pending.pop_front();
                Acked::InOrder
            }
            _ => Acked::OutOfOrder(self.pending.pop_front()),
        }
    }

    /// Marks the connection closed and hands out every operation not yet reported.
    pub fn close(&mut self) -> Vec<TransferId> {
        self.closed = true;
        let mut all: Vec<TransferId> = self.pending.drain(..).collect();
        all.extend(self.queued.drain(..));
        all
    }

    /// Whether [`LedgerState::close`] ran.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Operations on the wire, waiting for their acknowledgement.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }
}

/// [`LedgerState`] behind a lock, shared by a connection's writer task, its acknowledgement
/// reader task and whoever closes it (loom-modelled).
#[derive(Debug, Default)]
pub struct OpLedger {
    state: Mutex<LedgerState>,
}

impl OpLedger {
    /// A ledger for a new connection.
    pub fn new() -> Self {
        Self::default()
    }

    /// See [`LedgerState::enqueue`].
    pub fn enqueue(&self, id: TransferId) -> bool {
        lock(&self.state).enqueue(id)
    }

    /// See [`LedgerState::unqueue`].
    pub fn unqueue(&self, id: TransferId) {
        lock(&self.state).unqueue(id);
    }

    /// See [`LedgerState::start`].
    pub fn start(&self, id: TransferId, failed: bool) -> Start {
        lock(&self.state).start(id, failed)
    }

    /// See [`LedgerState::acked`].
    pub fn acked(&self, id: TransferId) -> Acked {
        lock(&self.state).acked(id)
    }

    /// See [`LedgerState::close`].
    pub fn close(&self) -> Vec<TransferId> {
        lock(&self.state).close()
    }

    /// See [`LedgerState::is_closed`].
    pub fn is_closed(&self) -> bool {
        lock(&self.state).is_closed()
    }

    /// See [`LedgerState::in_flight`].
    pub fn in_flight(&self) -> usize {
        lock(&self.state).in_flight()
    }
}
