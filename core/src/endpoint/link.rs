//! Links to peers: targets the core keeps connected, link checks of silent sessions, and closing sessions.

use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::api::{Action, ApiError, ConnectFailure, Event, Link, SessionState};
use crate::codec::{ErrorCode, Message};
use crate::ids::{DialId, SessionId, TargetId};
use crate::state::{FailureReason, KvPoll};
use crate::timer::Timer;

use super::sessions::RememberedBlacklist;
use super::targets::LinkEvidence;
use super::{Endpoint, Side, WriterQuarantine};

impl Endpoint {
    /// Registers a peer to stay connected to. The core asks for a connection at once
    /// ([`Action::Connect`]) and again, with exponential backoff and jitter, whenever the
    /// session drops or the connection attempt fails, until [`Endpoint::remove_target`].
    pub fn add_target(&mut self, now: Instant) -> TargetId {
        let now = self.clock(now);
        let id = self.targets.add(now, &self.config, &mut self.timers);
        self.dial(id);
        id
    }

    /// Stops reconnecting a target (its current session, if any, stays until it ends). A
    /// connection of an attempt still under way is closed as soon as it arrives
    /// ([`Endpoint::open_session_for`]).
    pub fn remove_target(&mut self, target: TargetId) {
        self.targets.remove(target, &mut self.timers);
    }

    /// The embedder lets a kept peer go: the target is removed ([`Endpoint::remove_target`]),
    /// its session and a link check's fresh one are disconnected ([`Endpoint::disconnect`]),
    /// and rooms waiting for it fail `AbortedLocally`.
    pub fn disconnect_target(&mut self, now: Instant, target: TargetId) {
        let now = self.clock(now);
        let Some(t) = self.targets.get(&target) else {
            return;
        };
        let sessions: Vec<SessionId> = t.session.into_iter().chain(t.check).collect();
        let waiting = t.waiting.clone();
        self.remove_target(target);
        for sid in sessions {
            self.disconnect(now, sid);
        }
        // Rooms still waiting for its session would wait for nothing.
        for room in waiting {
            self.fail_room(now, room, FailureReason::AbortedLocally);
        }
    }

    /// A target's idle timer fired: a target with no room (waiting for it, or on its session)
    /// since `peer_idle_timeout` is let go ([`Event::TargetLetGo`]) like
    /// [`Endpoint::disconnect_target`]; one still in use is looked at again later.
    pub(super) fn on_target_idle(&mut self, now: Instant, target: TargetId) {
        let idle = self.config.peer_idle_timeout;
        let Some(t) = self.targets.get_mut(&target) else {
            return;
        };
        // Rooms that ended elsewhere (aborted, timed out) leave no claim on the target.
        let rooms = &self.rooms;
        t.waiting.retain(|r| rooms.contains(r));
        let sessions = &self.sessions;
        let in_use = !t.waiting.is_empty()
            || t.session
                .into_iter()
                .chain(t.check)
                .any(|sid| sessions.get(&sid).is_some_and(|s| !s.rooms.is_empty()));
        let due = if in_use {
            now + idle
        } else {
            t.last_used + idle
        };
        if due > now {
            self.timers
                .set(&mut t.idle_timer, due, Timer::TargetIdle(target));
            return;
        }
        info!(%target, session = ?t.session, idle_ms = idle.as_millis() as u64, "kept peer unused for the idle timeout, letting it go");
        self.counters.peers_let_go += 1;
        self.outbox.event(Event::TargetLetGo { target });
        self.disconnect_target(now, target);
    }

    /// The embedder no longer needs `session` (it let the peer go, or a connect of several
    /// addresses failed part-way): rooms still on it fail `AbortedLocally`, the peer hears an
    /// orderly goodbye (`Error(Shutdown)`, its rooms fail `PeerShutdown`), and the driver
    /// closes it ([`Action::CloseSession`]). A session a kept peer's target holds stays: let
    /// the target go instead ([`Endpoint::disconnect_target`]).
    pub fn disconnect(&mut self, now: Instant, session: SessionId) {
        let now = self.clock(now);
        // A session a kept peer follows (one connection served both after a take-over)
        // stays while that target does.
        if self.targets.hold(session) {
            debug!(%session, "disconnect: still a kept peer's session; kept");
            return;
        }
        debug!(%session, "disconnected by the embedder");
        self.close_session(
            now,
            session,
            ErrorCode::Shutdown,
            "disconnected by its embedder",
            FailureReason::AbortedLocally,
        );
    }

