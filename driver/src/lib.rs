//! `kvferry-driver`: the one driver loop, and what every runtime's driver shares.
//!
//! Owns the driver loop itself ([`Driver`], generic over a runtime's [`Host`]): it feeds the
//! core's inputs, drains its outputs under a budget, and asks the host to start the tasks
//! that move bytes. Those tasks are written here once ([`runtime`], over the [`Runtime`]
//! trait: dialing, accepting, control readers and writers, data connections, releases, the
//! timer task), on the streams and the timer a runtime lends. Also the embedder-facing API
//! ([`KvNode`], derived for every [`RuntimeNode`]), the types it speaks (room handles, node
//! errors, configuration, announcements), the bookkeeping that turns the core's room events
//! into handle updates ([`RoomBook`]), the receive path's admission through the core
//! ([`CoreCheck`]) and the metrics export. Must never spawn a task or open a socket of its
//! own (the runtime's), nor decide a retry, a timeout or anything about a room (the core's):
//! every wait it writes is bounded by a core deadline or a [`kvferry_core::Config`] value.

mod accept;
mod calls;
mod machine;
pub mod runtime;
pub use accept::{accept, within, Accepted};
pub use calls::{Embedder, ShardCalls};
pub use machine::{
    Answer, Connections, DataConn, Dial, Driver, FaultSwitch, FrameSink, Host, OpSink, Release,
    SessionIo, TURN_BUDGET,
};
pub use runtime::{ControlQueue, ControlTasks, DriverAccess, Runtime};

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use foldhash::fast::FixedState;
/// How a driver reaches one address of a peer (re-exported from the core, which decides
/// how long a room waits for a target that is down).
pub use kvferry_core::Link;
use kvferry_core::{
    ApiError, Chunk, Config, Counters, Endpoint, EndpointInfo, Event, FailureReason, Generation,
    Grant, KvPoll, Role, RoomId, SessionId, Slice, TransferId, WritePermit, WriteRefused,
};
use kvferry_memory::{MemoryMap, WriteCheck};
use tokio::sync::{mpsc, watch};

type Map<K, V> = std::collections::HashMap<K, V, FixedState>;

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

/// Everything needed to start a node (any driver).
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// The core's knobs.
    pub core: Config,
    /// Who this endpoint is.
    pub info: EndpointInfo,
    /// Data connections opened per session (operations are spread over them).
    pub data_connections: usize,
    /// Seed of the core's random choices.
    pub seed: u64,
    /// Injected data-path faults (demos and tests only; `None` in production).
    pub faults: Option<FaultPlan>,
    /// Which data plane carries the operations.
    pub backend: DataBackend,
    /// TLS on every control and data connection (`None`: plain TCP). The cluster-token
    /// proofs of the handshake run inside it either way.
    pub tls: Option<kvferry_tcp::TlsFiles>,
}

/// Which data plane carries a node's operations (the control channel is TCP either way).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DataBackend {
    /// Data connections over TCP (every driver).
    #[default]
    Tcp,
    /// One-sided RDMA WRITEs on an RC queue pair per session (the tokio driver built with
    /// its `rdma` feature).
    Rdma {
        /// The device to open (`None`: the first one).
        device: Option<String>,
        /// Its port (usually 1).
        port: u8,
    },
}

/// The path one session's operations take, as logged when it is chosen and published as
/// `kvferry_session_path{path}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DataPath {
    /// TCP data connections from and into host memory.
    Tcp,
    /// TCP data connections, this node's device memory staged through host buffers.
    TcpStaged,
    /// One-sided RDMA WRITEs from and into host memory.
    Rdma,
    /// One-sided RDMA WRITEs with this node's device memory registered directly (dma-buf).
    RdmaDmaBuf,
}

impl DataPath {
    /// The label in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            DataPath::Tcp => "tcp",
            DataPath::TcpStaged => "tcp_staged",
            DataPath::Rdma => "rdma",
            DataPath::RdmaDmaBuf => "rdma_dmabuf",
        }
    }

    /// Whether the path is TCP.
    pub fn is_tcp(self) -> bool {
        matches!(self, DataPath::Tcp | DataPath::TcpStaged)
    }
}

