//! Data-path operations: every queued, in-flight or retry-waiting attempt by id, and the
//! round-robin of sessions with an operation ready to start.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use foldhash::fast::FixedState;

use crate::api::OpKind;
use crate::ids::{Generation, RoomId, SessionId, TransferId};
use crate::layout::Slice;
use crate::timer::{TimerKey, TimerTable};

use super::Map;

/// Every operation by id (ids never reused: a late report of an old attempt finds nothing),
/// and the sessions whose turn it is to start one.
#[derive(Debug)]
pub(super) struct Operations {
    by_id: Map<TransferId, Op>,
    last_id: u64,
    ready: VecDeque<SessionId>,
}

impl Operations {
    /// No operation yet; ids hashed with the endpoint's seeded `hasher`.
    pub(super) fn new(hasher: FixedState) -> Self {
        Operations {
            by_id: Map::with_hasher(hasher),
            last_id: 0,
            ready: VecDeque::new(),
        }
    }

    /// A fresh id, for an operation inserted under it.
    pub(super) fn next_id(&mut self) -> TransferId {
        self.last_id += 1;
        TransferId(self.last_id)
    }

    /// Keeps `op` under `id` (from [`Operations::next_id`]).
    pub(super) fn insert(&mut self, id: TransferId, op: Op) {
        self.by_id.insert(id, op);
    }

    /// Keeps `op` under a fresh id.
    pub(super) fn add(&mut self, op: Op) -> TransferId {
        let id = self.next_id();
        self.by_id.insert(id, op);
        id
    }

    /// Takes an operation out; its deadline (operation or retry) never fires after this.
    pub(super) fn remove(&mut self, id: TransferId, timers: &mut TimerTable) -> Option<Op> {
        let mut op = self.by_id.remove(&id)?;
        timers.cancel(&mut op.timer);
        Some(op)
    }

    pub(super) fn get(&self, id: &TransferId) -> Option<&Op> {
        self.by_id.get(id)
    }

    pub(super) fn get_mut(&mut self, id: &TransferId) -> Option<&mut Op> {
        self.by_id.get_mut(id)
    }

    /// The ids of the operations `keep` picks.
    pub(super) fn ids_where(&self, keep: impl Fn(&Op) -> bool) -> Vec<TransferId> {
        self.by_id
            .iter()
            .filter(|(_, op)| keep(op))
            .map(|(id, _)| *id)
            .collect()
    }

    /// Room operations (probes excluded), whatever their phase.
    pub(super) fn of_rooms(&self) -> usize {
        self.by_id.values().filter(|op| op.room.is_some()).count()
    }

    /// `new` took `old`'s work over: its operations go to `new`, and those in flight on
    /// `old` run again there without spending an attempt, whatever their report says.
    pub(super) fn move_session(&mut self, old: SessionId, new: SessionId) {
        for op in self.by_id.values_mut().filter(|op| op.session == old) {
            op.session = new;
            op.superseded = op.phase == OpPhase::InFlight;
        }
    }

    /// `session` may start an operation: it joins the round-robin.
    pub(super) fn ready(&mut self, session: SessionId) {
        self.ready.push_back(session);
    }

    /// The next session whose turn it is.
    pub(super) fn next_ready(&mut self) -> Option<SessionId> {
        self.ready.pop_front()
    }
}

#[derive(Debug)]
pub(super) struct Op {
    pub(super) session: SessionId,
    pub(super) room: Option<RoomId>,
    pub(super) generation: Generation,
    pub(super) kind: OpKind,
    pub(super) slices: Arc<[Slice]>,
    /// Owned-layer indexes (from the endpoint's first layer) the operation writes.
    pub(super) layers: Range<usize>,
    pub(super) bytes: u64,
    pub(super) attempt: u32,
    /// Times it was flushed by a failure that was not its own (they spend no attempt).
    pub(super) flushes: u32,
    pub(super) phase: OpPhase,
    pub(super) timer: Option<TimerKey>,
    /// In flight on a connection that a fresh one took over: whatever its report says but
    /// `Done`, it runs again on the new session without counting an attempt.
    pub(super) superseded: bool,
    /// One-sided data plane with the checksum option: the XXH3-64 of the source bytes, which
    /// decode verifies over what landed once the operation is done.
    pub(super) source_checksum: Option<u64>,
}

