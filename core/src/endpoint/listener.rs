//! The listener's waits: connections accepted and not yet a session's, each with its
//! deadline, and the pause after a failed accept. The driver only holds the sockets; when
//! each wait ends is decided here, so the simulation fires these deadlines like any other.
//!
//! Invariants of [`Listener`]:
//! - every pending connection has exactly one armed [`Timer::Accepted`]; when it fires the
//!   connection is forgotten and exactly one [`Action::DropAccepted`] names it;
//! - a connection settled first is forgotten with its timer disarmed, so it is never dropped
//!   after it became a session's (its session's own handshake timer takes over);
//! - the listener is paused exactly while [`Timer::AcceptBackoff`] is armed, and
//!   [`Action::ResumeAccepting`] goes out once when it fires.

use std::time::Instant;

use tracing::{debug, warn};

use super::{Endpoint, Map};
use crate::api::Action;
use crate::ids::ConnId;
use crate::timer::{Timer, TimerKey, TimerTable};

/// Accepted connections waiting to become a session's, and the accept backoff.
#[derive(Debug, Default)]
pub(super) struct Listener {
    /// Each pending connection's deadline.
    pending: Map<ConnId, Option<TimerKey>>,
    /// Connections accepted so far (numbers them).
    accepted: u64,
    /// Armed while accepting is paused after a failed accept.
    backoff: Option<TimerKey>,
}

impl Listener {
    /// Numbers a new connection and arms its deadline at `at`.
    fn accept(&mut self, timers: &mut TimerTable, at: Instant) -> ConnId {
        self.accepted += 1;
        let conn = ConnId(self.accepted);
        let mut slot = None;
        timers.set(&mut slot, at, Timer::Accepted(conn));
        self.pending.insert(conn, slot);
        conn
    }

    /// Forgets `conn` and disarms its deadline; `false` if it was not pending.
    fn settle(&mut self, timers: &mut TimerTable, conn: ConnId) -> bool {
        match self.pending.remove(&conn) {
            Some(mut slot) => {
                timers.cancel(&mut slot);
                true
            }
            None => false,
        }
    }

    /// `conn`'s deadline (`key`) fired: forgets it; `true` if it was still pending.
    fn expire(&mut self, conn: ConnId, key: TimerKey) -> bool {
        let due = self
            .pending
            .get(&conn)
            .is_some_and(|slot| *slot == Some(key));
        if due {
            self.pending.remove(&conn);
        }
        due
    }

    /// Pauses accepting until `at` (a pause already running is extended).
    fn pause(&mut self, timers: &mut TimerTable, at: Instant) {
        timers.set(&mut self.backoff, at, Timer::AcceptBackoff);
    }

    /// The backoff (`key`) fired: `true` if it is the one armed (accepting resumes).
    fn resume(&mut self, key: TimerKey) -> bool {
        let due = self.backoff == Some(key);
        if due {
            self.backoff = None;
        }
        due
    }
}

impl Endpoint {
    /// Input: the listener accepted a connection. It has `handshake_timeout` to become a
    /// session's (TLS handshake, preamble, and a control hello or a data connection's hello
    /// and answer); if it has not by then, [`Action::DropAccepted`] names it. Report it
    /// settled ([`Endpoint::handle_accept_settled`]) as soon as it is a session's or gone.
    pub fn handle_accepted(&mut self, now: Instant) -> ConnId {
        let now = self.clock(now);
        let conn = self
            .listener
            .accept(&mut self.timers, now + self.config.handshake_timeout);
        debug!(%conn, "connection accepted");
        conn
    }

    /// Input: an accepted connection became a session's control or data connection, or
    /// ended (garbage, refused, closed by the peer): its deadline no longer applies.
    pub fn handle_accept_settled(&mut self, conn: ConnId) {
        self.listener.settle(&mut self.timers, conn);
    }

    /// Input: the listener failed to accept (out of descriptors, say). Accepting pauses for
    /// `accept_backoff`; [`Action::ResumeAccepting`] says when to accept again.
    pub fn handle_accept_failed(&mut self, now: Instant) {
        let now = self.clock(now);
        self.listener
            .pause(&mut self.timers, now + self.config.accept_backoff);
    }

    /// Accepted connections still waiting to become a session's.
    pub fn accepted_pending(&self) -> usize {
        self.listener.pending.len()
    }

    pub(super) fn on_accepted_timer(&mut self, conn: ConnId, key: TimerKey) {
        if self.listener.expire(conn, key) {
            warn!(%conn, "accepted connection did not become a session's in time; dropping it");
            self.actions.push_back(Action::DropAccepted(conn));
        }
    }

    pub(super) fn on_accept_backoff_timer(&mut self, key: TimerKey) {
        if self.listener.resume(key) {
            self.actions.push_back(Action::ResumeAccepting);
        }
    }
}
