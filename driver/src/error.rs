//! What the node's embedder-facing calls return when they fail: typed, matchable, with
//! sources.

use crate::PeerId;

use kvferry_core::{ApiError, FailureReason};

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
    /// No peer has this id on this node (never had, it was disconnected, or the core let it
    /// go after `peer_idle_timeout` unused: connect again).
    UnknownPeer(PeerId),
    /// The embedder disconnected the peer this call waited for ([`crate::Node::disconnect`]).
    Disconnected,
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

impl NodeError {
    /// The room failure this error amounts to, for a session that was refused or a peer
    /// that stayed unreachable (`None` for the other errors).
    pub fn failure_reason(&self) -> Option<FailureReason> {
        match self {
            NodeError::Refused { code, .. } => Some(code.failure_reason()),
            NodeError::RefusedAs(reason) | NodeError::Unreachable(reason) => Some(*reason),
            NodeError::Rejected(reason) => Some(reason.failure_reason()),
            NodeError::HandshakeTimeout => Some(FailureReason::PeerSilent),
            _ => None,
        }
    }
}

/// A combination a node refuses to start with, and what to do instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unsupported {
    /// RDMA in a build without the `rdma` feature.
    RdmaNotBuilt,
    /// The end-to-end checksum over the RDMA backend with device memory: one-sided writes
    /// are verified by hashing the landed bytes on the CPU, which cannot read device memory.
    ChecksumOverRdmaDevice,
    /// The same-host path required (`SameHost::Required`) on a node that cannot take it;
    /// why, as a decline names it.
    SameHostUnavailable(&'static str),
    /// The same-host path required and a session that cannot take it (this side refused
    /// it); why, as the decline names it.
    SameHostDeclined(&'static str),
}

impl std::fmt::Display for Unsupported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Unsupported::RdmaNotBuilt => "this build has no RDMA support: rebuild with the `rdma` feature, or use --backend tcp",
            Unsupported::ChecksumOverRdmaDevice => "the end-to-end checksum (KVFERRY_CHECKSUM) over the RDMA backend hashes host memory only, and this node's KV is in device memory; turn it off or use the TCP backend (which hashes device memory in its staging buffers)",
            Unsupported::SameHostDeclined(why) => {
                return write!(f, "this node requires the same-host path (transport=same-host) and refused a session that cannot take it: {why}; use transport=auto to fall back to the network");
            }
            Unsupported::SameHostUnavailable(why) => {
                return write!(f, "the same-host path is required (transport=same-host) and this node cannot take it: {why}; use transport=auto to fall back to the network");
            }
        })
    }
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
                write!(
                    f,
                    "no peer {} on this node (connect to it first; a disconnected peer is gone)",
                    p.0
                )
            }
            NodeError::Disconnected => {
                write!(
                    f,
                    "the peer was disconnected by this node while the call waited for it"
                )
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
    /// The core's `ShutDown` is the node's: one error for a shut-down node, however far its
    /// stopping had gone when the call came.
    fn from(e: ApiError) -> Self {
        match e {
            ApiError::ShutDown => NodeError::ShutDown,
            e => NodeError::Api(e),
        }
    }
}
