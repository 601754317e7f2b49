//! Deadlines: every timer the endpoint arms, and what its expiry does.

use std::sync::Arc;
use std::time::Instant;

use smallvec::SmallVec;
use tracing::{debug, info, warn};

use crate::api::{Action, Event, Link, OpKind, SessionState, TransferOutcome};
use crate::codec::ErrorCode;
use crate::ids::{RoomId, SessionId, TransferId};
use crate::layout::{Region, Slice};
use crate::state::{FailureReason, KvPoll};
use crate::timer::{Timer, TimerKey, TimerTable};

use super::targets::LinkEvidence;
use super::{Endpoint, Op, OpPhase, Shutdown, Side};

impl Endpoint {
    /// Processes every deadline due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let now = self.clock(now);
        while let Some((key, timer)) = self.timers.pop_due(now) {
            self.on_timer(now, key, timer);
        }
    }

    pub(super) fn on_timer(&mut self, now: Instant, key: TimerKey, timer: Timer) {
        match timer {
            Timer::Bootstrap(room) => self.on_bootstrap_timer(now, room, key),
            Timer::Waiting(room) => self.on_waiting_timer(now, room, key),
            Timer::AbortAck(room) => self.on_abort_ack_timer(room, key),
            Timer::Operation(id) => self.on_operation_timer(now, id, key),
            Timer::Retry(id) => self.on_retry_timer(id, key),
            Timer::Handshake(sid) => self.on_handshake_timer(now, sid, key),
            Timer::Heartbeat(sid) => self.on_heartbeat_timer(now, sid, key),
            Timer::Reconnect(target) => {
                let Some(t) = self.targets.get_mut(&target) else {
                    return;
                };
                if !fired(&mut t.timer, key) {
                    return;
                }
                let dialing = t.attempt.pending().is_some();
                if dialing || self.target_session(target).is_some() {
                    debug!(%target, dialing, "reconnect timer: no dial");
                    return;
                }
                self.dial(target);
            }
            Timer::Silence(sid) => self.on_silence_timer(now, sid, key),
            Timer::DataReconnect(sid) => self.on_data_reconnect_timer(sid, key),
            Timer::Accepted(conn) => self.on_accepted_timer(conn, key),
            Timer::AcceptBackoff => self.on_accept_backoff_timer(key),
            Timer::Dial(dial) => self.on_dial_timer(now, dial, key),
            Timer::Drain(drain) => self.on_drain_timer(drain, key),
            Timer::Linger(sid) => {
                let Some(s) = self.sessions.get_mut(&sid) else {
                    return;
                };
                if fired(&mut s.timers.linger, key) && s.state == SessionState::Closing {
                    debug!(session = %sid, "close linger over; stopping the control writer");
                    self.outbox.action(Action::StopLingering(sid));
                }
            }
            Timer::WriterQuarantine(sid) => {
                let Some(q) = self.writer_quarantines.get_mut(&sid) else {
                    return;
                };
                if !fired(&mut q.timer, key) {
                    return;
                }
                if let Some(q) = self.writer_quarantines.remove(&sid) {
                    debug!(session = %sid, "the writer's liveness window passed: its rooms' pages go back");
                    self.sources_drained(now, sid, q.rooms, None);
                }
            }
            Timer::Fence(sid) => self.on_fence_timer(now, sid, key),
            Timer::Shutdown => {
                if let Shutdown::Closing { timer } = &mut self.shutdown {
                    if fired(timer, key) {
                        self.finish_shutdown();
                    }
                }
            }
            Timer::TargetIdle(target) => {
                let Some(t) = self.targets.get_mut(&target) else {
                    return;
                };
                if fired(&mut t.idle_timer, key) {
                    self.on_target_idle(now, target);
                }
            }
            Timer::Unreachable(target) => self.on_unreachable_timer(now, target, key),
            Timer::Liveness(sid) => self.on_liveness_timer(now, sid, key),
            Timer::Probe(sid) => self.on_probe_timer(sid, key),
            Timer::BlacklistIdle(sid) => self.on_blacklist_idle_timer(now, sid, key),
        }
    }

    /// A room still Bootstrapping at its deadline fails: unreachable, saturated or bootstrap timeout, whichever kept it.
    fn on_bootstrap_timer(&mut self, now: Instant, room: RoomId, key: TimerKey) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if !fired(&mut r.bootstrap_timer, key) {
            return;
        }
        if r.state != KvPoll::Bootstrapping {
            return;
        }
        let saturated = match &r.side {
            Side::Sender(s) => {
                s.saturated
                    || s.announced_by.iter().any(|sid| {
                        self.sessions
                            .get(sid)
                            .and_then(|x| x.capacity)
                            .is_some_and(|c| c.saturated())
                    })
            }
            Side::Receiver(rr) => rr.queue_position > 0,
        };
        let down_target = match &r.side {
            Side::Receiver(rr) => rr.waiting_for.iter().find_map(|l| match *l {
                Link::Target(t) => Some(t),
                Link::Session(_) => None,
            }),
            Side::Sender(_) => None,
        };
        let reason = if let Some(t) = down_target {
            // Still waiting for a target's session: that is why it never bootstrapped.
            self.unreachable_reason(t)
        } else if saturated {
            FailureReason::DecodeSaturated
        } else {
            FailureReason::BootstrapTimeout
        };
        info!(%room, %reason, "room bootstrap deadline expired");
        self.conclude(now, room, KvPoll::Failed(reason));
    }

    /// A decode room that heard nothing for `waiting_timeout` fails; one that heard since is re-armed.
    fn on_waiting_timer(&mut self, now: Instant, room: RoomId, key: TimerKey) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if !fired(&mut r.waiting_timer, key) {
            return;
        }
        if r.state.is_terminal() {
            return;
        }
        let due = r.last_activity + self.config.waiting_timeout;
        if due > now {
            self.timers
                .set(&mut r.waiting_timer, due, Timer::Waiting(room));
            return;
        }
        info!(%room, "room waiting deadline expired");
        self.conclude(now, room, KvPoll::Failed(FailureReason::WaitingTimeout));
    }

    /// An aborted room whose sources did not acknowledge the drain in time: their sessions are fenced.
    fn on_abort_ack_timer(&mut self, room: RoomId, key: TimerKey) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if !fired(&mut r.abort_timer, key) {
            return;
        }
        let Side::Receiver(rr) = &r.side else { return };
        let mut undrained: SmallVec<[SessionId; 2]> = rr
            .sources
            .iter()
            .filter(|s| s.granted && !s.drained && !s.done)
            .map(|s| s.session)
            .collect();
        for sid in self.grants.landing_sessions(room) {
            if !undrained.contains(&sid) {
                undrained.push(sid);
            }
        }
        for sid in undrained {
            warn!(%room, session = %sid, "no drain acknowledgement in time, fencing the session");
            self.fence(sid);
        }
    }

    /// An attempt not reported in time: its session is fenced (unless already replaced) and the attempt settled as transient.
    fn on_operation_timer(&mut self, now: Instant, id: TransferId, key: TimerKey) {
        let Some(op) = self.ops.get_mut(&id) else {
            return;
        };
        if op.timer != Some(key) || op.phase != OpPhase::InFlight {
            return;
        }
        op.timer = None;
        let session = op.session;
        if op.superseded {
            // It hangs on a connection already replaced: the new one is not at fault.
            self.settle_attempt(now, id, TransferOutcome::Transient);
            return;
        }
        warn!(%session, room = ?op.room, "transfer attempt timed out; fencing the session");
        // The attempt may still be writing: fence before anything else is sent.
        self.fence(session);
        self.settle_attempt(now, id, TransferOutcome::Transient);
    }

    /// An operation's retry wait is over: it is queued again at the front of its session.
    fn on_retry_timer(&mut self, id: TransferId, key: TimerKey) {
        let Some(op) = self.ops.get_mut(&id) else {
            return;
        };
        if op.timer != Some(key) || op.phase != OpPhase::RetryWait {
            return;
        }
        op.timer = None;
        op.phase = OpPhase::Queued;
        let session = op.session;
        if let Some(s) = self.sessions.get_mut(&session) {
            s.ops.push_front(id);
        }
        self.mark_ready(session);
    }

    /// No hello in time: the session closes, and its target learns the peer is silent.
    fn on_handshake_timer(&mut self, now: Instant, sid: SessionId, key: TimerKey) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if !fired(&mut s.timers.handshake, key) {
            return;
        }
        if s.state == SessionState::Handshaking {
            let target = s.target;
            if let Some(t) = target.and_then(|t| self.targets.get_mut(&t)) {
                // The connection was taken and nothing answered: the process is stuck.
                t.evidence = Some(LinkEvidence::Silent);
                if t.check == Some(sid) {
                    // A link check given up: close it quietly (no error that a late
                    // delivery could turn against the session it was checking).
                    self.request_close(sid);
                    return;
                }
            }
            self.close_session(
                now,
                sid,
                ErrorCode::HandshakeTimeout,
                "no hello in time",
                FailureReason::PeerSilent,
            );
        }
    }

    /// Broken data connections of a live, unfenced session are reopened.
    fn on_data_reconnect_timer(&mut self, sid: SessionId, key: TimerKey) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if !fired(&mut s.timers.data, key) {
            return;
        }
        let live = matches!(
            s.state,
            SessionState::Established | SessionState::Blacklisted
        );
        let n = std::mem::take(&mut s.data_lost);
        if live && !s.ops.fencing() {
            for _ in 0..n {
                self.outbox.action(Action::OpenDataConnection(sid));
            }
        }
    }

    /// A fence the data path did not confirm in time closes its session.
    fn on_fence_timer(&mut self, now: Instant, sid: SessionId, key: TimerKey) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if fired(&mut s.timers.fence, key) && s.ops.fencing() && s.state != SessionState::Closing {
            warn!(session = %sid, "the data path did not confirm a fence in time; closing the session");
            self.counters.fence_timeouts += 1;
            self.close_session(
                now,
                sid,
                ErrorCode::FenceTimeout,
                "fence not confirmed in time",
                FailureReason::TransferFailed,
            );
        }
    }

    /// A target without a session for `unreachable_timeout`: reported, and the rooms waiting for it fail.
    fn on_unreachable_timer(&mut self, now: Instant, target: crate::ids::TargetId, key: TimerKey) {
        let Some(t) = self.targets.get_mut(&target) else {
            return;
        };
        if !fired(&mut t.unreachable_timer, key) {
            return;
        }
        t.unreachable_reported = true;
        t.unreachable();
        let waiting = std::mem::take(&mut t.waiting);
        let reason = self.unreachable_reason(target);
        self.outbox
            .event(Event::TargetUnreachable { target, reason });
        if !waiting.is_empty() {
            warn!(%target, rooms = waiting.len(), %reason, "peer unreachable for the whole window, failing the rooms waiting for it");
        }
        for room in waiting {
            let still = self.rooms.get(&room).is_some_and(|r| {
                matches!(&r.side, Side::Receiver(rr) if rr.waiting_for.contains(&Link::Target(target)))
            });
            if still {
                self.conclude(now, room, KvPoll::Failed(reason));
            }
        }
    }

    /// A session silent past its liveness window closes with the cause its link checks found
    /// (or is handed over to its successor first).
    fn on_liveness_timer(&mut self, now: Instant, sid: SessionId, key: TimerKey) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if !fired(&mut s.timers.liveness, key) {
            return;
        }
        let due = s.liveness.gives_up_at();
        if due > now {
            self.timers
                .set(&mut s.timers.liveness, due, Timer::Liveness(sid));
            return;
        }
        // What fresh connections found during the silence names the cause; without
        // any (a listener cannot dial), the peer is silent.
        if self.hand_over_before_end(sid) {
            return;
        }
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        let evidence = s
            .target
            .filter(|_| !self.successions.is_superseded(sid))
            .and_then(|t| self.targets.get(&t))
            .and_then(|t| t.evidence);
        // Without a link check (the accepting side never dials) the peer is silent.
        let reason = evidence.map_or(FailureReason::PeerSilent, LinkEvidence::reason);
        warn!(session = %sid, %reason, "peer silent for the whole liveness window");
        self.close_session(
            now,
            sid,
            ErrorCode::HeartbeatsMissed,
            "heartbeats missed",
            reason,
        );
    }

    /// A blacklisted session due a probe gets an 8-byte probe write at the front of its queue.
    fn on_probe_timer(&mut self, sid: SessionId, key: TimerKey) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if !fired(&mut s.timers.probe, key) {
            return;
        }
        if s.state != SessionState::Blacklisted || s.probation.probing() {
            return;
        }
        self.counters.probes_sent += 1;
        let slices: Arc<[Slice]> = Arc::from(vec![Slice::run(Region::Scratch, 0, 0, 8)]);
        let id = self
            .ops
            .add(Op::queued(sid, None, 0, OpKind::Probe, slices, 0..0));
        if let Some(s) = self.sessions.get_mut(&sid) {
            s.probation.probe_queued(id);
            s.ops.push_front(id);
        }
        self.mark_ready(sid);
    }

    /// A blacklisted session nobody targeted for `blacklist_idle_timeout` is forgotten.
    fn on_blacklist_idle_timer(&mut self, now: Instant, sid: SessionId, key: TimerKey) {
        let idle = self.config.blacklist_idle_timeout;
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if !fired(&mut s.timers.idle, key) {
            return;
        }
        if s.state != SessionState::Blacklisted {
            return;
        }
        let due = s.last_targeted + idle;
        if due > now {
            self.timers
                .set(&mut s.timers.idle, due, Timer::BlacklistIdle(sid));
            return;
        }
        info!(session = %sid, "blacklisted session idle, forgetting it");
        self.counters.sessions_expired += 1;
        self.outbox.event(Event::SessionExpired { session: sid });
        // Expiry forgets the blacklist: do not carry it into a reconnect.
        if let Some(s) = self.sessions.get_mut(&sid) {
            s.state = SessionState::Established;
        }
        self.close_session(
            now,
            sid,
            ErrorCode::Shutdown,
            "idle blacklisted session",
            FailureReason::SessionBlacklisted,
        );
    }
}

