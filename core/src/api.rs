//! The types the endpoint's API takes and returns: identity, commands, outputs and errors.

use core::fmt;
use std::sync::Arc;

use smallvec::SmallVec;

use crate::ids::{Generation, Incarnation, NodeId, PromptDigest, RoomId, SessionId, TransferId};
use crate::layout::{ExtraPool, Heads, Layout, LayoutMismatch, Region, Slice};
use crate::state::{InvalidTransition, KvPoll, Role};

/// Who this endpoint is; sent to every peer in the hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointInfo {
    /// Prefill or decode.
    pub role: Role,
    /// Rank within the instance (TP / PP index).
    pub rank: u16,
    /// Stable name of this endpoint slot.
    pub node: NodeId,
    /// Chosen at process start; a restart must pick a new one.
    pub incarnation: Incarnation,
    /// Cluster token; peers presenting another one are refused.
    pub token: Vec<u8>,
    /// The memory this endpoint registered.
    pub layout: Layout,
    /// First layer this endpoint writes (prefill PP stage), inclusive.
    pub layer_start: u16,
    /// Last layer this endpoint writes, exclusive.
    pub layer_end: u16,
    /// Whether this endpoint writes aux and state data (the last PP stage).
    pub writes_aux: bool,
    /// The KV heads this endpoint holds (attention TP); whole pages by default.
    pub heads: Heads,
    /// Extra pools (state, sliding-window pages, indexer pages) that move with rooms, in
    /// the order both peers name them; empty by default.
    pub extras: Vec<ExtraPool>,
}

impl EndpointInfo {
    /// A single-stage endpoint owning every layer and the aux data.
    pub fn new(role: Role, node: NodeId, incarnation: Incarnation, layout: Layout) -> Self {
        EndpointInfo {
            role,
            rank: 0,
            node,
            incarnation,
            token: Vec::new(),
            layout,
            layer_start: 0,
            layer_end: layout.layers,
            writes_aux: true,
            heads: Heads::whole(&layout),
            extras: Vec::new(),
        }
    }

    /// Size in bytes of a region this endpoint registers, or `None` if it has no such region.
    pub fn region_len(&self, region: Region) -> Option<u64> {
        match region {
            Region::Extra { pool, tensor } => {
                self.extras.get(usize::from(pool))?.region_len(tensor)
            }
            r => self.layout.region_len(r),
        }
    }
}

/// What the peer on the other end of a session said about itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// Its role.
    pub role: Role,
    /// Its rank.
    pub rank: u16,
    /// Its stable name.
    pub node: NodeId,
    /// Its process start identity.
    pub incarnation: Incarnation,
    /// Its memory.
    pub layout: Layout,
    /// Layers it writes, `start..end`.
    pub layer_start: u16,
    /// See `layer_start`.
    pub layer_end: u16,
    /// Whether it writes aux data.
    pub writes_aux: bool,
    /// The KV heads it holds.
    pub heads: Heads,
    /// How often it sends heartbeats.
    pub heartbeat_interval: core::time::Duration,
    /// How many of them may go missing before it may be given up.
    pub heartbeat_misses: u32,
}

/// Decode's page grant for a room: where every source writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// Destination pages in room order.
    pub pages: Vec<u32>,
    /// Destination aux row, if the model has aux data.
    pub aux_slot: Option<u32>,
    /// Destination state slot, if the model has recurrent state.
    pub state_slot: Option<u32>,
    /// How many decode ranks request this room from each source (TP fan-in), usually 1.
    pub receivers: u8,
    /// Pages at the start of the room this decode already holds (a prefix it cached): the
    /// sources skip them, and `pages` are the room's pages after them.
    pub skip_pages: u32,
    /// Sources that take part without writing (bit `i`: the room's `i`-th source): they are
    /// asked for nothing and only confirm the room, e.g. MLA ranks whose copy another rank
    /// sends. At most 64 sources.
    pub idle_sources: u64,
    /// Destination items of each extra pool, in room order (item `i` of pool `p` that the
    /// source names goes to `extras[p][i]`); a pool left out or empty is not asked for.
    pub extras: Vec<Vec<u32>>,
    /// The tokens this decode wants the room's KV for: a source that opened the room for
    /// other tokens refuses it (`prompt_mismatch`). `None`: not checked.
    pub prompt: Option<PromptDigest>,
}

