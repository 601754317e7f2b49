//! Data-path results: retries, the failure threshold, blacklist and probes, fences.

use std::ops::Range;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::api::{Action, Event, OpKind, SessionState, TransferOutcome};
use crate::codec::{LandedRange, Message};
use crate::ids::{Generation, RoomId, SessionId, TransferId};
use crate::state::{FailureReason, KvPoll, Role};
use crate::timer::Timer;

use super::{Endpoint, Op, OpPhase, Side};

/// Flushes one write may take without spending an attempt: one more means its path keeps
/// failing under it, whatever its neighbours do.
const MAX_FLUSHES: u32 = 16;

impl Endpoint {
    /// A data-path operation finished. Unknown ids (already settled, superseded) are ignored.
    pub fn handle_transfer_result(
        &mut self,
        now: Instant,
        id: TransferId,
        outcome: TransferOutcome,
    ) {
        let now = self.clock(now);
        let Some(op) = self.ops.get_mut(&id) else {
            self.counters.stale_messages += 1;
            return;
        };
        if op.phase != OpPhase::InFlight {
            return;
        }
        self.timers.cancel(&mut op.timer);
        self.settle_attempt(now, id, outcome);
    }

    /// One-sided data planes (RDMA) with the checksum option: the XXH3-64 of operation
    /// `id`'s source bytes, slice after slice, computed by the driver as it posts the writes.
    /// Once the operation is `Done`, decode is sent it ([`crate::codec::Message::OpChecksum`])
    /// and verifies it over the landed bytes before the room may succeed. Ignored without
    /// the option or for an unknown id.
    pub fn handle_source_checksum(&mut self, id: TransferId, checksum: u64) {
        if !self.config.checksum {
            return;
        }
        if let Some(op) = self.ops.get_mut(&id) {
            op.source_checksum = Some(checksum);
        }
    }

    /// Takes an attempt that was in flight out of flight and decides what happens next.
    pub(super) fn settle_attempt(
        &mut self,
        now: Instant,
        id: TransferId,
        outcome: TransferOutcome,
    ) {
        let Some(mut op) = self.ops.remove(id, &mut self.timers) else {
            return;
        };
        if outcome != TransferOutcome::Done {
            // A retry is hashed again where it is posted (or carries its checksum in the
            // batch, if it moves to TCP).
            op.source_checksum = None;
        }
        if let Some(s) = self.sessions.get_mut(&op.session) {
            s.ops.ended();
        }
        self.mark_ready(op.session);
        let room_live = op.room.and_then(|room| {
            let r = self.rooms.get_mut(&room)?;
            if let Side::Sender(s) = &mut r.side {
                s.ops_in_flight = s.ops_in_flight.saturating_sub(1);
            }
            (r.generation == op.generation && !r.state.is_terminal()).then_some(room)
        });
        if op.kind == OpKind::Probe {
            self.on_probe_result(now, op.session, id, outcome);
            return;
        }
        // A fresh session of the same peer waits to take this one over (accepting side):
        // the dialer may already have moved, refusing writes that still come here or closing
        // the old connection, whose data connections then break before this side hears that
        // it ended. Either is the hand-over, not a failed transfer.
        let moved = matches!(
            outcome,
            TransferOutcome::Refused | TransferOutcome::Transient | TransferOutcome::Flushed
        ) && self
            .sessions
            .get(&op.session)
            .is_some_and(|s| s.handing_over);
        if (op.superseded || moved) && outcome != TransferOutcome::Done {
            // Its connection was taken over (or the dialer moved to the fresh one and refused
            // what still came here): not a data-path failure, run it again as new.
            self.run_again_as_new(now, op, room_live);
            return;
        }
        // A write flushed by a failure that was not its own spends no attempt, or a burst of
        // its neighbours' failures would fail its room; past `MAX_FLUSHES` the path itself is
        // what fails, and the flush counts as this write's failure.
        let outcome = match outcome {
            TransferOutcome::Flushed if op.flushes >= MAX_FLUSHES => TransferOutcome::Transient,
            other => other,
        };
        match outcome {
            TransferOutcome::Transient => self.counters.transient_failures += 1,
            TransferOutcome::Fatal => self.counters.fatal_failures += 1,
            _ => {}
        }
        if let Some(s) = self.sessions.get_mut(&op.session) {
            if outcome == TransferOutcome::Done {
                s.stats.ops_done += 1;
                s.stats.bytes_done += op.bytes;
            } else {
                s.stats.ops_failed += 1;
            }
        }
        let session_usable = self
            .sessions
            .get(&op.session)
            .is_some_and(|s| s.state == SessionState::Established);
        match outcome {
            TransferOutcome::Done => self.attempt_done(now, op, room_live),
            TransferOutcome::Transient | TransferOutcome::Flushed
                if (outcome == TransferOutcome::Flushed
                    || op.attempt < self.config.transfer_retries)
                    && room_live.is_some()
                    && session_usable =>
            {
                self.retry_later(now, op, outcome);
            }
            TransferOutcome::Refused => {
                warn!(session = %op.session, room = ?op.room, "destination refused the write");
                // Fail first: with this operation gone the room must not look complete.
                if let Some(room) = room_live {
                    self.conclude(now, room, KvPoll::Failed(FailureReason::AbortedByPeer));
                }
                self.op_finished(now, op.room, op.generation, op.layers.clone());
            }
            TransferOutcome::Transient | TransferOutcome::Fatal | TransferOutcome::Flushed => {
                self.attempt_exhausted(now, op, room_live, outcome);
            }
        }
    }

