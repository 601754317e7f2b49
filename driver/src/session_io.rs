//! One session's connections as the driver holds them, and the operations parked for them.

use crate::{DataConn, Host, OpSink};
use std::net::SocketAddr;

use crate::{round_robin, DataPath};
use kvferry_core::{TargetId, TransferOp};
use kvferry_sync::ConnSet;

/// A session's connections as the driver sees them.
pub struct SessionIo<H: Host> {
    /// The control writer's queue; dropped when the session closes, so the writer ends.
    pub(crate) control: Option<crate::ControlQueue>,
    pub(crate) tasks: Option<crate::ControlTasks<H::Task>>,
    /// Set when this side dialed: it opens the data connections.
    pub(crate) peer_addr: Option<SocketAddr>,
    /// The target this session was dialed for.
    pub(crate) target: Option<TargetId>,
    /// Data connections; closing once the session is being closed (loom-modelled).
    pub(crate) data: ConnSet<DataConn<H>>,
    pub(crate) next_sender: usize,
    /// Operations waiting for a data connection (the core's operation timeout bounds them).
    pub(crate) parked: Vec<TransferOp>,
    /// The path its operations take, once chosen.
    pub(crate) path: Option<DataPath>,
    /// Ends the control writer's linger while the session closes (the core decides when).
    pub(crate) linger: Option<tokio::sync::oneshot::Sender<()>>,
    /// The session's same-host state, once a side offered or declined it.
    pub(crate) cma: Option<crate::cma::SessionCma>,
    /// The session's RDMA queue pair, when its data moves over RDMA.
    #[cfg(feature = "rdma")]
    pub(crate) rdma: Option<crate::rdma::SessionRdma>,
}

impl<H: Host> SessionIo<H> {
    /// Holds `op` until the session's data path can take it.
    pub fn park(&mut self, op: TransferOp) {
        self.parked.push(op);
    }

    /// The operations held so far, to post now.
    pub fn take_parked(&mut self) -> Vec<TransferOp> {
        std::mem::take(&mut self.parked)
    }

    /// Whether the session moves data over an RDMA queue pair (and so opens no TCP data
    /// connection).
    pub(crate) fn has_queue_pair(&self) -> bool {
        #[cfg(feature = "rdma")]
        return self.rdma.is_some();
        #[cfg(not(feature = "rdma"))]
        false
    }

    /// Sends the operations held so far on the open data connections, keeping what none
    /// takes.
    pub(crate) fn send_parked(&mut self) {
        for op in self.take_parked() {
            if let Err(op) = send_round_robin(self, op) {
                self.parked.push(op);
            }
        }
    }
}

/// Sends `op` on the session's data connections in turn.
pub(crate) fn send_round_robin<H: Host>(
    io: &mut SessionIo<H>,
    op: TransferOp,
) -> Result<(), TransferOp> {
    let senders: Vec<&H::Sender> = io
        .data
        .iter()
        .filter_map(|c| match c {
            DataConn::Sender(s) => Some(s),
            DataConn::Receiver(_) => None,
        })
        .collect();
    round_robin(&senders, &mut io.next_sender, op, |s, op| s.send(op))
}
