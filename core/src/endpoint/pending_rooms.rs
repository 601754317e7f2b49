//! Prefill: room messages that arrived before the sender room was opened.
//!
//! Invariants of [`PendingRooms`]: at most the configured number of rooms is held, the
//! oldest arrival evicted first (each held room has its arrival in the order; arrivals of
//! rooms taken since are skipped); a room holds the messages of one generation, the newest
//! seen.

use std::collections::VecDeque;

use foldhash::fast::FixedState;
use smallvec::SmallVec;

use super::Map;
use crate::codec::RoomRequest;
use crate::ids::{Generation, RoomId, SessionId};

/// The messages one not-yet-opened room received.
#[derive(Debug, Default)]
pub(super) struct PendingRoom {
    pub(super) generation: Generation,
    pub(super) requests: SmallVec<[(SessionId, RoomRequest); 1]>,
    pub(super) notices: SmallVec<[(SessionId, u32); 1]>,
}

/// Rooms with messages and no sender room yet, in arrival order.
#[derive(Debug)]
pub(super) struct PendingRooms {
    rooms: Map<RoomId, PendingRoom>,
    order: VecDeque<(RoomId, Generation)>,
}

impl PendingRooms {
    pub(super) fn new(hasher: FixedState) -> Self {
        PendingRooms {
            rooms: Map::with_hasher(hasher),
            order: VecDeque::new(),
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
            let Some((old, g)) = self.order.pop_front() else {
                break;
            };
            if self.generation_of(old) == Some(g) {
                if let Some(p) = self.rooms.remove(&old) {
                    evicted.push((old, p));
                }
            }
        }
        self.order.push_back((room, generation));
        self.rooms.insert(
            room,
            PendingRoom {
                generation,
                ..PendingRoom::default()
            },
        );
        evicted
    }

    /// The messages held for `room`.
    pub(super) fn get_mut(&mut self, room: RoomId) -> Option<&mut PendingRoom> {
        self.rooms.get_mut(&room)
    }
}
