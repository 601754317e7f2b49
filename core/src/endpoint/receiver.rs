//! Decode: receiver rooms, page grants, and what sources say about a room.

use std::sync::Arc;
use std::time::Instant;

use smallvec::SmallVec;
use tracing::{debug, info, warn};

use crate::api::{Action, ApiError, EndpointInfo, Grant, Link, PeerInfo, SessionState};
use crate::codec::{Message, ProgressStage, RoomRequest, SKIP_ALL};
use crate::counters::Counters;
use crate::ids::{Generation, RoomId, SessionId};
use crate::layout::{page_runs, ExtraPool, ItemCopy, PageSet};
use crate::state::{FailureReason, KvPoll, Role};
use crate::timer::Timer;

use super::coverage::Coverage;
use super::grant_table::Granted;
use super::room_table::Rooms;
use super::{Endpoint, ReceiverRoom, Room, Side, Source};

impl Endpoint {
    /// Decode: opens a receiver room fed by `sources` (one session per prefill rank feeding it).
    ///
    /// With `grant`, the pages are given now and the request is sent at once; without, the
    /// room stays `Bootstrapping` until [`Endpoint::grant_pages`] (the sources are told it is
    /// pending so their deadlines know why).
    pub fn open_receiver(
        &mut self,
        now: Instant,
        room: RoomId,
        generation: Generation,
        sources: &[SessionId],
        grant: Option<Grant>,
    ) -> Result<(), ApiError> {
        let now = self.clock(now);
        self.check_open(Role::Decode, room, generation)?;
        if sources.is_empty() {
            return Err(ApiError::NoSources);
        }
        // A session taken over lives on in the one that took it.
        let sources: Vec<SessionId> = sources.iter().map(|&s| self.heir(s)).collect();
        let mut ended = None;
        for &s in &sources {
            if !self.sessions.contains_key(&s) {
                // A session that ended is a peer lost, not a caller's mistake: the room fails
                // with the reason the session ended for.
                ended = Some(self.ended_reason(s).ok_or(ApiError::UnknownSession(s))?);
            }
        }
        if let Some(g) = &grant {
            self.check_grant(g)?;
        }
        let rr = ReceiverRoom {
            held_grant: grant,
            ..ReceiverRoom::default()
        };
        self.insert_bootstrapping(now, room, generation, Side::Receiver(rr));
        if let Some(reason) = ended {
            info!(%room, %reason, "room over a session that already ended");
            self.conclude(now, room, KvPoll::Failed(reason));
            return Ok(());
        }
        self.attach_sources(now, room, &sources);
        Ok(())
    }

    /// Decode: opens a receiver room fed through `links`: sessions, or targets the core keeps
    /// connected. A target without a session now is waited for: the room stays
    /// `Bootstrapping` (a grant given meanwhile is held) until every target is up, and fails
    /// once one has been down for `unreachable_timeout` (at once if it already has), with the
    /// reason its connection attempts found: [`FailureReason::ConnectionRefused`],
    /// [`FailureReason::PeerUnreachable`] (no answer), or the peer's refusal at the handshake.
    pub fn open_receiver_via(
        &mut self,
        now: Instant,
        room: RoomId,
        generation: Generation,
        links: &[Link],
        grant: Option<Grant>,
    ) -> Result<(), ApiError> {
        let now = self.clock(now);
        let resolved = self.resolve_links(links)?;
        for link in links {
            if let Link::Target(t) = link {
                if let Some(target) = self.targets.get_mut(t) {
                    target.last_used = now;
                }
            }
        }
        if let Some(sessions) = resolved {
            return self.open_receiver(now, room, generation, &sessions, grant);
        }
        self.check_open(Role::Decode, room, generation)?;
        if let Some(g) = &grant {
            self.check_grant(g)?;
        }
        let rr = ReceiverRoom {
            waiting_for: links.iter().copied().collect(),
            held_grant: grant,
            ..ReceiverRoom::default()
        };
        self.insert_bootstrapping(now, room, generation, Side::Receiver(rr));
        let window = self.config.unreachable_timeout;
        let mut expired = None;
        for link in links {
            let Link::Target(t) = *link else { continue };
            if self.target_session(t).is_some() {
                continue;
            }
            let Some(target) = self.targets.get_mut(&t) else {
                continue;
            };
            let since = *target.down_since.get_or_insert(now);
            if since + window <= now {
                expired = Some(t);
                continue;
            }
            target.waiting.push(room);
            if target.unreachable_timer.is_none() {
                self.timers.set(
                    &mut target.unreachable_timer,
                    since + window,
                    Timer::Unreachable(t),
                );
            }
        }
        if let Some(t) = expired {
            let reason = self.unreachable_reason(t);
            info!(%room, %reason, "room toward a peer that has been unreachable for the whole window");
            self.conclude(now, room, KvPoll::Failed(reason));
        }
        Ok(())
    }

