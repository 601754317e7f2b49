//! Prefill: sender rooms, chunks and layers, and answering room requests (pending rooms, tombstones, reused ids).

use std::time::Instant;

use smallvec::SmallVec;
use tracing::{debug, info, warn};

use crate::api::{ApiError, Chunk, Event, SessionState};
use crate::codec::{Message, ProgressStage, RoomRequest};
use crate::ids::{Generation, PromptDigest, RoomId, SessionId};
use crate::layout::{ExtraPool, PageRun};
use crate::state::{FailureReason, KvPoll, Role};
use crate::timer::Timer;

use super::layer_bits::LayerBits;
use super::pending_rooms::PendingRoom;
use super::{Endpoint, HeldChunk, PeerIdentity, Receiver, Room, SenderRoom, Side};

impl Endpoint {
    /// Prefill: opens a sender room for the KV of `prompt`'s tokens (a request naming other
    /// tokens is refused with `prompt_mismatch`; `None` checks nothing). It is
    /// `Bootstrapping` until every decode rank that will read it sent its request (requests
    /// that arrived earlier are applied now).
    pub fn open_sender(
        &mut self,
        now: Instant,
        room: RoomId,
        generation: Generation,
        prompt: Option<PromptDigest>,
    ) -> Result<(), ApiError> {
        let now = self.clock(now);
        if self.local.role != Role::Prefill {
            return Err(ApiError::WrongRole {
                needs: Role::Prefill,
            });
        }
        if self.shutdown.begun() {
            return Err(ApiError::ShutDown);
        }
        if self.rooms.contains(&room) {
            return Err(ApiError::RoomExists(room));
        }
        // A failure decided before the room was opened (decode aborted, session blacklisted,
        // consensus) is delivered at once, so prefill never computes a doomed room.
        let early = match (self.tombstones.verdict(room), self.tombstones.get(room)) {
            (Some((g, reason)), _) if g == generation => Some(reason),
            (_, Some((g, _))) if g >= generation => {
                return Err(ApiError::StaleGeneration {
                    room,
                    generation,
                    used: g,
                })
            }
            _ => None,
        };
        let side = Side::Sender(SenderRoom {
            prompt,
            ..SenderRoom::default()
        });
        if let Some(reason) = early {
            let mut record = Room::bootstrapping(generation, now, side);
            record.state = KvPoll::Failed(reason);
            self.rooms.insert(room, record);
            self.emit_state(room, generation, KvPoll::Failed(reason));
            self.count_terminal(KvPoll::Failed(reason));
            self.maybe_release(now, room);
            return Ok(());
        }
        self.insert_bootstrapping(now, room, generation, side);
        if let Some(p) = self.pending.take(room) {
            if p.generation == generation {
                for (sid, pos) in p.notices {
                    self.on_room_pending(now, sid, room, generation, pos);
                }
                for (sid, req) in p.requests {
                    self.on_room_request(now, sid, req);
                }
            } else if p.generation > generation {
                self.pending.put_back(room, p);
            }
        }
        Ok(())
    }

