//! Room states ([`KvPoll`]) and typed failure reasons ([`FailureReason`]).

use core::fmt;

/// Why a room failed. Carried on the wire, in events, in counters and in consensus verdicts.
///
/// Each variant says whose fault it is and whether retrying the request elsewhere makes sense
/// ([`FailureReason::is_soft`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum FailureReason {
    /// No room request (prefill) or no page grant (decode) arrived before `bootstrap_timeout`.
    BootstrapTimeout,
    /// Decode said it had no capacity for this room until `bootstrap_timeout`. Retry later.
    DecodeSaturated,
    /// Decode saw no progress for the room within `waiting_timeout`, or the end-to-end budget ran out.
    WaitingTimeout,
    /// The peer's address gave no answer at all: connection attempts timed out or found no
    /// route for the whole `unreachable_timeout` (a room waiting for the peer), or for the
    /// liveness window of a silent session (a black-holed link). Retry once the link is back.
    PeerUnreachable,
    /// The peer restarted (new incarnation); everything of its previous life is void.
    PeerRestarted,
    /// The session toward the peer is blacklisted after repeated transfer failures.
    SessionBlacklisted,
    /// A data-path operation failed fatally or exhausted its retries.
    TransferFailed,
    /// The local embedder aborted the room, or let go of (disconnected) a peer it waited on.
    AbortedLocally,
    /// The peer aborted or failed the room and said so.
    AbortedByPeer,
    /// The peer sent something that violates the protocol for this room.
    ProtocolError,
    /// The peer's memory layout or protocol version cannot serve this room.
    IncompatiblePeer,
    /// The local endpoint is shutting down.
    Shutdown,
    /// Prefill already concluded this room id for another decode (another node, or an earlier
    /// incarnation of this one); it is never answered from that room's outcome. Open the
    /// request again under a fresh room id (or a higher generation).
    RoomIdReused,
    /// Nothing arrived from the peer for the liveness window (`heartbeat_interval` x
    /// `heartbeat_misses`) while its address still took connections (a hung peer process), or
    /// the peer said it heard nothing from us.
    PeerSilent,
    /// The connection to the peer closed without a shutdown notice: the peer process died or
    /// the connection was reset.
    ConnectionLost,
    /// The peer announced that it is shutting down (SIGTERM, SIGINT, or its embedder's call).
    PeerShutdown,
    /// The peer refused our cluster token, or we refused its token.
    Unauthorized,
    /// The peer's host answered but nothing listened at the port (connection refused) for the
    /// whole unreachable window: the peer process is down while its machine is up.
    ConnectionRefused,
    /// The peer already holds a newer attempt (generation) of this room: this one is void.
    StaleGeneration,
    /// Bytes of the room arrived that are not the bytes the prefill sent: the end-to-end
    /// checksum (`KVFERRY_CHECKSUM`) of a write did not match. The room's pages are garbage.
    ChecksumMismatch,
    /// The prefill's chunks for the room and the decode's grant differ: its last chunk left
    /// granted pages (after `skip_pages`), the aux row, the state slot or extra items
    /// unwritten, or its chunks hold more pages than were granted. Both embedders must agree
    /// on the room's length; resubmitting the same request fails the same way.
    GrantMismatch,
    /// The decode asked for the room's KV for other tokens than the ones the prefill computed
    /// it for (the two sides' `PromptDigest`s differ): a router handed the room to another
    /// prompt's request. Nothing moved; the decode computes the prompt itself.
    PromptMismatch,
}

impl FailureReason {
    /// All variants, in wire-code order.
    pub const ALL: [FailureReason; 22] = [
        FailureReason::BootstrapTimeout,
        FailureReason::DecodeSaturated,
        FailureReason::WaitingTimeout,
        FailureReason::PeerUnreachable,
        FailureReason::PeerRestarted,
        FailureReason::SessionBlacklisted,
        FailureReason::TransferFailed,
        FailureReason::AbortedLocally,
        FailureReason::AbortedByPeer,
        FailureReason::ProtocolError,
        FailureReason::IncompatiblePeer,
        FailureReason::Shutdown,
        FailureReason::RoomIdReused,
        FailureReason::PeerSilent,
        FailureReason::ConnectionLost,
        FailureReason::PeerShutdown,
        FailureReason::Unauthorized,
        FailureReason::ConnectionRefused,
        FailureReason::StaleGeneration,
        FailureReason::ChecksumMismatch,
        FailureReason::GrantMismatch,
        FailureReason::PromptMismatch,
    ];

    /// The one-byte code used on the wire (see `docs/PROTOCOL.md`).
    pub fn code(self) -> u8 {
        self as u8 + 1
    }

