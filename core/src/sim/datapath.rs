//! The simulated data path: an operation is checked when it starts and its bytes land when
//! it completes, with page ownership checked on both ends.

use super::*;

impl Sim {
    pub(super) fn start_op(&mut self, n: usize, op: TransferOp) {
        self.ops_emitted += 1;
        if let Some(room) = op.room {
            let key = (room, op.generation);
            let node = &self.nodes[n];
            if node.released.contains(&key) {
                self.violations
                    .push(format!("node {n}: op for {room} emitted after its release"));
            } else if matches!(node.states.get(&key), Some(KvPoll::Failed(_))) {
                self.violations
                    .push(format!("node {n}: op for {room} emitted after it failed"));
            }
        }
        let Some((li, dir)) = self.link_of(n, op.session) else {
            let id = op.id;
            self.inflight.insert(
                (n, id),
                InFlight {
                    src: n,
                    dst: n,
                    dst_session: op.session,
                    op,
                    outcome: TransferOutcome::Transient,
                    permit: None,
                },
            );
            let at = self.now;
            self.push(at, Pending::OpDone { node: n, id });
            return;
        };
        let l = &self.links[li];
        let (dst, dst_session) = if dir == 0 { l.b } else { l.a };
        if let (Some(room), Some(first)) = (op.room, op.slices.first()) {
            let key = (dst, room, op.generation);
            let logical = (n, first.region.code(), first.dst_offset);
            if !self
                .landed_ops
                .get(&key)
                .is_some_and(|l| l.contains(&logical))
            {
                self.unlanded.entry(key).or_default().insert(logical);
            }
        }
        let l = &self.links[li];
        let up = l.up;
        let blackholed = l.blackhole_until > self.now;
        let down = self.nodes[n]
            .data_down_until
            .get(&op.session)
            .is_some_and(|t| *t > self.now);
        let mut outcome = TransferOutcome::Done;
        let mut hang = false;
        let mut permit = None;
        if !up || down {
            outcome = TransferOutcome::Transient;
        } else if blackholed || self.rng.chance(self.faults.op_hang) {
            hang = true;
        } else if self.rng.chance(self.faults.op_fatal) {
            outcome = TransferOutcome::Fatal;
        } else if self.rng.chance(self.faults.op_transient) {
            outcome = TransferOutcome::Transient;
        } else {
            // The receiver validates the write header when the write starts, as the drivers'
            // receive paths do: the grant table first, the core for whatever it does not
            // admit. The permit holds the room's pages until the bytes landed.
            let room = op.room.unwrap_or(RoomId(0));
            let ep = &mut self.nodes[dst].endpoint;
            let verdict = ep.admits_write(dst_session, room, op.generation, &op.slices);
            let fast = ep
                .grant_table()
                .begin(dst_session, room, op.generation, &op.slices);
            let probe = op.slices.iter().any(|s| s.region == Region::Scratch);
            match (&fast, verdict) {
                (Some(_), Err(refused)) => self.violations.push(format!(
                    "the grant table admitted a write of {room} the core refuses ({refused:?})"
                )),
                (None, Ok(())) if !probe => self.violations.push(format!(
                    "the grant table sent a write of {room} the core admits to the core"
                )),
                _ => {}
            }
            let begun = match fast {
                Some(p) => Ok(p),
                None => self.nodes[dst].endpoint.begin_write(
                    self.now,
                    dst_session,
                    room,
                    op.generation,
                    &op.slices,
                ),
            };
            match begun {
                Ok(p) => permit = Some(p),
                Err(_) => outcome = TransferOutcome::Refused,
            }
            self.drain(dst);
        }
        let id = op.id;
        let delay = self.faults.op_delay;
        let d = self.uniform(delay);
        if permit.is_some() && !hang && self.rng.chance(self.faults.op_orphan) {
            // The sender sees a broken connection now; the receiver applies the bytes later.
            let key = self.next_orphan;
            self.next_orphan += 1;
            let late = d + self.uniform(delay) * 4;
            let f = InFlight {
                src: n,
                dst,
                dst_session,
                op,
                outcome,
                permit,
            };
            // Its bytes left the source now (they sit in the network); they land later.
            self.check_source(&f);
            self.orphans.insert(key, f);
            let at = self.now + late;
            self.push(at, Pending::OrphanLands { key });
            self.nodes[n]
                .endpoint
                .handle_transfer_result(self.now, id, TransferOutcome::Transient);
            self.drain(n);
            return;
        }
        self.inflight.insert(
            (n, id),
            InFlight {
                src: n,
                dst,
                dst_session,
                op,
                outcome,
                permit,
            },
        );
        if !hang {
            let at = self.now + d;
            self.push(at, Pending::OpDone { node: n, id });
        }
    }

