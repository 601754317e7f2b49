//! Both roles: aborting, failing and concluding rooms, and releasing their pages.

use std::time::Instant;

use smallvec::SmallVec;
use tracing::{debug, warn};

use crate::api::{ApiError, Event};
use crate::codec::{ErrorCode, Message};
use crate::ids::{Generation, RoomId, SessionId};
use crate::state::{FailureReason, KvPoll, Role};
use crate::timer::Timer;

use super::{Endpoint, OpPhase, PeerIdentity, Room, Shutdown, Side};

impl Endpoint {
    /// Records a new room of either side in `Bootstrapping`, with its bootstrap deadline armed.
    pub(super) fn insert_bootstrapping(
        &mut self,
        now: Instant,
        room: RoomId,
        generation: Generation,
        side: Side,
    ) {
        let mut record = Room::bootstrapping(generation, now, side);
        self.timers.set(
            &mut record.bootstrap_timer,
            now + self.config.bootstrap_timeout,
            Timer::Bootstrap(room),
        );
        self.rooms.insert(room, record);
        self.emit_state(room, generation, KvPoll::Bootstrapping);
    }

    /// Aborts a room locally. Decode keeps its pages quarantined until every source drained
    /// or was fenced; prefill stops issuing operations and tells its receivers.
    pub fn abort(&mut self, now: Instant, room: RoomId) -> Result<(), ApiError> {
        let now = self.clock(now);
        let r = self.rooms.get(&room).ok_or(self.not_open(room))?;
        if r.state.is_terminal() {
            return Err(ApiError::RoomConcluded(room, r.state));
        }
        self.conclude(now, room, KvPoll::Failed(FailureReason::AbortedLocally));
        Ok(())
    }

    /// Fails a room softly, for instance on a consensus verdict. Works from any non-terminal
    /// state (including `Bootstrapping`); returns `false` when the room was already terminal
    /// or unknown, so applying the same verdict twice is harmless.
    pub fn fail_room(&mut self, now: Instant, room: RoomId, reason: FailureReason) -> bool {
        let now = self.clock(now);
        match self.rooms.get(&room) {
            Some(r) if !r.state.is_terminal() => {
                self.conclude(now, room, KvPoll::Failed(reason));
                true
            }
            Some(_) => false,
            None => {
                // Prefill may hold requests for a room it has not opened yet: answer them.
                if let Some(p) = self.pending.take(room) {
                    self.reject_pending(room, p, reason);
                    true
                } else {
                    false
                }
            }
        }
    }

    /// Shuts the endpoint down: every live room fails with `Shutdown`, every session is told
    /// and closed. Later commands fail with [`ApiError::ShutDown`].
    pub fn shutdown(&mut self, now: Instant) {
        let now = self.clock(now);
        if !self.shutdown.begun() {
            self.shutdown = Shutdown::Closing { timer: None };
        }
        // Kept peers are dialed no more, and none is waited for.
        self.targets.stop_dialing(&mut self.timers);
        let rooms: Vec<RoomId> = self.rooms.ids().collect();
        for room in rooms {
            if self
                .rooms
                .get(&room)
                .is_some_and(|r| !r.state.is_terminal())
            {
                self.conclude(now, room, KvPoll::Failed(FailureReason::Shutdown));
            }
        }
        let sessions: Vec<SessionId> = self.sessions.keys().copied().collect();
        for sid in sessions {
            self.close_for_shutdown(now, sid);
        }
        if self.sessions.is_empty() {
            self.finish_shutdown();
        } else if let Shutdown::Closing { timer: slot @ None } = &mut self.shutdown {
            let due = now + self.config.shutdown_timeout;
            self.timers.set(slot, due, Timer::Shutdown);
        }
    }

    /// Whether the shutdown completed ([`Event::ShutDown`] went out).
    pub fn shutdown_complete(&self) -> bool {
        matches!(self.shutdown, Shutdown::Complete)
    }