    /// The driver connected to a target: like [`Endpoint::open_session`], bound to it. While
    /// the target's session is silent this is a link check: if its handshake completes with
    /// the same peer process, it takes the silent session's work over.
    pub fn open_session_for(&mut self, now: Instant, target: TargetId) -> SessionId {
        let sid = self.open_session(now);
        if !self.targets.contains(&target) {
            // The target was removed while this attempt was under way: nobody wants it.
            self.disconnect(now, sid);
            return sid;
        }
        let check_deadline = self.last_now + self.config.silence_timeout;
        let live = self.target_session(target);
        if let Some(t) = self.targets.get_mut(&target) {
            debug!(%target, session = %sid, check = live.is_some(), "connected to target");
            if let Some(dial) = t.attempt.end() {
                self.dials.settle(&mut self.timers, dial);
            }
            if live.is_some() {
                t.check = Some(sid);
            } else {
                t.session = Some(sid);
            }
            if let Some(s) = self.sessions.get_mut(&sid) {
                s.target = Some(target);
                if live.is_some() {
                    // A link check: a peer that took the connection but says nothing is silent.
                    self.timers.set(
                        &mut s.timers.handshake,
                        check_deadline,
                        Timer::Handshake(sid),
                    );
                }
            }
        }
        sid
    }

    /// The driver could not connect for a target's attempt `dial` ([`Action::Connect`]): the
    /// failure is evidence for the reason of rooms that wait for it, and the core tries again
    /// (after the shortest pause following a timeout, which paced the attempt already; with
    /// backoff after a refusal). An attempt the core already counted as no answer (its driver
    /// said nothing within one more `connect_timeout`) is not counted again, but what it found
    /// still names the reason of rooms waiting for the peer.
    pub fn handle_connect_failed(&mut self, now: Instant, dial: DialId, failure: ConnectFailure) {
        let now = self.clock(now);
        let Some(target) = self.targets.of_dial(dial) else {
            // An attempt its deadline ended: what it found still says what the peer is.
            for t in self.targets.values_mut() {
                if t.attempt.late_report(dial) {
                    t.evidence = Some(LinkEvidence::of(failure));
                    break;
                }
            }
            debug!(%dial, ?failure, "connect failure of an attempt already given up");
            return;
        };
        self.target_attempt_failed(now, target, failure);
    }

    /// `target`'s attempt ended without a connection.
    pub(super) fn target_attempt_failed(
        &mut self,
        now: Instant,
        target: TargetId,
        failure: ConnectFailure,
    ) {
        let live = self.target_session(target);
        let checking = live
            .and_then(|s| self.sessions.get(&s))
            .is_some_and(|s| s.liveness.checking());
        let Some(t) = self.targets.get_mut(&target) else {
            return;
        };
        if let Some(dial) = t.attempt.end() {
            self.dials.settle(&mut self.timers, dial);
        }
        t.evidence = Some(LinkEvidence::of(failure));
        if live.is_some() {
            // A link check: an attempt that timed out paced itself, so the next one goes out
            // at once (a heal is found within one connect timeout); after a refusal the
            // silence timer paces the next one.
            if checking && failure == ConnectFailure::NoAnswer {
                self.dial(target);
            }
            return;
        }
        self.schedule_reconnect(now, target, failure == ConnectFailure::NoAnswer);
    }

    /// The reason for rooms that gave up on `target`, from what its connection attempts found.
    pub(super) fn unreachable_reason(&self, target: TargetId) -> FailureReason {
        // A target is only ever waited for after an attempt failed; without one, say so.
        self.targets
            .get(&target)
            .and_then(|t| t.evidence)
            .map_or(FailureReason::PeerUnreachable, LinkEvidence::reason)
    }

    /// The established session of a target, if it has one now.
    pub fn target_session(&self, target: TargetId) -> Option<SessionId> {
        let sid = self.targets.get(&target)?.session?;
        match self.sessions.get(&sid)?.state {
            SessionState::Established | SessionState::Blacklisted => Some(sid),
            _ => None,
        }
    }

    /// Why the peer at `target` refused us at the handshake, if its last attempt was refused
    /// ([`Event::TargetRefused`]).
    pub fn target_refused(&self, target: TargetId) -> Option<FailureReason> {
        match self.targets.get(&target)?.evidence? {
            LinkEvidence::Rejected(reason) => Some(reason),
            _ => None,
        }
    }

    /// Why `target` is unreachable, once it has been down for the whole `unreachable_timeout`
    /// ([`Event::TargetUnreachable`]).
    pub fn target_unreachable(&self, target: TargetId) -> Option<FailureReason> {
        let t = self.targets.get(&target)?;
        t.unreachable_reported
            .then(|| self.unreachable_reason(target))
    }