    /// The receiver is done with a write (`landed`: every byte applied; else abandoned): its
    /// permit goes back.
    pub(super) fn end_write(&mut self, f: &InFlight, landed: bool) {
        if let Some(permit) = f.permit {
            let permit = if landed { permit.applied() } else { permit };
            self.nodes[f.dst]
                .endpoint
                .end_write(self.now, permit, &f.op.slices);
            self.drain(f.dst);
        }
    }

    /// The bytes of a write land now: check that every page still belongs to the room.
    pub(super) fn land(&mut self, f: &InFlight) {
        self.land_dst(f);
        self.check_source(f);
    }

    /// The sender read the write's source pages: check that they still belong to the room.
    pub(super) fn check_source(&mut self, f: &InFlight) {
        self.check_owner(f, f.src, |s| s.src_offset, ("read", "from source page"));
    }

    /// The write's bytes land in the destination: every page must still be the room's.
    pub(super) fn land_dst(&mut self, f: &InFlight) {
        if let (Some(room), Some(first)) = (f.op.room, f.op.slices.first()) {
            let key = (f.dst, room, f.op.generation);
            let logical = (f.src, first.region.code(), first.dst_offset);
            if let Some(set) = self.unlanded.get_mut(&key) {
                set.remove(&logical);
            }
            self.landed_ops.entry(key).or_default().insert(logical);
        }
        if let Some(room) = f.op.room {
            let node = &mut self.nodes[f.dst];
            let info = &node.info;
            let landed = node.landed.entry((room, f.op.generation)).or_default();
            for slice in f.op.slices.iter() {
                let unit = match slice.region {
                    // KV lands by head of a token row (a whole page where heads are not split).
                    Region::Kv { .. } => u64::from(info.heads.head_bytes),
                    Region::Aux => u64::from(info.layout.aux_bytes),
                    Region::State => u64::from(info.layout.state_bytes),
                    Region::Extra { pool, tensor } => {
                        crate::layout::ExtraPool::item_bytes_of(&info.extras, pool, tensor)
                    }
                    Region::Scratch => continue,
                };
                if unit == 0 {
                    continue;
                }
                // Only whole units count: a page half written is not there.
                for row in slice.runs() {
                    let first = row.dst_offset.div_ceil(unit);
                    let end = (row.dst_offset + row.len) / unit;
                    for i in first..end {
                        landed.insert((row.region.code(), i));
                    }
                }
            }
        }
        self.check_owner(f, f.dst, |s| s.dst_offset, ("write", "landed on page"));
    }

    /// Every KV page the write's slices touch on `node` (at the offsets `offset` picks) must
    /// belong to the write's room; each one that does not is a violation worded with `what`
    /// (the access, and where).
    pub(super) fn check_owner(
        &mut self,
        f: &InFlight,
        node: usize,
        offset: impl Fn(&crate::layout::Slice) -> u64,
        what: (&str, &str),
    ) {
        let Some(room) = f.op.room else { return };
        let key = (room, f.op.generation);
        let page_bytes = u64::from(self.nodes[node].info.layout.page_bytes);
        for slice in f.op.slices.iter().flat_map(crate::layout::Slice::runs) {
            if !matches!(slice.region, Region::Kv { .. }) {
                continue;
            }
            let first = offset(&slice) / page_bytes;
            let last = (offset(&slice) + slice.len - 1) / page_bytes;
            for p in first..=last {
                let owner = self.nodes[node].pages.get(p as usize).copied().flatten();
                if owner != Some(key) {
                    let (access, place) = what;
                    self.violations.push(format!(
                        "node {node}: {access} of {room} {place} {p} owned by {owner:?}"
                    ));
                }
            }
        }
    }
}