    /// A superseded attempt (its connection taken over) runs again under a new id at the
    /// front of its session's queue; one whose room ended is finished instead.
    fn run_again_as_new(&mut self, now: Instant, mut op: Op, room_live: Option<RoomId>) {
        op.superseded = false;
        if room_live.is_none() {
            self.op_finished(now, op.room, op.generation, op.layers.clone());
            return;
        }
        op.phase = OpPhase::Queued;
        let session = op.session;
        let new_id = self.ops.next_id();
        self.ops.insert(new_id, op);
        if let Some(s) = self.sessions.get_mut(&session) {
            s.ops.push_front(new_id);
        }
        self.mark_ready(session);
    }

    /// An attempt that landed: the session's failure count resets, the checksum goes to the
    /// decode before the room's word, and the operation is finished.
    fn attempt_done(&mut self, now: Instant, op: Op, room_live: Option<RoomId>) {
        if let Some(s) = self.sessions.get_mut(&op.session) {
            s.probation.landed();
        }
        self.counters.bytes_transferred += op.bytes;
        // Before the room's word: decode must hold every checksum when it hears it.
        if let (Some(checksum), Some(room)) = (op.source_checksum, room_live) {
            let ranges = op
                .slices
                .iter()
                .map(|s| LandedRange {
                    region: s.region,
                    offset: s.dst_offset,
                    len: s.len,
                    rows: s.rows,
                    stride: s.dst_stride,
                })
                .collect();
            self.outbox.transmit(
                op.session,
                Message::OpChecksum {
                    room,
                    generation: op.generation,
                    checksum,
                    ranges,
                },
            );
        }
        if op.attempt > 1 || op.flushes > 0 {
            self.counters.retry_recoveries += 1;
            warn!(
                session = %op.session,
                room = ?op.room,
                attempts = op.attempt,
                "transfer recovered after retry"
            );
        }
        self.op_finished(now, op.room, op.generation, op.layers.clone());
    }

    /// A failed attempt with retries left (or flushed by another's failure): waits its
    /// backoff under a new id, so that a late report of the old attempt cannot be mistaken.
    fn retry_later(&mut self, now: Instant, mut op: Op, outcome: TransferOutcome) {
        self.counters.retries += 1;
        let step = self.config.retry_backoff;
        let jitter = self.rng.below(step.as_nanos() as u64 / 2 + 1);
        let delay = step * op.attempt + Duration::from_nanos(jitter);
        debug!(session = %op.session, room = ?op.room, attempt = op.attempt, ?outcome, ?delay, "transfer attempt failed, retrying");
        if outcome == TransferOutcome::Flushed {
            op.flushes += 1;
        } else {
            op.attempt += 1;
        }
        op.phase = OpPhase::RetryWait;
        // A new id per attempt: a late report of the old attempt cannot be mistaken.
        let new_id = self.ops.next_id();
        self.timers
            .set(&mut op.timer, now + delay, Timer::Retry(new_id));
        self.ops.insert(new_id, op);
    }

    /// An operation out of attempts: its room fails, and its session counts one failure
    /// toward the blacklist threshold.
    fn attempt_exhausted(
        &mut self,
        now: Instant,
        op: Op,
        room_live: Option<RoomId>,
        outcome: TransferOutcome,
    ) {
        let first = op.slices.first().copied();
        let Some(room) = room_live else {
            // The room already concluded (aborted): the failure says nothing new.
            self.op_finished(now, op.room, op.generation, op.layers.clone());
            return;
        };
        self.counters.ops_exhausted += 1;
        warn!(
            session = %op.session,
            room = ?op.room,
            attempts = op.attempt,
            slices = op.slices.len(),
            bytes = op.bytes,
            first_slice = ?first,
            ?outcome,
            "transfer failed after retries"
        );
        // Fail first: with this operation gone the room must not look complete.
        self.conclude(now, room, KvPoll::Failed(FailureReason::TransferFailed));
        self.op_finished(now, op.room, op.generation, op.layers.clone());
        let threshold = self.config.session_failure_threshold;
        let blacklist = match self.sessions.get_mut(&op.session) {
            Some(s) if s.state == SessionState::Established => s.probation.exhausted(threshold),
            _ => false,
        };
        if blacklist {
            self.blacklist(now, op.session);
        }
    }