    /// The session `link` stands for now, if it has an established one.
    pub fn link_session(&self, link: Link) -> Option<SessionId> {
        match link {
            Link::Session(s) => Some(self.heir(s)),
            Link::Target(t) => self.target_session(t),
        }
    }

    /// Arms the next connection attempt. `paced`: the last attempt timed out, so it already
    /// waited; try again after the shortest interval (a healed link is found within it).
    pub(super) fn schedule_reconnect(&mut self, now: Instant, target: TargetId, paced: bool) {
        let max = self.config.reconnect_max_interval;
        let shortest = self.config.reconnect_interval;
        let window = self.config.unreachable_timeout;
        let shut_down = self.shutdown.begun();
        let Some(t) = self.targets.get_mut(&target) else {
            return;
        };
        t.session = None;
        if shut_down {
            // A node going away dials no one again.
            return;
        }
        let since = *t.down_since.get_or_insert(now);
        if t.unreachable_timer.is_none() && !t.unreachable_reported {
            self.timers.set(
                &mut t.unreachable_timer,
                since + window,
                Timer::Unreachable(target),
            );
        }
        let base = if paced { shortest } else { t.backoff };
        let jitter = Duration::from_nanos(self.rng.below(base.as_nanos() as u64 / 4 + 1));
        self.timers
            .set(&mut t.timer, now + base + jitter, Timer::Reconnect(target));
        if !paced {
            t.backoff = (base * 2).min(max);
        }
    }

    /// Whether a closing session's control writer is lingering (its `close_linger` not over).
    pub fn session_lingers(&self, session: SessionId) -> bool {
        self.sessions
            .get(&session)
            .is_some_and(|s| s.timers.linger.is_some())
    }

    /// The session's control connection is gone and the driver closed its data connections:
    /// nothing of this session can be written any more (this counts as a fence).
    pub fn handle_disconnected(&mut self, now: Instant, session: SessionId) {
        let now = self.clock(now);
        self.hand_over_before_end(session);
        let Some(s) = self.sessions.get(&session) else {
            return;
        };
        let reason = s.close_reason;
        let superseded = self.successions.is_superseded(session);
        match s.peer {
            _ if superseded => {
                debug!(%session, "superseded connection closed");
            }
            Some(peer) if reason == FailureReason::PeerShutdown && s.rooms.is_empty() => {
                // An orderly goodbye with nothing at stake is not a loss worth a warning.
                info!(%session, node = %peer.node, "peer shut down");
            }
            Some(peer) if reason == FailureReason::AbortedLocally => {
                info!(%session, node = %peer.node, rooms = s.rooms.len(), "session closed: disconnected by the embedder");
            }
            Some(peer) if reason != FailureReason::Shutdown => {
                warn!(%session, node = %peer.node, %reason, rooms = s.rooms.len(), "lost the peer");
            }
            Some(peer) => info!(%session, node = %peer.node, "session closed by our shutdown"),
            None => debug!(%session, %reason, "session ended before its handshake"),
        }
        let (state, peer, last_targeted) = (s.state, s.peer, s.last_targeted);
        if let (SessionState::Blacklisted, Some(peer)) = (state, peer) {
            let until = last_targeted + self.config.blacklist_idle_timeout;
            self.sessions.remember_blacklist(
                peer.node,
                RememberedBlacklist {
                    incarnation: peer.incarnation,
                    until,
                },
            );
        }
        if let Some(peer) = peer {
            self.sessions.forget_node(peer.node, session);
        }
        self.fail_session_rooms(now, session, reason);
        self.settle_session_ops(now, session, false);
        let writer_fenced = self
            .sessions
            .get(&session)
            .is_some_and(|s| s.writer.may_write_after_end());
        if writer_fenced {
            self.quarantine_until_writer_gives_up(now, session);
        } else {
            self.fence_done(now, session);
        }
        if self.successions.connection_gone(session) {
            // Ended for good: links to it (or to sessions it took over) ended with it.
            self.remember_ended(session, reason);
        }
        self.grants.remove_session(session);
        if let Some(mut s) = self.sessions.remove(&session) {
            if let Some(old) = s.resumes.take() {
                // A fresh connection that ended unused: the session it was to take over goes on.
                self.resume_unused(old);
            }
            s.timers.cancel_all(&mut self.timers);
        }
        self.outbox.event(Event::SessionClosed { session });
        let refused = matches!(
            reason,
            FailureReason::Unauthorized | FailureReason::IncompatiblePeer
        );
        for (&id, t) in self.targets.iter_mut() {
            if refused && (t.check == Some(session) || t.session == Some(session)) {
                t.evidence = Some(LinkEvidence::Rejected(reason));
                self.outbox
                    .event(Event::TargetRefused { target: id, reason });
            }
            if t.check == Some(session) {
                t.check = None;
            }
        }
        for target in self.targets.on_session(session) {
            self.schedule_reconnect(now, target, false);
        }
        if self.sessions.is_empty() {
            self.finish_shutdown();
        }
    }