    /// Prefill: the next chunk of a room. Its pages go to the next granted destination pages.
    /// May be called while the room is still `Bootstrapping`; planning waits for the requests.
    pub fn send_chunk(&mut self, now: Instant, room: RoomId, chunk: Chunk) -> Result<(), ApiError> {
        let now = self.clock(now);
        let layers = self.owned_layers();
        let pages = self.local.layout.pages;
        let slots = self.local.layout.slots;
        let max_queued = self.config.max_queued_ops;
        if let Some(&page) = chunk.pages.iter().find(|p| **p >= pages) {
            return Err(ApiError::PageOutOfRange { page, pages });
        }
        for slot in [chunk.aux_slot, chunk.state_slot].into_iter().flatten() {
            if slot >= slots {
                return Err(ApiError::SlotOutOfRange { slot, slots });
            }
        }
        if let Some((pool, item, items)) =
            ExtraPool::out_of_range(&self.local.extras, &chunk.extras)
        {
            return Err(ApiError::ExtraOutOfRange { pool, item, items });
        }
        let sessions = &self.sessions;
        let full = match self.rooms.get(&room).map(|r| &r.side) {
            Some(Side::Sender(s)) => s.receivers.iter().map(|x| x.session).find(|sid| {
                sessions
                    .get(sid)
                    .is_some_and(|x| x.ops.queued() as u32 >= max_queued)
            }),
            _ => None,
        };
        let r = self.live_room(room, Role::Prefill)?;
        let Side::Sender(s) = &mut r.side else {
            return Err(ApiError::UnknownRoom(room));
        };
        if s.last_seen {
            return Err(ApiError::ChunkAfterLast(room));
        }
        if let Some(sid) = full {
            return Err(ApiError::SessionQueueFull(sid));
        }
        let n = chunk.pages.len() as u32;
        s.chunks.push_back(HeldChunk {
            src: chunk.pages,
            dst_start: s.next_dst,
            layerwise: chunk.layerwise,
            released: if chunk.layerwise {
                LayerBits::new(layers)
            } else {
                LayerBits::all(layers)
            },
            planned: LayerBits::new(layers),
        });
        s.next_dst += n;
        if chunk.last {
            s.last_seen = true;
            s.aux_src = chunk.aux_slot;
            s.state_src = chunk.state_slot;
            s.extras_src = chunk.extras;
        }
        r.last_activity = now;
        self.plan_room(now, room);
        Ok(())
    }

    /// Prefill: layer `layer` of every named room finished its forward pass; its operations
    /// may go now. Applies to every chunk already sent that still holds that layer.
    pub fn mark_layer_ready(
        &mut self,
        now: Instant,
        rooms: &[RoomId],
        layer: u16,
    ) -> Result<(), ApiError> {
        let now = self.clock(now);
        if self.local.role != Role::Prefill {
            return Err(ApiError::WrongRole {
                needs: Role::Prefill,
            });
        }
        if layer < self.local.layer_start || layer >= self.local.layer_end {
            return Err(ApiError::LayerOutOfRange { layer });
        }
        let idx = usize::from(layer - self.local.layer_start);
        for &room in rooms {
            let Some(r) = self.rooms.get_mut(&room) else {
                continue;
            };
            if r.state.is_terminal() {
                continue;
            }
            if let Side::Sender(s) = &mut r.side {
                for c in s.chunks.iter_mut() {
                    c.released.set(idx);
                }
                r.last_activity = now;
            }
            self.plan_room(now, room);
        }
        Ok(())
    }

    pub(super) fn on_room_pending(
        &mut self,
        now: Instant,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
        pos: u32,
    ) {
        if self.answer_if_concluded(sid, room, generation)
            || self.refuse_if_blacklisted(now, sid, room, generation)
        {
            return;
        }
        if self.refuse_if_served_elsewhere(sid, room, generation) {
            return;
        }
        let who = self.identity(sid);
        match self.rooms.get_mut(&room) {
            Some(r) if r.generation == generation => {
                if let Side::Sender(s) = &mut r.side {
                    if !s.announced_by.contains(&sid) {
                        s.announced_by.push(sid);
                    }
                    if let Some(w) = who.filter(|w| !s.peers.contains(w)) {
                        s.peers.push(w);
                    }
                    s.saturated = pos > 0;
                }
                if let Some(s) = self.sessions.get_mut(&sid) {
                    s.rooms.insert(room);
                }
            }
            Some(r) if r.generation > generation => self.refuse_stale(sid, room, generation),
            _ => {
                if let Some(p) = self.pending_entry(sid, room, generation) {
                    let first = p.notices.is_empty() && p.requests.is_empty();
                    p.notices.retain(|(s, _)| *s != sid);
                    p.notices.push((sid, pos));
                    if first {
                        self.outbox.event(Event::RoomAnnounced {
                            room,
                            generation,
                            session: sid,
                            pages: 0,
                            skip_pages: 0,
                        });
                    }
                }
            }
        }
    }