/// The `Transport` payload by which a node says it moves a session's data over TCP (no RDMA
/// for this session: a TCP node, or device memory its NIC cannot register); a peer that
/// offered RDMA moves that session over TCP too. `docs/PROTOCOL.md`, "Data path".
pub const TCP_PATH: [u8; 1] = [0];

/// Reproducible data-path fault injection: each write is hit with probability `rate`,
/// decided by a hash of (seed, room, operation id); `kind` says what a hit does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FaultPlan {
    /// Probability that a write is hit.
    pub rate: f64,
    /// Seed of the decisions.
    pub seed: u64,
    /// What a hit does.
    pub kind: FaultKind,
}

/// What an injected data-path fault does to the write it hits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum FaultKind {
    /// The write breaks: over TCP the receiver resets the data connection before applying the
    /// batch; over RDMA the prefill posts it with a key the peer never registered, so the
    /// peer's device refuses it and the queue pair fails.
    #[default]
    Break,
    /// One bit of the write's first byte is flipped on its way (RDMA: the prefill flips it in
    /// the source after hashing and before posting), so the bytes that land are not the ones
    /// the source held: what the checksum option must catch.
    FlipBit,
}

impl FaultPlan {
    /// Whether the batch `op` of `room` is hit.
    pub fn hits(&self, room: RoomId, op: TransferId) -> bool {
        let mut z = self.seed ^ room.0.rotate_left(21) ^ op.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 11) as f64 / (1u64 << 53) as f64) < self.rate
    }
}

/// A room's state as seen through a [`RoomHandle`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoomView {
    /// Current state.
    pub state: KvPoll,
    /// Whether the pages may be reused.
    pub releasable: bool,
    /// Prefill: the highest layer that, with every owned layer before it, decode holds
    /// (see [`Event::LayerDelivered`]).
    pub delivered_through: Option<u16>,
}

/// Awaits one room's progress. Cancel-safe: dropping a wait loses nothing.
#[derive(Debug, Clone)]
pub struct RoomHandle {
    room: RoomId,
    rx: watch::Receiver<RoomView>,
}

impl RoomHandle {
    /// A handle that follows `rx` (drivers create them through [`RoomBook::watch`]).
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

/// Errors of the node's IO-facing calls, typed so that a caller can match on what went
/// wrong; new variants may come (`#[non_exhaustive]`).
#[derive(Debug)]
#[non_exhaustive]
pub enum NodeError {
    /// A socket operation failed.
    Io(std::io::Error),
    /// The endpoint refused the call.
    Api(ApiError),
    /// The session did not complete its handshake in time.
    HandshakeTimeout,
    /// The peer refused the session with an `Error` frame: its code and explanation.
    Refused {
        /// The peer's error code.
        code: kvferry_core::codec::ErrorCode,
        /// The peer's explanation (a layout field and both values, ...).
        detail: String,
    },
    /// A kept peer refused this node at its handshake; the reason the core filed (the
    /// peer's own words, when it sent them, come as [`NodeError::Refused`]).
    RefusedAs(FailureReason),
    /// This node refused the peer at the handshake.
    Rejected(kvferry_core::RejectReason),
    /// The node was shut down.
    ShutDown,
    /// No peer has this id on this node.
    UnknownPeer(PeerId),
    /// A persistent peer has no established session right now (it is being reconnected).
    PeerUnavailable(PeerId),
    /// A persistent peer had no session for the core's whole `unreachable_timeout`; the
    /// reason says what the connection attempts found.
    Unreachable(FailureReason),
    /// The locked-memory limit (`RLIMIT_MEMLOCK`, after raising the soft limit to the hard
    /// one) is below what the shards' io_uring rings need.
    MemoryLockLimit {
        /// The limit, in bytes.
        limit: u64,
        /// What the shards need, in bytes.
        needed: u64,
        /// Shards asked for.
        shards: usize,
    },
    /// A shard's thread could not start, or did not report ready in time.
    ShardStart {
        /// The shard.
        shard: usize,
        /// Why (`None`: it did not report ready in time).
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The configuration asks for something this build or runtime does not do.
    Unsupported(Unsupported),
    /// The data-plane backend (RDMA) could not open its device.
    Backend(Box<dyn std::error::Error + Send + Sync>),
    /// TLS was asked for and its material could not be set up.
    Tls(kvferry_tcp::TlsError),
    /// A registered region is memory this node's data plane cannot reach (device memory
    /// with no copy engine).
    UnreachableMemory {
        /// The region.
        region: kvferry_core::Region,
        /// What memory it is.
        kind: kvferry_memory::MemoryKind,
        /// What would serve it.
        fix: &'static str,
    },
}

/// A combination a node refuses to start with, and what to do instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unsupported {
    /// RDMA on the glommio driver: RDMA runs on the tokio driver.
    RdmaOnGlommio,
    /// TLS on the glommio driver: TLS runs on the tokio driver.
    TlsOnGlommio,
    /// RDMA in a build without the `rdma` feature.
    RdmaNotBuilt,
    /// The end-to-end checksum over the RDMA backend with device memory: one-sided writes
    /// are verified by hashing the landed bytes on the CPU, which cannot read device memory.
    ChecksumOverRdmaDevice,
}

impl std::fmt::Display for Unsupported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Unsupported::RdmaOnGlommio => "the glommio driver carries data over TCP only; RDMA runs on the tokio driver (--runtime tokio)",
            Unsupported::TlsOnGlommio => "the glommio driver has no TLS yet; TLS runs on the tokio driver (--runtime tokio)",
            Unsupported::RdmaNotBuilt => "this build has no RDMA support: rebuild with the `rdma` feature, or use --backend tcp",
            Unsupported::ChecksumOverRdmaDevice => "the end-to-end checksum (KVFERRY_CHECKSUM) over the RDMA backend hashes host memory only, and this node's KV is in device memory; turn it off or use the TCP backend (which hashes device memory in its staging buffers)",
        })
    }
}