impl Op {
    /// A new operation of `session`, queued for its first attempt, its bytes those of `slices`.
    pub(super) fn queued(
        session: SessionId,
        room: Option<RoomId>,
        generation: Generation,
        kind: OpKind,
        slices: Arc<[Slice]>,
        layers: Range<usize>,
    ) -> Op {
        Op {
            session,
            room,
            generation,
            kind,
            bytes: slices.iter().map(Slice::bytes).sum(),
            slices,
            layers,
            attempt: 1,
            flushes: 0,
            phase: OpPhase::Queued,
            timer: None,
            superseded: false,
            source_checksum: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OpPhase {
    Queued,
    InFlight,
    RetryWait,
}

#[cfg(test)]
mod tests {
    use super::{
        Arc, FixedState, Op, OpKind, OpPhase, Operations, RoomId, SessionId, Slice, TimerTable,
    };
    use crate::layout::Region;
    use crate::timer::Timer;
    use std::time::{Duration, Instant};

    fn no_ops() -> Operations {
        Operations::new(FixedState::default())
    }

    fn op(session: u32, room: Option<u64>, phase: OpPhase) -> Op {
        let slices = Arc::from(vec![Slice::run(Region::Scratch, 0, 0, 8)]);
        Op {
            phase,
            ..Op::queued(
                SessionId(session),
                room.map(RoomId),
                1,
                OpKind::Kv,
                slices,
                0..0,
            )
        }
    }

    #[test]
    fn ids_are_never_reused_even_after_removal() {
        let (mut ops, mut timers) = (no_ops(), TimerTable::default());
        let a = ops.add(op(1, Some(1), OpPhase::Queued));
        ops.remove(a, &mut timers);
        let b = ops.add(op(1, Some(1), OpPhase::Queued));
        assert_ne!(a, b);
        assert!(ops.get(&a).is_none());
    }

    #[test]
    fn a_removed_operation_leaves_no_deadline_behind() {
        let (mut ops, mut timers) = (no_ops(), TimerTable::default());
        let id = ops.add(op(1, Some(1), OpPhase::InFlight));
        let o = ops.get_mut(&id).unwrap();
        timers.set(
            &mut o.timer,
            Instant::now() + Duration::from_secs(1),
            Timer::Operation(id),
        );
        assert!(ops.remove(id, &mut timers).is_some());
        assert!(timers.next().is_none());
    }

    #[test]
    fn a_take_over_moves_every_operation_and_marks_only_those_in_flight_superseded() {
        let mut ops = no_ops();
        let queued = ops.add(op(1, Some(1), OpPhase::Queued));
        let flying = ops.add(op(1, Some(1), OpPhase::InFlight));
        let other = ops.add(op(2, Some(2), OpPhase::InFlight));
        ops.move_session(SessionId(1), SessionId(3));
        let q = ops.get(&queued).unwrap();
        assert_eq!((q.session, q.superseded), (SessionId(3), false));
        let f = ops.get(&flying).unwrap();
        assert_eq!((f.session, f.superseded), (SessionId(3), true));
        let o = ops.get(&other).unwrap();
        assert_eq!((o.session, o.superseded), (SessionId(2), false));
    }

    #[test]
    fn probes_are_not_counted_as_room_operations() {
        let mut ops = no_ops();
        ops.add(op(1, Some(1), OpPhase::Queued));
        ops.add(op(1, None, OpPhase::InFlight));
        assert_eq!(ops.of_rooms(), 1);
        assert_eq!(ops.ids_where(|o| o.room.is_none()).len(), 1);
    }

    #[test]
    fn sessions_take_turns_in_the_order_they_became_ready() {
        let mut ops = no_ops();
        ops.ready(SessionId(2));
        ops.ready(SessionId(1));
        assert_eq!(ops.next_ready(), Some(SessionId(2)));
        assert_eq!(ops.next_ready(), Some(SessionId(1)));
        assert_eq!(ops.next_ready(), None);
    }
}
