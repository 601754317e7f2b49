//! Every error a Python caller can meet, as a typed exception: the classes, the family each
//! room failure reason belongs to, and the exception for each node error.

use kvferry_core::FailureReason;
use kvferry_tokio::NodeError;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

pyo3::create_exception!(
    _kvferry,
    KvferryError,
    PyException,
    "Base of every kvferry error."
);
pyo3::create_exception!(
    _kvferry,
    InvalidArgument,
    KvferryError,
    "A call's argument is invalid (a page index out of range, a room id in use, a bad layout)."
);
pyo3::create_exception!(
    _kvferry,
    UnknownPeer,
    InvalidArgument,
    "A peer id this node does not know: never connected, disconnected, or let go after `peer_idle_timeout` unused (connect to its addresses again)."
);
pyo3::create_exception!(
    _kvferry,
    UnsupportedMemory,
    KvferryError,
    "Registered memory this node cannot reach (GPU memory in a build without a copy engine for it); names the region."
);
pyo3::create_exception!(
    _kvferry,
    TransportUnavailable,
    KvferryError,
    "transport=\"rdma\" where this node cannot move data over RDMA (no rdma-core, no device, a device that cannot be opened); says what is missing."
);
pyo3::create_exception!(
    _kvferry,
    NodeClosed,
    KvferryError,
    "The node was shut down."
);
pyo3::create_exception!(
    _kvferry,
    ConnectError,
    KvferryError,
    "A peer could not be reached or refused the session (token, layout, role)."
);
pyo3::create_exception!(
    _kvferry,
    PeerRefused,
    ConnectError,
    "The peer refused the session at its handshake, or this node refused the peer; `args[0]` is the room failure reason's snake_case name (unauthorized, incompatible_peer, ...), `args[1]` the message naming both settings."
);
pyo3::create_exception!(
    _kvferry,
    PeerUnreachable,
    ConnectError,
    "A kept peer had no session for the whole unreachable timeout; `args[0]` names what the connection attempts found (connection_refused, peer_unreachable, ...), `args[1]` the message."
);
pyo3::create_exception!(
    _kvferry,
    HandshakeTimeout,
    ConnectError,
    "The session's handshake did not complete within the handshake timeout (the peer accepted the connection and never answered)."
);
pyo3::create_exception!(
    _kvferry,
    RoomFailed,
    KvferryError,
    "A room ended Failed; `args[0]` is the reason's snake_case name, `args[1]` its explanation."
);
pyo3::create_exception!(
    _kvferry,
    TimeoutFailure,
    RoomFailed,
    "bootstrap_timeout, waiting_timeout: a deadline passed."
);
pyo3::create_exception!(
    _kvferry,
    PeerFailure,
    RoomFailed,
    "The peer went away or cannot be used (unreachable, refused, restarted, silent, lost, shut down, blacklisted)."
);
pyo3::create_exception!(
    _kvferry,
    TransferFailure,
    RoomFailed,
    "transfer_failed: the data path failed after every retry."
);
pyo3::create_exception!(
    _kvferry,
    AbortFailure,
    RoomFailed,
    "aborted_locally, aborted_by_peer."
);
pyo3::create_exception!(
    _kvferry,
    CapacityFailure,
    RoomFailed,
    "decode_saturated: the decode had no room for it before the deadline."
);
pyo3::create_exception!(
    _kvferry,
    ProtocolFailure,
    RoomFailed,
    "protocol_error, incompatible_peer, room_id_reused, stale_generation, unauthorized: a peer or the caller broke the contract."
);
pyo3::create_exception!(
    _kvferry,
    ShutdownFailure,
    RoomFailed,
    "shutdown: this node shut down."
);

/// The exception class families a room's failure reason belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Family {
    Timeout,
    Peer,
    Transfer,
    Abort,
    Capacity,
    Protocol,
    Shutdown,
}

/// The family of `reason`; `None` for a reason this build does not know yet (a test checks
/// that every reason of the core has one).
pub(crate) fn family(reason: FailureReason) -> Option<Family> {
    use FailureReason as R;
    Some(match reason {
        R::BootstrapTimeout | R::WaitingTimeout => Family::Timeout,
        R::PeerUnreachable
        | R::PeerRestarted
        | R::PeerSilent
        | R::ConnectionLost
        | R::ConnectionRefused
        | R::PeerShutdown
        | R::SessionBlacklisted => Family::Peer,
        R::TransferFailed | R::ChecksumMismatch => Family::Transfer,
        R::AbortedLocally | R::AbortedByPeer => Family::Abort,
        R::DecodeSaturated => Family::Capacity,
        R::ProtocolError
        | R::GrantMismatch
        | R::PromptMismatch
        | R::IncompatiblePeer
        | R::RoomIdReused
        | R::StaleGeneration
        | R::Unauthorized => Family::Protocol,
        R::Shutdown => Family::Shutdown,
        #[allow(unreachable_patterns)]
        _ => return None,
    })
}

/// The exception instance for a room that failed with `reason`.
pub(crate) fn room_failure(reason: FailureReason) -> PyErr {
    let args = (reason.as_str(), reason.explain());
    match family(reason) {
        Some(Family::Timeout) => TimeoutFailure::new_err(args),
        Some(Family::Peer) => PeerFailure::new_err(args),
        Some(Family::Transfer) => TransferFailure::new_err(args),
        Some(Family::Abort) => AbortFailure::new_err(args),
        Some(Family::Capacity) => CapacityFailure::new_err(args),
        Some(Family::Protocol) => ProtocolFailure::new_err(args),
        Some(Family::Shutdown) => ShutdownFailure::new_err(args),
        None => RoomFailed::new_err(args),
    }
}

/// The exception for a node error.
pub(crate) fn node_error(e: NodeError) -> PyErr {
    let reason = e.failure_reason().map_or("", FailureReason::as_str);
    match e {
        NodeError::Api(e) => InvalidArgument::new_err(e.to_string()),
        NodeError::ShutDown => NodeClosed::new_err(e.to_string()),
        NodeError::UnknownPeer(_) => UnknownPeer::new_err(e.to_string()),
        NodeError::Disconnected => ConnectError::new_err(e.to_string()),
        NodeError::UnreachableMemory { .. } => UnsupportedMemory::new_err(e.to_string()),
        NodeError::Unsupported(
            kvferry_tokio::Unsupported::RdmaNotBuilt
            | kvferry_tokio::Unsupported::SameHostUnavailable(_)
            | kvferry_tokio::Unsupported::SameHostDeclined(_),
        )
        | NodeError::Backend(_) => TransportUnavailable::new_err(e.to_string()),
        NodeError::Unsupported(_) => InvalidArgument::new_err(e.to_string()),
        NodeError::HandshakeTimeout => HandshakeTimeout::new_err(e.to_string()),
        NodeError::Refused { .. } | NodeError::RefusedAs(_) | NodeError::Rejected(_) => {
            PeerRefused::new_err((reason, e.to_string()))
        }
        NodeError::Unreachable(_) => PeerUnreachable::new_err((reason, e.to_string())),
        other => ConnectError::new_err(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_failure_reason_of_the_core_raises_a_family_exception() {
        for reason in FailureReason::ALL {
            assert!(
                family(reason).is_some(),
                "{reason:?} has no exception family"
            );
        }
    }
}