    /// One data connection of a live session ended on its own (not by a fence or a close):
    /// the side that dialed the session replaces it after `data_reconnect_interval`
    /// ([`Action::OpenDataConnection`]); the other side waits for the dialer's.
    pub fn handle_data_connection_lost(&mut self, now: Instant, session: SessionId) {
        let now = self.clock(now);
        let wait = self.config.data_reconnect_interval;
        let Some(s) = self.sessions.get_mut(&session) else {
            return;
        };
        let live = matches!(
            s.state,
            SessionState::Established | SessionState::Blacklisted
        );
        if !live || s.inbound || s.ops.fencing() || self.successions.is_superseded(session) {
            return;
        }
        s.data_lost += 1;
        if s.timers.data.is_none() {
            self.timers.set(
                &mut s.timers.data,
                now + wait,
                Timer::DataReconnect(session),
            );
        }
    }

    /// Decode: `sid` ended and only its writer could stop its writes: its rooms' pages stay
    /// quarantined for its liveness window and a heartbeat (the writer gives up a session it
    /// has not heard for that long, and writes nothing after), or until the writer exits.
    fn quarantine_until_writer_gives_up(&mut self, now: Instant, sid: SessionId) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        s.epoch = s.epoch.wrapping_add(1);
        self.grants.set_epoch(sid, s.epoch);
        let until = now + s.liveness.window() + self.config.heartbeat_interval;
        let rooms = self.rooms_written_by(sid);
        if rooms.is_empty() {
            return;
        }
        info!(session = %sid, rooms = rooms.len(), wait = ?(until - now), "session ended before its writer confirmed it stopped: its rooms' pages stay quarantined");
        let mut q = WriterQuarantine { rooms, timer: None };
        self.timers
            .set(&mut q.timer, until, Timer::WriterQuarantine(sid));
        self.writer_quarantines.insert(sid, q);
    }

    /// The driver carried out [`Action::FenceSession`]: no write of this session that was in
    /// flight before can land any more.
    pub fn handle_fence_complete(&mut self, now: Instant, session: SessionId) {
        let now = self.clock(now);
        let Some(s) = self.sessions.get_mut(&session) else {
            return;
        };
        if !s.ops.end_fence() {
            return;
        }
        self.timers.cancel(&mut s.timers.fence);
        self.settle_session_ops(now, session, true);
        self.fence_done(now, session);
        self.mark_ready(session);
    }

    /// Sends bytes from this side's data-plane backend to the peer's (for example the RDMA
    /// hello); the peer's endpoint emits [`Event::TransportReceived`]. Only on an established
    /// session, at most [`crate::codec::MAX_TRANSPORT_LEN`] bytes.
    pub fn send_transport(
        &mut self,
        now: Instant,
        session: SessionId,
        payload: &[u8],
    ) -> Result<(), ApiError> {
        let _ = self.clock(now);
        if payload.len() > crate::codec::MAX_TRANSPORT_LEN {
            return Err(ApiError::TransportTooLong(payload.len()));
        }
        let s = self
            .sessions
            .get(&session)
            .ok_or(ApiError::UnknownSession(session))?;
        if !matches!(
            s.state,
            SessionState::Established | SessionState::Blacklisted
        ) {
            return Err(ApiError::SessionNotReady(session));
        }
        self.outbox.transmit(
            session,
            Message::Transport {
                payload: payload.to_vec(),
            },
        );
        Ok(())
    }

    /// The sessions behind `links` if every one has an established session now; `None` if a
    /// target has none yet.
    pub(super) fn resolve_links(&self, links: &[Link]) -> Result<Option<Vec<SessionId>>, ApiError> {
        if links.is_empty() {
            return Err(ApiError::NoSources);
        }
        let mut sessions = Vec::with_capacity(links.len());
        let mut all = true;
        for link in links {
            match *link {
                Link::Session(sid) => sessions.push(self.heir(sid)),
                Link::Target(t) => {
                    if !self.targets.contains(&t) {
                        return Err(ApiError::UnknownTarget(t));
                    }
                    match self.target_session(t) {
                        Some(sid) => sessions.push(sid),
                        None => all = false,
                    }
                }
            }
        }
        Ok(all.then_some(sessions))
    }

    /// A target's session is established: rooms waiting for it attach their sources now.
    pub(super) fn target_up(&mut self, now: Instant, target: TargetId) {
        let Some(t) = self.targets.get_mut(&target) else {
            return;
        };
        if let Some(since) = t.down_since.take() {
            info!(%target, down_ms = now.saturating_duration_since(since).as_millis() as u64, "peer is reachable again");
        }
        self.timers.cancel(&mut t.unreachable_timer);
        t.unreachable_reported = false;
        if let Some(session) = t.session {
            self.outbox.event(Event::TargetUp { target, session });
        }
        let waiting = std::mem::take(&mut t.waiting);
        for room in waiting {
            let links = match self.rooms.get(&room).map(|r| (&r.side, r.state)) {
                Some((Side::Receiver(rr), KvPoll::Bootstrapping)) if !rr.waiting_for.is_empty() => {
                    rr.waiting_for.clone()
                }
                _ => continue,
            };
            let Ok(Some(sessions)) = self.resolve_links(&links) else {
                // Still waiting for another target; it holds the room in its own list.
                continue;
            };
            self.attach_sources(now, room, &sessions);
        }
    }

    /// Asks the driver for one connection attempt to `target`, bounded by the target's
    /// deadline (`Target::dial_timeout`).
    pub(super) fn dial(&mut self, target: TargetId) {
        let Some(timeout) = self.targets.get(&target).map(|t| t.dial_timeout) else {
            return;
        };
        if self.shutdown.begun() {
            return;
        }
        let deadline = self.last_now + timeout;
        let dial = self
            .dials
            .start(&mut self.timers, deadline, DialId, Timer::Dial);
        let Some(t) = self.targets.get_mut(&target) else {
            return;
        };
        // One attempt per target: a new one supersedes one still pending.
        if let Some(old) = t.attempt.start(dial) {
            self.dials.settle(&mut self.timers, old);
        }
        self.outbox.action(Action::Connect { target, dial });
    }

    /// Why `session` ended, if it ended for good recently.
    pub(super) fn ended_reason(&self, session: SessionId) -> Option<FailureReason> {
        self.ended.reason(session)
    }

    /// Keeps why `session` ended, for rooms opened over it late.
    fn remember_ended(&mut self, session: SessionId, reason: FailureReason) {
        self.ended.remember(session, reason);
    }

    pub(super) fn mark_ready(&mut self, sid: SessionId) {
        let max = self.config.max_ops_in_flight;
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if s.ops.wants_turn(max) {
            self.ops.ready(sid);
        }
    }

    pub(super) fn request_close(&mut self, sid: SessionId) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if s.state == SessionState::Closing {
            return;
        }
        s.state = SessionState::Closing;
        // The control writer gets `close_linger` to send what is queued (the Error frame
        // that says why, say); the core decides when that is over, not the driver.
        let at = self.last_now + self.config.close_linger;
        self.timers
            .set(&mut s.timers.linger, at, Timer::Linger(sid));
        // A fence still waiting is moot: closing the session closes every connection.
        self.timers.cancel(&mut s.timers.fence);
        self.outbox.action(Action::CloseSession(sid));
    }

    /// The embedder's data plane cannot serve `session` as this node's configuration demands
    /// (a transport it requires and the peer cannot take): the peer hears why, the session's
    /// rooms fail `IncompatiblePeer`, and its target is marked refused, as at a handshake
    /// that refused the layout.
    pub fn refuse_session(&mut self, now: Instant, session: SessionId, detail: &str) {
        let now = self.clock(now);
        self.close_session(
            now,
            session,
            ErrorCode::IncompatibleLayout,
            detail,
            FailureReason::IncompatiblePeer,
        );
    }

    /// Tells the peer why, fails the session's rooms and asks the driver to close it.
    pub(super) fn close_session(
        &mut self,
        now: Instant,
        sid: SessionId,
        code: ErrorCode,
        detail: &str,
        reason: FailureReason,
    ) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if s.state == SessionState::Closing {
            return;
        }
        s.close_reason = reason;
        self.outbox.transmit(
            sid,
            Message::Error {
                code,
                detail: detail.to_owned(),
            },
        );
        self.fail_session_rooms(now, sid, reason);
        self.request_close(sid);
    }
}