impl Grant {
    /// A grant of `pages` (and aux and state slots) from every source, nothing skipped.
    pub fn new(pages: Vec<u32>, aux_slot: Option<u32>, state_slot: Option<u32>) -> Self {
        Grant {
            pages,
            aux_slot,
            state_slot,
            receivers: 1,
            skip_pages: 0,
            idle_sources: 0,
            extras: Vec::new(),
            prompt: None,
        }
    }
}

/// One chunk of a prefill room: the source pages of the next part of the room.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Source pages; they go to the next `pages.len()` granted destination pages.
    pub pages: Vec<u32>,
    /// Whether this is the room's last chunk (aux and state follow it).
    pub last: bool,
    /// Source aux row (read with the last chunk).
    pub aux_slot: Option<u32>,
    /// Source state slot (read with the last chunk).
    pub state_slot: Option<u32>,
    /// When true, no layer of this chunk moves until [`crate::Endpoint::mark_layer_ready`]
    /// names it; when false, every layer is ready now (whole-batch mode).
    pub layerwise: bool,
    /// Source items of each extra pool, in room order (read with the last chunk); they pair
    /// one to one with the items the grant names for that pool.
    pub extras: Vec<Vec<u32>>,
}

/// What a data-path operation is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// KV pages of a room.
    Kv,
    /// Aux and state data of a room (after its last KV chunk).
    Aux,
    /// A small write into the peer's scratch region to probe a blacklisted session.
    Probe,
}

/// A data-path operation for the driver to carry out and report with
/// [`crate::Endpoint::handle_transfer_result`].
///
/// Done means the destination applied every byte and acknowledged it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferOp {
    /// Handle of this attempt; a retry gets a new one.
    pub id: TransferId,
    /// The session (peer) to write to.
    pub session: SessionId,
    /// The room written, `None` for probes.
    pub room: Option<RoomId>,
    /// The room's generation (0 for probes).
    pub generation: Generation,
    /// What the operation is for.
    pub kind: OpKind,
    /// 1 for the first attempt.
    pub attempt: u32,
    /// The copies, each from the local region to the peer's region of the same name.
    pub slices: Arc<[Slice]>,
    /// Sum of the slice lengths.
    pub bytes: u64,
    /// Whether the destination verifies the operation's bytes against a checksum the driver
    /// computes over them as it sends (`Config::checksum`).
    pub checksum: bool,
}

/// How a data-path operation ended, as the driver saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferOutcome {
    /// Every byte applied and acknowledged by the destination.
    Done,
    /// Failed in a way a retry may fix (connection reset, timeout, endpoint busy).
    Transient,
    /// Failed in a way no retry fixes (memory not registered, invalid descriptor).
    Fatal,
    /// The destination refused the write: the room concluded there or the write was outside
    /// the room's pages. Never retried, never counted against the session.
    Refused,
    /// Never ran: the path under it failed first (another write's failure or a fence moved
    /// its RDMA queue pair to the error state). Run again without spending an attempt.
    Flushed,
}