    pub(super) fn on_room_request(&mut self, now: Instant, sid: SessionId, req: RoomRequest) {
        let (room, generation) = (req.room, req.generation);
        if self.answer_if_concluded(sid, room, generation)
            || self.refuse_if_blacklisted(now, sid, room, generation)
            || self.refuse_if_served_elsewhere(sid, room, generation)
        {
            return;
        }
        // Validate against the peer's registered memory before accepting anything, held or
        // not: a request that cannot be served is answered now, not when the room opens.
        if !self.servable(sid, &req) {
            warn!(%room, session = %sid, "room request outside the peer's registered memory, or for heads this rank does not hold");
            self.refuse_request(now, sid, room, generation, FailureReason::ProtocolError);
            return;
        }
        match self.rooms.get(&room) {
            Some(r) if r.generation == generation => {}
            Some(r) if r.generation > generation => {
                self.refuse_stale(sid, room, generation);
                return;
            }
            _ => {
                let pages = req.pages.iter().fold(0u32, |n, r| n.saturating_add(r.len));
                let skip_pages = req.skip_pages;
                if let Some(p) = self.pending_entry(sid, room, generation) {
                    let first = p.requests.is_empty();
                    p.requests.retain(|(s, _)| *s != sid);
                    p.requests.push((sid, req));
                    if first {
                        self.outbox.event(Event::RoomAnnounced {
                            room,
                            generation,
                            session: sid,
                            pages,
                            skip_pages,
                        });
                    }
                }
                return;
            }
        }
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if r.state.is_terminal() {
            // Concluded but still draining: tell this late requester the outcome.
            let failure = r.state.failure();
            self.answer_with_outcome(sid, room, generation, failure);
            return;
        }
        let Side::Sender(s) = &mut r.side else { return };
        if s.receivers.iter().any(|x| x.session == sid) {
            self.counters.stale_messages += 1;
            return;
        }
        if let (Some(held), Some(asked)) = (s.prompt, req.prompt) {
            if held != asked {
                warn!(%room, generation, session = %sid, %held, %asked, "room requested for other tokens than it holds, refused");
                self.refuse_request(now, sid, room, generation, FailureReason::PromptMismatch);
                return;
            }
        }
        let mut dst = Vec::with_capacity(req.pages.iter().map(|r| r.len as usize).sum());
        for run in &req.pages {
            dst.extend(run.start..run.start + run.len);
        }
        s.receivers.push(Receiver {
            session: sid,
            skip: req.skip_pages,
            dst,
            aux_slot: req.aux_slot,
            state_slot: req.state_slot,
            extras: req
                .extras
                .iter()
                .map(|runs| runs.iter().flat_map(|r| r.start..r.start + r.len).collect())
                .collect(),
        });
        if let Some(w) = self
            .sessions
            .get(&sid)
            .and_then(|x| x.peer)
            .map(|p| (p.node, p.incarnation))
            .filter(|w| !s.peers.contains(w))
        {
            s.peers.push(w);
        }
        s.expected = s.expected.max(req.receivers);
        if !s.announced_by.contains(&sid) {
            s.announced_by.push(sid);
        }
        let bootstrapped = s.receivers.len() >= usize::from(s.expected);
        if let Some(x) = self.sessions.get_mut(&sid) {
            x.rooms.insert(room);
            x.last_targeted = now;
        }
        if bootstrapped {
            self.set_state(room, KvPoll::WaitingForInput);
            let Some(r) = self.rooms.get_mut(&room) else {
                return;
            };
            self.timers.cancel(&mut r.bootstrap_timer);
            r.last_activity = now;
            self.timers.set(
                &mut r.waiting_timer,
                now + self.config.waiting_timeout,
                Timer::Waiting(room),
            );
            self.send_progress(now, room, ProgressStage::Queued);
            self.plan_room(now, room);
        }
    }