    /// One operation of a room is gone for good (done or given up).
    pub(super) fn op_finished(
        &mut self,
        now: Instant,
        room: Option<RoomId>,
        generation: Generation,
        layers: Range<usize>,
    ) {
        let Some(room) = room else { return };
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if r.generation != generation {
            return;
        }
        if let Side::Sender(s) = &mut r.side {
            s.ops_live = s.ops_live.saturating_sub(1);
            if let Some(live) = s.layer_live.get_mut(layers) {
                for n in live {
                    *n = n.saturating_sub(1);
                }
            }
        }
        r.last_activity = now;
        if r.state.is_terminal() {
            self.maybe_release(now, room);
        } else {
            self.report_delivered_layers(room);
            self.check_sender_complete(now, room);
        }
    }

    /// Emits `LayerDelivered` for every owned layer, in order, whose operations are all
    /// planned (no chunk still holds it back) and acknowledged, once the last chunk was sent.
    pub(super) fn report_delivered_layers(&mut self, room: RoomId) {
        let first_layer = self.local.layer_start;
        let owned = self.owned_layers();
        let Some((generation, s)) = self.rooms.live_sender(room) else {
            return;
        };
        if !s.last_seen {
            return;
        }
        while usize::from(s.layers_delivered) < owned {
            let l = usize::from(s.layers_delivered);
            let planned = s.chunks.iter().all(|c| c.planned.get(l));
            if !planned || s.layer_live.get(l).is_some_and(|&n| n > 0) {
                break;
            }
            s.layers_delivered += 1;
            self.outbox.event(Event::LayerDelivered {
                room,
                generation,
                layer: first_layer + l as u16,
            });
        }
    }