/// A scheduler-facing event from [`crate::Endpoint::poll_event`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A room changed state.
    RoomState {
        /// The room.
        room: RoomId,
        /// Its generation.
        generation: Generation,
        /// The new state.
        state: KvPoll,
    },
    /// Prefill: every operation of `layer`, and of every owned layer before it, has been
    /// acknowledged by every receiver, so that much of the room's KV sits in decode's memory and
    /// the source pages of those layers (or a staging buffer holding them) may be reused.
    /// Emitted once per owned layer, in layer order, only after the room's last chunk was
    /// sent, and always before the room's `Success`.
    LayerDelivered {
        /// The room.
        room: RoomId,
        /// Its generation.
        generation: Generation,
        /// The layer.
        layer: u16,
    },
    /// No write to (decode) or read from (prefill) the room's pages can happen any more:
    /// the embedder may reuse them. Always after the room's terminal state.
    Releasable {
        /// The room.
        room: RoomId,
        /// Its generation.
        generation: Generation,
    },
    /// The handshake with a peer succeeded.
    SessionEstablished {
        /// The session.
        session: SessionId,
        /// Who the peer is.
        peer: PeerInfo,
    },
    /// The peer was refused at the handshake; its rooms fail with `IncompatiblePeer`.
    SessionRejected {
        /// The session.
        session: SessionId,
        /// Why.
        reason: RejectReason,
    },
    /// The session reached its failure threshold; its rooms fail with `SessionBlacklisted`.
    SessionBlacklisted {
        /// The session.
        session: SessionId,
    },
    /// A probe of a blacklisted session succeeded; it takes rooms again.
    SessionRecovered {
        /// The session.
        session: SessionId,
    },
    /// A blacklisted session nobody targeted was forgotten after the idle timeout.
    SessionExpired {
        /// The session.
        session: SessionId,
    },
    /// A peer came back with a new incarnation; its previous session is void.
    PeerRestarted {
        /// The peer's stable name.
        node: NodeId,
        /// The superseded session.
        old: SessionId,
        /// The new session.
        new: SessionId,
    },
    /// A fresh connection to the same peer process took a silent session's work over: its
    /// rooms, queued operations and failure count now live on `new`, and nothing was lost.
    SessionResumed {
        /// The peer's stable name.
        node: NodeId,
        /// The silent session, closed without failing anything.
        old: SessionId,
        /// The session that carries on.
        new: SessionId,
    },
    /// Prefill: a decode asked for a room this endpoint has not opened yet. The embedder
    /// opens it with [`crate::Endpoint::open_sender`] (or lets its bootstrap fail).
    RoomAnnounced {
        /// The room.
        room: RoomId,
        /// Its generation.
        generation: Generation,
        /// The decode session that asked.
        session: SessionId,
        /// Pages the decode granted (0 while it is still waiting for pages).
        pages: u32,
        /// Room pages the decode already holds and does not want: the room has
        /// `skip_pages + pages` pages (`SKIP_ALL`: it wants nothing from this rank).
        skip_pages: u32,
    },
    /// The peer closed the session and said why (wrong token, incompatible layout, ...).
    PeerError {
        /// The session.
        session: SessionId,
        /// The peer's reason.
        code: crate::codec::ErrorCode,
        /// The peer's explanation.
        detail: String,
    },
    /// [`crate::Endpoint::shutdown`] is complete: every session closed (`unclosed` 0), or
    /// `shutdown_timeout` passed with `unclosed` sessions still closing. The driver may stop.
    ShutDown {
        /// Sessions whose connections had not closed by then.
        unclosed: usize,
    },
    /// A session ended; the driver's connections of it are closed.
    SessionClosed {
        /// The session.
        session: SessionId,
    },
    /// A target ([`crate::Endpoint::add_target`]) has an established session, at first
    /// contact or again after it was down.
    TargetUp {
        /// The target.
        target: crate::ids::TargetId,
        /// Its session.
        session: SessionId,
    },
    /// The peer at a target answered and refused us at the handshake (token, role, layout,
    /// version): retrying will not help until one side is reconfigured. The core keeps
    /// trying; rooms waiting for the target fail with `reason` once it has been down for
    /// `unreachable_timeout`.
    TargetRefused {
        /// The target.
        target: crate::ids::TargetId,
        /// The reason rooms toward it fail with.
        reason: crate::state::FailureReason,
    },
    /// A target has had no session for `unreachable_timeout` (once per time it goes down);
    /// `reason` says what the attempts found, and is what rooms waiting for it fail with.
    TargetUnreachable {
        /// The target.
        target: crate::ids::TargetId,
        /// The reason rooms toward it fail with.
        reason: crate::state::FailureReason,
    },
    /// A kept peer no room used for `peer_idle_timeout` was let go: its target is removed
    /// (not dialed again) and its session closed. An embedder's name for it is void.
    TargetLetGo {
        /// The target, unknown from now on.
        target: crate::ids::TargetId,
    },
    /// The peer's data-plane backend sent bytes for ours ([`crate::Endpoint::send_transport`]).
    TransportReceived {
        /// The session.
        session: SessionId,
        /// The bytes, as sent.
        payload: Vec<u8>,
    },
}