    /// Attaches a new room's sessions (at once, or once its targets are up), then sends its
    /// grant (or the pending notice).
    pub(super) fn attach_sources(&mut self, now: Instant, room: RoomId, sessions: &[SessionId]) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        let Side::Receiver(rr) = &mut r.side else {
            return;
        };
        rr.waiting_for.clear();
        for &sid in sessions {
            if rr.sources.iter().all(|s| s.session != sid) {
                rr.sources.push(Source::new(sid));
            }
        }
        let grant = rr.held_grant.take();
        for &sid in sessions {
            if let Some(s) = self.sessions.get_mut(&sid) {
                s.rooms.insert(room);
            }
        }
        debug!(%room, "room attached to its sources");
        if let Some(g) = grant {
            self.apply_grant(now, room, g);
        } else {
            self.send_to_sources(room, |room, generation| Message::RoomPending {
                room,
                generation,
                queue_position: 0,
            });
        }
        self.fail_if_sources_unusable(now, room);
    }

    /// Decode: the data path of `session` writes without this endpoint seeing each write
    /// (one-sided RDMA). Its rooms then succeed on the source's word, bound to the peer's
    /// incarnation, instead of on bytes counted through [`Endpoint::end_write`].
    pub fn set_one_sided(&mut self, session: SessionId) {
        if let Some(s) = self.sessions.get_mut(&session) {
            s.writer.set_one_sided();
        }
    }

    /// Decode: only the peer can stop `session`'s writes (it copies into this process from
    /// its own, on the same host): a fence completes on its word, and once the session ends
    /// without it, its rooms' pages stay quarantined for the session's liveness window (the
    /// writer gives up a silent session within it and writes nothing after), or until
    /// [`Endpoint::handle_writer_exited`].
    pub fn set_fenced_by_writer(&mut self, session: SessionId) {
        if let Some(s) = self.sessions.get_mut(&session) {
            s.writer.set_fenced_by_writer();
        }
    }

    /// Prefill: whether a write into `session`'s peer that the peer does not see land (a
    /// same-host copy) may run now: the session is not closing and the peer was heard
    /// within the session's liveness window. A peer silent for longer may have given the
    /// session up and, if only this writer could fence it, released its pages one window
    /// and a heartbeat after; a writer that copies only while this holds never lands there.
    pub fn may_write_unseen(&self, session: SessionId, now: Instant) -> bool {
        self.sessions
            .get(&session)
            .is_some_and(|s| s.state != SessionState::Closing && s.liveness.alive_at(now))
    }

    /// Decode: the process that wrote `session` (ended, fenced by its writer) has exited:
    /// nothing of it can land any more, and its rooms' pages go back now.
    pub fn handle_writer_exited(&mut self, now: Instant, session: SessionId) {
        let now = self.clock(now);
        if let Some(mut q) = self.writer_quarantines.remove(&session) {
            self.timers.cancel(&mut q.timer);
            debug!(%session, rooms = q.rooms.len(), "the writer exited: its rooms' pages go back");
            self.sources_drained(now, session, q.rooms, None);
        }
    }

    /// Decode: `session`'s writes are seen landing again (its one-sided path was declined or
    /// given up): its rooms succeed on the bytes counted, and closing its connections
    /// fences it, as over TCP.
    pub fn clear_one_sided(&mut self, session: SessionId) {
        if let Some(s) = self.sessions.get_mut(&session) {
            s.writer.set_seen();
        }
    }

    /// Decode: what the one-sided `session` writes into this node's memory becomes visible
    /// to the memory's device only after a flush (GPUDirect RDMA whose write ordering is
    /// weaker than the owner's). Its rooms report `Success` only once
    /// [`Action::FlushLanded`] was carried out ([`Endpoint::end_flush`]).
    pub fn flush_landed_writes(&mut self, session: SessionId) {
        if let Some(s) = self.sessions.get_mut(&session) {
            s.writer.set_flush_landed();
        }
    }

    /// Decode: the flush asked by [`Action::FlushLanded`] for `room` ended: the room
    /// succeeds, or fails `TransferFailed` with `result`'s reason. A room that ended
    /// meanwhile (its deadline, an abort) or a later generation is left as it is.
    pub fn end_flush(
        &mut self,
        now: Instant,
        room: RoomId,
        generation: Generation,
        result: Result<(), String>,
    ) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if r.generation != generation || r.state.is_terminal() {
            return;
        }
        let Side::Receiver(rr) = &mut r.side else {
            return;
        };
        if !std::mem::take(&mut rr.flushing) {
            return;
        }
        match result {
            Ok(()) => self.conclude(now, room, KvPoll::Success),
            Err(why) => {
                warn!(%room, why, "landed writes could not be flushed to their device");
                self.conclude(now, room, KvPoll::Failed(FailureReason::TransferFailed));
            }
        }
    }

    /// Decode: the room waits for capacity behind `position` others (0: being allocated).
    /// The sources learn it, so a prefill deadline expiring says `DecodeSaturated`.
    pub fn set_queue_position(
        &mut self,
        now: Instant,
        room: RoomId,
        position: u32,
    ) -> Result<(), ApiError> {
        let _ = self.clock(now);
        let r = self.live_room(room, Role::Decode)?;
        if r.state != KvPoll::Bootstrapping {
            return Err(ApiError::AlreadyGranted(room));
        }
        if let Side::Receiver(rr) = &mut r.side {
            rr.queue_position = position;
        }
        self.send_to_sources(room, |room, generation| Message::RoomPending {
            room,
            generation,
            queue_position: position,
        });
        Ok(())
    }

    /// Decode: grants the room its pages and sends the request to every source.
    pub fn grant_pages(
        &mut self,
        now: Instant,
        room: RoomId,
        grant: Grant,
    ) -> Result<(), ApiError> {
        let now = self.clock(now);
        let r = self.live_room(room, Role::Decode)?;
        if r.state != KvPoll::Bootstrapping {
            return Err(ApiError::AlreadyGranted(room));
        }
        if matches!(&r.side, Side::Receiver(rr) if rr.held_grant.is_some()) {
            return Err(ApiError::AlreadyGranted(room));
        }
        self.check_grant(&grant)?;
        if let Some(Side::Receiver(rr)) = self.rooms.get_mut(&room).map(|r| &mut r.side) {
            if !rr.waiting_for.is_empty() {
                rr.held_grant = Some(grant);
                return Ok(());
            }
        }
        self.apply_grant(now, room, grant);
        Ok(())
    }

    pub(super) fn on_room_status(
        &mut self,
        now: Instant,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
        failure: Option<FailureReason>,
    ) {
        let Some(r) = room_of_message(&mut self.rooms, &mut self.counters, room, generation) else {
            return;
        };
        let Side::Receiver(rr) = &mut r.side else {
            return;
        };
        let Some(src) = rr.sources.iter_mut().find(|s| s.session == sid) else {
            self.strike(sid, "status for a room it does not feed", false);
            return;
        };
        r.last_activity = now;
        match failure {
            None => {
                if !src.granted {
                    self.strike(sid, "success before the request", false);
                    return;
                }
                let one_sided = self
                    .sessions
                    .get(&sid)
                    .is_some_and(|s| s.writer.one_sided());
                // A checksummed one-sided source's bytes count as they are verified: its word
                // waits for the checks still running, then needs them all, as over TCP.
                let checked = one_sided && self.config.checksum;
                if checked && !src.checking.is_empty() {
                    src.success_pending = true;
                    return;
                }
                if (!one_sided || checked) && !src.coverage.complete() && !r.state.is_terminal() {
                    // Success means the bytes are here: a word without them is a violation.
                    warn!(%room, session = %sid, covered = src.coverage.covered(), expected = src.coverage.expected(), "source reported success for pages that never landed");
                    self.counters.protocol_errors += 1;
                    self.conclude(now, room, KvPoll::Failed(FailureReason::ProtocolError));
                    return;
                }
                src.done = true;
                src.drained = true;
                if r.state.is_terminal() {
                    self.maybe_release(now, room);
                } else {
                    self.sources_done(now, room);
                }
            }
            Some(reason) => {
                // The peer's own local reasons, seen from here.
                let reason = match reason {
                    FailureReason::AbortedLocally => FailureReason::AbortedByPeer,
                    FailureReason::Shutdown => FailureReason::PeerShutdown,
                    r => r,
                };
                if !r.state.is_terminal() {
                    self.conclude(now, room, KvPoll::Failed(reason));
                }
            }
        }
    }

    /// Decode: once every source of a live room is done, the room succeeds (after flushing
    /// what one-sided sources wrote, where their device needs it).
    pub(super) fn sources_done(&mut self, now: Instant, room: RoomId) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        let Side::Receiver(rr) = &mut r.side else {
            return;
        };
        if r.state.is_terminal() || !rr.sources.iter().all(|s| s.done) {
            return;
        }
        let flush = rr.sources.iter().any(|s| {
            self.sessions
                .get(&s.session)
                .is_some_and(|x| x.writer.needs_flush())
        });
        if !flush {
            self.conclude(now, room, KvPoll::Success);
        } else if !rr.flushing {
            rr.flushing = true;
            self.outbox.action(Action::FlushLanded {
                room,
                generation: r.generation,
            });
        }
    }

    pub(super) fn on_progress(
        &mut self,
        now: Instant,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
        stage: ProgressStage,
    ) {
        let Some(r) = room_of_message(&mut self.rooms, &mut self.counters, room, generation) else {
            return;
        };
        if r.state.is_terminal() {
            self.counters.stale_messages += 1;
            return;
        }
        let Side::Receiver(rr) = &r.side else { return };
        if !rr.sources.iter().any(|s| s.session == sid && s.granted) {
            return;
        }
        r.last_activity = now;
        if stage == ProgressStage::Transferring && r.state == KvPoll::WaitingForInput {
            self.set_state(room, KvPoll::Transferring);
        }
    }

    pub(super) fn on_abort_ack(
        &mut self,
        now: Instant,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
    ) {
        let Some(r) = room_of_message(&mut self.rooms, &mut self.counters, room, generation) else {
            return;
        };
        let Side::Receiver(rr) = &mut r.side else {
            return;
        };
        if let Some(src) = rr.sources.iter_mut().find(|s| s.session == sid) {
            src.drained = true;
        }
        if r.state.is_terminal() {
            self.maybe_release(now, room);
        }
    }

    pub(super) fn check_grant(&self, g: &Grant) -> Result<(), ApiError> {
        let l = &self.local.layout;
        if g.skip_pages == SKIP_ALL {
            // Asking a source for nothing is `idle_sources`; this value is the wire's for it.
            return Err(ApiError::PageOutOfRange {
                page: g.skip_pages,
                pages: l.pages,
            });
        }
        if let Some(&page) = g.pages.iter().find(|p| **p >= l.pages) {
            return Err(ApiError::PageOutOfRange {
                page,
                pages: l.pages,
            });
        }
        for (slot, item) in [(g.aux_slot, l.aux_bytes), (g.state_slot, l.state_bytes)] {
            if let Some(slot) = slot {
                if slot >= l.slots || item == 0 {
                    return Err(ApiError::SlotOutOfRange {
                        slot,
                        slots: l.slots,
                    });
                }
            }
        }
        if let Some((pool, item, items)) = ExtraPool::out_of_range(&self.local.extras, &g.extras) {
            return Err(ApiError::ExtraOutOfRange { pool, item, items });
        }
        Ok(())
    }

    pub(super) fn apply_grant(&mut self, now: Instant, room: RoomId, grant: Grant) {
        let runs = page_runs(&grant.pages);
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        let generation = r.generation;
        let Side::Receiver(rr) = &mut r.side else {
            return;
        };
        rr.granted = Arc::new(Granted {
            pages: Some(PageSet::new(&grant.pages)),
            aux_slot: grant.aux_slot,
            state_slot: grant.state_slot,
            extras: grant.extras.iter().map(|x| PageSet::new(x)).collect(),
        });
        let mut targets: SmallVec<[(SessionId, bool); 2]> = SmallVec::new();
        for (i, src) in rr.sources.iter_mut().enumerate() {
            src.granted = true;
            src.idle = i < 64 && grant.idle_sources & (1 << i) != 0;
            src.coverage = if src.idle {
                Coverage::default()
            } else {
                let session = self.sessions.get(&src.session);
                Coverage::new(
                    &self.local,
                    session.and_then(|s| s.peer),
                    session.map_or(&[][..], |s| &s.extra_copies[..]),
                    &grant,
                )
            };
            targets.push((src.session, src.idle));
        }
        let writers: Option<SmallVec<[PeerInfo; 2]>> = rr
            .sources
            .iter()
            .filter(|s| !s.idle)
            .map(|s| self.sessions.get(&s.session).and_then(|x| x.peer))
            .collect();
        let parts_gap = || {
            let copies: Vec<&[Vec<ItemCopy>]> = rr
                .sources
                .iter()
                .filter(|s| !s.idle)
                .filter_map(|s| self.sessions.get(&s.session))
                .filter(|x| x.peer.is_some_and(|p| p.writes_aux))
                .map(|x| &x.extra_copies[..])
                .collect();
            uncovered_parts(&self.local, &copies, &grant)
        };
        // Both checks only once every writing source's peer is known.
        let gap = writers.and_then(|w| uncovered(&self.local, &w, &grant).or_else(parts_gap));
        if let Some(gap) = gap {
            // No source would ever write these bytes: the room could only time out, or (where
            // a source reports success) succeed with them missing.
            warn!(%room, gap = %gap, "the room's sources cannot fill it");
            self.conclude(now, room, KvPoll::Failed(FailureReason::IncompatiblePeer));
            return;
        }
        if let Side::Receiver(rr) = &r.side {
            let writers = rr
                .sources
                .iter()
                .filter(|s| s.granted && !s.idle)
                .map(|s| s.session)
                .collect();
            self.grants
                .open(room, generation, rr.granted.clone(), writers);
        }
        self.timers.cancel(&mut r.bootstrap_timer);
        r.last_activity = now;
        self.timers.set(
            &mut r.waiting_timer,
            now + self.config.waiting_timeout,
            Timer::Waiting(room),
        );
        let request = RoomRequest {
            room,
            generation,
            receivers: grant.receivers.max(1),
            skip_pages: grant.skip_pages,
            pages: runs,
            aux_slot: grant.aux_slot,
            state_slot: grant.state_slot,
            prompt: grant.prompt,
            extras: grant.extras.iter().map(|x| page_runs(x)).collect(),
        };
        for (sid, idle) in targets {
            let request = if idle {
                request.idle()
            } else {
                request.clone()
            };
            self.outbox.transmit(sid, Message::RoomRequest(request));
        }
        if let Some(Side::Receiver(rr)) = self.rooms.get_mut(&room).map(|r| &mut r.side) {
            rr.request = Some(Box::new(request));
        }
        self.set_state(room, KvPoll::WaitingForInput);
    }

    pub(super) fn fail_if_sources_unusable(&mut self, now: Instant, room: RoomId) {
        let Some(Side::Receiver(rr)) = self.rooms.get(&room).map(|r| &r.side) else {
            return;
        };
        let closing = rr
            .sources
            .iter()
            .filter_map(|s| self.sessions.get(&s.session))
            .find(|s| s.state == SessionState::Closing)
            .map(|s| s.close_reason);
        if let Some(reason) = closing {
            self.conclude(now, room, KvPoll::Failed(reason));
        }
    }

    pub(super) fn send_to_sources(
        &mut self,
        room: RoomId,
        make: impl Fn(RoomId, Generation) -> Message,
    ) {
        let Some(r) = self.rooms.get(&room) else {
            return;
        };
        let Side::Receiver(rr) = &r.side else { return };
        for src in &rr.sources {
            self.outbox.transmit(src.session, make(room, r.generation));
        }
    }
}