/// Refuses, before anything starts, memory the data plane cannot reach: a device region
/// without a copy engine. Never a crash, never a CPU read of a device address. Over RDMA,
/// device memory the NIC cannot register moves staged over TCP (the RDMA adapter decides).
pub fn check_memory(
    memory: &MemoryMap,
    backend: &DataBackend,
    checksum: bool,
) -> Result<(), NodeError> {
    if checksum
        && matches!(backend, DataBackend::Rdma { .. })
        && memory.device_regions().next().is_some()
    {
        return Err(NodeError::Unsupported(Unsupported::ChecksumOverRdmaDevice));
    }
    if let Some((region, kind)) = memory.unreachable_region() {
        return Err(NodeError::UnreachableMemory {
            region,
            kind,
            fix: "register it with a copy engine (MemoryMap::with_staging; the CUDA engine of kvferry-gpu), or register host memory",
        });
    }
    if let (Some(staging), Some((region, kind))) =
        (memory.staging(), memory.device_regions().next())
    {
        let config = staging.config();
        tracing::info!(
            ?region,
            %kind,
            engine = staging.engine().name(),
            buffers = config.buffers,
            buffer_bytes = config.buffer_bytes,
            rdma = matches!(backend, DataBackend::Rdma { .. }),
            "device memory staged through host buffers where it moves over TCP"
        );
    }
    Ok(())
}

impl std::fmt::Display for NodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NodeError::Io(e) => write!(f, "network error: {e}"),
            NodeError::Api(e) => write!(f, "{e}"),
            NodeError::HandshakeTimeout => write!(
                f,
                "the peer did not complete the handshake in time (check address, token and layout)"
            ),
            NodeError::Refused { code, detail } => {
                write!(f, "the peer refused the session: {code:?}: {detail}")
            }
            NodeError::RefusedAs(reason) => write!(f, "the peer refused the session: {reason}"),
            NodeError::Rejected(kvferry_core::RejectReason::BadToken) => {
                write!(
                    f,
                    "the peer presented another cluster token (check --token / KVFERRY_TOKEN)"
                )
            }
            NodeError::Rejected(kvferry_core::RejectReason::WrongRole) => {
                write!(
                    f,
                    "the peer has the same role as this node (connect decode to prefill)"
                )
            }
            NodeError::Rejected(kvferry_core::RejectReason::IncompatibleLayout(m)) => {
                write!(f, "the peer's memory layout differs: {m} (use the same model shape on both sides)")
            }
            NodeError::Rejected(kvferry_core::RejectReason::VersionMismatch) => {
                write!(f, "the peer speaks another protocol version")
            }
            NodeError::ShutDown => write!(f, "the node is shut down"),
            NodeError::UnknownPeer(p) => {
                write!(f, "no peer {} on this node (connect to it first)", p.0)
            }
            NodeError::PeerUnavailable(p) => {
                write!(f, "peer {} is not connected right now (reconnecting)", p.0)
            }
            NodeError::Unreachable(reason) => write!(
                f,
                "the peer stayed unreachable for the whole unreachable timeout ({reason})"
            ),
            NodeError::MemoryLockLimit {
                limit,
                needed,
                shards,
            } => write!(
                f,
                "the runtime could not start: RLIMIT_MEMLOCK is {limit} bytes after raising the \
                 soft limit to the hard one; glommio needs at least {needed} bytes for {shards} \
                 shard(s): run `ulimit -l unlimited` (or raise memlock in \
                 /etc/security/limits.conf) or use fewer shards"
            ),
            NodeError::ShardStart {
                shard,
                source: Some(e),
            } => write!(f, "the runtime could not start: shard {shard}: {e}"),
            NodeError::ShardStart {
                shard,
                source: None,
            } => write!(
                f,
                "the runtime could not start: shard {shard} did not start"
            ),
            NodeError::Unsupported(what) => write!(f, "{what}"),
            NodeError::Backend(e) => write!(f, "the data plane could not start: {e}"),
            NodeError::Tls(e) => write!(f, "TLS: {e}"),
            NodeError::UnreachableMemory { region, kind, fix } => {
                write!(
                    f,
                    "{region:?} is {kind}, which this node cannot reach: {fix}"
                )
            }
        }
    }
}

