//! The one timer table of an endpoint: every deadline, ordered, each saying why it exists.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::ids::{ConnId, DialId, DrainId, RoomId, SessionId, TransferId};

/// Why a deadline exists. [`crate::Endpoint::poll_timeout`] returns the earliest one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Timer {
    /// A room is still Bootstrapping: no request (prefill) or no page grant (decode).
    Bootstrap(RoomId),
    /// Decode: a room heard nothing from its prefill ranks for `waiting_timeout`.
    Waiting(RoomId),
    /// Decode: an aborted room still waits for drain acknowledgements; fence at expiry.
    AbortAck(RoomId),
    /// An attempt of an operation was not reported in time.
    Operation(TransferId),
    /// An operation waits for its next attempt.
    Retry(TransferId),
    /// The peer's hello did not arrive in time.
    Handshake(SessionId),
    /// Time to send a heartbeat (and room keepalives) on a session.
    Heartbeat(SessionId),
    /// The peer has been silent for too long.
    Liveness(SessionId),
    /// Time to look whether a session went silent (and check its link with a fresh connection).
    Silence(SessionId),
    /// Time to probe a blacklisted session.
    Probe(SessionId),
    /// A blacklisted session nobody targets is forgotten.
    BlacklistIdle(SessionId),
    /// Time to reconnect to a target whose session dropped.
    Reconnect(crate::ids::TargetId),
    /// A target has been without a session for `unreachable_timeout`: rooms waiting for it fail.
    Unreachable(crate::ids::TargetId),
    /// Time to look whether a target went unused for `peer_idle_timeout` (then it is let go).
    TargetIdle(crate::ids::TargetId),
    /// A shutdown waited `shutdown_timeout` for its sessions to close: it is complete anyway.
    Shutdown,
    /// Time to replace a session's broken data connections.
    DataReconnect(SessionId),
    /// An accepted connection has not become a session's within `handshake_timeout`.
    Accepted(ConnId),
    /// The listener's pause after a failed accept is over.
    AcceptBackoff,
    /// A connection attempt has not connected within `connect_timeout`.
    Dial(DialId),
    /// A replaced data path has had `operation_timeout` to flush what it still held.
    Drain(DrainId),
    /// A closing session's control writer has had `close_linger` to send what was queued.
    Linger(SessionId),
    /// A fence of the session was not confirmed within `fence_timeout`.
    Fence(SessionId),
    /// An ended writer-fenced session's writer has had its liveness window to stop writing.
    WriterQuarantine(SessionId),
}

/// Opaque key of an armed timer, kept by its owner to disarm it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct TimerKey(Instant, u64);

/// All deadlines of one endpoint in one ordered map; the minimum is the next wake-up.
#[derive(Debug, Default)]
pub(crate) struct TimerTable {
    map: BTreeMap<TimerKey, Timer>,
    seq: u64,
}

impl TimerTable {
    /// Arms `timer` at `at`, disarming `old` first. Returns the new key.
    pub(crate) fn set(&mut self, old: &mut Option<TimerKey>, at: Instant, timer: Timer) {
        self.cancel(old);
        self.seq += 1;
        let key = TimerKey(at, self.seq);
        self.map.insert(key, timer);
        *old = Some(key);
    }

    /// Disarms the timer stored in `slot`, if any.
    pub(crate) fn cancel(&mut self, slot: &mut Option<TimerKey>) {
        if let Some(key) = slot.take() {
            self.map.remove(&key);
        }
    }

    /// The earliest deadline and its reason.
    pub(crate) fn next(&self) -> Option<(Instant, Timer)> {
        self.map.first_key_value().map(|(k, t)| (k.0, *t))
    }

    /// Removes and returns the earliest timer due at or before `now`.
    pub(crate) fn pop_due(&mut self, now: Instant) -> Option<(TimerKey, Timer)> {
        let entry = self.map.first_entry()?;
        if entry.key().0 > now {
            return None;
        }
        let key = *entry.key();
        Some((key, entry.remove()))
    }

    /// Number of armed timers.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}