    /// A room request that cannot be served (an empty or overflowing page run, no receivers,
    /// a request for nothing that asks for something, a malformed body): the requester hears
    /// `protocol_error` for the room at once, and the room ends here too, so neither side
    /// waits for a deadline.
    pub(super) fn on_unservable_request(
        &mut self,
        now: Instant,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
    ) {
        if self.local.role != Role::Prefill
            || self.answer_if_concluded(sid, room, generation)
            || self.refuse_if_served_elsewhere(sid, room, generation)
        {
            return;
        }
        warn!(%room, generation, session = %sid, "room request that cannot be served, refused");
        self.refuse_request(now, sid, room, generation, FailureReason::ProtocolError);
    }

    /// Answers `reason` to a request this rank refuses (one it cannot serve, or one for other
    /// tokens than the room holds), and ends the room it names (open or not) so that neither
    /// side waits for a deadline.
    fn refuse_request(
        &mut self,
        now: Instant,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
        reason: FailureReason,
    ) {
        if reason == FailureReason::ProtocolError {
            self.counters.protocol_errors += 1;
        }
        match self
            .rooms
            .get(&room)
            .map(|r| (r.generation, r.state.is_terminal()))
        {
            Some((g, _)) if g > generation => self.refuse_stale(sid, room, generation),
            Some((g, ended)) if g == generation => {
                self.answer_with_outcome(sid, room, generation, Some(reason));
                if !ended {
                    self.conclude(now, room, KvPoll::Failed(reason));
                }
            }
            _ => {
                self.answer_with_outcome(sid, room, generation, Some(reason));
                self.fail_unopened(sid, room, generation, reason);
            }
        }
    }

    /// A room not open here failed before it opened (the decode aborted it, or asked what
    /// cannot be served): the requests held for it are answered with `verdict`, and the
    /// verdict is remembered so that the embedder's open fails at once instead of computing
    /// a doomed room (unless a newer attempt is already remembered).
    fn fail_unopened(
        &mut self,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
        verdict: FailureReason,
    ) {
        match self.pending.take(room) {
            Some(p) if p.generation == generation => self.reject_pending(room, p, verdict),
            Some(p) => self.pending.put_back(room, p),
            None => {}
        }
        let newer = self
            .tombstones
            .get(room)
            .is_some_and(|(g, _)| g >= generation);
        if !newer {
            let who = self.identity(sid).into_iter().collect();
            self.tombstones
                .insert_verdict(room, generation, verdict, who);
        }
    }

    /// Whether a request fits the peer's registered memory and this rank's: pages and slots
    /// the peer registered, no more pages than this rank holds, extra items within this
    /// rank's pools, and heads this rank holds.
    fn servable(&self, sid: SessionId, req: &RoomRequest) -> bool {
        let peer = self.sessions.get(&sid).and_then(|s| s.peer);
        // A decode rank that holds none of our heads asked the wrong prefill rank.
        let shares_heads = peer.is_some_and(|p| !self.local.heads.shared(&p.heads).is_empty());
        // A room has at most as many pages as this rank holds: the bound of what a request
        // may make us allocate, whatever pool size the peer declared.
        let total: u64 = req.pages.iter().map(|r| u64::from(r.len)).sum();
        let run_items = |runs: &[PageRun]| runs.iter().map(|r| u64::from(r.len)).sum::<u64>();
        let extras_fit = req.extras.len() <= self.local.extras.len()
            && req
                .extras
                .iter()
                .zip(&self.local.extras)
                .all(|(runs, pool)| run_items(runs) <= u64::from(pool.items));
        shares_heads
            && extras_fit
            && total <= u64::from(self.local.layout.pages)
            && peer.map(|p| p.layout).is_some_and(|l| {
                req.pages
                    .iter()
                    .all(|run| u64::from(run.start) + u64::from(run.len) <= u64::from(l.pages))
                    && [req.aux_slot, req.state_slot]
                        .iter()
                        .flatten()
                        .all(|s| *s < l.slots)
            })
    }