impl std::error::Error for NodeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            NodeError::Io(e) => Some(e),
            NodeError::Api(e) => Some(e),
            NodeError::Tls(e) => Some(e),
            NodeError::Backend(e) => Some(e.as_ref()),
            NodeError::ShardStart {
                source: Some(e), ..
            } => Some(e.as_ref()),
            _ => None,
        }
    }
}

impl From<std::io::Error> for NodeError {
    fn from(e: std::io::Error) -> Self {
        NodeError::Io(e)
    }
}

impl From<ApiError> for NodeError {
    fn from(e: ApiError) -> Self {
        NodeError::Api(e)
    }
}

/// Prefill: a decode asked for a room this node has not opened (lossless, unlike events).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Announcement {
    /// The room.
    pub room: RoomId,
    /// Its generation.
    pub generation: Generation,
    /// Pages the decode granted (0 while it waits for pages).
    pub pages: u32,
}

/// Where a prefill's room announcements go: the one receiver the embedder holds (the latest
/// [`Announcer::subscribe`] wins). Lossless, unlike an event broadcast: an announcement that
/// no receiver takes (none subscribed yet, or the last one was dropped) waits in a backlog
/// that the next subscriber receives first, so a decode that asks for a room before the
/// embedder subscribes is not left waiting for a sender that never opens. Cheap to clone;
/// every shard of a node holds the same one.
#[derive(Clone, Debug, Default)]
pub struct Announcer(Arc<std::sync::Mutex<Announcements>>);

/// The receiver's sender and the announcements no receiver took yet.
#[derive(Debug, Default)]
struct Announcements {
    tx: Option<mpsc::UnboundedSender<Announcement>>,
    backlog: std::collections::VecDeque<Announcement>,
}

impl Announcer {
    /// Announcements kept for a subscriber to come; beyond it the oldest are dropped (their
    /// rooms fail `bootstrap_timeout` on both sides, as any room nobody opens).
    pub const BACKLOG: usize = 65536;

    /// A new receiver: first every announcement no receiver took, then every later one
    /// (replaces the previous receiver).
    pub fn subscribe(&self) -> mpsc::UnboundedReceiver<Announcement> {
        let (tx, rx) = mpsc::unbounded_channel();
        if let Ok(mut a) = self.0.lock() {
            for announcement in std::mem::take(&mut a.backlog) {
                let _ = tx.send(announcement);
            }
            a.tx = Some(tx);
        }
        rx
    }

    /// Forwards a [`Event::RoomAnnounced`] to the receiver, or keeps it for the next one;
    /// other events are ignored.
    pub fn on_event(&self, event: &Event) {
        let Event::RoomAnnounced {
            room,
            generation,
            pages,
            ..
        } = *event
        else {
            return;
        };
        let announcement = Announcement {
            room,
            generation,
            pages,
        };
        let Ok(mut a) = self.0.lock() else {
            return;
        };
        let unsent = match a.tx.as_ref() {
            Some(tx) => tx.send(announcement).err().map(|e| e.0),
            None => Some(announcement),
        };
        if let Some(announcement) = unsent {
            a.tx = None;
            if a.backlog.len() == Self::BACKLOG {
                a.backlog.pop_front();
                tracing::warn!(%room, "no receiver takes room announcements: dropped the oldest");
            }
            a.backlog.push_back(announcement);
        }
    }
}

