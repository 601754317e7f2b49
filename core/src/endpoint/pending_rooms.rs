//! Prefill: room messages that arrived before the sender room was opened.
//!
//! Invariants of [`PendingRooms`]: at most the configured number of rooms is held, the
//! oldest arrival evicted first (each held room has its arrival, by number, in the order;
//! arrivals of rooms taken since are skipped, and dropped once they outnumber the limit, so
//! the order stays bounded); a room holds the messages of one generation, the newest seen.

use std::collections::VecDeque;

use foldhash::fast::FixedState;
use smallvec::SmallVec;

use crate::codec::RoomRequest;

use super::Map;

use crate::ids::{Generation, RoomId, SessionId};

/// The messages one not-yet-opened room received.
#[derive(Debug, Default)]
pub(super) struct PendingRoom {
    pub(super) generation: Generation,
    pub(super) requests: SmallVec<[(SessionId, RoomRequest); 1]>,
    pub(super) notices: SmallVec<[(SessionId, u32); 1]>,
    /// Its arrival's number: an order entry is this room's only if the numbers match.
    arrival: u64,
}

/// Rooms with messages and no sender room yet, in arrival order.
#[derive(Debug)]
pub(super) struct PendingRooms {
    rooms: Map<RoomId, PendingRoom>,
    /// Arrivals, oldest first, by room and arrival number.
    order: VecDeque<(RoomId, u64)>,
    /// Arrivals so far (numbers them).
    arrivals: u64,
}

impl PendingRooms {
    pub(super) fn new(hasher: FixedState) -> Self {
        PendingRooms {
            rooms: Map::with_hasher(hasher),
            order: VecDeque::new(),
            arrivals: 0,
        }
    }

    /// The generation held for `room`.
    pub(super) fn generation_of(&self, room: RoomId) -> Option<Generation> {
        self.rooms.get(&room).map(|p| p.generation)
    }

    /// Takes `room`'s messages out (to deliver or answer them).
    pub(super) fn take(&mut self, room: RoomId) -> Option<PendingRoom> {
        self.rooms.remove(&room)
    }

    /// Puts back messages just taken (they belong to a newer generation than the one that
    /// opened): they keep their place in the arrival order.
    pub(super) fn put_back(&mut self, room: RoomId, p: PendingRoom) {
        self.rooms.insert(room, p);
    }

    /// Every held room, for a session taken over by another.
    pub(super) fn values_mut(&mut self) -> impl Iterator<Item = &mut PendingRoom> {
        self.rooms.values_mut()
    }

    /// The rooms whose messages `pred` picks.
    pub(super) fn rooms_where(&self, pred: impl Fn(&PendingRoom) -> bool) -> Vec<RoomId> {
        self.rooms
            .iter()
            .filter(|(_, p)| pred(p))
            .map(|(r, _)| *r)
            .collect()
    }

    /// Makes `room` held at `generation` (no newer one may be held): an older generation's
    /// messages are dropped; a room not held yet is added, evicting the oldest arrivals
    /// beyond `limit`, which are returned so that their requesters hear why.
    pub(super) fn admit(
        &mut self,
        room: RoomId,
        generation: Generation,
        limit: usize,
    ) -> Vec<(RoomId, PendingRoom)> {
        if self.generation_of(room).is_some_and(|g| g < generation) {
            self.rooms.remove(&room);
        }
        let mut evicted = Vec::new();
        if self.rooms.contains_key(&room) {
            return evicted;
        }
        while self.rooms.len() >= limit {
            let Some((old, arrival)) = self.order.pop_front() else {
                break;
            };
            if self.rooms.get(&old).is_some_and(|p| p.arrival == arrival) {
                if let Some(p) = self.rooms.remove(&old) {
                    evicted.push((old, p));
                }
            }
        }
        self.arrivals += 1;
        self.order.push_back((room, self.arrivals));
        self.rooms.insert(
            room,
            PendingRoom {
                generation,
                arrival: self.arrivals,
                ..PendingRoom::default()
            },
        );
        // Rooms opened since they arrived left their entries behind: drop them before they
        // outnumber the rooms a full table holds.
        if self.order.len() > 2 * limit.max(64) {
            let rooms = &self.rooms;
            self.order
                .retain(|(r, a)| rooms.get(r).is_some_and(|p| p.arrival == *a));
        }
        evicted
    }

    /// The messages held for `room`.
    pub(super) fn get_mut(&mut self, room: RoomId) -> Option<&mut PendingRoom> {
        self.rooms.get_mut(&room)
    }
}

#[cfg(test)]
mod tests {
    use super::{FixedState, PendingRooms, RoomId};

    #[test]
    fn rooms_opened_soon_after_they_arrive_leave_a_bounded_order_behind() {
        let mut pending = PendingRooms::new(FixedState::with_seed(1));
        for r in 0..10_000u64 {
            assert!(pending.admit(RoomId(r), 0, 100).is_empty());
            assert!(pending.take(RoomId(r)).is_some());
        }
        assert!(pending.order.len() <= 2 * 100, "{}", pending.order.len());
    }

    #[test]
    fn a_room_that_arrives_again_is_not_evicted_by_its_earlier_arrival() {
        let mut pending = PendingRooms::new(FixedState::with_seed(1));
        assert!(pending.admit(RoomId(1), 0, 2).is_empty());
        pending.take(RoomId(1));
        assert!(pending.admit(RoomId(2), 0, 2).is_empty());
        assert!(pending.admit(RoomId(1), 0, 2).is_empty());
        // Full: the oldest arrival still held is room 2's, not room 1's first one.
        let evicted: Vec<RoomId> = pending
            .admit(RoomId(3), 0, 2)
            .into_iter()
            .map(|(r, _)| r)
            .collect();
        assert_eq!(evicted, vec![RoomId(2)]);
        assert_eq!(pending.generation_of(RoomId(1)), Some(0));
    }
}
