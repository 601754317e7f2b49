//! What the endpoint asks of the world, in order: control messages for peers, actions on
//! connections for the driver, events for the embedding scheduler.

use std::collections::VecDeque;

use crate::api::{Action, Event};
use crate::codec::Message;
use crate::ids::SessionId;

/// The endpoint's three output queues; each drains first in, first out.
#[derive(Debug, Default)]
pub(super) struct Outbox {
    transmits: VecDeque<(SessionId, Message)>,
    actions: VecDeque<Action>,
    events: VecDeque<Event>,
}

impl Outbox {
    /// Queues a control message for `session`'s peer.
    pub(super) fn transmit(&mut self, session: SessionId, msg: Message) {
        self.transmits.push_back((session, msg));
    }

    /// Queues an action on a connection for the driver.
    pub(super) fn action(&mut self, action: Action) {
        self.actions.push_back(action);
    }

    /// Queues an event for the embedding scheduler.
    pub(super) fn event(&mut self, event: Event) {
        self.events.push_back(event);
    }

    /// The oldest queued control message and its session.
    pub(super) fn next_transmit(&mut self) -> Option<(SessionId, Message)> {
        self.transmits.pop_front()
    }

    /// The oldest queued action.
    pub(super) fn next_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// The oldest queued event.
    pub(super) fn next_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// `session`'s handshake just completed: the room messages queued for it while it
    /// handshook go (they would leave behind its hello); its handshake messages stay.
    pub(super) fn drop_room_messages(&mut self, session: SessionId) {
        self.transmits
            .retain(|(s, m)| *s != session || m.is_handshake());
    }
}

#[cfg(test)]
mod tests {
    use super::{Action, Event, Message, Outbox, SessionId};
    use crate::ids::RoomId;

    fn room_message() -> Message {
        Message::AbortAck {
            room: RoomId(7),
            generation: 1,
        }
    }

    #[test]
    fn each_queue_drains_in_the_order_it_was_filled() {
        let mut out = Outbox::default();
        out.transmit(SessionId(1), room_message());
        out.transmit(SessionId(2), Message::Challenge { nonce: [3; 32] });
        out.action(Action::CloseSession(SessionId(1)));
        out.action(Action::FenceSession(SessionId(2)));
        out.event(Event::SessionClosed {
            session: SessionId(1),
        });
        assert_eq!(out.next_transmit().map(|(s, _)| s), Some(SessionId(1)));
        assert_eq!(out.next_transmit().map(|(s, _)| s), Some(SessionId(2)));
        assert!(out.next_transmit().is_none());
        assert!(matches!(
            out.next_action(),
            Some(Action::CloseSession(SessionId(1)))
        ));
        assert!(matches!(
            out.next_action(),
            Some(Action::FenceSession(SessionId(2)))
        ));
        assert!(out.next_action().is_none());
        assert!(matches!(
            out.next_event(),
            Some(Event::SessionClosed { .. })
        ));
        assert!(out.next_event().is_none());
    }

    #[test]
    fn an_established_sessions_queued_room_messages_go_and_its_handshake_and_others_stay() {
        let mut out = Outbox::default();
        let challenge = Message::Challenge { nonce: [3; 32] };
        out.transmit(SessionId(1), room_message());
        out.transmit(SessionId(1), challenge.clone());
        out.transmit(SessionId(2), room_message());
        out.drop_room_messages(SessionId(1));
        let left: Vec<_> = std::iter::from_fn(|| out.next_transmit()).collect();
        assert_eq!(left.len(), 2);
        assert_eq!(left[0].0, SessionId(1));
        assert!(left[0].1.is_handshake());
        assert_eq!(left[1].0, SessionId(2));
        assert!(!left[1].1.is_handshake());
    }
}
