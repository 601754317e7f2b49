//! Decode: what lands in its memory. Every write is checked against the room's grant, held by a
//! permit while it lands, and counted toward the source's coverage once applied (or verified,
//! for one-sided paths).

use std::time::Instant;

use tracing::{debug, warn};

use crate::api::{Action, SessionState, WritePermit, WriteRefused};
use crate::codec::LandedRange;
use crate::ids::{Generation, RoomId, SessionId};
use crate::layout::{ExtraPool, ItemCopy, Region, Slice};
use crate::state::{FailureReason, KvPoll};

use super::grant_table::{granted_admits, in_region, item_copy, part_row};
use super::{Endpoint, Side, Source};

impl Endpoint {
    /// Decode: may the peer behind `session` write `slice` for `(room, generation)`?
    ///
    /// Checks the room is live and of that generation, the session is a granted source, the
    /// region exists and the range stays inside the room's pages (or its aux row / state slot).
    /// Scratch-region writes (probes) only need a session. A refused write inside a live room
    /// fails that room with `ProtocolError`.
    pub fn check_write(
        &mut self,
        now: Instant,
        session: SessionId,
        room: RoomId,
        generation: Generation,
        slice: &Slice,
    ) -> Result<(), WriteRefused> {
        let now = self.clock(now);
        if self.successions.is_superseded(session) {
            return Err(WriteRefused::SessionSuperseded);
        }
        let result = self.check_write_inner(session, room, generation, slice);
        if result == Err(WriteRefused::AlreadyLanded) {
            debug!(%room, %session, "a write repeated after its room succeeded");
            return result;
        }
        if let Err(refused) = result {
            self.counters.writes_refused += 1;
            warn!(%room, %session, ?refused, ?slice, "data-plane write refused");
            let live = self
                .rooms
                .get(&room)
                .is_some_and(|r| r.generation == generation && !r.state.is_terminal());
            let out_of_bounds = matches!(
                refused,
                WriteRefused::OutOfRegion
                    | WriteRefused::PageNotGranted
                    | WriteRefused::SlotNotGranted
                    | WriteRefused::LayerNotOwned
                    | WriteRefused::HeadsNotShared
                    | WriteRefused::BadRows
                    | WriteRefused::UnknownRegion
                    | WriteRefused::NotASource
            );
            if live && out_of_bounds {
                self.conclude(now, room, KvPoll::Failed(FailureReason::ProtocolError));
            }
        }
        result
    }

    /// Decode: whether the core would admit every slice of a write of `session` for
    /// `(room, generation)` now, changing nothing (the check [`Endpoint::begin_write`] makes).
    pub fn admits_write(
        &self,
        session: SessionId,
        room: RoomId,
        generation: Generation,
        slices: &[Slice],
    ) -> Result<(), WriteRefused> {
        if self.successions.is_superseded(session) {
            return Err(WriteRefused::SessionSuperseded);
        }
        slices
            .iter()
            .try_for_each(|s| self.check_write_inner(session, room, generation, s))
    }

    /// Decode: authorizes one whole write (every slice, as [`Endpoint::check_write`]) and
    /// counts it as landing until [`Endpoint::end_write`]: the room's pages are not released
    /// while it is out. Drivers call this, not `check_write`, before applying a payload.
    pub fn begin_write(
        &mut self,
        now: Instant,
        session: SessionId,
        room: RoomId,
        generation: Generation,
        slices: &[Slice],
    ) -> Result<WritePermit, WriteRefused> {
        self.admit(now, session, room, generation, slices, Landing::Write)
    }

    /// Checks every slice and numbers a permit: a write that may be landing is counted in the
    /// grant table (a fence of its session voids it; its units are counted when it ends), a
    /// check of bytes that already landed records the units it covers with its source.
    fn admit(
        &mut self,
        now: Instant,
        session: SessionId,
        room: RoomId,
        generation: Generation,
        slices: &[Slice],
        landing: Landing,
    ) -> Result<WritePermit, WriteRefused> {
        for slice in slices {
            self.check_write(now, session, room, generation, slice)?;
        }
        let epoch = self.sessions.get(&session).map_or(0, |s| s.epoch);
        let holds_pages = slices.iter().any(|s| s.region != Region::Scratch);
        let seq = self.grants.next_seq();
        if holds_pages {
            match landing {
                Landing::Write => {
                    self.counters.writes_admitted_locked += 1;
                    self.grants.count(room, generation, session, epoch);
                }
                Landing::Check => {
                    let units = self.write_units(room, session, slices);
                    if let Some(src) = self.source_mut(room, generation, session) {
                        src.checking.push((seq, units));
                    }
                }
            }
        }
        Ok(WritePermit {
            session,
            room: holds_pages.then_some(room),
            generation,
            epoch,
            seq,
            applied: false,
            corrupt: false,
        })
    }