/// The room a peer's message names, if it is the attempt the message is about; a message
/// about another attempt, or a room gone, counts as stale. (Over the two fields, so the
/// caller may use the endpoint's other state while it holds the room.)
fn room_of_message<'a>(
    rooms: &'a mut Rooms,
    counters: &mut Counters,
    room: RoomId,
    generation: Generation,
) -> Option<&'a mut Room> {
    match rooms.get_mut(&room) {
        Some(r) if r.generation == generation => Some(r),
        _ => {
            counters.stale_messages += 1;
            None
        }
    }
}

/// The first unit of a split extra tensor's part of ours that none of the writers of extra
/// items (`copies`: how each one's items land here) holds, worded for the log; `None` when
/// they hold all of them, or no item of a split tensor is granted.
fn uncovered_parts(
    local: &EndpointInfo,
    copies: &[&[Vec<ItemCopy>]],
    grant: &Grant,
) -> Option<String> {
    for (p, pool) in local.extras.iter().enumerate() {
        if grant.extras.get(p).map_or(true, Vec::is_empty) {
            continue;
        }
        for t in 0..pool.item_bytes.len() {
            // A source whose share is ours moves whole items.
            if copies
                .iter()
                .any(|c| copy_of(c, p, t) == Some(&ItemCopy::Whole))
            {
                continue;
            }
            for (k, part) in pool.parts_of(t).iter().enumerate() {
                let (first, end) = (part.first, part.first + part.count);
                let mut unit = first;
                while unit < end {
                    let reach = copies
                        .iter()
                        .filter_map(|c| match copy_of(c, p, t) {
                            Some(ItemCopy::Parts { parts, .. }) => Some(parts),
                            _ => None,
                        })
                        .flatten()
                        .filter(|c| usize::from(c.part) == k && c.units.contains(&unit))
                        .map(|c| c.units.end)
                        .max();
                    match reach {
                        Some(e) => unit = e,
                        None => {
                            return Some(format!(
                                "no source holds unit {unit} of part {k} of extra pool {p} \
                                 tensor {t} ({first}..{end} here)"
                            ))
                        }
                    }
                }
            }
        }
    }
    None
}

