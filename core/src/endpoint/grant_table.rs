//! Decode: what each room's grant lets its sources write, published where a receive path
//! reads it without the driver's lock, and the writes of each room still landing.
//!
//! Invariants of [`GrantTable`]: a room admits here only while the core's room of that
//! generation is live with its grant applied, and only from the sessions of its granted,
//! non-idle sources; a session admits only from its handshake until it is taken over or
//! closed, with the fence epoch the core holds; every permit for a room's pages is counted
//! here, under its session and the epoch it was admitted in, from its admission until it
//! ends or the core voids that session's writes of earlier epochs (a fence: nothing of them
//! can land any more), and the core releases a room only once nothing of it is counted. Whatever the table
//! does not admit goes to the core, which decides it with its whole state: the table may send
//! a write there that the core admits, never admit one the core would refuse.

use std::collections::HashMap;
use std::sync::Arc;

// loom's lock under `cfg(loom)`, so the models of a receive path racing the core see every
// interleaving at this lock too.
#[cfg(loom)]
use loom::sync::{Mutex, MutexGuard};
#[cfg(not(loom))]
use std::sync::{Mutex, MutexGuard};

use foldhash::fast::FixedState;
use smallvec::SmallVec;

use crate::api::{EndpointInfo, PeerInfo, WritePermit, WriteRefused};
use crate::ids::{Generation, RoomId, SessionId};
use crate::layout::{ExtraCopies, ExtraPool, ItemCopy, PageSet, PartCopy, Region, Slice};

/// The memory a room's grant gave its sources: fixed from the grant until the room goes.
#[derive(Debug, Default)]
pub(crate) struct Granted {
    /// The room's pages (`None` until the grant).
    pub(crate) pages: Option<PageSet>,
    /// Its aux row.
    pub(crate) aux_slot: Option<u32>,
    /// Its state slot.
    pub(crate) state_slot: Option<u32>,
    /// Its items of each extra pool.
    pub(crate) extras: Box<[PageSet]>,
}

/// Whether `slice` names memory this endpoint registered, in a shape its region allows: the
/// checks that need no room.
pub(crate) fn in_region(local: &EndpointInfo, slice: &Slice) -> Result<u64, WriteRefused> {
    let region_len = local
        .region_len(slice.region)
        .ok_or(WriteRefused::UnknownRegion)?;
    let end = slice.dst_end().ok_or(WriteRefused::BadRows)?;
    if slice.rows > 1 && !matches!(slice.region, Region::Kv { .. } | Region::Extra { .. }) {
        return Err(WriteRefused::BadRows);
    }
    if end > region_len {
        return Err(WriteRefused::OutOfRegion);
    }
    Ok(end)
}

