//! The listener's and the dialer's waits: connections accepted and not yet a session's,
//! connection attempts not yet connected and replaced data paths not yet drained, each with
//! its deadline, and the pause after a failed accept. The driver only holds the sockets; when
//! each wait ends is decided here, so the simulation fires these deadlines like any other.
//!
//! Invariants (of [`Deadlines`], held by the [`Listener`] for accepted connections and by
//! the endpoint for dials and drains, and of the [`Listener`]'s pause):
//! - every pending connection has exactly one armed [`Timer::Accepted`]; when it fires the
//!   connection is forgotten and exactly one [`Action::DropAccepted`] names it (a pending
//!   dial likewise: [`Timer::Dial`], [`Action::AbandonDial`]; a drain: [`Timer::Drain`],
//!   [`Action::StopDraining`]);
//! - one settled first is forgotten with its timer disarmed, so it never expires after it
//!   settled (an accepted connection that became a session's: its session's own handshake
//!   timer takes over); a settle after it expired is ignored, and ids are never reused;
//! - the listener is paused exactly while [`Timer::AcceptBackoff`] is armed, and
//!   [`Action::ResumeAccepting`] goes out once when it fires.

use std::time::Instant;

use tracing::{debug, info, warn};

use super::targets::dial_timeout_cap;
use super::{Endpoint, Map};
use crate::api::{Action, ConnectFailure};
use crate::ids::{ConnId, DialId, DrainId, SessionId};
use crate::timer::{Timer, TimerKey, TimerTable};

/// Attempts in progress, each with one deadline: accepted connections not yet a session's
/// ([`Timer::Accepted`]), connection attempts not yet connected ([`Timer::Dial`]) or
/// replaced data paths not yet drained ([`Timer::Drain`]).
///
/// Invariants: every pending attempt has exactly one armed timer; when it fires the attempt
/// is forgotten and `expire` says so exactly once; an attempt settled first is forgotten with
/// its timer disarmed, so it never expires after it settled.
#[derive(Debug)]
pub(super) struct Deadlines<Id> {
    /// Each pending attempt's deadline.
    pending: Map<Id, Option<TimerKey>>,
    /// Attempts so far (numbers them).
    issued: u64,
}

impl<Id> Default for Deadlines<Id> {
    fn default() -> Self {
        Deadlines {
            pending: Map::default(),
            issued: 0,
        }
    }
}

impl<Id: Copy + Eq + std::hash::Hash> Deadlines<Id> {
    /// Numbers a new attempt (`id` of the count) and arms its deadline (`timer`) at `at`.
    pub(super) fn start(
        &mut self,
        timers: &mut TimerTable,
        at: Instant,
        id: fn(u64) -> Id,
        timer: fn(Id) -> Timer,
    ) -> Id {
        self.issued += 1;
        let this = id(self.issued);
        let mut slot = None;
        timers.set(&mut slot, at, timer(this));
        self.pending.insert(this, slot);
        this
    }

    /// Makes `id` pending again (its deadline expired) until `at`.
    pub(super) fn keep(
        &mut self,
        timers: &mut TimerTable,
        id: Id,
        at: Instant,
        timer: fn(Id) -> Timer,
    ) {
        timers.set(self.pending.entry(id).or_default(), at, timer(id));
    }

    /// Moves pending `id`'s deadline to `at`; `false` if it was not pending.
    pub(super) fn rearm(
        &mut self,
        timers: &mut TimerTable,
        id: Id,
        at: Instant,
        timer: fn(Id) -> Timer,
    ) -> bool {
        match self.pending.get_mut(&id) {
            Some(slot) => {
                timers.set(slot, at, timer(id));
                true
            }
            None => false,
        }
    }

    /// Forgets `id` and disarms its deadline; `false` if it was not pending.
    pub(super) fn settle(&mut self, timers: &mut TimerTable, id: Id) -> bool {
        match self.pending.remove(&id) {
            Some(mut slot) => {
                timers.cancel(&mut slot);
                true
            }
            None => false,
        }
    }