/// A peer as the embedder names it: the list of its addresses (one per shard of the peer;
/// one for a tokio node). Room `r` moves over the session to address `r mod len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u32);

/// The shard (or peer address) that owns room `room` among `n`: `room mod n`. Both sides of
/// a transfer apply it, so a room meets its peer on the same shard whatever the runtimes.
pub fn shard_of(room: RoomId, n: usize) -> usize {
    (room.0 % n.max(1) as u64) as usize
}

/// The embedder's API, the same on every driver (tokio, glommio): open rooms, send chunks,
/// mark layers ready, abort, and await a room's terminal state and release through a
/// cancel-safe [`RoomHandle`]. Every future is `Send`, so any executor can await it.
pub trait KvNode: Clone + Send + Sync + 'static {
    /// Which runtime runs this node (`"tokio"`, `"glommio"`).
    fn runtime(&self) -> &'static str;

    /// Which data plane carries its operations (`"tcp"`, `"rdma"`).
    fn backend(&self) -> &'static str {
        "tcp"
    }

    /// The registered memory the node moves bytes from and into.
    fn memory(&self) -> &Arc<MemoryMap>;

    /// How many shards own rooms (1 on tokio).
    fn shards(&self) -> usize;

    /// Accepts peers on `addr` (port 0: any); returns one address per shard.
    fn listen(
        &self,
        addr: SocketAddr,
    ) -> impl Future<Output = Result<Vec<SocketAddr>, NodeError>> + Send;

    /// Opens sessions to a peer that listens on `addrs` (one per shard of the peer) and waits
    /// for their handshakes.
    fn connect(
        &self,
        addrs: Vec<SocketAddr>,
    ) -> impl Future<Output = Result<PeerId, NodeError>> + Send;

    /// Names a peer whose sessions the core keeps connected by itself (reconnecting with
    /// backoff after a loss or a restart); rooms toward it fail with
    /// [`NodeError::PeerUnavailable`] while it is away.
    fn connect_persistent(
        &self,
        addrs: Vec<SocketAddr>,
    ) -> impl Future<Output = Result<PeerId, NodeError>> + Send;

    /// Decode: opens a room fed by `peers` (see [`kvferry_core::Endpoint::open_receiver`]).
    fn open_receiver(
        &self,
        room: RoomId,
        generation: Generation,
        peers: Vec<PeerId>,
        grant: Option<Grant>,
    ) -> impl Future<Output = Result<RoomHandle, NodeError>> + Send;

    /// Decode: grants pages to a room opened without them.
    fn grant_pages(
        &self,
        room: RoomId,
        grant: Grant,
    ) -> impl Future<Output = Result<(), NodeError>> + Send;

    /// Prefill: opens a sender room.
    fn open_sender(
        &self,
        room: RoomId,
        generation: Generation,
    ) -> impl Future<Output = Result<RoomHandle, NodeError>> + Send;

    /// Prefill: hands a chunk of pages to send.
    fn send_chunk(
        &self,
        room: RoomId,
        chunk: Chunk,
    ) -> impl Future<Output = Result<(), NodeError>> + Send;

    /// Prefill: layer `layer` of `rooms` is computed.
    fn mark_layer_ready(
        &self,
        rooms: Vec<RoomId>,
        layer: u16,
    ) -> impl Future<Output = Result<(), NodeError>> + Send;

    /// Decode: the embedder's free capacity, advertised to prefills (backpressure).
    fn set_capacity(&self, capacity: kvferry_core::Capacity) -> impl Future<Output = ()> + Send;

    /// Decode: a room waiting for pages is at `position` in the embedder's queue.
    fn set_queue_position(
        &self,
        room: RoomId,
        position: u32,
    ) -> impl Future<Output = Result<(), NodeError>> + Send;

    /// Injects reproducible data-path faults (demos and tests only; `None` clears them).
    fn set_faults(&self, faults: Option<FaultPlan>) -> impl Future<Output = ()> + Send;

    /// Aborts a room (its pages stay quarantined until no write can land).
    fn abort(&self, room: RoomId) -> impl Future<Output = Result<(), NodeError>> + Send;

    /// The core's counters, summed over shards.
    fn counters(&self) -> impl Future<Output = Counters> + Send;

    /// The path each live session moves its operations on, per shard (`kvferry_session_path`).
    fn data_paths(&self) -> impl Future<Output = Vec<(usize, SessionId, DataPath)>> + Send;

    /// Prefill: every room a decode asks for, lossless: those no receiver took yet (asked
    /// for before this call) come first. One receiver at a time; this one replaces the last.
    fn room_announcements(&self) -> mpsc::UnboundedReceiver<Announcement>;

    /// Waits until every address of a persistent peer ([`KvNode::connect_persistent`]) has
    /// had a session: the first contact. Fails at once if one of them refused us at the
    /// handshake, or once one stayed unreachable for the core's `unreachable_timeout`.
    fn reach(&self, peer: PeerId) -> impl Future<Output = Result<(), NodeError>> + Send;

    /// Why a persistent peer is unreachable now (down for the whole `unreachable_timeout`: a
    /// room opened toward it fails at once), or `None`; never waits.
    fn unreachable(
        &self,
        peer: PeerId,
    ) -> impl Future<Output = Result<Option<FailureReason>, NodeError>> + Send;

    /// Fails every room, tells every peer, closes every connection and stops.
    fn shutdown(&self) -> impl Future<Output = ()> + Send;
}