    pub(super) fn on_abort(
        &mut self,
        now: Instant,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
        reason: FailureReason,
    ) {
        info!(%room, session = %sid, %reason, "peer aborted the room");
        // A decode that had no capacity for the room says so; any other decode verdict is,
        // from here, the peer giving up.
        let verdict = match reason {
            FailureReason::DecodeSaturated => FailureReason::DecodeSaturated,
            _ => FailureReason::AbortedByPeer,
        };
        let feeds = |r: &Room| match &r.side {
            Side::Sender(s) => {
                s.receivers.iter().any(|x| x.session == sid) || s.announced_by.contains(&sid)
            }
            Side::Receiver(_) => false,
        };
        if self
            .rooms
            .get(&room)
            .is_some_and(|r| r.generation == generation && !feeds(r))
        {
            // Another decode's abort of a room id this one serves (a refused reuse): it
            // touches nothing here.
            self.outbox
                .transmit(sid, Message::AbortAck { room, generation });
            return;
        }
        match self.rooms.get(&room) {
            Some(r) if r.generation == generation => {
                if !r.state.is_terminal() {
                    self.conclude(now, room, KvPoll::Failed(verdict));
                } else {
                    // Duplicate or late abort: ack again once drained.
                    self.maybe_release(now, room);
                    if self
                        .rooms
                        .get(&room)
                        .is_some_and(|r| matches!(&r.side, Side::Sender(s) if s.ops_in_flight == 0))
                    {
                        self.outbox
                            .transmit(sid, Message::AbortAck { room, generation });
                    }
                }
                if !self
                    .rooms
                    .get(&room)
                    .is_some_and(|r| r.generation == generation)
                {
                    // Released right away: the ack went out with the release.
                }
            }
            Some(r) if r.generation > generation => {
                // An older attempt: it was drained before the new one could open.
                self.outbox
                    .transmit(sid, Message::AbortAck { room, generation });
            }
            _ => {
                // Not open (yet, or any more): nothing of it is in flight.
                self.fail_unopened(sid, room, generation, verdict);
                self.outbox
                    .transmit(sid, Message::AbortAck { room, generation });
            }
        }
    }