    /// Decode: a write authorized by [`Endpoint::begin_write`] (or the
    /// [`GrantTable`](super::GrantTable)) was applied or abandoned; its units count once
    /// applied. `slices` are the write's own, as admitted (a one-sided check's permit,
    /// [`Action::VerifyLanded`], needs none).
    pub fn end_write(&mut self, now: Instant, permit: WritePermit, slices: &[Slice]) {
        let now = self.clock(now);
        let Some(room) = permit.room else { return };
        if self.end_check(now, room, permit) {
            return;
        }
        let current = self.sessions.get(&permit.session).map(|s| s.epoch);
        if current != Some(permit.epoch) {
            // Void: the session was fenced since, and its landing writes forgotten.
            return;
        }
        self.grants.end(&permit);
        if permit.applied {
            self.counters.writes_applied += 1;
        }
        let live = self
            .rooms
            .get(&room)
            .is_some_and(|r| r.generation == permit.generation && !r.state.is_terminal());
        if permit.applied && live {
            // The source may have moved to a session that took the writer's over.
            if let Some(writer) = self.source_session_of(room, permit.session) {
                let units = self.write_units(room, writer, slices);
                if let Some(src) = self.source_mut(room, permit.generation, writer) {
                    for u in units {
                        src.coverage.mark(u);
                    }
                }
            }
        }
        if permit.corrupt && live {
            // The bytes that landed are not the sender's: the room's pages are garbage.
            warn!(%room, session = %permit.session, "a write's checksum did not match what its sender computed");
            self.conclude(now, room, KvPoll::Failed(FailureReason::ChecksumMismatch));
        } else if live {
            self.settle_landed(now, room);
        }

        if self.rooms.get(&room).is_some_and(|r| r.state.is_terminal()) {
            self.maybe_release(now, room);
        }
    }

    /// Decode: the session that now writes `room` for what `session` wrote: itself, or the
    /// live session that carries its work (through any number of take-overs, whether the
    /// sessions between are still connected or not).
    fn source_session_of(&self, room: RoomId, session: SessionId) -> Option<SessionId> {
        let Some(Side::Receiver(rr)) = self.rooms.get(&room).map(|r| &r.side) else {
            return None;
        };
        [session, self.successions.heir(session)]
            .into_iter()
            .find(|s| rr.sources.iter().any(|src| src.session == *s))
    }

    /// Decode: a source on a session whose writes this node applies itself (TCP) is done
    /// once every unit it was granted landed and none of its writes is still landing: its
    /// word would only repeat what the coverage says. The room succeeds when every source is.
    /// One-sided sources (RDMA, same host) keep waiting for their word: their bytes land
    /// unseen; so does a source whose coverage says nothing (granted before its peer's
    /// layout was known).
    pub(super) fn settle_landed(&mut self, now: Instant, room: RoomId) {
        let landing = self.grants.landing(room);
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        let Side::Receiver(rr) = &mut r.side else {
            return;
        };
        let mut newly = false;
        for src in rr.sources.iter_mut() {
            let applied_here = self
                .sessions
                .get(&src.session)
                .is_some_and(|s| !s.writer.one_sided());
            if applied_here
                && src.granted
                && !src.idle
                && !src.done
                && src.coverage.expected() > 0
                && src.coverage.complete()
                && landing == 0
                && src.checking.is_empty()
            {
                src.done = true;
                newly = true;
            }
        }
        if newly {
            self.sources_done(now, room);
        }
    }