/// How tensor `t` of pool `p` lands here from one source, if its copies name it.
fn copy_of(copies: &[Vec<ItemCopy>], p: usize, t: usize) -> Option<&ItemCopy> {
    copies.get(p).and_then(|x| x.get(t))
}

/// What of a granted room the writing sources `writers` (peers known) leave unwritten
/// together, worded for the log: a layer no stage owns, heads of ours no source holds, or an
/// aux row, state slot or extra items with no source that writes them. `None` if they cover
/// all of it (or the grant asks for nothing).
fn uncovered(local: &EndpointInfo, writers: &[PeerInfo], grant: &Grant) -> Option<String> {
    let layout = &local.layout;
    let slots = (grant.aux_slot.is_some() && layout.aux_bytes > 0)
        || (grant.state_slot.is_some() && layout.state_bytes > 0)
        || grant.extras.iter().any(|x| !x.is_empty());
    if slots && !writers.iter().any(|p| p.writes_aux) {
        return Some("no source writes the aux row, state slot or extra items".into());
    }
    if grant.pages.is_empty() {
        return None;
    }
    let mut layer = 0u16;
    while layer < layout.layers {
        match writers
            .iter()
            .filter(|p| p.layer_start <= layer && layer < p.layer_end)
            .map(|p| p.layer_end)
            .max()
        {
            Some(end) => layer = end,
            None => return Some(format!("no source owns layer {layer}")),
        }
    }
    let (first, end) = (local.heads.start, local.heads.start + local.heads.count);
    let mut head = first;
    while head < end {
        let reach = writers
            .iter()
            .map(|p| local.heads.shared(&p.heads))
            .filter(|r| r.start <= head && head < r.end)
            .map(|r| r.end)
            .max();
        match reach {
            Some(e) => head = e,
            None => {
                return Some(format!(
                    "no source holds head {head} of this rank's {first}..{end}"
                ))
            }
        }
    }
    None
}