    pub(super) fn on_probe_result(
        &mut self,
        now: Instant,
        sid: SessionId,
        id: TransferId,
        outcome: TransferOutcome,
    ) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if !s.probation.probe_ended(id) {
            return;
        }
        if s.state != SessionState::Blacklisted {
            return;
        }
        if outcome == TransferOutcome::Done {
            // The data path works; confirm the peer's control loop answers too.
            let nonce = self.rng.next_u64();
            if let Some(s) = self.sessions.get_mut(&sid) {
                s.probation.challenged(nonce);
            }
            self.outbox.transmit(sid, Message::Probe { nonce });
            // If the ack never comes, the next probe timer tries again.
        }
        self.schedule_probe(now, sid);
    }

    pub(super) fn on_probe_ack(&mut self, now: Instant, sid: SessionId, nonce: u64) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if s.state != SessionState::Blacklisted
            || !s.probation.answered(nonce, self.config.probe_interval)
        {
            return;
        }
        s.state = SessionState::Established;
        self.timers.cancel(&mut s.timers.probe);
        self.timers.cancel(&mut s.timers.idle);
        self.counters.sessions_recovered += 1;
        info!(session = %sid, "blacklisted session recovered after a successful probe");
        self.outbox.event(Event::SessionRecovered { session: sid });
        let _ = now;
        self.mark_ready(sid);
    }

    pub(super) fn blacklist(&mut self, now: Instant, sid: SessionId) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if s.state == SessionState::Blacklisted {
            return;
        }
        s.state = SessionState::Blacklisted;
        s.probation.blacklisted(self.config.probe_interval);
        s.last_targeted = now;
        let idle = now + self.config.blacklist_idle_timeout;
        self.timers
            .set(&mut s.timers.idle, idle, Timer::BlacklistIdle(sid));
        self.counters.sessions_blacklisted += 1;
        warn!(session = %sid, failures = s.probation.failures(), "session blacklisted");
        self.outbox
            .event(Event::SessionBlacklisted { session: sid });
        self.fail_session_rooms(now, sid, FailureReason::SessionBlacklisted);
        self.schedule_probe(now, sid);
    }

    pub(super) fn schedule_probe(&mut self, now: Instant, sid: SessionId) {
        let max = self.config.probe_max_interval;
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if s.state != SessionState::Blacklisted {
            return;
        }
        let base = s.probation.next_probe_wait(max);
        let jitter = Duration::from_nanos(self.rng.below(base.as_nanos() as u64 / 4 + 1));
        self.timers
            .set(&mut s.timers.probe, now + base + jitter, Timer::Probe(sid));
    }

    pub(super) fn fail_session_rooms(
        &mut self,
        now: Instant,
        sid: SessionId,
        reason: FailureReason,
    ) {
        let Some(s) = self.sessions.get(&sid) else {
            return;
        };
        let rooms: Vec<RoomId> = s.rooms.iter().copied().collect();
        for room in rooms {
            let involved = match self.rooms.get(&room).map(|r| &r.side) {
                Some(Side::Sender(x)) => {
                    x.receivers.iter().any(|x| x.session == sid) || x.announced_by.contains(&sid)
                }
                Some(Side::Receiver(_)) => true,
                None => false,
            };
            if involved {
                self.conclude(now, room, KvPoll::Failed(reason));
            }
        }
        // Prefill: requests buffered for rooms not yet opened must not linger either.
        if self.local.role == Role::Prefill {
            let stale = self.pending.rooms_where(|p| {
                p.requests.iter().any(|x| x.0 == sid) || p.notices.iter().any(|x| x.0 == sid)
            });
            for room in stale {
                if let Some(p) = self.pending.take(room) {
                    // Tell the requesters now: they must not wait for a deadline to learn it.
                    self.reject_pending(room, p, reason);
                }
            }
        }
    }

    /// After a fence or a close: every attempt of the session still in flight is settled.
    pub(super) fn settle_session_ops(&mut self, now: Instant, sid: SessionId, retry: bool) {
        let ids = self
            .ops
            .ids_where(|op| op.session == sid && (op.phase == OpPhase::InFlight || !retry));
        for id in ids {
            let phase = self.ops.get(&id).map(|o| o.phase);
            if phase == Some(OpPhase::InFlight) {
                let outcome = if retry {
                    TransferOutcome::Transient
                } else {
                    TransferOutcome::Fatal
                };
                self.settle_attempt(now, id, outcome);
            } else if let Some(op) = self.ops.remove(id, &mut self.timers) {
                self.op_finished(now, op.room, op.generation, op.layers.clone());
            }
        }
    }

    /// Decode: a fenced or closed session can no longer write; its sources count as drained.
    pub(super) fn fence_done(&mut self, now: Instant, sid: SessionId) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        // Nothing written before the fence can land any more: its permits are void. A data
        // connection attached since writes under the new epoch, and its writes stay counted.
        s.epoch = s.epoch.wrapping_add(1);
        let epoch = s.epoch;
        self.grants.set_epoch(sid, epoch);
        let rooms = self.rooms_written_by(sid);
        self.sources_drained(now, sid, rooms, Some(epoch));
    }

    /// Every room `sid` may have written: its own, and those fresh sessions took over from it.
    pub(super) fn rooms_written_by(&self, sid: SessionId) -> Vec<RoomId> {
        let mut rooms: Vec<RoomId> = self
            .sessions
            .get(&sid)
            .map(|s| s.rooms.iter().copied().collect())
            .unwrap_or_default();
        // Writes of this connection may be pending in rooms a fresh session took over.
        for to in self.successions.successors(sid) {
            if let Some(x) = self.sessions.get(&to) {
                rooms.extend(x.rooms.iter().copied());
            }
        }
        rooms
    }

    /// Decode: `sid` can write none of `rooms` any more (but, where `keep` names its
    /// current epoch, what it writes from now on): its sources there count as drained, and
    /// its writes still counted as landing anywhere are forgotten.
    pub(super) fn sources_drained(
        &mut self,
        now: Instant,
        sid: SessionId,
        mut rooms: Vec<RoomId>,
        keep: Option<u32>,
    ) {
        let voided = self.grants.void(sid, keep);
        for room in &voided {
            if !rooms.contains(room) {
                rooms.push(*room);
            }
        }
        for room in rooms {
            let Some(r) = self.rooms.get_mut(&room) else {
                continue;
            };
            let terminal = r.state.is_terminal();
            let mut touched = !matches!(r.side, Side::Receiver(_));
            if let Side::Receiver(rr) = &mut r.side {
                touched |= voided.contains(&room);
                for src in rr.sources.iter_mut() {
                    if src.session == sid {
                        touched = true;
                        if terminal {
                            src.drained = true;
                        }
                    }
                }
            }
            if terminal && touched {
                self.maybe_release(now, room);
            } else if voided.contains(&room) {
                // A source waiting only for those writes is done now.
                self.settle_landed(now, room);
            }
        }
    }

    pub(super) fn fence(&mut self, sid: SessionId) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if s.state == SessionState::Closing || !s.ops.start_fence() {
            return;
        }
        // The driver must confirm that nothing in flight can land; the core bounds that wait.
        let at = self.last_now + self.config.fence_timeout;
        self.timers.set(&mut s.timers.fence, at, Timer::Fence(sid));
        self.counters.fences += 1;
        self.outbox.action(Action::FenceSession(sid));
    }
}