    /// `id`'s deadline (`key`) fired: forgets it; `true` if it was still pending.
    pub(super) fn expire(&mut self, id: Id, key: TimerKey) -> bool {
        let due = self.pending.get(&id).is_some_and(|slot| *slot == Some(key));
        if due {
            self.pending.remove(&id);
        }
        due
    }

    /// Attempts still pending.
    pub(super) fn len(&self) -> usize {
        self.pending.len()
    }
}

/// Accepted connections waiting to become a session's, and the accept backoff.
#[derive(Debug, Default)]
pub(super) struct Listener {
    /// Each pending connection's deadline.
    pending: Deadlines<ConnId>,
    /// Armed while accepting is paused after a failed accept.
    backoff: Option<TimerKey>,
}

impl Listener {
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
        let conn = self.listener.pending.start(
            &mut self.timers,
            now + self.config.handshake_timeout,
            ConnId,
            Timer::Accepted,
        );
        debug!(%conn, "connection accepted");
        conn
    }

    /// Input: an accepted connection became a session's control or data connection, or
    /// ended (garbage, refused, closed by the peer): its deadline no longer applies.
    pub fn handle_accept_settled(&mut self, conn: ConnId) {
        self.listener.pending.settle(&mut self.timers, conn);
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

    /// Input: the driver started a caller's one-shot connection attempt (a data
    /// connection's starts with [`Endpoint::handle_data_dial_started`], a target's is the
    /// core's own [`Action::Connect`]). No later attempt learns from it, so it gets the
    /// longest deadline a target's attempt may reach (8 x `connect_timeout`): a link slower
    /// than `connect_timeout` is still reached. If it has not connected by then,
    /// [`Action::AbandonDial`] names it and the driver gives it up as timed out. Report it
    /// settled ([`Endpoint::handle_dial_settled`]) as soon as it connected or failed.
    pub fn handle_dial_started(&mut self, now: Instant) -> DialId {
        let now = self.clock(now);
        self.dials.start(
            &mut self.timers,
            now + dial_timeout_cap(&self.config),
            DialId,
            Timer::Dial,
        )
    }

    /// Input: the driver started dialing one of `session`'s data connections
    /// ([`Action::OpenDataConnection`]). Its deadline is the session's: `connect_timeout`, or
    /// twice what the session's own handshake took if that was longer, doubled after each of
    /// the session's data dials that timed out (up to `handshake_timeout`), so a link slower
    /// than `connect_timeout` still gets its data connections. Settle it as any dial.
    pub fn handle_data_dial_started(&mut self, now: Instant, session: SessionId) -> DialId {
        let now = self.clock(now);
        let timeout = self
            .sessions
            .get(&session)
            .map_or(self.config.connect_timeout, |s| s.data_dials.timeout());
        let dial = self
            .dials
            .start(&mut self.timers, now + timeout, DialId, Timer::Dial);
        if let Some(s) = self.sessions.get_mut(&session) {
            s.data_dials.started(dial);
        }
        dial
    }

    /// Input: the driver begins a target's attempt ([`Action::Connect`]) now, which may be a
    /// while after the core asked for it (a busy machine runs the task late): its
    /// deadline counts from now, so the wait for a CPU is not taken for a peer that
    /// does not answer. An attempt the driver never begins still ends at the deadline the
    /// core set when it asked.
    pub fn handle_dial_began(&mut self, now: Instant, dial: DialId) {
        let now = self.clock(now);
        let abandoning = self.targets.abandoning(dial);
        if !abandoning {
            let timeout = self
                .targets
                .of_dial(dial)
                .and_then(|t| self.targets.get(&t))
                .map_or(self.config.connect_timeout, |t| t.dial_timeout);
            self.dials
                .rearm(&mut self.timers, dial, now + timeout, Timer::Dial);
        }
    }

    /// Input: a connection attempt connected or failed: its deadline no longer applies.
    /// A target's attempt ([`Action::Connect`]) is not settled here but by its outcome, so a
    /// connection that never becomes the target's session still ends at its deadline.
    pub fn handle_dial_settled(&mut self, dial: DialId) {
        if self.targets.of_dial(dial).is_none() {
            self.dials.settle(&mut self.timers, dial);
            self.sessions.settle_data_dial(dial);
        }
    }

    /// Connection attempts still under way.
    pub fn dials_pending(&self) -> usize {
        self.dials.len()
    }

    /// Input: a data path was replaced while operations were outstanding on it (an RDMA
    /// queue pair in the error state flushes them as completions): the driver collects what
    /// it flushes until [`Action::StopDraining`], one `operation_timeout` later (every
    /// operation it held has timed out in the core by then). Report it settled
    /// ([`Endpoint::handle_drain_settled`]) when it is drained first.
    pub fn handle_drain_started(&mut self, now: Instant) -> DrainId {
        let now = self.clock(now);
        self.drains.start(
            &mut self.timers,
            now + self.config.operation_timeout,
            DrainId,
            Timer::Drain,
        )
    }

    /// Input: a replaced data path is drained (or gone): its deadline no longer applies.
    pub fn handle_drain_settled(&mut self, drain: DrainId) {
        self.drains.settle(&mut self.timers, drain);
    }

    /// Replaced data paths still draining.
    pub fn drains_pending(&self) -> usize {
        self.drains.len()
    }

    pub(super) fn on_drain_timer(&mut self, drain: DrainId, key: TimerKey) {
        if self.drains.expire(drain, key) {
            debug!(%drain, "replaced data path not drained within operation_timeout; stop collecting");
            self.outbox.action(Action::StopDraining(drain));
        }
    }

    pub(super) fn on_dial_timer(&mut self, now: Instant, dial: DialId, key: TimerKey) {
        if !self.dials.expire(dial, key) {
            return;
        }
        let Some(target) = self.targets.of_dial(dial) else {
            match self.sessions.data_dial_timed_out(dial) {
                Some((session, next)) => {
                    info!(%session, %dial, next_ms = next.as_millis() as u64, "data connection did not open in time; the session's next dials wait longer");
                }
                None => {
                    debug!(%dial, "connection attempt did not connect within its deadline; abandoning it")
                }
            }
            self.outbox.action(Action::AbandonDial(dial));
            return;
        };
        let check = self.target_session(target).is_some();
        let Some(t) = self.targets.get_mut(&target) else {
            return;
        };
        if t.attempt.abandon() {
            // The driver gives it up and says what it found (a refusal it had not read yet on
            // a busy machine is still a refusal); it has one more connect_timeout for that.
            debug!(%dial, "target's attempt did not connect within its deadline; abandoning it");
            if !check {
                t.attempt_timed_out(&self.config);
            }
            self.outbox.action(Action::AbandonDial(dial));
            let at = now + self.config.connect_timeout;
            self.dials.keep(&mut self.timers, dial, at, Timer::Dial);
            return;
        }
        // Its driver never said how it ended (a task lost): counted here, as no answer.
        debug!(%dial, "target's attempt never reported; counted as no answer");
        self.target_attempt_failed(now, target, ConnectFailure::NoAnswer);
    }

    pub(super) fn on_accepted_timer(&mut self, conn: ConnId, key: TimerKey) {
        if self.listener.pending.expire(conn, key) {
            warn!(%conn, "accepted connection did not become a session's in time; dropping it");
            self.outbox.action(Action::DropAccepted(conn));
        }
    }

    pub(super) fn on_accept_backoff_timer(&mut self, key: TimerKey) {
        if self.listener.resume(key) {
            self.outbox.action(Action::ResumeAccepting);
        }
    }
}