    /// Decode: the coverage units a write of (already checked) `slices` fills entirely.
    pub(super) fn write_units(
        &self,
        room: RoomId,
        session: SessionId,
        slices: &[Slice],
    ) -> Vec<u32> {
        let mut units = Vec::new();
        let Some(Side::Receiver(rr)) = self.rooms.get(&room).map(|r| &r.side) else {
            return units;
        };
        let Some(cov) = rr
            .sources
            .iter()
            .find(|s| s.session == session)
            .map(|s| &s.coverage)
        else {
            return units;
        };
        let layout = &self.local.layout;
        let copies = self
            .sessions
            .get(&session)
            .map_or(&[][..], |s| &s.extra_copies[..]);
        let rows = self
            .sessions
            .get(&session)
            .and_then(|s| s.peer)
            .and_then(|p| self.local.heads.row_write(layout.page_bytes, &p.heads));
        let rank = |p: u64| rr.granted.pages.as_ref().and_then(|ps| ps.rank(p as u32));
        for s in slices.iter().flat_map(Slice::runs) {
            match s.region {
                // A source holding other heads fills token rows (its part of each).
                Region::Kv { layer, plane } if rows.is_some_and(|w| w.tokens > 0) => {
                    let w = rows.unwrap_or_else(|| unreachable!());
                    let tokens = u64::from(w.tokens);
                    for row in w.rows(s.dst_offset, s.len) {
                        let unit = rank(row / tokens)
                            .and_then(|r| cov.kv_unit(layer, plane, r, (row % tokens) as u32));
                        units.extend(unit);
                    }
                }
                Region::Kv { layer, plane } => {
                    let page = u64::from(layout.page_bytes);
                    let first = s.dst_offset.div_ceil(page);
                    let end = (s.dst_offset + s.len) / page;
                    for p in first..end {
                        if let Some(u) = rank(p).and_then(|r| cov.kv_unit(layer, plane, r, 0)) {
                            units.push(u);
                        }
                    }
                }
                Region::Aux if s.len >= u64::from(layout.aux_bytes) => {
                    units.push(cov.slot_unit(false));
                }
                Region::State if s.len >= u64::from(layout.state_bytes) => {
                    units.push(cov.slot_unit(true));
                }
                Region::Extra { pool, tensor } => {
                    let item = ExtraPool::item_bytes_of(&self.local.extras, pool, tensor);
                    let granted = rr.granted.extras.get(usize::from(pool));
                    let (true, Some(granted)) = (item > 0, granted) else {
                        continue;
                    };
                    let first = s.dst_offset / item;
                    match item_copy(copies, pool, tensor) {
                        ItemCopy::Whole => {
                            for i in first..first + s.len / item {
                                let unit = granted
                                    .rank(i as u32)
                                    .and_then(|r| cov.extra_unit(pool, tensor, r, 0));
                                units.extend(unit);
                            }
                        }
                        // One row of one part: its place among the item's shared rows.
                        ItemCopy::Parts { parts, .. } => {
                            let Some((k, row)) = part_row(parts, s.dst_offset % item, s.len) else {
                                continue;
                            };
                            let before = parts[..k]
                                .iter()
                                .fold(0u32, |n, p| n.saturating_add(p.rows));
                            let unit = granted
                                .rank(first as u32)
                                .and_then(|r| cov.extra_unit(pool, tensor, r, before + row));
                            units.extend(unit);
                        }
                    }
                }
                _ => {}
            }
        }
        units
    }

    /// Decode: the source entry of `session` in room `(room, generation)`.
    pub(super) fn source_mut(
        &mut self,
        room: RoomId,
        generation: Generation,
        session: SessionId,
    ) -> Option<&mut Source> {
        let r = self.rooms.get_mut(&room)?;
        if r.generation != generation {
            return None;
        }
        let Side::Receiver(rr) = &mut r.side else {
            return None;
        };
        rr.sources.iter_mut().find(|s| s.session == session)
    }

    pub(super) fn check_write_inner(
        &self,
        session: SessionId,
        room: RoomId,
        generation: Generation,
        slice: &Slice,
    ) -> Result<(), WriteRefused> {
        let end = in_region(&self.local, slice)?;
        if slice.region == Region::Scratch {
            return match self.sessions.get(&session).map(|s| s.state) {
                Some(SessionState::Established | SessionState::Blacklisted) => Ok(()),
                _ => Err(WriteRefused::NotASource),
            };
        }
        let Some(r) = self.rooms.get(&room) else {
            // A room that succeeded here has every byte in place: a late repeat of one of its
            // writes is answered as landed (and never applied).
            return Err(match self.tombstones.get(room) {
                Some((g, KvPoll::Success)) if g == generation => WriteRefused::AlreadyLanded,
                _ => WriteRefused::UnknownRoom,
            });
        };
        if r.generation != generation {
            return Err(WriteRefused::StaleGeneration);
        }
        if r.state == KvPoll::Success {
            return Err(WriteRefused::AlreadyLanded);
        }
        if r.state.is_terminal() {
            return Err(WriteRefused::RoomConcluded);
        }
        let Side::Receiver(rr) = &r.side else {
            return Err(WriteRefused::UnknownRoom);
        };
        // An idle source was asked for nothing: any write of it is out of place.
        if !rr
            .sources
            .iter()
            .any(|s| s.session == session && s.granted && !s.idle)
        {
            return Err(WriteRefused::NotASource);
        }
        let (peer, copies) = match self.sessions.get(&session) {
            Some(s) => (s.peer, &s.extra_copies[..]),
            None => (None, &[][..]),
        };
        granted_admits(&self.local, &rr.granted, peer, copies, slice, end)
    }

