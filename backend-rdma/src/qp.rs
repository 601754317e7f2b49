//! The lifecycle of one RC queue pair: brought up through INIT, RTR and RTS; every posted
//! operation completes exactly once; the core's fence is "move to the error state and drain".

use std::collections::BTreeMap;

use kvferry_core::{TransferId, TransferOutcome};

use crate::handshake::RdmaHello;
use crate::wc::{classify, WcStatus};

/// The verbs QP states kvferry uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    /// Created, not usable.
    Reset,
    /// Initialised (port, access flags), not connected.
    Init,
    /// Ready to receive: connected to the peer's QP number, LID/GID and PSN.
    Rtr,
    /// Ready to send: operations may be posted.
    Rts,
    /// Error: nothing new is accepted; outstanding work requests complete flushed.
    Error,
}

/// A transition or a post the current state does not allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpError {
    /// `from` cannot move to `to`.
    Transition {
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
    },
    /// Operations are posted only in RTS.
    NotReady(QpState),
    /// The peer's handshake cannot connect a QP (QP number 0).
    BadPeer,
}

impl std::fmt::Display for QpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QpError::Transition { from, to } => {
                write!(f, "queue pair cannot go from {from:?} to {to:?}")
            }
            QpError::NotReady(s) => write!(f, "queue pair is {s:?}, not ready to send"),
            QpError::BadPeer => write!(f, "the peer announced no usable queue pair"),
        }
    }
}

impl std::error::Error for QpError {}

/// One queue pair's state and its outstanding signalled work requests (one per operation).
#[derive(Debug)]
pub struct QpLifecycle {
    state: QpState,
    next_wr: u64,
    outstanding: BTreeMap<u64, TransferId>,
}

impl Default for QpLifecycle {
    fn default() -> Self {
        QpLifecycle {
            state: QpState::Reset,
            next_wr: 1,
            outstanding: BTreeMap::new(),
        }
    }
}

impl QpLifecycle {
    /// A new queue pair (RESET).
    pub fn new() -> Self {
        Self::default()
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.state
    }

    /// Operations posted and not completed.
    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }

    fn step(&mut self, from: QpState, to: QpState) -> Result<(), QpError> {
        if self.state != from {
            return Err(QpError::Transition {
                from: self.state,
                to,
            });
        }
        self.state = to;
        Ok(())
    }

    /// RESET -> INIT.
    pub fn to_init(&mut self) -> Result<(), QpError> {
        self.step(QpState::Reset, QpState::Init)
    }

    /// INIT -> RTR, connected to the peer of `remote`.
    pub fn to_rtr(&mut self, remote: &RdmaHello) -> Result<(), QpError> {
        if remote.qpn == 0 {
            return Err(QpError::BadPeer);
        }
        self.step(QpState::Init, QpState::Rtr)
    }

    /// RTR -> RTS.
    pub fn to_rts(&mut self) -> Result<(), QpError> {
        self.step(QpState::Rtr, QpState::Rts)
    }

    /// Records a signalled work request for `op` and returns its `wr_id`.
    pub fn post(&mut self, op: TransferId) -> Result<u64, QpError> {
        if self.state != QpState::Rts {
            return Err(QpError::NotReady(self.state));
        }
        let wr = self.next_wr;
        self.next_wr += 1;
        self.outstanding.insert(wr, op);
        Ok(wr)
    }

    /// A work completion for `wr_id`: the operation it finishes and the core's outcome, once.
    /// An error completion moves the QP to the error state (as the hardware does: later work
    /// requests complete flushed). An unknown or repeated `wr_id` yields nothing.
    pub fn complete(
        &mut self,
        wr_id: u64,
        status: Option<WcStatus>,
    ) -> Option<(TransferId, TransferOutcome)> {
        let op = self.outstanding.remove(&wr_id)?;
        if status != Some(WcStatus::Success) {
            self.state = QpState::Error;
        }
        Some((op, classify(status)))
    }

    /// A post the device refused (`ibv_post_send` failed: nothing of it was queued, the QP
    /// is unchanged): forget its work request; returns the operation.
    pub fn cancel(&mut self, wr_id: u64) -> Option<TransferId> {
        self.outstanding.remove(&wr_id)
    }

    /// The core asked for a fence: the QP goes to the error state (`ibv_modify_qp` to ERR);
    /// every outstanding work request will complete flushed.
    pub fn fence(&mut self) {
        self.state = QpState::Error;
    }

    /// Whether the fence is complete: in the error state with nothing outstanding, so no
    /// write of this QP can land any more.
    pub fn is_drained(&self) -> bool {
        self.state == QpState::Error && self.outstanding.is_empty()
    }

    /// ERROR -> RESET for reuse, once drained.
    pub fn reset(&mut self) -> Result<(), QpError> {
        if !self.is_drained() {
            return Err(QpError::Transition {
                from: self.state,
                to: QpState::Reset,
            });
        }
        self.state = QpState::Reset;
        Ok(())
    }
}
