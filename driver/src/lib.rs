//! `kvferry-driver`: the one driver loop, and what every runtime's driver shares.
//!
//! Owns the driver loop itself ([`Driver`], generic over a runtime's [`Host`]): it feeds the
//! core's inputs, drains its outputs under a budget, and asks the host to start the tasks
//! that move bytes. Those tasks are written here once ([`runtime`], over the [`Runtime`]
//! trait: dialing, accepting, control readers and writers, data connections, releases, the
//! timer task), on the streams and the timer a runtime lends. Also the embedder-facing API
//! ([`Node`], written once over a runtime's [`Shards`]), the types it speaks (room handles, node
//! errors, configuration, announcements), the bookkeeping that turns the core's room events
//! into handle updates ([`RoomBook`]), the receive path's admission through the core
//! ([`CoreCheck`]) and the metrics export. Must never spawn a task or open a socket of its
//! own (the runtime's), nor decide a retry, a timeout or anything about a room (the core's):
//! every wait it writes ends at a core deadline (a [`CoreWait`] the core's actions end, or a
//! timeout the core hands over with its action).

mod accept;
mod admission;
mod announce;
mod calls;
pub mod cma;
mod config;
mod error;
mod events;
mod fault_switch;
mod faults;
mod handle;
mod host;
mod listener;
mod machine;
mod metrics_export;
mod node;
mod plane;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod runtime;
mod session_io;
mod waits;
pub use accept::{accept, Accepted};
pub use admission::{CoreCheck, EndpointAccess};
pub use announce::{Announcement, Announcer};
pub use calls::{DriverCalls, Node, NodeParts, RoomOpen, ShardCall, ShardFuture, Shards};
pub use cma::{check_same_host, SameHost, SameHostPlane};
pub use config::{
    check_memory, check_read_spin, log_start, read_spin_from_vars, tcp_only, DataBackend, DataPath,
    NodeConfig, DEFAULT_READ_SPIN, START_TARGET, TCP_PATH,
};
pub use error::{NodeError, Unsupported};
pub use events::EventSink;
pub use fault_switch::FaultSwitch;
pub use faults::{FaultKind, FaultPlan};
pub use handle::{RoomHandle, RoomView};
pub use host::{Connections, DataConn, Dial, Host, Job, OpSink, Release};
pub use listener::CoreWait;
pub use machine::{Driver, TURN_BUDGET};
pub use metrics_export::{export_metrics, export_staging_metrics, role_label};
pub use node::{shard_of, PeerId, RoomBook};
pub use runtime::{ControlQueue, ControlTasks, DriverAccess, Runtime};
pub use session_io::SessionIo;
pub use waits::Answer;

/// How a driver reaches one address of a peer (re-exported from the core, which decides
/// how long a room waits for a target that is down).
pub use kvferry_core::Link;

/// What a failed connection attempt tells the core: refused (the host is up, nothing listens)
/// or no answer (timed out, no route). Drivers report it with `handle_connect_failed`.
pub fn connect_failure(e: &std::io::Error) -> kvferry_core::ConnectFailure {
    use std::io::ErrorKind;
    match e.kind() {
        ErrorKind::ConnectionRefused
        | ErrorKind::ConnectionReset
        | ErrorKind::ConnectionAborted => kvferry_core::ConnectFailure::Refused,
        _ => kvferry_core::ConnectFailure::NoAnswer,
    }
}

/// Hands `item` to the next of `senders` that takes it, starting after the one used last
/// (`next`), so operations spread over a session's data connections; gives it back if none
/// takes it (every connection closed: the driver parks it until one attaches).
pub fn round_robin<S: ?Sized, T>(
    senders: &[&S],
    next: &mut usize,
    item: T,
    send: impl Fn(&S, T) -> Result<(), T>,
) -> Result<(), T> {
    let n = senders.len();
    let mut item = item;
    for k in 0..n {
        let i = (*next + k) % n;
        match send(senders[i], item) {
            Ok(()) => {
                *next = i + 1;
                return Ok(());
            }
            Err(back) => item = back,
        }
    }
    Err(item)
}

/// Decode's verdict on the bytes a one-sided write landed in `ranges` (the driver's
/// `Job::VerifyLanded`, off the driver's thread): `applied()` if they hash to `checksum`, `corrupt()` if not, the
/// permit as it was if they cannot be read.
pub fn landed_verdict(
    memory: &kvferry_memory::MemoryMap,
    permit: kvferry_core::WritePermit,
    ranges: &[kvferry_core::Slice],
    checksum: u64,
) -> kvferry_core::WritePermit {
    match memory.checksum(ranges, kvferry_memory::SliceSide::Destination) {
        Ok(landed) if landed == checksum => permit.applied(),
        Ok(landed) => {
            tracing::warn!(session = %permit.session, room = ?permit.room, landed, expected = checksum, "landed bytes differ from what their source wrote");
            permit.corrupt()
        }
        Err(e) => {
            tracing::warn!(session = %permit.session, room = ?permit.room, error = %e, "cannot read the landed bytes to verify them");
            permit
        }
    }
}
