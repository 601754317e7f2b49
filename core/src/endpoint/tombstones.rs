//! Bounded memory of concluded rooms.
//!
//! Invariants kept here: at most `cap` rooms are remembered, the oldest forgotten first (a
//! room remembered again counts as new); a remembered outcome is given only to the peers that
//! took part in the room (or to anyone, for a room nobody took part in, which can only say
//! Failed).

use std::collections::VecDeque;

use foldhash::fast::FixedState;
use smallvec::SmallVec;

use super::{Map, PeerIdentity};
use crate::ids::{Generation, RoomId};
use crate::state::{FailureReason, KvPoll};

/// Bounded memory of concluded rooms: answers late messages of the room's own peers and
/// refuses stale generations. It never answers another peer (a reused room id).
#[derive(Debug)]
pub(super) struct Tombstones {
    map: Map<RoomId, Tombstone>,
    order: VecDeque<(RoomId, u64)>,
    seq: u64,
    cap: usize,
}

#[derive(Debug)]
struct Tombstone {
    generation: Generation,
    outcome: KvPoll,
    seq: u64,
    /// Whether a room record existed here (`false`: a verdict reached before it opened).
    opened: bool,
    /// The peers that took part: the only ones answered from `outcome`.
    peers: SmallVec<[PeerIdentity; 1]>,
}

impl Tombstones {
    /// An empty memory of at most `cap` rooms.
    pub(super) fn new(cap: usize, hasher: FixedState) -> Self {
        Tombstones {
            map: Map::with_hasher(hasher),
            order: VecDeque::new(),
            seq: 0,
            cap,
        }
    }

    /// Remembers a room that was opened here and concluded.
    pub(super) fn insert(
        &mut self,
        room: RoomId,
        generation: Generation,
        outcome: KvPoll,
        peers: SmallVec<[PeerIdentity; 1]>,
    ) {
        self.remember(room, generation, outcome, true, peers);
    }

    /// Remembers a verdict reached before the room was opened here (prefill only).
    pub(super) fn insert_verdict(
        &mut self,
        room: RoomId,
        generation: Generation,
        reason: FailureReason,
        peers: SmallVec<[PeerIdentity; 1]>,
    ) {
        self.remember(room, generation, KvPoll::Failed(reason), false, peers);
    }

    pub(super) fn remember(
        &mut self,
        room: RoomId,
        generation: Generation,
        outcome: KvPoll,
        opened: bool,
        peers: SmallVec<[PeerIdentity; 1]>,
    ) {
        self.seq += 1;
        self.map.insert(
            room,
            Tombstone {
                generation,
                outcome,
                seq: self.seq,
                opened,
                peers,
            },
        );
        self.order.push_back((room, self.seq));
        while self.order.len() > self.cap {
            if let Some((old, seq)) = self.order.pop_front() {
                if self.map.get(&old).is_some_and(|e| e.seq == seq) {
                    self.map.remove(&old);
                }
            }
        }
    }

    pub(super) fn get(&self, room: RoomId) -> Option<(Generation, KvPoll)> {
        self.map.get(&room).map(|e| (e.generation, e.outcome))
    }

    /// The outcome of a room that was opened here and concluded (a verdict reached before
    /// the room was opened is not an outcome: the room may still be opened).
    pub(super) fn concluded(&self, room: RoomId) -> Option<KvPoll> {
        self.map.get(&room).filter(|e| e.opened).map(|e| e.outcome)
    }

    /// Whether `who` took part in the remembered room (a tombstone nobody took part in, such
    /// as a prefill room that timed out unrequested, answers everyone: it can only say Failed).
    pub(super) fn took_part(&self, room: RoomId, who: Option<PeerIdentity>) -> bool {
        self.map
            .get(&room)
            .is_some_and(|e| e.peers.is_empty() || who.is_some_and(|w| e.peers.contains(&w)))
    }

    /// A verdict for a room never opened here, to deliver when it is opened.
    pub(super) fn verdict(&self, room: RoomId) -> Option<(Generation, FailureReason)> {
        match self.map.get(&room) {
            Some(Tombstone {
                generation,
                outcome: KvPoll::Failed(reason),
                opened: false,
                ..
            }) => Some((*generation, *reason)),
            _ => None,
        }
    }
}
