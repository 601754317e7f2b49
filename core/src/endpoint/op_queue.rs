//! A session's operations toward its peer: queued, in flight, and its turn in the endpoint's
//! ready list.
//!
//! Invariants of [`OpQueue`]: `in_flight` counts the operations handed to the driver and not
//! reported yet (including those a taken-over session handed on); `in_ready` is true exactly
//! while the session is in the endpoint's ready list, so it is there at most once; while a
//! fence waits for the driver's confirmation no operation starts.

use std::collections::VecDeque;

use crate::ids::TransferId;

/// The operations a session runs toward its peer.
#[derive(Debug, Default)]
pub(super) struct OpQueue {
    queued: VecDeque<TransferId>,
    in_flight: u32,
    in_ready: bool,
    /// A fence waits for the driver's confirmation.
    fencing: bool,
}

/// The queued and in-flight operations of a session a fresh connection took over.
pub(super) struct HandedOver {
    queued: VecDeque<TransferId>,
    in_flight: u32,
}

impl OpQueue {
    /// Queues `id` after the others.
    pub(super) fn push_back(&mut self, id: TransferId) {
        self.queued.push_back(id);
    }

    /// Queues `id` before the others (a retry, a probe).
    pub(super) fn push_front(&mut self, id: TransferId) {
        self.queued.push_front(id);
    }

    /// Operations waiting for their turn.
    pub(super) fn queued(&self) -> usize {
        self.queued.len()
    }

    /// Operations handed to the driver and not reported.
    pub(super) fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Whether the session joins the ready list now: it has work, room for it under `max` in
    /// flight, no fence pending, and is not in the list already.
    pub(super) fn wants_turn(&mut self, max: u32) -> bool {
        if self.in_ready || self.fencing || self.in_flight >= max || self.queued.is_empty() {
            return false;
        }
        self.in_ready = true;
        true
    }

    /// The session's turn came (it left the ready list): the next operation to run, unless
    /// it may not run now (`may_run` false), a fence is pending or `max` are in flight.
    pub(super) fn turn(&mut self, max: u32, may_run: bool) -> Option<TransferId> {
        self.in_ready = false;
        if !may_run || self.fencing || self.in_flight >= max {
            return None;
        }
        self.queued.pop_front()
    }

    /// The operation its turn gave went to the driver.
    pub(super) fn started(&mut self) {
        self.in_flight += 1;
    }

    /// An operation in flight reported.
    pub(super) fn ended(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// Whether a fence waits for the driver's confirmation.
    pub(super) fn fencing(&self) -> bool {
        self.fencing
    }

    /// A fence starts: false if one is already pending.
    pub(super) fn start_fence(&mut self) -> bool {
        !std::mem::replace(&mut self.fencing, true)
    }

    /// The driver confirmed the fence: false if none was pending.
    pub(super) fn end_fence(&mut self) -> bool {
        std::mem::replace(&mut self.fencing, false)
    }

    /// Gives up every operation to the session that takes this one over.
    pub(super) fn hand_over(&mut self) -> HandedOver {
        HandedOver {
            queued: std::mem::take(&mut self.queued),
            in_flight: std::mem::take(&mut self.in_flight),
        }
    }

    /// Carries on the operations of a session this one took over, after its own.
    pub(super) fn take_over(&mut self, handed: HandedOver) {
        self.queued.extend(handed.queued);
        self.in_flight += handed.in_flight;
    }
}

#[cfg(test)]
mod tests {
    use super::OpQueue;
    use crate::ids::TransferId;

    #[test]
    fn a_session_joins_the_ready_list_once_and_only_with_work_and_room() {
        let mut q = OpQueue::default();
        assert!(!q.wants_turn(2), "nothing queued");
        q.push_back(TransferId(1));
        q.push_back(TransferId(2));
        assert!(q.wants_turn(2));
        assert!(!q.wants_turn(2), "already in the list");
        assert_eq!(q.turn(2, true), Some(TransferId(1)));
        q.started();
        assert!(!q.wants_turn(1), "one in flight is the most");
        assert_eq!(q.in_flight(), 1);
    }

    #[test]
    fn a_pending_fence_starts_nothing() {
        let mut q = OpQueue::default();
        q.push_back(TransferId(1));
        assert!(q.start_fence());
        assert!(!q.start_fence(), "one fence at a time");
        assert!(!q.wants_turn(4));
        assert_eq!(q.turn(4, true), None);
        assert!(q.end_fence());
        assert!(q.wants_turn(4));
        assert_eq!(q.turn(4, true), Some(TransferId(1)));
    }

    #[test]
    fn a_take_over_carries_the_queue_and_the_count_in_flight() {
        let (mut old, mut new) = (OpQueue::default(), OpQueue::default());
        old.push_back(TransferId(1));
        old.push_back(TransferId(2));
        assert_eq!(old.turn(4, true), Some(TransferId(1)));
        old.started();
        new.push_back(TransferId(9));
        new.take_over(old.hand_over());
        assert_eq!((old.queued(), old.in_flight()), (0, 0));
        assert_eq!((new.queued(), new.in_flight()), (2, 1));
        assert_eq!(new.turn(4, true), Some(TransferId(9)));
    }
}