/// Whether `slice` (ending at `end`), written by the peer `peer` describes (its extra items
/// going as `copies` says), lies inside what `granted` gave the room: its layers, its heads'
/// rows, its pages, slots, items and the parts of them the peer shares.
pub(crate) fn granted_admits(
    local: &EndpointInfo,
    granted: &Granted,
    peer: Option<PeerInfo>,
    copies: &[Vec<ItemCopy>],
    slice: &Slice,
    end: u64,
) -> Result<(), WriteRefused> {
    let layout = &local.layout;
    match slice.region {
        Region::Kv { layer, .. } => {
            if peer.is_some_and(|p| layer < p.layer_start || layer >= p.layer_end) {
                return Err(WriteRefused::LayerNotOwned);
            }
            let rows = peer.and_then(|p| local.heads.row_write(layout.page_bytes, &p.heads));
            if rows.is_some_and(|w| !w.admits_rows(slice)) {
                return Err(WriteRefused::HeadsNotShared);
            }
            let page = u64::from(layout.page_bytes);
            let first = (slice.dst_offset / page) as u32;
            let last = ((end - 1) / page) as u32;
            let pages = granted.pages.as_ref().ok_or(WriteRefused::PageNotGranted)?;
            if pages.contains_range(first, last) {
                Ok(())
            } else {
                Err(WriteRefused::PageNotGranted)
            }
        }
        Region::Aux | Region::State => {
            let (slot, item) = if slice.region == Region::Aux {
                (granted.aux_slot, layout.aux_bytes)
            } else {
                (granted.state_slot, layout.state_bytes)
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
            let item = ExtraPool::item_bytes_of(&local.extras, pool, tensor);
            let items = granted
                .extras
                .get(usize::from(pool))
                .ok_or(WriteRefused::ItemNotGranted)?;
            let first = (slice.dst_offset / item.max(1)) as u32;
            let last = ((end - 1) / item.max(1)) as u32;
            let writes_extras = peer.map_or(true, |p| p.writes_aux);
            let shaped = match item_copy(copies, pool, tensor) {
                ItemCopy::Whole => {
                    item > 0
                        && slice.dst_offset % item == 0
                        && slice.len % item == 0
                        && (slice.rows == 1 || slice.dst_stride % item == 0)
                }
                ItemCopy::Parts { parts, .. } => {
                    first == last
                        && part_row(parts, slice.dst_offset % item.max(1), slice.len).is_some_and(
                            |(k, row)| {
                                let p = &parts[k];
                                row.checked_add(slice.rows).is_some_and(|end| end <= p.rows)
                                    && (slice.rows == 1 || slice.dst_stride == p.dst_stride)
                            },
                        )
                }
            };
            if shaped && writes_extras && items.contains_range(first, last) {
                Ok(())
            } else {
                Err(WriteRefused::ItemNotGranted)
            }
        }
        Region::Scratch => Ok(()),
    }
}

/// How tensor `tensor` of extra pool `pool` goes, by `copies` (whole when not named).
pub(crate) fn item_copy(copies: &[Vec<ItemCopy>], pool: u8, tensor: u16) -> &ItemCopy {
    static WHOLE: ItemCopy = ItemCopy::Whole;
    copies
        .get(usize::from(pool))
        .and_then(|p| p.get(usize::from(tensor)))
        .unwrap_or(&WHOLE)
}

/// The part (index in `parts`) and row a write of `len` bytes at `at` within an item is
/// exactly the shared units of.
pub(crate) fn part_row(parts: &[PartCopy], at: u64, len: u64) -> Option<(usize, u32)> {
    parts
        .iter()
        .enumerate()
        .find_map(|(k, p)| p.row_at(at, len).map(|row| (k, row)))
}

/// Decode: the grants of live rooms and the writes landing in them, shared between the core
/// (which changes it, under the driver's lock) and the receive paths (which admit writes
/// against it without that lock). See the module's invariants.
#[derive(Debug)]
pub struct GrantTable {
    local: Arc<EndpointInfo>,
    inner: Mutex<Table>,
}

#[derive(Debug)]
struct Table {
    rooms: HashMap<RoomId, RoomGrant, FixedState>,
    sessions: HashMap<SessionId, WriterSession, FixedState>,
    /// Write permits given so far (numbers them).
    next_permit: u64,
}

#[derive(Debug)]
struct RoomGrant {
    generation: Generation,
    /// Live, its grant applied: writes may begin.
    open: bool,
    granted: Arc<Granted>,
    /// The sessions of its granted, non-idle sources.
    writers: SmallVec<[SessionId; 2]>,
    /// Writes begun and not ended: (writing session, its epoch then, how many).
    landing: SmallVec<[(SessionId, u32, u32); 2]>,
}

#[derive(Debug)]
struct WriterSession {
    peer: PeerInfo,
    /// How its extra items land here.
    copies: Arc<ExtraCopies>,
    epoch: u32,
    /// A fresh connection took its work over: its writes go to the core (which refuses them).
    superseded: bool,
}

impl GrantTable {
    /// An empty table for the endpoint described by `local`.
    pub(crate) fn new(local: Arc<EndpointInfo>, hasher: FixedState) -> Self {
        GrantTable {
            local,
            inner: Mutex::new(Table {
                rooms: HashMap::with_hasher(hasher.clone()),
                sessions: HashMap::with_hasher(hasher),
                next_permit: 0,
            }),
        }
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        // Nothing in here panics while holding the lock; a poisoned lock still holds a
        // consistent table.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits one whole write of `session` for `(room, generation)` without the core, when
    /// the room's grant plainly allows every slice: the permit is counted as landing until
    /// `end_write`. `None`: ask the core ([`crate::Endpoint::begin_write`]), which decides with
    /// its whole state (refusals, probes, repeats of landed writes).
    pub fn begin(
        &self,
        session: SessionId,
        room: RoomId,
        generation: Generation,
        slices: &[Slice],
    ) -> Option<WritePermit> {
        let mut t = self.table();
        let writer = t.sessions.get(&session).filter(|w| !w.superseded)?;
        let r = t.rooms.get(&room)?;
        if !r.open || r.generation != generation || !r.writers.contains(&session) {
            return None;
        }
        for slice in slices {
            if slice.region == Region::Scratch {
                return None;
            }
            let end = in_region(&self.local, slice).ok()?;
            granted_admits(
                &self.local,
                &r.granted,
                Some(writer.peer),
                &writer.copies,
                slice,
                end,
            )
            .ok()?;
        }
        let epoch = writer.epoch;
        let holds_pages = !slices.is_empty();
        let seq = t.next_seq();
        if holds_pages {
            t.count(room, generation, session, epoch);
        }
        Some(WritePermit {
            session,
            room: holds_pages.then_some(room),
            generation,
            epoch,
            seq,
            applied: false,
            corrupt: false,
        })
    }

    /// Numbers a permit the core gives.
    pub(crate) fn next_seq(&self) -> u64 {
        self.table().next_seq()
    }

    /// Counts a write the core admitted for `room`'s pages as landing, under `session`'s
    /// `epoch`.
    pub(crate) fn count(
        &self,
        room: RoomId,
        generation: Generation,
        session: SessionId,
        epoch: u32,
    ) {
        self.table().count(room, generation, session, epoch);
    }

    /// The write `permit` names, counted for its room, ended.
    pub(crate) fn end(&self, permit: &WritePermit) {
        let mut t = self.table();
        let Some(r) = permit
            .room
            .and_then(|room| t.rooms.get_mut(&room))
            .filter(|r| r.generation == permit.generation)
        else {
            return;
        };
        let counted =
            |(s, e, _): &(SessionId, u32, u32)| *s == permit.session && *e == permit.epoch;
        if let Some(i) = r.landing.iter().position(counted) {
            r.landing[i].2 -= 1;
            if r.landing[i].2 == 0 {
                r.landing.swap_remove(i);
            }
        }
    }

    /// Forgets the writes of `session` counted as landing in any room, but those of epoch
    /// `keep`: they can no longer land (a fence stopped them, or the session's writer gave
    /// up). Returns the rooms where some were forgotten.
    pub(crate) fn void(&self, session: SessionId, keep: Option<u32>) -> Vec<RoomId> {
        let mut t = self.table();
        let mut touched = Vec::new();
        for (&room, r) in t.rooms.iter_mut() {
            let before = r.landing.len();
            r.landing
                .retain(|(s, e, _)| *s != session || Some(*e) == keep);
            if r.landing.len() != before {
                touched.push(room);
            }
        }
        touched
    }

    /// Writes counted as landing in `room`.
    pub(crate) fn landing(&self, room: RoomId) -> u32 {
        self.table()
            .rooms
            .get(&room)
            .map_or(0, |r| r.landing.iter().map(|(_, _, n)| n).sum())
    }

    /// The sessions with writes counted as landing in `room`.
    pub(crate) fn landing_sessions(&self, room: RoomId) -> SmallVec<[SessionId; 2]> {
        let mut sessions: SmallVec<[SessionId; 2]> = SmallVec::new();
        if let Some(r) = self.table().rooms.get(&room) {
            for (s, _, _) in &r.landing {
                if !sessions.contains(s) {
                    sessions.push(*s);
                }
            }
        }
        sessions
    }

    /// `room`'s grant was applied: its writers may write what `granted` holds.
    pub(crate) fn open(
        &self,
        room: RoomId,
        generation: Generation,
        granted: Arc<Granted>,
        writers: SmallVec<[SessionId; 2]>,
    ) {
        let mut t = self.table();
        let landing = t
            .rooms
            .remove(&room)
            .filter(|r| r.generation == generation)
            .map(|r| r.landing)
            .unwrap_or_default();
        t.rooms.insert(
            room,
            RoomGrant {
                generation,
                open: true,
                granted,
                writers,
                landing,
            },
        );
    }

    /// `room` concluded: no write of it begins without the core any more.
    pub(crate) fn close(&self, room: RoomId) {
        if let Some(r) = self.table().rooms.get_mut(&room) {
            r.open = false;
        }
    }

    /// `room` was released (nothing of it lands any more).
    pub(crate) fn remove(&self, room: RoomId) {
        self.table().rooms.remove(&room);
    }

    /// `new` took `old`'s work over: `room`'s source writes on `new` now, and `old` no more.
    pub(crate) fn move_writer(&self, room: RoomId, old: SessionId, new: SessionId) {
        if let Some(r) = self.table().rooms.get_mut(&room) {
            for w in r.writers.iter_mut().filter(|w| **w == old) {
                *w = new;
            }
        }
    }

    /// `session` finished its handshake with the peer `peer` describes.
    pub(crate) fn add_session(
        &self,
        session: SessionId,
        peer: PeerInfo,
        epoch: u32,
        copies: Arc<ExtraCopies>,
    ) {
        self.table().sessions.insert(
            session,
            WriterSession {
                peer,
                copies,
                epoch,
                superseded: false,
            },
        );
    }

    /// `session` was taken over: nothing of it begins without the core any more.
    pub(crate) fn supersede(&self, session: SessionId) {
        if let Some(s) = self.table().sessions.get_mut(&session) {
            s.superseded = true;
        }
    }

    /// `session`'s fence epoch moved on: permits of earlier epochs are void.
    pub(crate) fn set_epoch(&self, session: SessionId, epoch: u32) {
        if let Some(s) = self.table().sessions.get_mut(&session) {
            s.epoch = epoch;
        }
    }

    /// `session` closed.
    pub(crate) fn remove_session(&self, session: SessionId) {
        self.table().sessions.remove(&session);
    }
}

impl Table {
    fn next_seq(&mut self) -> u64 {
        self.next_permit += 1;
        self.next_permit
    }

    fn count(&mut self, room: RoomId, generation: Generation, session: SessionId, epoch: u32) {
        // A write the core admitted is counted even where no grant was published: the core
        // must not release the room's pages while it lands.
        let r = self.rooms.entry(room).or_insert_with(|| RoomGrant {
            generation,
            open: false,
            granted: Arc::default(),
            writers: SmallVec::new(),
            landing: SmallVec::new(),
        });
        match r
            .landing
            .iter_mut()
            .find(|(s, e, _)| *s == session && *e == epoch)
        {
            Some((_, _, n)) => *n += 1,
            None => r.landing.push((session, epoch, 1)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{
        Arc, EndpointInfo, FixedState, GrantTable, Granted, PageSet, PeerInfo, Region, RoomId,
        SessionId, Slice, SmallVec, WritePermit,
    };
    use crate::ids::{Incarnation, NodeId};
    use crate::layout::Heads;
    use crate::sim::small_layout;
    use crate::state::Role;
    use std::time::Duration;

    const ROOM: RoomId = RoomId(7);
    const S1: SessionId = SessionId(1);
    const S2: SessionId = SessionId(2);

    fn table() -> GrantTable {
        let layout = small_layout(8);
        let local = EndpointInfo::new(Role::Decode, NodeId(1), Incarnation(1), layout);
        GrantTable::new(Arc::new(local), FixedState::with_seed(3))
    }

    fn peer() -> PeerInfo {
        let layout = small_layout(8);
        PeerInfo {
            role: Role::Prefill,
            rank: 0,
            node: NodeId(2),
            incarnation: Incarnation(1),
            layout,
            layer_start: 0,
            layer_end: layout.layers,
            writes_aux: true,
            heads: Heads::whole(&layout),
            heartbeat_interval: Duration::from_millis(100),
            heartbeat_misses: 3,
        }
    }

    /// `ROOM` of generation 0 granted pages 2 and 3, written by `S1`.
    fn open_room(t: &GrantTable) {
        t.add_session(S1, peer(), 0, Arc::default());
        t.add_session(S2, peer(), 0, Arc::default());
        let granted = Granted {
            pages: Some(PageSet::new(&[2, 3])),
            ..Granted::default()
        };
        t.open(ROOM, 0, Arc::new(granted), SmallVec::from_slice(&[S1]));
    }

    fn page(p: u64) -> Slice {
        Slice::run(Region::Kv { layer: 1, plane: 0 }, 0, p * 1024, 1024)
    }

    #[test]
    fn an_open_rooms_writer_is_admitted_inside_its_pages_and_nowhere_else() {
        let t = table();
        open_room(&t);
        let permit = t
            .begin(S1, ROOM, 0, &[page(2), page(3)])
            .expect("granted pages");
        assert_eq!(
            (permit.room, permit.session, permit.epoch),
            (Some(ROOM), S1, 0)
        );
        assert!(
            t.begin(S1, ROOM, 0, &[page(2), page(4)]).is_none(),
            "page 4"
        );
        assert!(t.begin(S2, ROOM, 0, &[page(2)]).is_none(), "not a writer");
        assert!(
            t.begin(S1, ROOM, 1, &[page(2)]).is_none(),
            "another generation"
        );
        assert!(
            t.begin(S1, RoomId(8), 0, &[page(2)]).is_none(),
            "another room"
        );
        let probe = Slice::run(Region::Scratch, 0, 0, 8);
        assert!(
            t.begin(S1, ROOM, 0, &[probe]).is_none(),
            "probes go to the core"
        );
    }

    #[test]
    fn a_concluded_room_admits_nothing_and_keeps_its_landing_writes_counted() {
        let t = table();
        open_room(&t);
        let permit = t.begin(S1, ROOM, 0, &[page(2)]).unwrap();
        t.close(ROOM);
        assert!(t.begin(S1, ROOM, 0, &[page(3)]).is_none());
        assert_eq!(t.landing(ROOM), 1);
        t.end(&permit);
        assert_eq!(t.landing(ROOM), 0);
    }

    #[test]
    fn permits_are_numbered_once_whoever_gives_them() {
        let t = table();
        open_room(&t);
        let a = t.begin(S1, ROOM, 0, &[page(2)]).unwrap().seq;
        let b = t.next_seq();
        let c = t.begin(S1, ROOM, 0, &[page(3)]).unwrap().seq;
        assert!(a < b && b < c);
    }

    #[test]
    fn voiding_a_session_forgets_only_its_own_landing_writes() {
        let t = table();
        open_room(&t);
        let _landing = t.begin(S1, ROOM, 0, &[page(2)]).unwrap();
        t.count(ROOM, 0, S2, 0);
        assert_eq!(t.void(S1, None), vec![ROOM]);
        assert!(t.void(S1, None).is_empty(), "nothing left to void");
        assert_eq!(t.landing(ROOM), 1);
        assert_eq!(t.landing_sessions(ROOM).as_slice(), &[S2]);
    }

    #[test]
    fn a_fence_voids_the_writes_before_it_and_keeps_those_admitted_since() {
        let t = table();
        open_room(&t);
        let before = t.begin(S1, ROOM, 0, &[page(2)]).unwrap();
        t.set_epoch(S1, 1);
        // A data connection attached while the fence ran writes under the new epoch.
        let since = t.begin(S1, ROOM, 0, &[page(3)]).unwrap();
        assert_eq!(t.void(S1, Some(1)), vec![ROOM]);
        assert_eq!(t.landing(ROOM), 1, "the write since the fence still lands");
        t.end(&before);
        assert_eq!(t.landing(ROOM), 1, "a void permit's end changes nothing");
        t.end(&since);
        assert_eq!(t.landing(ROOM), 0);
    }

    #[test]
    fn an_end_for_another_generation_of_the_room_changes_nothing() {
        let t = table();
        open_room(&t);
        let permit = t.begin(S1, ROOM, 0, &[page(2)]).unwrap();
        t.end(&WritePermit {
            generation: 1,
            ..permit
        });
        assert_eq!(t.landing(ROOM), 1);
    }

    #[test]
    fn a_taken_over_writer_is_admitted_under_its_new_session_only() {
        let t = table();
        open_room(&t);
        let s3 = SessionId(3);
        t.add_session(s3, peer(), 0, Arc::default());
        t.move_writer(ROOM, S1, s3);
        t.supersede(S1);
        assert!(t.begin(S1, ROOM, 0, &[page(2)]).is_none());
        assert!(t.begin(s3, ROOM, 0, &[page(2)]).is_some());
    }

    #[test]
    fn a_fenced_sessions_epoch_is_the_one_its_new_permits_carry() {
        let t = table();
        open_room(&t);
        t.set_epoch(S1, 4);
        assert_eq!(t.begin(S1, ROOM, 0, &[page(2)]).unwrap().epoch, 4);
        t.remove_session(S1);
        assert!(
            t.begin(S1, ROOM, 0, &[page(2)]).is_none(),
            "a closed session"
        );
    }

    #[test]
    fn a_write_the_core_admits_where_nothing_was_published_is_counted_all_the_same() {
        let t = table();
        t.count(RoomId(9), 0, S1, 0);
        assert_eq!(t.landing(RoomId(9)), 1);
        assert!(t.begin(S1, RoomId(9), 0, &[page(2)]).is_none());
    }

    #[test]
    fn a_writer_outside_its_layers_is_sent_to_the_core() {
        let t = table();
        open_room(&t);
        let stage = PeerInfo {
            layer_start: 2,
            ..peer()
        };
        t.add_session(S1, stage, 0, Arc::default());
        assert!(t.begin(S1, ROOM, 0, &[page(2)]).is_none(), "layer 1");
        let own = Slice::run(Region::Kv { layer: 2, plane: 0 }, 0, 2048, 1024);
        assert!(t.begin(S1, ROOM, 0, &[own]).is_some());
    }
}