    pub(super) fn send_progress(&mut self, now: Instant, room: RoomId, stage: ProgressStage) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        let generation = r.generation;
        let Side::Sender(s) = &mut r.side else { return };
        if s.stage == Some(stage) {
            return;
        }
        s.stage = Some(stage);
        s.last_progress_sent = Some(now);
        for x in &s.receivers {
            self.outbox.transmit(
                x.session,
                Message::Progress {
                    room,
                    generation,
                    stage,
                },
            );
        }
    }

    /// Answers a room message about a concluded room at once, from the tombstones.
    pub(super) fn answer_if_concluded(
        &mut self,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
    ) -> bool {
        if self
            .rooms
            .get(&room)
            .is_some_and(|r| r.generation >= generation)
        {
            return false;
        }
        let took_part = self.tombstones.took_part(room, self.identity(sid));
        match self.tombstones.get(room) {
            Some((g, _)) if g >= generation && !took_part => {
                self.refuse_reused(sid, room, generation);
                true
            }
            Some((g, outcome)) if g == generation => {
                let failure = outcome.failure();
                debug!(%room, session = %sid, ?outcome, "late message for a concluded room answered");
                self.answer_with_outcome(sid, room, generation, failure);
                true
            }
            Some((g, _)) if g > generation => {
                self.refuse_stale(sid, room, generation);
                true
            }
            _ => false,
        }
    }

    /// A request or notice for an attempt older than one this endpoint already holds: the
    /// decode learns at once that this attempt is void (a late duplicate is ignored there).
    pub(super) fn refuse_stale(&mut self, sid: SessionId, room: RoomId, generation: Generation) {
        self.counters.stale_messages += 1;
        debug!(%room, generation, session = %sid, "request for an older generation refused");
        self.answer_with_outcome(sid, room, generation, Some(FailureReason::StaleGeneration));
    }

    /// Who the peer behind `sid` is, once its hello arrived.
    pub(super) fn identity(&self, sid: SessionId) -> Option<PeerIdentity> {
        self.sessions
            .get(&sid)
            .and_then(|s| s.peer)
            .map(|p| (p.node, p.incarnation))
    }

    /// A live room already served by other decode endpoints (every receiver it expects has
    /// requested it, or it concluded) is never joined by a new one: that is a reused room id.
    pub(super) fn refuse_if_served_elsewhere(
        &mut self,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
    ) -> bool {
        let who = self.identity(sid);
        let Some(r) = self.rooms.get(&room) else {
            return false;
        };
        let Side::Sender(s) = &r.side else {
            return false;
        };
        let known = who.is_some_and(|w| s.peers.contains(&w))
            || s.receivers.iter().any(|x| x.session == sid)
            || s.announced_by.contains(&sid);
        let full =
            r.state != KvPoll::Bootstrapping && s.receivers.len() >= usize::from(s.expected.max(1));
        let other_generation = r.generation != generation && !known;
        if known || !(full || r.state.is_terminal() || other_generation) {
            return false;
        }
        self.refuse_reused(sid, room, generation);
        true
    }

    /// Refuses a room message from a decode that did not take part in the room this id
    /// names here: the room id was reused (another decode node, or a restarted one).
    pub(super) fn refuse_reused(&mut self, sid: SessionId, room: RoomId, generation: Generation) {
        info!(%room, session = %sid, "room id already used for another decode, refused");
        self.counters.rooms_refused_reused += 1;
        self.answer_with_outcome(sid, room, generation, Some(FailureReason::RoomIdReused));
    }

    /// New rooms toward a blacklisted session fail at bootstrap, before any compute.
    pub(super) fn refuse_if_blacklisted(
        &mut self,
        now: Instant,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
    ) -> bool {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return true;
        };
        if s.state != SessionState::Blacklisted {
            return false;
        }
        s.last_targeted = now;
        let reason = FailureReason::SessionBlacklisted;
        self.answer_with_outcome(sid, room, generation, Some(reason));
        match self.rooms.get(&room) {
            Some(r) if r.generation == generation && !r.state.is_terminal() => {
                self.conclude(now, room, KvPoll::Failed(reason));
            }
            Some(_) => {}
            None => {
                if let Some(p) = self.pending.take(room) {
                    self.reject_pending(room, p, reason);
                }
                let who = self.identity(sid).into_iter().collect();
                self.tombstones
                    .insert_verdict(room, generation, reason, who);
            }
        }
        true
    }

    /// Tells a decode session a room's outcome and that nothing of it is, or will be, in
    /// flight from here (late requests, rooms refused before they opened).
    pub(super) fn answer_with_outcome(
        &mut self,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
        failure: Option<FailureReason>,
    ) {
        self.outbox.transmit(
            sid,
            Message::RoomStatus {
                room,
                generation,
                failure,
            },
        );
        self.outbox
            .transmit(sid, Message::AbortAck { room, generation });
    }

    pub(super) fn pending_entry(
        &mut self,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
    ) -> Option<&mut PendingRoom> {
        if self
            .pending
            .generation_of(room)
            .is_some_and(|g| g > generation)
        {
            self.refuse_stale(sid, room, generation);
            return None;
        }
        let limit = self.config.pending_requests as usize;
        for (old, p) in self.pending.admit(room, generation, limit) {
            // Evicted before the sender opened: the requesters must not wait forever.
            self.reject_pending(old, p, FailureReason::BootstrapTimeout);
        }
        self.pending.get_mut(room)
    }

    pub(super) fn reject_pending(&mut self, room: RoomId, p: PendingRoom, reason: FailureReason) {
        let generation = p.generation;
        let mut told: SmallVec<[SessionId; 2]> = SmallVec::new();
        let mut peers: SmallVec<[PeerIdentity; 1]> = SmallVec::new();
        for sid in p
            .requests
            .iter()
            .map(|x| x.0)
            .chain(p.notices.iter().map(|x| x.0))
        {
            if !told.contains(&sid) {
                told.push(sid);
                self.answer_with_outcome(sid, room, generation, Some(reason));
                if let Some(w) = self.identity(sid) {
                    peers.push(w);
                }
            }
        }
        self.tombstones
            .insert_verdict(room, generation, reason, peers);
    }
}
