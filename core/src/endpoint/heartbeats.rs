//! Heartbeats and silence: a session's heartbeats sent on time, and a silent session's link
//! checked with fresh connections until it moves again or its liveness window ends.

use std::time::Instant;

use smallvec::SmallVec;
use tracing::info;

use crate::api::SessionState;
use crate::codec::Message;
use crate::ids::{RoomId, SessionId};
use crate::state::Role;
use crate::timer::{Timer, TimerKey};

use super::liveness::Look;
use super::timers::fired;
use super::{Endpoint, Side};

impl Endpoint {
    /// A session that heard nothing for `silence_timeout`, or whose peer confirmed none of our
    /// outstanding frames for as long, gets its link checked with fresh connections, one
    /// attempt per `connect_timeout`, until a fresh connection takes it over, the liveness
    /// window ends, or the old connection has moved both ways again for a whole window.
    /// One direction is enough to stall rooms: after an outage the peer's retransmissions may
    /// arrive while ours sit in TCP's backoff. And an old control connection that moves again
    /// says nothing of its data connections, each in a backoff of its own (up to seconds), so
    /// the check goes on until fresh connections replace them all.
    pub(super) fn on_silence_timer(&mut self, now: Instant, sid: SessionId, key: TimerKey) {
        let pace = self.config.connect_timeout;
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if !fired(&mut s.timers.silence, key) {
            return;
        }
        if !matches!(
            s.state,
            SessionState::Established | SessionState::Blacklisted
        ) {
            return;
        }
        if let Look::Moving(due) = s.liveness.look(sid, now) {
            self.timers
                .set(&mut s.timers.silence, due, Timer::Silence(sid));
            return;
        }
        self.timers
            .set(&mut s.timers.silence, now + pace, Timer::Silence(sid));
        let Some(target) = s.target else {
            // Only the side that dials can check the link; the other waits for its peer's.
            return;
        };
        let started = s.liveness.start_check(now);
        let node = s.peer.map(|p| p.node);
        let Some(t) = self.targets.get_mut(&target) else {
            return;
        };
        if t.session != Some(sid) {
            return;
        }
        if let Some(stall) = started {
            t.evidence = None;
            let (quiet_ms, unconfirmed_ms) = (stall.quiet_ms, stall.unconfirmed_ms);
            if stall.quiet {
                info!(session = %sid, ?node, quiet_ms, "peer silent; checking the link with fresh connections");
            } else {
                info!(session = %sid, ?node, ?unconfirmed_ms, "peer heard but our frames not confirmed; checking the link with fresh connections");
            }
        }
        if t.attempt.pending().is_none() && t.check.is_none() {
            self.dial(target);
        }
    }

    /// The heartbeat for `sid` now: decode's capacity (zero from prefill) and the frames read
    /// from the session's connection so far.
    pub(super) fn heartbeat(&self, sid: SessionId) -> Message {
        let (free_pages, queued_rooms) = match self.local.role {
            Role::Decode => (self.capacity.free_pages, self.capacity.queued_rooms),
            Role::Prefill => (0, 0),
        };
        Message::Heartbeat {
            free_pages,
            queued_rooms,
            frames_received: self
                .sessions
                .get(&sid)
                .map_or(0, |s| s.liveness.frames_received()),
        }
    }

    pub(super) fn on_heartbeat_timer(&mut self, now: Instant, sid: SessionId, key: TimerKey) {
        let interval = self.config.heartbeat_interval;
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if !fired(&mut s.timers.heartbeat, key) {
            return;
        }
        if s.state == SessionState::Closing {
            return;
        }
        self.timers.set(
            &mut s.timers.heartbeat,
            now + interval,
            Timer::Heartbeat(sid),
        );
        let rooms: SmallVec<[RoomId; 16]> = s.rooms.iter().copied().collect();
        let heartbeat = self.heartbeat(sid);
        self.outbox.transmit(sid, heartbeat);
        if self.local.role != Role::Prefill {
            return;
        }
        // Keepalive progress for rooms that said nothing for a progress interval, so decode's
        // deadline measures whether prefill is alive and moving, not how long its queues are.
        let interval = self.config.progress_interval;
        for room in rooms {
            let Some(r) = self.rooms.get_mut(&room) else {
                continue;
            };
            if r.state.is_terminal() {
                continue;
            }
            let Side::Sender(s) = &mut r.side else {
                continue;
            };
            let Some(stage) = s.stage else { continue };
            if s.last_progress_sent.is_some_and(|t| t + interval > now) {
                continue;
            }
            s.last_progress_sent = Some(now);
            let generation = r.generation;
            if s.receivers.iter().any(|x| x.session == sid) {
                self.outbox.transmit(
                    sid,
                    Message::Progress {
                        room,
                        generation,
                        stage,
                    },
                );
            }
        }
    }
}