/// What a runtime's node says of itself: its embedder (every room call goes through it), its
/// memory, how it listens and how it shuts down. Every such node is a [`KvNode`].
pub trait RuntimeNode: Clone + Send + Sync + 'static {
    /// How a call reaches one of the node's shards.
    type Calls: ShardCalls;

    /// The room calls and the peer table over the node's shards.
    fn embedder(&self) -> &Embedder<Self::Calls>;

    /// Which runtime runs this node (`"tokio"`, `"glommio"`).
    fn runtime(&self) -> &'static str;

    /// Which data plane carries its operations (`"tcp"`, `"rdma"`).
    fn backend(&self) -> &'static str {
        "tcp"
    }

    /// The registered memory the node moves bytes from and into.
    fn memory(&self) -> &Arc<MemoryMap>;

    /// Accepts peers on `addr` (port 0: any); returns one address per shard.
    fn listen(
        &self,
        addr: SocketAddr,
    ) -> impl Future<Output = Result<Vec<SocketAddr>, NodeError>> + Send;

    /// Prefill: every room a decode asks for before this node opened it.
    fn room_announcements(&self) -> mpsc::UnboundedReceiver<Announcement>;

    /// Fails every room, tells every peer, closes every connection and listener.
    fn shutdown(&self) -> impl Future<Output = ()> + Send;
}