/// Whether the timer that fired under `key` is still the one `slot` holds (not re-armed or
/// cancelled since); if so the slot is cleared, since that timer is spent.
pub(super) fn fired(slot: &mut Option<TimerKey>, key: TimerKey) -> bool {
    if *slot != Some(key) {
        return false;
    }
    *slot = None;
    true
}

/// A session's deadlines, one slot each.
///
/// Invariant: a session that leaves the endpoint cancels every slot ([`Self::cancel_all`]),
/// so no timer of a gone session stays in the table.
#[derive(Debug, Default)]
pub(super) struct SessionTimers {
    pub(super) handshake: Option<TimerKey>,
    pub(super) heartbeat: Option<TimerKey>,
    pub(super) liveness: Option<TimerKey>,
    pub(super) silence: Option<TimerKey>,
    pub(super) probe: Option<TimerKey>,
    /// A blacklisted session nobody targets is forgotten when it fires.
    pub(super) idle: Option<TimerKey>,
    /// Armed while the session closes: how long its control writer may still send.
    pub(super) linger: Option<TimerKey>,
    /// Armed while a fence waits for the driver's confirmation.
    pub(super) fence: Option<TimerKey>,
    /// Armed while broken data connections wait to be replaced.
    pub(super) data: Option<TimerKey>,
}

impl SessionTimers {
    /// Cancels the deadlines that watch the peer through this connection (heartbeats,
    /// silence, probes, blacklist idleness): a fresh connection took the session over.
    pub(super) fn cancel_watch(&mut self, timers: &mut TimerTable) {
        for t in [
            &mut self.heartbeat,
            &mut self.silence,
            &mut self.probe,
            &mut self.idle,
        ] {
            timers.cancel(t);
        }
    }

    /// Cancels every deadline: the session leaves the endpoint.
    pub(super) fn cancel_all(&mut self, timers: &mut TimerTable) {
        self.cancel_watch(timers);
        for t in [
            &mut self.handshake,
            &mut self.liveness,
            &mut self.linger,
            &mut self.fence,
            &mut self.data,
        ] {
            timers.cancel(t);
        }
    }
}