    /// Inverse of [`FailureReason::code`].
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get((code as usize).checked_sub(1)?).copied()
    }

    /// Index into per-reason counter arrays.
    pub fn index(self) -> usize {
        self as usize
    }

    /// A stable snake_case name for metrics labels and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::BootstrapTimeout => "bootstrap_timeout",
            FailureReason::DecodeSaturated => "decode_saturated",
            FailureReason::WaitingTimeout => "waiting_timeout",
            FailureReason::PeerUnreachable => "peer_unreachable",
            FailureReason::PeerRestarted => "peer_restarted",
            FailureReason::SessionBlacklisted => "session_blacklisted",
            FailureReason::TransferFailed => "transfer_failed",
            FailureReason::AbortedLocally => "aborted_locally",
            FailureReason::AbortedByPeer => "aborted_by_peer",
            FailureReason::ProtocolError => "protocol_error",
            FailureReason::IncompatiblePeer => "incompatible_peer",
            FailureReason::Shutdown => "shutdown",
            FailureReason::RoomIdReused => "room_id_reused",
            FailureReason::PeerSilent => "peer_silent",
            FailureReason::ConnectionLost => "connection_lost",
            FailureReason::PeerShutdown => "peer_shutdown",
            FailureReason::Unauthorized => "unauthorized",
            FailureReason::ConnectionRefused => "connection_refused",
            FailureReason::StaleGeneration => "stale_generation",
            FailureReason::ChecksumMismatch => "checksum_mismatch",
            FailureReason::GrantMismatch => "grant_mismatch",
            FailureReason::PromptMismatch => "prompt_mismatch",
        }
    }

    /// What happened and what to check, for an operator reading an error.
    pub fn explain(self) -> &'static str {
        match self {
            FailureReason::BootstrapTimeout => "no decode asked for the room (or no pages were granted) before the bootstrap deadline; check that the router sent the request to both sides and KVFERRY_BOOTSTRAP_TIMEOUT_MS",
            FailureReason::DecodeSaturated => "decode had no KV capacity for the room until the bootstrap deadline; add decode capacity or admit fewer rooms",
            FailureReason::WaitingTimeout => "nothing moved for the room within the waiting deadline; check that prefill is computing and sending it, and KVFERRY_WAITING_TIMEOUT_MS",
            FailureReason::PeerUnreachable => "the peer's address gave no answer (connection attempts timed out or found no route) for the whole window; check the network path to the peer, KVFERRY_UNREACHABLE_TIMEOUT_MS and KVFERRY_CONNECT_TIMEOUT_MS",
            FailureReason::PeerRestarted => "the peer restarted, so its earlier rooms are void; resubmit the request",
            FailureReason::SessionBlacklisted => "the link to this peer failed repeatedly and is blacklisted until a probe succeeds; check the data path (network, registered memory)",
            FailureReason::TransferFailed => "a data transfer failed after all retries; check the data path and KVFERRY_TRANSFER_RETRIES",
            FailureReason::AbortedLocally => "this endpoint's scheduler aborted the room",
            FailureReason::AbortedByPeer => "the peer aborted or failed the room (its scheduler gave up or it refused a write)",
            FailureReason::ProtocolError => "the peer violated the protocol for this room (a write outside its pages, a malformed request); check both sides run compatible kvferry versions",
            FailureReason::IncompatiblePeer => "the peer was refused at the handshake (role, protocol version or memory layout) or by a transport one side requires (transport=\"same-host\" with a peer that cannot take it); the node logs which: check that both sides use the same kvferry version, model shape and transport",
            FailureReason::Shutdown => "the endpoint is shutting down",
            FailureReason::RoomIdReused => "prefill already concluded this room id for another decode (another node or an earlier incarnation of this one); resubmit the request under a fresh room id",
            FailureReason::PeerSilent => "nothing arrived from the peer for the liveness window while its address still took connections (a hung or overloaded peer process); check the peer process, and KVFERRY_HEARTBEAT_INTERVAL_MS / KVFERRY_HEARTBEAT_MISSES",
            FailureReason::ConnectionLost => "the connection to the peer closed without a shutdown notice (the peer died or the connection was reset); check the peer process",
            FailureReason::PeerShutdown => "the peer announced it is shutting down; resubmit the request to a live peer",
            FailureReason::Unauthorized => "the cluster token was refused; check that both sides use the same --token / KVFERRY_TOKEN",
            FailureReason::ConnectionRefused => "nothing listened at the peer's address (connection refused) for the whole unreachable window: the peer process is down; start it, or check the address",
            FailureReason::StaleGeneration => "the peer already holds a newer attempt (generation) of this room, so this attempt is void; retry under a generation above the newest one used",
            FailureReason::ChecksumMismatch => "bytes of the room arrived that are not the bytes the prefill sent (the end-to-end checksum did not match), so its pages were discarded; check the network path and the hosts' memory, and resubmit the request",
            FailureReason::GrantMismatch => "the prefill's chunks for the room did not cover what the decode granted (fewer room pages after skip_pages, no aux row or state slot for a granted one, other extra items) or held more pages than granted; check that both sides agree on the prompt's length and on skip_pages",
            FailureReason::PromptMismatch => "the decode asked for the room's KV for other tokens than the prefill computed it for (their prompt digests differ), so nothing moved; the router handed this room's parameters to another request: check how it pairs prefill answers with decode requests",
        }
    }

    /// Soft failures are about load or transient conditions: the scheduler may retry the
    /// request (possibly elsewhere). Hard ones point at a broken peer, a bug or an operator.
    pub fn is_soft(self) -> bool {
        matches!(
            self,
            FailureReason::BootstrapTimeout
                | FailureReason::DecodeSaturated
                | FailureReason::WaitingTimeout
                | FailureReason::PeerUnreachable
                | FailureReason::PeerRestarted
                | FailureReason::SessionBlacklisted
                | FailureReason::TransferFailed
                | FailureReason::AbortedLocally
                | FailureReason::AbortedByPeer
                | FailureReason::Shutdown
                | FailureReason::RoomIdReused
                | FailureReason::PeerSilent
                | FailureReason::ConnectionLost
                | FailureReason::PeerShutdown
                | FailureReason::ConnectionRefused
                | FailureReason::StaleGeneration
                | FailureReason::ChecksumMismatch
        )
    }
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The state of one room on one endpoint, as the embedding scheduler polls it.
///
/// `Bootstrapping -> WaitingForInput -> Transferring -> Success`, and `Failed(reason)` from
/// every non-terminal state. `Success` and `Failed` are terminal and never change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvPoll {
    /// Prefill: waiting for the decode's room request. Decode: waiting for pages or the handshake.
    Bootstrapping,
    /// Prefill: destinations known, waiting for chunks. Decode: request sent, waiting for data.
    WaitingForInput,
    /// Data is moving for this room.
    Transferring,
    /// Every byte of the room arrived and was acknowledged. Terminal.
    Success,
    /// The room failed for the given reason. Terminal.
    Failed(FailureReason),
}