/// Something the driver must do to its connections, from [`crate::Endpoint::poll_action`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Close the session's data connections so no write in flight can land, report every
    /// in-flight operation of it, then call [`crate::Endpoint::handle_fence_complete`].
    /// The control connection stays; data connections may be re-opened afterwards.
    FenceSession(SessionId),
    /// Close every connection of the session, then call
    /// [`crate::Endpoint::handle_disconnected`].
    CloseSession(SessionId),
    /// Open a control connection to this target's address, then call
    /// [`crate::Endpoint::open_session_for`] (or [`crate::Endpoint::handle_connect_failed`]
    /// with `dial` and what went wrong). The core bounds the attempt: the target's deadline
    /// (`connect_timeout` on a fast link; see `Config::connect_timeout` for how it adapts)
    /// after it asked, or after the driver says it began
    /// ([`crate::Endpoint::handle_dial_began`]), it names it in [`Action::AbandonDial`]; a driver that then says nothing for one more
    /// `connect_timeout` has its attempt counted as no answer by the core itself. Also asked while the target's session is silent: a
    /// fresh connection that completes its handshake takes the silent session's work over.
    Connect {
        /// The target to reach.
        target: crate::ids::TargetId,
        /// The attempt (the core started its deadline already).
        dial: crate::ids::DialId,
    },
    /// Open one more data connection of this session (this side dialed it), proving the
    /// session's key ([`crate::Endpoint::data_key`]): it replaces one that broke.
    OpenDataConnection(SessionId),
    /// Decode, one-sided data plane with the checksum option: a source says the operation
    /// that wrote `ranges` completed. Hash the bytes now in those ranges (XXH3-64, seed 0, in
    /// order) and hand the permit back with [`crate::Endpoint::end_write`]: `applied()` if
    /// the hash equals `checksum`, `corrupt()` if not. The room's pages are held meanwhile.
    VerifyLanded {
        /// The write's permit, as [`crate::Endpoint::begin_write`] gave it.
        permit: WritePermit,
        /// Where the operation's bytes landed, in the order they were hashed (`src_offset`
        /// is 0: only the destination matters here).
        ranges: Vec<Slice>,
        /// The source's hash of the bytes it wrote.
        checksum: u64,
    },
    /// Decode, a room whose sources all reported `Success` over a one-sided path whose writes
    /// need a flush ([`crate::Endpoint::flush_landed_writes`]): make every write the NIC
    /// completed so far visible to the memory's device (CUDA: `cuFlushGPUDirectRDMAWrites`),
    /// then report with [`crate::Endpoint::end_flush`]. The room stays `Transferring`
    /// meanwhile, under its own deadline.
    FlushLanded {
        /// The room.
        room: RoomId,
        /// Its generation.
        generation: Generation,
    },
    /// Drop this accepted connection now: it did not become a session's within
    /// `handshake_timeout` (no preamble, no TLS handshake, no data hello or no answer to its
    /// challenge in time). The core has forgotten it already: no
    /// [`crate::Endpoint::handle_accept_settled`] follows.
    DropAccepted(crate::ids::ConnId),
    /// Give this connection attempt up now: it did not connect within its deadline
    /// (`connect_timeout`, or what the core adapted it to for a target or a session's data
    /// connections).
    /// Report a target's with [`crate::Endpoint::handle_connect_failed`] (what it found:
    /// [`ConnectFailure::NoAnswer`] unless a refusal was already there to read); unreported,
    /// the core counts it as no answer one `connect_timeout` later. Any other attempt the
    /// core has forgotten already: a later [`crate::Endpoint::handle_dial_settled`] for it is
    /// ignored.
    AbandonDial(crate::ids::DialId),
    /// Stop collecting what this replaced data path flushes: it had `operation_timeout`.
    /// The core has forgotten it already: a later [`crate::Endpoint::handle_drain_settled`]
    /// for it is ignored.
    StopDraining(crate::ids::DrainId),
    /// The pause after a failed accept ([`crate::Endpoint::handle_accept_failed`]) is over:
    /// accept again.
    ResumeAccepting,
    /// A closing session's control writer has had `close_linger` to send its queued frames:
    /// stop it, close the session's connections and report
    /// [`crate::Endpoint::handle_disconnected`] as for [`Action::CloseSession`].
    StopLingering(SessionId),
}

