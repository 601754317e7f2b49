//! The rooms held by id: each is inserted when it opens and removed when it is released, and
//! none of its deadlines outlives it.

use foldhash::fast::FixedState;

use crate::ids::{Generation, RoomId};
use crate::state::KvPoll;
use crate::timer::TimerTable;

use super::{Map, Room, SenderRoom, Side};

/// Every room held, by id.
#[derive(Debug)]
pub(super) struct Rooms {
    by_id: Map<RoomId, Room>,
}

impl Rooms {
    /// No room yet; ids are hashed with the endpoint's seeded `hasher` (peers name rooms).
    pub(super) fn new(hasher: FixedState) -> Self {
        Rooms {
            by_id: Map::with_hasher(hasher),
        }
    }

    /// Holds a room that just opened.
    pub(super) fn insert(&mut self, id: RoomId, room: Room) {
        self.by_id.insert(id, room);
    }

    /// Releases a room; its bootstrap, waiting and abort deadlines never fire after this.
    pub(super) fn remove(&mut self, id: RoomId, timers: &mut TimerTable) -> Option<Room> {
        let mut r = self.by_id.remove(&id)?;
        for t in [
            &mut r.bootstrap_timer,
            &mut r.waiting_timer,
            &mut r.abort_timer,
        ] {
            timers.cancel(t);
        }
        Some(r)
    }

    pub(super) fn get(&self, id: &RoomId) -> Option<&Room> {
        self.by_id.get(id)
    }

    pub(super) fn get_mut(&mut self, id: &RoomId) -> Option<&mut Room> {
        self.by_id.get_mut(id)
    }

    pub(super) fn contains(&self, id: &RoomId) -> bool {
        self.by_id.contains_key(id)
    }

    /// How many rooms are held.
    pub(super) fn len(&self) -> usize {
        self.by_id.len()
    }

    /// A sender room past its bootstrap and not concluded, with its generation: the rooms whose
    /// layers may be planned and reported delivered.
    pub(super) fn live_sender(&mut self, room: RoomId) -> Option<(Generation, &mut SenderRoom)> {
        let r = self.by_id.get_mut(&room)?;
        if r.state.is_terminal() || r.state == KvPoll::Bootstrapping {
            return None;
        }
        let generation = r.generation;
        match &mut r.side {
            Side::Sender(s) => Some((generation, s)),
            Side::Receiver(_) => None,
        }
    }

    /// The ids of the rooms held, in no particular order.
    pub(super) fn ids(&self) -> impl Iterator<Item = RoomId> + '_ {
        self.by_id.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{FixedState, Room, RoomId, Rooms, SenderRoom, Side, TimerTable};
    use crate::timer::Timer;

    #[test]
    fn a_released_room_leaves_none_of_its_deadlines_behind() {
        let (mut rooms, mut timers, now) = (
            Rooms::new(FixedState::default()),
            TimerTable::default(),
            Instant::now(),
        );
        let id = RoomId(9);
        let mut room = Room::bootstrapping(1, now, Side::Sender(SenderRoom::default()));
        timers.set(
            &mut room.bootstrap_timer,
            now + Duration::from_secs(1),
            Timer::Bootstrap(id),
        );
        timers.set(
            &mut room.abort_timer,
            now + Duration::from_secs(2),
            Timer::AbortAck(id),
        );
        rooms.insert(id, room);
        assert_eq!((rooms.len(), rooms.contains(&id)), (1, true));
        assert!(rooms.remove(id, &mut timers).is_some());
        assert!(timers.next().is_none());
        assert_eq!((rooms.len(), rooms.ids().count()), (0, 0));
        assert!(
            rooms.remove(id, &mut timers).is_none(),
            "a room is released once"
        );
    }
}
