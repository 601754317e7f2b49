//! Multi-rank consensus (TP / PP): one pure rule over per-rank room states, and a log that
//! applies each verdict exactly once on every rank.
//!
//! Ranks of one instance poll the same room at slightly different times and see different
//! states (seed 002: one PP stage timed out while the next still saw `Bootstrapping`). The rule
//! never asserts on skew: `Failed` dominates, otherwise the least advanced state wins.

use std::collections::{BTreeMap, HashSet, VecDeque};

use crate::ids::RoomId;
use crate::state::{FailureReason, KvPoll};

/// Combines per-rank states of one room, in rank order, into the instance's state.
///
/// Any `Failed` wins (the lowest rank's reason, so every rank computes the same answer);
/// otherwise the least advanced state. An empty slice is `Bootstrapping`.
pub fn combine(polls: &[KvPoll]) -> KvPoll {
    let mut combined = KvPoll::Success;
    for &poll in polls {
        match poll {
            KvPoll::Failed(_) => return poll,
            p if p.order() < combined.order() => combined = p,
            _ => {}
        }
    }
    if polls.is_empty() {
        KvPoll::Bootstrapping
    } else {
        combined
    }
}

/// A decision of the leader rank, broadcast by the embedder's own collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Position in the log; every rank applies decisions in this order.
    pub seq: u64,
    /// The room decided.
    pub room: RoomId,
    /// The terminal state every rank must adopt.
    pub verdict: KvPoll,
}

/// The ordered, idempotent consensus log of one rank.
///
/// The leader turns combined states into [`Decision`]s with [`ConsensusLog::decide`]; every
/// rank (the leader included) feeds the broadcast decisions to [`ConsensusLog::apply`], which
/// yields each exactly once and in sequence order, whatever the arrival order or duplicates.
/// A failed verdict is then applied with [`crate::Endpoint::fail_room`], which is soft: it
/// works from any local state, including `Bootstrapping`, and is a no-op on terminal rooms.
#[derive(Debug)]
pub struct ConsensusLog {
    next_seq: u64,
    next_apply: u64,
    decided: HashSet<RoomId>,
    decided_order: VecDeque<RoomId>,
    pending: BTreeMap<u64, Decision>,
    memory: usize,
}

impl ConsensusLog {
    /// A log that remembers the last `memory` decided rooms to refuse deciding them twice.
    pub fn new(memory: usize) -> Self {
        ConsensusLog {
            next_seq: 0,
            next_apply: 0,
            decided: HashSet::new(),
            decided_order: VecDeque::new(),
            pending: BTreeMap::new(),
            memory: memory.max(1),
        }
    }

    /// Leader: decides `room` from the per-rank states if they combine to a terminal state and
    /// the room was not decided before.
    pub fn decide(&mut self, room: RoomId, polls: &[KvPoll]) -> Option<Decision> {
        let verdict = combine(polls);
        if !verdict.is_terminal() || self.decided.contains(&room) {
            return None;
        }
        if self.decided_order.len() == self.memory {
            if let Some(old) = self.decided_order.pop_front() {
                self.decided.remove(&old);
            }
        }
        self.decided.insert(room);
        self.decided_order.push_back(room);
        let decision = Decision {
            seq: self.next_seq,
            room,
            verdict,
        };
        self.next_seq += 1;
        Some(decision)
    }

    /// Every rank: accepts a broadcast decision and returns the decisions now ready to apply,
    /// in order. Duplicates and already-applied sequence numbers yield nothing.
    pub fn apply(&mut self, decision: Decision) -> Vec<Decision> {
        if decision.seq >= self.next_apply {
            self.pending.entry(decision.seq).or_insert(decision);
        }
        let mut ready = Vec::new();
        while let Some(d) = self.pending.remove(&self.next_apply) {
            ready.push(d);
            self.next_apply += 1;
        }
        ready
    }

    /// Sequence number of the next decision this rank will apply.
    pub fn applied_up_to(&self) -> u64 {
        self.next_apply
    }
}

/// The failure reason of a verdict, if it is a failure.
pub fn verdict_failure(verdict: KvPoll) -> Option<FailureReason> {
    verdict.failure()
}