/// Why a connection attempt to a target failed: the evidence behind a room's reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnectFailure {
    /// The host answered and refused (nothing listens at the port): the process is down.
    Refused,
    /// No answer within the attempt's timeout, or no route to the host: the link is down.
    NoAnswer,
}

/// How a receiver room reaches one of its sources: a session the embedder opened, or a
/// target the core keeps connected (its session changes across reconnects).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Link {
    /// A session opened by the embedder.
    Session(SessionId),
    /// A persistent target ([`crate::Endpoint::add_target`]): rooms toward it wait for its
    /// session up to `unreachable_timeout` from when it went down.
    Target(crate::ids::TargetId),
}

/// Why a peer was refused at the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectReason {
    /// The cluster token did not match.
    BadToken,
    /// Both ends have the same role.
    WrongRole,
    /// The memory layouts disagree on this field (both values named).
    IncompatibleLayout(LayoutMismatch),
    /// The peer speaks another protocol version.
    VersionMismatch,
}

impl RejectReason {
    /// What the rooms of a session refused for this reason fail with.
    pub fn failure_reason(self) -> crate::state::FailureReason {
        match self {
            RejectReason::BadToken => crate::state::FailureReason::Unauthorized,
            RejectReason::WrongRole
            | RejectReason::IncompatibleLayout(_)
            | RejectReason::VersionMismatch => crate::state::FailureReason::IncompatiblePeer,
        }
    }
}

/// Why a data connection was not admitted to a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataRefusal {
    /// No session of ours has the tag it named (never, or no longer).
    UnknownSession,
    /// Its proof does not answer our challenge with that session's key (a replay, or a
    /// connection that does not hold the key).
    BadProof,
    /// The session it named is closing.
    SessionEnded,
}

impl fmt::Display for DataRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DataRefusal::UnknownSession => "no session has that tag",
            DataRefusal::BadProof => "the proof does not answer the challenge",
            DataRefusal::SessionEnded => "the session is closing",
        })
    }
}

impl std::error::Error for DataRefusal {}