    /// Whether this node may connect to a peer or take a connection now: not once its
    /// shutdown began (a caller's dial, a new target or a new listener gets `ShutDown`; a
    /// connection that arrives anyway is closed with `Error(Shutdown)` at once).
    pub fn may_connect(&self) -> Result<(), ApiError> {
        if self.shutdown.begun() {
            return Err(ApiError::ShutDown);
        }
        Ok(())
    }

    /// Tells `sid`'s peer this node is shutting down, and closes the session.
    pub(super) fn close_for_shutdown(&mut self, now: Instant, sid: SessionId) {
        self.close_session(
            now,
            sid,
            ErrorCode::Shutdown,
            "shutting down",
            FailureReason::Shutdown,
        );
    }

    /// Reports the shutdown complete, once: when the last session closed, or at its timeout.
    pub(super) fn finish_shutdown(&mut self) {
        let Shutdown::Closing { timer } = &mut self.shutdown else {
            return;
        };
        self.timers.cancel(timer);
        self.shutdown = Shutdown::Complete;
        let unclosed = self.sessions.len();
        if unclosed > 0 {
            warn!(
                unclosed,
                "shutdown timeout: sessions still closing are dropped"
            );
        }
        self.outbox.event(Event::ShutDown { unclosed });
    }

    pub(super) fn check_open(
        &self,
        role: Role,
        room: RoomId,
        generation: Generation,
    ) -> Result<(), ApiError> {
        if self.local.role != role {
            return Err(ApiError::WrongRole { needs: role });
        }
        if self.shutdown.begun() {
            return Err(ApiError::ShutDown);
        }
        if self.rooms.contains(&room) {
            return Err(ApiError::RoomExists(room));
        }
        if let Some((used, _)) = self.tombstones.get(room) {
            if used >= generation {
                return Err(ApiError::StaleGeneration {
                    room,
                    generation,
                    used,
                });
            }
        }
        Ok(())
    }

    /// The error for a call about a room not held here: one that concluded and was released
    /// says how it ended, so an embedder racing the room's failure learns the reason.
    pub(super) fn not_open(&self, room: RoomId) -> ApiError {
        match self.tombstones.concluded(room) {
            Some(state) => ApiError::RoomConcluded(room, state),
            None => ApiError::UnknownRoom(room),
        }
    }

    pub(super) fn live_room(&mut self, room: RoomId, role: Role) -> Result<&mut Room, ApiError> {
        if self.local.role != role {
            return Err(ApiError::WrongRole { needs: role });
        }
        let missing = self.not_open(room);
        let r = self.rooms.get_mut(&room).ok_or(missing)?;
        if r.state.is_terminal() {
            return Err(ApiError::RoomConcluded(room, r.state));
        }
        Ok(r)
    }

