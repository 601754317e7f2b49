//! What a runtime lends the driver ([`Host`]): its tasks, its connections' sending halves, and
//! the requests the driver makes of it.

use crate::runtime::ControlTasks;
use crate::Answer;
#[cfg(doc)]
use crate::Driver;
use kvferry_core::{Event, SessionId, SessionKey, TargetId, TransferOp};
use kvferry_core::{Slice, WritePermit};
use std::future::Future;
use std::net::SocketAddr;

/// Where a data connection's operations go: the sending half a host built for the driver,
/// and how it is closed.
pub trait OpSink: Sized {
    /// Queues `op` on the connection; gives it back if the connection is closed.
    fn send(&self, op: TransferOp) -> Result<(), TransferOp>;

    /// Whether the connection ended (it takes nothing more and may be dropped).
    fn is_closed(&self) -> bool {
        false
    }

    /// Closes the connection and waits until nothing of it can write any more.
    fn close(self) -> impl Future<Output = ()>;

    /// Stops the connection without waiting (it was never used).
    fn abort(self);
}

impl<T: kvferry_tcp::send::Task, R: kvferry_tcp::send::Report> OpSink
    for kvferry_tcp::send::DataSender<T, R>
{
    fn send(&self, op: TransferOp) -> Result<(), TransferOp> {
        kvferry_tcp::send::DataSender::send(self, op)
    }

    fn is_closed(&self) -> bool {
        kvferry_tcp::send::DataSender::is_closed(self)
    }

    async fn close(self) {
        kvferry_tcp::send::DataSender::close(self).await;
    }

    fn abort(self) {
        kvferry_tcp::send::DataSender::abort(self);
    }
}

/// One data connection of a session: prefill writes on it, decode serves writes from it.
pub enum DataConn<H: Host> {
    /// Prefill's sending half.
    Sender(H::Sender),
    /// Decode's receiving task.
    Receiver(H::Task),
}

/// A session's data connections and control connection tasks, for a host to close.
pub type Connections<H> = (Vec<DataConn<H>>, Option<ControlTasks<<H as Host>::Task>>);

/// What a runtime gives the driver loop: tasks that move bytes and report back. Each method
/// only starts work (it must not wait, and must not call into the [`Driver`] it serves).
pub trait Host: Sized + 'static {
    /// Prefill's sending half of a data connection.
    type Sender: OpSink;
    /// A task of the host's runtime: decode's receiver on a data connection, a control
    /// connection's reader and writer (stopped when the session closes).
    type Task;

    /// Starts `job` as a task of the host's runtime (it must not reach the driver before this
    /// returns: the driver is in use). Each job reports back through the [`Driver`] methods
    /// its variant names.
    fn start(&self, job: Job<Self>);

    /// Hands an event to the embedder's subscribers once the driver has handled it.
    fn publish(&self, _event: Event) {}

    /// Whether a task (a decode receiver) has ended (it can be dropped from its session).
    fn task_finished(_task: &Self::Task) -> bool {
        false
    }
}

/// What the driver loop asks its host to start ([`Host::start`]); a runtime spawns its
/// `run` (in [`crate::runtime`], written once for every runtime).
pub enum Job<H: Host> {
    /// Opens a control connection to `addr` for `dial` (until the core abandons the
    /// attempt: a target's wait comes with it, a caller's is [`Driver::dial_started`]), then
    /// calls [`Driver::attach_control`] (with the dial's target, or its caller as the
    /// handshake's waiter); on failure calls [`Driver::connect_failed`] or tells the caller.
    Connect {
        /// Where to dial.
        addr: SocketAddr,
        /// Who the connection is for.
        dial: Dial,
    },
    /// Opens one data connection of `session` to `addr`, proving `key`; if it opens and its
    /// sending or receiving half starts it is handed to [`Driver::attach_data`], if not
    /// [`Driver::data_connection_lost`] is told.
    OpenData {
        /// The session the connection belongs to.
        session: SessionId,
        /// The peer's listener.
        addr: SocketAddr,
        /// The key the session's handshake gave its data connections.
        key: SessionKey,
    },
    /// Stops `tasks` (a close's control tasks; none for a fence), then closes `conns` until
    /// nothing of them can write any more, then calls [`Driver::released`] with `why`. The
    /// control writer's queue is closed already: the writer ends once its last frames are
    /// written (before any data connection closes, so the peer reads why first), and is
    /// stopped when `linger` ends first (the core's `close_linger`; `None`: at once).
    Release {
        /// The session whose connections go.
        session: SessionId,
        /// Its data connections.
        conns: Vec<DataConn<H>>,
        /// Its control connection's tasks (a close's).
        tasks: Option<ControlTasks<H::Task>>,
        /// When the control writer is stopped if it has not ended.
        linger: Option<crate::CoreWait>,
        /// A fence or a close.
        why: Release,
    },
    /// Awaits an RDMA queue pair's completions for `session` and reports them
    /// ([`crate::rdma::watch`]) until `stop` ends and what the queue pair flushed is in.
    #[cfg(feature = "rdma")]
    WatchCompletions {
        /// The session the queue pair belongs to.
        session: SessionId,
        /// The queue pair.
        qp: crate::rdma::SharedQp,
        /// Ends when the queue pair is replaced or the session closes.
        stop: tokio::sync::oneshot::Receiver<()>,
    },
    /// Hashes the bytes an RDMA write landed in `ranges` of `memory`, off the driver's thread,
    /// and hands `permit` back with `end_write`: `applied()` if they hash to `checksum`,
    /// `corrupt()` if not ([`crate::landed_verdict`]).
    VerifyLanded {
        /// The write's permit.
        permit: WritePermit,
        /// Where its bytes landed.
        ranges: Vec<Slice>,
        /// What the source's bytes hashed to.
        checksum: u64,
        /// The node's memory.
        memory: std::sync::Arc<kvferry_memory::MemoryMap>,
    },
    /// Makes the NIC's writes into each device of `memory` visible to that device, off the
    /// driver's thread, and ends the flush with `end_flush`.
    #[cfg(feature = "rdma")]
    FlushLanded {
        /// The room whose sources all reported Success.
        room: kvferry_core::RoomId,
        /// Its generation.
        generation: kvferry_core::Generation,
        /// The node's memory.
        memory: std::sync::Arc<kvferry_memory::MemoryMap>,
    },
}

/// Who a control connection is dialed for ([`Job::Connect`]).
pub enum Dial {
    /// A target the core keeps connected: the core hears how the attempt ended (a timeout it
    /// counted itself, when `abandon` ended).
    Target {
        /// The target to reach.
        target: TargetId,
        /// The core's attempt ([`kvferry_core::Action::Connect`]).
        dial: kvferry_core::DialId,
        /// Ends when the core gives the attempt up.
        abandon: crate::CoreWait,
    },
    /// An embedder's call: it hears how the handshake (or the dial) ended.
    Caller(Answer),
}

/// Why a host releases a session's connections ([`Job::Release`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// A fence: the data connections go, the session stays.
    Fence,
    /// A close: every connection of the session goes.
    Close,
}