/// Misuse of the endpoint API by the embedder. Nothing changed when this is returned.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ApiError {
    /// The call is for the other role.
    WrongRole {
        /// The role this call needs.
        needs: Role,
    },
    /// A live room with this id exists; conclude it first.
    RoomExists(RoomId),
    /// No live room has this id.
    UnknownRoom(RoomId),
    /// This (room, generation) was already used; pick a higher generation.
    StaleGeneration {
        /// Room.
        room: RoomId,
        /// Generation given.
        generation: Generation,
        /// Highest generation already used.
        used: Generation,
    },
    /// The room is terminal; the call has no effect on it.
    RoomConcluded(RoomId, KvPoll),
    /// No open session has this id.
    UnknownSession(SessionId),
    /// No target has this id (never added, or removed).
    UnknownTarget(crate::ids::TargetId),
    /// A receiver room needs at least one source session.
    NoSources,
    /// A page index beyond the registered pool.
    PageOutOfRange {
        /// Offending page.
        page: u32,
        /// Pool size.
        pages: u32,
    },
    /// An aux or state slot beyond the registered slots, or the model has none.
    SlotOutOfRange {
        /// Offending slot.
        slot: u32,
        /// Registered slots.
        slots: u32,
    },
    /// An extra pool this endpoint did not register, or an item beyond its pool.
    ExtraOutOfRange {
        /// The pool named.
        pool: usize,
        /// The offending item (0 when the pool itself does not exist).
        item: u32,
        /// Items the pool holds (0 when it does not exist).
        items: u32,
    },
    /// The room's pages were already granted.
    AlreadyGranted(RoomId),
    /// A chunk was sent after the last one.
    ChunkAfterLast(RoomId),
    /// A layer this endpoint does not own.
    LayerOutOfRange {
        /// Offending layer.
        layer: u16,
    },
    /// A session's operation queue is full; retry the chunk later.
    SessionQueueFull(SessionId),
    /// A transition the lifecycle forbids.
    InvalidTransition(InvalidTransition),
    /// The endpoint was shut down.
    ShutDown,
    /// The session has not completed its handshake (or is closing).
    SessionNotReady(SessionId),
    /// A transport payload longer than [`crate::codec::MAX_TRANSPORT_LEN`].
    TransportTooLong(usize),
    /// A listener beyond loopback without a cluster token of the node's own
    /// ([`crate::Endpoint::check_listen`]): anyone reaching the port could ask for rooms.
    OpenListener {
        /// What the token is: "no cluster token" or "the built-in demo token".
        token: &'static str,
    },
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApiError::WrongRole { needs } => write!(f, "this call needs a {needs:?} endpoint"),
            ApiError::RoomExists(r) => write!(f, "{r} is already open"),
            ApiError::UnknownRoom(r) => write!(f, "{r} is not open"),
            ApiError::StaleGeneration {
                room,
                generation,
                used,
            } => write!(
                f,
                "{room} generation {generation} is stale (generation {used} was used)"
            ),
            ApiError::RoomConcluded(r, s) => write!(f, "{r} already concluded as {s:?}"),
            ApiError::UnknownSession(s) => write!(f, "{s} is not open"),
            ApiError::UnknownTarget(t) => write!(f, "{t} is not a target of this endpoint"),
            ApiError::NoSources => write!(f, "a receiver room needs at least one source"),
            ApiError::SessionNotReady(s) => write!(f, "{s} has not completed its handshake"),
            ApiError::TransportTooLong(n) => write!(
                f,
                "a transport payload of {n} bytes exceeds {} bytes",
                crate::codec::MAX_TRANSPORT_LEN
            ),
            ApiError::OpenListener { token } => write!(
                f,
                "refusing to listen beyond loopback with {token}: anyone who reaches the port \
                 could ask for rooms; set a cluster token shared by the nodes (KVFERRY_TOKEN, \
                 --token, Python token=), listen on loopback, or set KVFERRY_ALLOW_NO_TOKEN=1"
            ),
            ApiError::PageOutOfRange { page, pages } => {
                write!(f, "page {page} is outside the pool of {pages} pages")
            }
            ApiError::SlotOutOfRange { slot, slots } => {
                write!(f, "slot {slot} is outside the {slots} registered slots")
            }
            ApiError::ExtraOutOfRange { pool, item, items } => write!(
                f,
                "item {item} of extra pool {pool} is outside the pool ({items} items registered)"
            ),
            ApiError::AlreadyGranted(r) => write!(f, "{r} already has its pages"),
            ApiError::ChunkAfterLast(r) => write!(f, "{r} already had its last chunk"),
            ApiError::LayerOutOfRange { layer } => {
                write!(f, "layer {layer} is not owned by this endpoint")
            }
            ApiError::SessionQueueFull(s) => write!(f, "{s} has a full operation queue"),
            ApiError::InvalidTransition(t) => t.fmt(f),
            ApiError::ShutDown => write!(f, "the endpoint is shut down"),
        }
    }
}

impl std::error::Error for ApiError {}