    /// Moves a room to a terminal state and starts whatever must follow (notify, drain,
    /// quarantine). Refused (no-op) if the room is already terminal.
    pub(super) fn conclude(&mut self, now: Instant, room: RoomId, to: KvPoll) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        let Ok(state) = r.state.transition(to) else {
            return;
        };
        r.state = state;
        let generation = r.generation;
        self.grants.close(room);
        self.timers.cancel(&mut r.bootstrap_timer);
        self.timers.cancel(&mut r.waiting_timer);
        self.count_terminal(state);
        self.emit_state(room, generation, state);
        match state {
            KvPoll::Failed(reason) => debug!(%room, %reason, "room failed"),
            _ => debug!(%room, "room succeeded"),
        }
        let failure = state.failure();
        let landing = self.grants.landing(room);
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        match &mut r.side {
            Side::Sender(s) => {
                s.chunks.clear();
                for x in &s.receivers {
                    self.outbox.transmit(
                        x.session,
                        Message::RoomStatus {
                            room,
                            generation,
                            failure,
                        },
                    );
                }
                // Decode sessions that only announced the room learn it too.
                for sid in &s.announced_by {
                    if !s.receivers.iter().any(|x| x.session == *sid) {
                        self.outbox.transmit(
                            *sid,
                            Message::RoomStatus {
                                room,
                                generation,
                                failure,
                            },
                        );
                        self.outbox
                            .transmit(*sid, Message::AbortAck { room, generation });
                    }
                }
                if failure.is_some() {
                    self.drop_room_ops(room, generation);
                }
            }
            Side::Receiver(rr) => {
                // A write still landing holds the pages whatever the outcome; the abort timer
                // bounds how long (it fences the session).
                let mut waiting = landing > 0;
                if let Some(reason) = failure {
                    for src in rr.sources.iter_mut() {
                        if src.done {
                            continue;
                        }
                        if !src.granted {
                            src.drained = true;
                        }
                        waiting |= !src.drained;
                        self.outbox.transmit(
                            src.session,
                            Message::Abort {
                                room,
                                generation,
                                reason,
                            },
                        );
                    }
                }
                if waiting {
                    self.timers.set(
                        &mut r.abort_timer,
                        now + self.config.abort_ack_timeout,
                        Timer::AbortAck(room),
                    );
                }
            }
        }
        self.maybe_release(now, room);
    }

    /// Removes every queued or retry-waiting operation of a room; in-flight ones settle later.
    pub(super) fn drop_room_ops(&mut self, room: RoomId, generation: Generation) {
        let mut dropped = 0u32;
        let ids = self.ops.ids_where(|op| {
            op.room == Some(room) && op.generation == generation && op.phase != OpPhase::InFlight
        });
        for id in ids {
            if self.ops.remove(id, &mut self.timers).is_some() {
                dropped += 1;
            }
        }
        if let Some(Side::Sender(s)) = self.rooms.get_mut(&room).map(|r| &mut r.side) {
            s.ops_live = s.ops_live.saturating_sub(dropped);
        }
    }

    /// Emits `Releasable` and forgets the room once nothing can touch its pages any more.
    pub(super) fn maybe_release(&mut self, now: Instant, room: RoomId) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if !r.state.is_terminal() {
            return;
        }
        let generation = r.generation;
        let landing = self.grants.landing(room);
        let ready = match &mut r.side {
            Side::Sender(s) => {
                if s.ops_in_flight > 0 {
                    false
                } else {
                    if r.state != KvPoll::Success && !s.drained_acked {
                        s.drained_acked = true;
                        for x in &s.receivers {
                            self.outbox
                                .transmit(x.session, Message::AbortAck { room, generation });
                        }
                    }
                    true
                }
            }
            // A repeat of a landed write that arrives after this is answered from the
            // tombstone (`WriteRefused::AlreadyLanded`): it never writes the pages.
            Side::Receiver(rr) => rr.sources.iter().all(|s| s.drained || s.done) && landing == 0,
        };
        if !ready {
            return;
        }
        let Some(r) = self.rooms.remove(room, &mut self.timers) else {
            return;
        };
        self.grants.remove(room);
        let peers: SmallVec<[PeerIdentity; 1]> = match &r.side {
            Side::Sender(s) => s.peers.iter().copied().collect(),
            Side::Receiver(_) => SmallVec::new(),
        };
        let sessions: SmallVec<[SessionId; 4]> = match &r.side {
            Side::Sender(s) => s
                .receivers
                .iter()
                .map(|x| x.session)
                .chain(s.announced_by.iter().copied())
                .collect(),
            Side::Receiver(rr) => rr.sources.iter().map(|s| s.session).collect(),
        };
        for sid in sessions {
            if let Some(s) = self.sessions.get_mut(&sid) {
                s.rooms.remove(&room);
                if let Some(t) = s.target.and_then(|t| self.targets.get_mut(&t)) {
                    t.last_used = now;
                }
            }
        }
        self.tombstones.insert(room, generation, r.state, peers);
        self.counters.rooms_released += 1;
        self.outbox.event(Event::Releasable { room, generation });
    }
}
