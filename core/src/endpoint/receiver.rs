//! Decode: receiver rooms, page grants, write admission and the landing proof, and what sources say about a room.

use super::*;

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
        if let Some(sessions) = self.resolve_links(links)? {
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
            s.one_sided = true;
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
        if self.superseded.contains_key(&session) {
            return Err(WriteRefused::SessionSuperseded);
        }
        let result = self.check_write_inner(session, room, generation, slice);
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
                    | WriteRefused::UnknownRegion
                    | WriteRefused::NotASource
            );
            if live && out_of_bounds {
                self.conclude(now, room, KvPoll::Failed(FailureReason::ProtocolError));
            }
        }
        result
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
        for slice in slices {
            self.check_write(now, session, room, generation, slice)?;
        }
        let epoch = self.sessions.get(&session).map_or(0, |s| s.epoch);
        let holds_pages = slices.iter().any(|s| s.region != Region::Scratch);
        self.next_permit += 1;
        let seq = self.next_permit;
        if holds_pages {
            let units = self.write_units(room, session, slices);
            if let Some(src) = self.source_mut(room, generation, session) {
                src.pending.push((seq, session, units));
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

    /// Decode: a write authorized by [`Endpoint::begin_write`] was applied or abandoned; its
    /// room's pages may be released now. Void permits (older fence epoch) are ignored.
    pub fn end_write(&mut self, now: Instant, permit: WritePermit) {
        let now = self.clock(now);
        let Some(room) = permit.room else { return };
        let current = self.sessions.get(&permit.session).map(|s| s.epoch);
        if current != Some(permit.epoch) {
            return;
        }
        // By permit number: the source may have moved to a session that took this one over.
        let Some(Side::Receiver(rr)) = self
            .rooms
            .get_mut(&room)
            .filter(|r| r.generation == permit.generation)
            .map(|r| &mut r.side)
        else {
            return;
        };
        let mut settled = None;
        let checks_passed = &mut self.counters.landed_checks_passed;
        for src in rr.sources.iter_mut() {
            if let Some(i) = src.pending.iter().position(|p| p.0 == permit.seq) {
                let (_, _, units) = src.pending.swap_remove(i);
                if permit.applied {
                    for u in units {
                        src.coverage.mark(u);
                    }
                }
                if permit.applied
                    && self
                        .sessions
                        .get(&permit.session)
                        .is_some_and(|s| s.one_sided)
                {
                    *checks_passed += 1;
                }
                if src.success_pending && src.pending.is_empty() {
                    src.success_pending = false;
                    settled = Some(src.session);
                }
                break;
            }
        }
        let live = self
            .rooms
            .get(&room)
            .is_some_and(|r| !r.state.is_terminal());
        if permit.corrupt && live {
            // The bytes that landed are not the sender's: the room's pages are garbage.
            warn!(%room, session = %permit.session, "a write's checksum did not match what its sender computed");
            self.conclude(now, room, KvPoll::Failed(FailureReason::ChecksumMismatch));
        }
        if let Some(source) = settled {
            // The source's Success waited for this check: take it now.
            self.on_room_status(now, source, room, permit.generation, None);
        }
        if self.rooms.get(&room).is_some_and(|r| r.state.is_terminal()) {
            self.maybe_release(now, room);
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
        let rows = self
            .sessions
            .get(&session)
            .and_then(|s| s.peer)
            .and_then(|p| self.local.heads.row_write(layout.page_bytes, &p.heads));
        let rank = |p: u64| rr.pages.as_ref().and_then(|ps| ps.rank(p as u32));
        for s in slices {
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
                    let granted = rr.extras.get(usize::from(pool));
                    if let (true, Some(granted)) = (item > 0, granted) {
                        let first = s.dst_offset / item;
                        for i in first..first + s.len / item {
                            let unit = granted
                                .rank(i as u32)
                                .and_then(|r| cov.extra_unit(pool, tensor, r));
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
        let layout = &self.local.layout;
        let region_len = self
            .local
            .region_len(slice.region)
            .ok_or(WriteRefused::UnknownRegion)?;
        let end = slice
            .dst_offset
            .checked_add(slice.len)
            .ok_or(WriteRefused::OutOfRegion)?;
        if end > region_len || slice.len == 0 {
            return Err(WriteRefused::OutOfRegion);
        }
        if slice.region == Region::Scratch {
            return match self.sessions.get(&session).map(|s| s.state) {
                Some(SessionState::Established | SessionState::Blacklisted) => Ok(()),
                _ => Err(WriteRefused::NotASource),
            };
        }
        let r = self.rooms.get(&room).ok_or(WriteRefused::UnknownRoom)?;
        if r.generation != generation {
            return Err(WriteRefused::StaleGeneration);
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
        match slice.region {
            Region::Kv { layer, .. } => {
                let peer = self.sessions.get(&session).and_then(|s| s.peer);
                if peer.is_some_and(|p| layer < p.layer_start || layer >= p.layer_end) {
                    return Err(WriteRefused::LayerNotOwned);
                }
                let rows =
                    peer.and_then(|p| self.local.heads.row_write(layout.page_bytes, &p.heads));
                if rows.is_some_and(|w| !w.admits(slice.dst_offset, slice.len)) {
                    return Err(WriteRefused::HeadsNotShared);
                }
                let page = u64::from(layout.page_bytes);
                let first = (slice.dst_offset / page) as u32;
                let last = ((end - 1) / page) as u32;
                let pages = rr.pages.as_ref().ok_or(WriteRefused::PageNotGranted)?;
                if pages.contains_range(first, last) {
                    Ok(())
                } else {
                    Err(WriteRefused::PageNotGranted)
                }
            }
            Region::Aux | Region::State => {
                let (slot, item) = if slice.region == Region::Aux {
                    (rr.aux_slot, layout.aux_bytes)
                } else {
                    (rr.state_slot, layout.state_bytes)
                };
                let slot = slot.ok_or(WriteRefused::SlotNotGranted)?;
                let start = u64::from(slot) * u64::from(item);
                if slice.dst_offset >= start && end <= start + u64::from(item) {
                    Ok(())
                } else {
                    Err(WriteRefused::SlotNotGranted)
                }
            }
            Region::Extra { pool, tensor } => {
                let item = ExtraPool::item_bytes_of(&self.local.extras, pool, tensor);
                let granted = rr
                    .extras
                    .get(usize::from(pool))
                    .ok_or(WriteRefused::ItemNotGranted)?;
                let whole = item > 0 && slice.dst_offset % item == 0 && slice.len % item == 0;
                let first = (slice.dst_offset / item.max(1)) as u32;
                let last = ((end - 1) / item.max(1)) as u32;
                let writes_extras = self
                    .sessions
                    .get(&session)
                    .and_then(|s| s.peer)
                    .map_or(true, |p| p.writes_aux);
                if whole && writes_extras && granted.contains_range(first, last) {
                    Ok(())
                } else {
                    Err(WriteRefused::ItemNotGranted)
                }
            }
            Region::Scratch => Ok(()),
        }
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
                let one_sided = self.sessions.get(&sid).is_some_and(|s| s.one_sided);
                // A checksummed one-sided source's bytes count as they are verified: its word
                // waits for the checks still running, then needs them all, as over TCP.
                let checked = one_sided && self.config.checksum;
                if checked && !src.pending.is_empty() {
                    src.success_pending = true;
                    return;
                }
                if (!one_sided || checked) && !src.coverage.complete() && !r.state.is_terminal() {
                    // Success means the bytes are here: a word without them is a violation.
                    warn!(%room, session = %sid, covered = src.coverage.covered, expected = src.coverage.expected, "source reported success for pages that never landed");
                    self.counters.protocol_errors += 1;
                    self.conclude(now, room, KvPoll::Failed(FailureReason::ProtocolError));
                    return;
                }
                src.done = true;
                src.drained = true;
                let all_done = rr.sources.iter().all(|s| s.done);
                if r.state.is_terminal() {
                    self.maybe_release(now, room);
                } else if all_done {
                    self.conclude(now, room, KvPoll::Success);
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
        let one_sided = self.sessions.get(&sid).is_some_and(|s| s.one_sided);
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
            })
            .collect();
        // A refused range fails a live room (`protocol_error`) inside check_write; a stale
        // or concluded room's checksum is counted and dropped there.
        if let Ok(permit) = self.begin_write(now, sid, room, generation, &slices) {
            self.actions.push_back(Action::VerifyLanded {
                permit,
                ranges: slices,
                checksum,
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
        rr.pages = Some(PageSet::new(&grant.pages));
        rr.aux_slot = grant.aux_slot;
        rr.state_slot = grant.state_slot;
        rr.extras = grant.extras.iter().map(|x| PageSet::new(x)).collect();
        let mut targets: SmallVec<[(SessionId, bool); 2]> = SmallVec::new();
        for (i, src) in rr.sources.iter_mut().enumerate() {
            src.granted = true;
            src.idle = i < 64 && grant.idle_sources & (1 << i) != 0;
            src.coverage = if src.idle {
                Coverage::default()
            } else {
                Coverage::new(
                    &self.local,
                    self.sessions.get(&src.session).and_then(|s| s.peer),
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
        if let Some(gap) = writers.and_then(|w| uncovered(&self.local, &w, &grant)) {
            // No source would ever write these bytes: the room could only time out, or (where
            // a source reports success) succeed with them missing.
            warn!(%room, gap = %gap, "the room's sources cannot fill it");
            self.conclude(now, room, KvPoll::Failed(FailureReason::IncompatiblePeer));
            return;
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
            extras: grant.extras.iter().map(|x| page_runs(x)).collect(),
        };
        for (sid, idle) in targets {
            let request = if idle {
                request.idle()
            } else {
                request.clone()
            };
            self.transmits
                .push_back((sid, Message::RoomRequest(request)));
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
            self.transmits
                .push_back((src.session, make(room, r.generation)));
        }
    }
}

/// The room a peer's message names, if it is the attempt the message is about; a message
/// about another attempt, or a room gone, counts as stale. (Over the two fields, so the
/// caller may use the endpoint's other state while it holds the room.)
fn room_of_message<'a>(
    rooms: &'a mut Map<RoomId, Room>,
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