/// A data-plane write the core authorized and that may be landing in this node's pages.
///
/// Returned by [`crate::Endpoint::begin_write`]; hand it back with
/// [`crate::Endpoint::end_write`] once the bytes were applied or abandoned. While a permit is
/// out, the room's pages are not released (no write after release), whatever happens to the
/// room; a fence or disconnect of the session voids its permits, since the driver then
/// guarantees that nothing of that session can write any more.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "a permit holds the room's pages until it is handed back with end_write"]
pub struct WritePermit {
    /// The writing session.
    pub session: SessionId,
    /// The room written (`None` for probe writes into scratch, which hold no pages).
    pub room: Option<RoomId>,
    /// The room's generation.
    pub generation: Generation,
    /// The session's fence epoch when the permit was given (older permits are void).
    pub epoch: u32,
    /// Which permit this is, numbered once for every write and check of the endpoint (a
    /// one-sided check's units are kept under it).
    pub seq: u64,
    /// Set by the receive path once every byte was applied ([`WritePermit::applied`]);
    /// a permit handed back without it was abandoned and lands nothing.
    pub applied: bool,
    /// Set by the receive path when the bytes landed but their checksum did not match what
    /// the sender computed ([`WritePermit::corrupt`]): the room's pages hold garbage.
    pub corrupt: bool,
}

impl WritePermit {
    /// The same permit, marked as applied: every byte of the write is in place.
    pub fn applied(self) -> Self {
        WritePermit {
            applied: true,
            ..self
        }
    }

    /// The same permit, marked as landed with bytes whose checksum did not match: the room
    /// fails with `checksum_mismatch`.
    pub fn corrupt(self) -> Self {
        WritePermit {
            applied: false,
            corrupt: true,
            ..self
        }
    }
}

/// Why a data-plane write was refused by [`crate::Endpoint::check_write`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteRefused {
    /// No live room has this id (never opened, or concluded and released).
    UnknownRoom,
    /// The write names another generation of the room.
    StaleGeneration,
    /// The room is terminal; its pages are quarantined or released.
    RoomConcluded,
    /// The room already succeeded: every byte granted to it landed, so a repeated write (a
    /// retry whose first attempt landed) is acknowledged as applied without applying it.
    AlreadyLanded,
    /// The writer's session is not a granted source of the room.
    NotASource,
    /// The region does not exist in this endpoint's layout.
    UnknownRegion,
    /// The byte range leaves the region.
    OutOfRegion,
    /// The byte range touches a page not granted to the room.
    PageNotGranted,
    /// The byte range is not the room's aux row or state slot.
    SlotNotGranted,
    /// The byte range is not whole items of an extra pool that the room granted.
    ItemNotGranted,
    /// The writer does not own this layer.
    LayerNotOwned,
    /// The bytes are not the heads the writer shares with this endpoint, in one token row
    /// (attention heads split across ranks).
    HeadsNotShared,
    /// The rows are malformed (empty, overlapping, a stride with one row) or strided outside a
    /// KV region.
    BadRows,
    /// The writer's session was taken over by a fresh connection: its writes are void (the
    /// operations are retried there), and the room does not fail for them.
    SessionSuperseded,
}

impl fmt::Display for WriteRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl std::error::Error for WriteRefused {}

/// The public view of a session's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionState {
    /// Waiting for the peer's hello.
    Handshaking,
    /// Usable.
    Established,
    /// Refused or failing; rooms toward it fail fast; probed until it recovers.
    Blacklisted,
    /// Being closed; waiting for the driver's confirmation.
    Closing,
}

/// Data-path figures of one session.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionStats {
    /// Operations (attempts) completed.
    pub ops_done: u64,
    /// Attempts that failed (transient, fatal or refused).
    pub ops_failed: u64,
    /// Payload bytes of completed operations.
    pub bytes_done: u64,
    /// Attempts in flight now.
    pub in_flight: u32,
    /// Operations queued now (including stale entries of dropped ones).
    pub queued: u32,
}

/// Backpressure information a decode peer advertised.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Capacity {
    /// Free KV pages.
    pub free_pages: u32,
    /// Rooms waiting for pages.
    pub queued_rooms: u32,
}

impl Capacity {
    /// No room can be admitted without waiting.
    pub fn saturated(&self) -> bool {
        self.free_pages == 0 || self.queued_rooms > 0
    }
}

/// Small list of sessions, for rooms fed by a few ranks.
pub type Sessions = SmallVec<[SessionId; 2]>;