impl<N: RuntimeNode> KvNode for N {
    fn runtime(&self) -> &'static str {
        RuntimeNode::runtime(self)
    }

    fn backend(&self) -> &'static str {
        RuntimeNode::backend(self)
    }

    fn memory(&self) -> &Arc<MemoryMap> {
        RuntimeNode::memory(self)
    }

    fn shards(&self) -> usize {
        self.embedder().calls().shards()
    }

    async fn listen(&self, addr: SocketAddr) -> Result<Vec<SocketAddr>, NodeError> {
        RuntimeNode::listen(self, addr).await
    }

    async fn connect(&self, addrs: Vec<SocketAddr>) -> Result<PeerId, NodeError> {
        self.embedder().connect(addrs).await
    }

    async fn connect_persistent(&self, addrs: Vec<SocketAddr>) -> Result<PeerId, NodeError> {
        self.embedder().connect_persistent(addrs).await
    }

    async fn open_receiver(
        &self,
        room: RoomId,
        generation: Generation,
        peers: Vec<PeerId>,
        grant: Option<Grant>,
    ) -> Result<RoomHandle, NodeError> {
        let rooms = self.embedder();
        rooms.open_receiver(room, generation, peers, grant).await
    }

    async fn grant_pages(&self, room: RoomId, grant: Grant) -> Result<(), NodeError> {
        self.embedder().grant_pages(room, grant).await
    }

    async fn open_sender(
        &self,
        room: RoomId,
        generation: Generation,
    ) -> Result<RoomHandle, NodeError> {
        self.embedder().open_sender(room, generation).await
    }

    async fn send_chunk(&self, room: RoomId, chunk: Chunk) -> Result<(), NodeError> {
        self.embedder().send_chunk(room, chunk).await
    }

    async fn mark_layer_ready(&self, rooms: Vec<RoomId>, layer: u16) -> Result<(), NodeError> {
        self.embedder().mark_layer_ready(rooms, layer).await
    }

    async fn set_capacity(&self, capacity: kvferry_core::Capacity) {
        self.embedder().set_capacity(capacity).await;
    }

    async fn set_queue_position(&self, room: RoomId, position: u32) -> Result<(), NodeError> {
        self.embedder().set_queue_position(room, position).await
    }

    async fn set_faults(&self, faults: Option<FaultPlan>) {
        self.embedder().set_faults(faults).await;
    }

    async fn abort(&self, room: RoomId) -> Result<(), NodeError> {
        self.embedder().abort(room).await
    }

    async fn counters(&self) -> Counters {
        self.embedder().counters().await
    }

    async fn data_paths(&self) -> Vec<(usize, SessionId, DataPath)> {
        self.embedder().data_paths().await
    }

    fn room_announcements(&self) -> mpsc::UnboundedReceiver<Announcement> {
        RuntimeNode::room_announcements(self)
    }

    async fn reach(&self, peer: PeerId) -> Result<(), NodeError> {
        self.embedder().reach(peer).await
    }

    async fn unreachable(&self, peer: PeerId) -> Result<Option<FailureReason>, NodeError> {
        self.embedder().unreachable(peer).await
    }

    async fn shutdown(&self) {
        RuntimeNode::shutdown(self).await;
    }
}

/// The driver's room handles: turns the core's room events into [`RoomHandle`] updates and
/// measures how long failed rooms' pages stayed quarantined.
#[derive(Debug)]
pub struct RoomBook {
    role: Role,
    rooms: Map<RoomId, watch::Sender<RoomView>>,
    failed_at: Map<RoomId, Instant>,
}

impl RoomBook {
    /// An empty book for a node of `role`.
    pub fn new(role: Role) -> Self {
        RoomBook {
            role,
            rooms: Map::default(),
            failed_at: Map::default(),
        }
    }

    /// A handle on `room`, starting from `state` unless the room is already watched.
    pub fn watch(&mut self, room: RoomId, state: KvPoll) -> RoomHandle {
        let tx = self.rooms.entry(room).or_insert_with(|| {
            watch::channel(RoomView {
                state,
                releasable: false,
                delivered_through: None,
            })
            .0
        });
        RoomHandle::new(room, tx.subscribe())
    }

    /// Drops the handles of a room that was never opened after all.
    pub fn forget(&mut self, room: RoomId) {
        self.rooms.remove(&room);
    }

    /// Whether `event` is one the book follows (drivers hand it these).
    pub fn follows(event: &Event) -> bool {
        matches!(
            event,
            Event::RoomState { .. } | Event::Releasable { .. } | Event::LayerDelivered { .. }
        )
    }