    /// A one-sided source's operation completed: its bytes are in decode's memory unseen.
    /// They are authorized like a write (the ranges must lie in what the room granted this
    /// source) and handed to the driver to hash; the room's pages are held until it ends.
    pub(super) fn on_op_checksum(
        &mut self,
        now: Instant,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
        checksum: u64,
        ranges: &[LandedRange],
    ) {
        let one_sided = self
            .sessions
            .get(&sid)
            .is_some_and(|s| s.writer.one_sided());
        if !one_sided || !self.config.checksum {
            // Over TCP the checksum rides with the write itself; without the option there is
            // nothing to verify.
            self.strike(
                sid,
                "an operation checksum on a path that does not use them",
                false,
            );
            return;
        }
        let slices: Vec<Slice> = ranges
            .iter()
            .map(|r| Slice {
                region: r.region,
                src_offset: 0,
                dst_offset: r.offset,
                len: r.len,
                rows: r.rows,
                src_stride: 0,
                dst_stride: r.stride,
            })
            .collect();
        // Bounded like one operation, and only into a room's memory: a peer cannot make this
        // node hash more than it could have written.
        let bytes = slices.iter().fold(0u64, |n, s| n.saturating_add(s.bytes()));
        if bytes > self.config.max_op_bytes || slices.iter().any(|s| s.region == Region::Scratch) {
            self.strike(
                sid,
                "an operation checksum beyond one operation's memory",
                false,
            );
            return;
        }
        // A refused range fails a live room (`protocol_error`) inside check_write; a stale
        // or concluded room's checksum is counted and dropped there.
        let Ok(permit) = self.admit(now, sid, room, generation, &slices, Landing::Check) else {
            return;
        };
        self.outbox.action(Action::VerifyLanded {
            permit,
            ranges: slices,
            checksum,
        });
    }

    /// Ends a check of landed bytes ([`Action::VerifyLanded`]) if `permit` is one: the units
    /// count if the bytes matched, the room fails `checksum_mismatch` if they did not, and a
    /// Success the source sent meanwhile is taken once its last check ended. `false`: not a
    /// check's permit.
    fn end_check(&mut self, now: Instant, room: RoomId, permit: WritePermit) -> bool {
        let Some(r) = self
            .rooms
            .get_mut(&room)
            .filter(|r| r.generation == permit.generation)
        else {
            return false;
        };
        let live = !r.state.is_terminal();
        let Side::Receiver(rr) = &mut r.side else {
            return false;
        };
        // By permit number: the source may have moved to a session that took this one over.
        let Some(src) = rr
            .sources
            .iter_mut()
            .find(|s| s.checking.iter().any(|c| c.0 == permit.seq))
        else {
            return false;
        };
        let Some(i) = src.checking.iter().position(|c| c.0 == permit.seq) else {
            return false;
        };
        let (_, units) = src.checking.swap_remove(i);
        if permit.applied {
            for u in units {
                src.coverage.mark(u);
            }
            self.counters.landed_checks_passed += 1;
        }
        let settled = (src.success_pending && src.checking.is_empty()).then(|| {
            src.success_pending = false;
            src.session
        });
        if permit.corrupt && live {
            warn!(%room, session = %permit.session, "landed bytes did not match what their source wrote");
            self.conclude(now, room, KvPoll::Failed(FailureReason::ChecksumMismatch));
        }
        if let Some(source) = settled {
            // The source's Success waited for this check: take it now.
            self.on_room_status(now, source, room, permit.generation, None);
        }
        true
    }
}

/// What a permit given by [`Endpoint::admit`] stands for.
#[derive(Clone, Copy)]
enum Landing {
    /// A write whose bytes may be landing now (a fence of its session voids it).
    Write,
    /// A check of bytes a one-sided source already wrote (never voided by a fence).
    Check,
}