impl KvPoll {
    /// Whether the state can never change again.
    pub fn is_terminal(self) -> bool {
        matches!(self, KvPoll::Success | KvPoll::Failed(_))
    }

    /// The reason of a failed state, `None` otherwise.
    pub fn failure(self) -> Option<FailureReason> {
        match self {
            KvPoll::Failed(reason) => Some(reason),
            _ => None,
        }
    }

    /// Rank in the lifecycle order used by consensus: Failed < Bootstrapping < ... < Success.
    pub fn order(self) -> u8 {
        match self {
            KvPoll::Failed(_) => 0,
            KvPoll::Bootstrapping => 1,
            KvPoll::WaitingForInput => 2,
            KvPoll::Transferring => 3,
            KvPoll::Success => 4,
        }
    }

    /// Checks a transition. Terminal states never change; forward moves only; `Failed` from any
    /// non-terminal state. Staying in the same non-terminal state is allowed (a no-op).
    pub fn transition(self, to: KvPoll) -> Result<KvPoll, InvalidTransition> {
        let ok = match (self, to) {
            (from, _) if from.is_terminal() => false,
            (_, KvPoll::Failed(_)) => true,
            (from, to) => to.order() >= from.order(),
        };
        if ok {
            Ok(to)
        } else {
            Err(InvalidTransition { from: self, to })
        }
    }
}

/// A room transition that the lifecycle forbids. Returned as a value, never a panic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InvalidTransition {
    /// The state the room was in.
    pub from: KvPoll,
    /// The state someone tried to move it to.
    pub to: KvPoll,
}

impl fmt::Display for InvalidTransition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid room transition {:?} -> {:?}",
            self.from, self.to
        )
    }
}

impl std::error::Error for InvalidTransition {}

/// The role of an endpoint in PD disaggregation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Computes KV and writes it into decode memory.
    Prefill,
    /// Owns the destination pages and generates with them.
    Decode,
}

impl Role {
    /// Wire code.
    pub fn code(self) -> u8 {
        match self {
            Role::Prefill => 1,
            Role::Decode => 2,
        }
    }

    /// Inverse of [`Role::code`].
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(Role::Prefill),
            2 => Some(Role::Decode),
            _ => None,
        }
    }
}