    /// Applies a room event of the core to its handles.
    pub fn on_event(&mut self, event: &Event) {
        match *event {
            Event::RoomState { room, state, .. } => {
                if let Some(tx) = self.rooms.get(&room) {
                    tx.send_modify(|v| v.state = state);
                }
                if matches!(state, KvPoll::Failed(_)) {
                    self.failed_at.insert(room, Instant::now());
                }
            }
            Event::LayerDelivered { room, layer, .. } => {
                if let Some(tx) = self.rooms.get(&room) {
                    tx.send_modify(|v| v.delivered_through = Some(layer));
                }
            }
            Event::Releasable { room, .. } => {
                if let Some(t) = self.failed_at.remove(&room) {
                    metrics::histogram!("kvferry_quarantine_seconds", "role" => role_label(self.role))
                        .record(t.elapsed().as_secs_f64());
                }
                if let Some(tx) = self.rooms.remove(&room) {
                    tx.send_modify(|v| v.releasable = true);
                }
            }
            _ => {}
        }
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

/// The `role` label of metrics.
pub fn role_label(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    }
}

/// Publishes the staging pool device memory moves through: that this node stages (and with
/// which engine), its size, what is free now, and the shared buffers taken so far (each
/// connection's own buffer is not counted).
pub fn export_staging_metrics(staging: &kvferry_memory::Staging, role: Role) {
    let role = role_label(role);
    let engine = staging.engine().name();
    let config = staging.config();
    metrics::gauge!("kvferry_staging_buffers", "role" => role, "engine" => engine)
        .set(config.buffers as f64);
    metrics::gauge!("kvferry_staging_buffers_free", "role" => role, "engine" => engine)
        .set(staging.free() as f64);
    metrics::counter!("kvferry_staging_buffers_taken_total", "role" => role, "engine" => engine)
        .absolute(staging.taken());
}

/// Publishes the core's counters (absolute values) and gauges through the `metrics` facade.
pub fn export_metrics(endpoint: &Endpoint, role: Role) {
    let role = role_label(role);
    let c = endpoint.counters();
    for (name, value) in c.iter() {
        metrics::counter!(format!("kvferry_{name}_total"), "role" => role).absolute(value);
    }
    for reason in FailureReason::ALL {
        metrics::counter!("kvferry_rooms_failed_total", "role" => role, "reason" => reason.as_str())
            .absolute(c.failed(reason));
    }
    metrics::gauge!("kvferry_sessions_blacklisted", "role" => role)
        .set(endpoint.blacklisted_sessions() as f64);
    metrics::gauge!("kvferry_ops_live", "role" => role).set(endpoint.live_ops() as f64);
    metrics::gauge!("kvferry_rooms_live", "role" => role).set(endpoint.live_rooms() as f64);
    for sid in endpoint.session_ids() {
        let Some(st) = endpoint.session_stats(sid) else {
            continue;
        };
        let session = sid.0.to_string();
        metrics::counter!("kvferry_session_bytes_total", "role" => role, "session" => session.clone()).absolute(st.bytes_done);
        metrics::counter!("kvferry_session_ops_total", "role" => role, "session" => session.clone()).absolute(st.ops_done);
        metrics::counter!("kvferry_session_ops_failed_total", "role" => role, "session" => session.clone()).absolute(st.ops_failed);
        metrics::gauge!("kvferry_session_ops_in_flight", "role" => role, "session" => session)
            .set(f64::from(st.in_flight));
    }
}

impl FrameSink for mpsc::UnboundedSender<Vec<u8>> {
    fn send(&self, frame: Vec<u8>) {
        let _ = mpsc::UnboundedSender::send(self, frame);
    }
}

/// How a receive path reaches its node's core endpoint: each driver says how it gets at the
/// endpoint (a lock, a shard's cell) and how it then handles the endpoint's outputs.
pub trait EndpointAccess {
    /// Runs `f` on the endpoint, then handles its outputs if `drain(&result)`; `None` when the
    /// node is gone.
    fn run<T>(
        &self,
        f: impl FnOnce(&mut Endpoint, Instant) -> T,
        drain: impl FnOnce(&T) -> bool,
    ) -> Option<T>;

    /// The fault plan in force (demos and tests).
    fn faults(&self) -> Option<FaultPlan>;
}

/// The receive path's admission on every driver: the node's core decides each write (every
/// slice against the room's granted pages) and takes every permit back.
pub struct CoreCheck<A> {
    /// The way to the endpoint.
    pub access: A,
    /// The session the data connection belongs to.
    pub session: SessionId,
}

impl<A: EndpointAccess> WriteCheck for CoreCheck<A> {
    fn inject_reset(&self, room: RoomId, op: TransferId) -> bool {
        self.access
            .faults()
            .is_some_and(|f| f.kind == FaultKind::Break && f.hits(room, op))
    }

    fn begin(
        &self,
        room: RoomId,
        generation: Generation,
        slices: &[Slice],
    ) -> Result<WritePermit, WriteRefused> {
        // A refusal may have changed a room's state (its outputs go out now); an accepted
        // write changes nothing until it ends.
        self.access
            .run(
                |e, now| e.begin_write(now, self.session, room, generation, slices),
                |r| r.is_err(),
            )
            .unwrap_or(Err(WriteRefused::UnknownRoom))
    }

    fn end(&self, permit: WritePermit) {
        self.access.run(|e, now| e.end_write(now, permit), |_| true);
    }
}
