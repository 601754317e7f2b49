//! Where a node's drivers publish the core's events for the embedder's subscribers.

use std::sync::{Arc, OnceLock};

use kvferry_core::Event;
use tokio::sync::broadcast;

/// How many events a subscriber may lag behind before it loses the oldest.
const CAPACITY: usize = 65536;

/// The node's event channel, shared by its shards' drivers. Nothing is allocated, locked or
/// sent until someone subscribes: a node nobody listens to pays one atomic load per event.
#[derive(Clone, Debug, Default)]
pub struct EventSink(Arc<OnceLock<broadcast::Sender<Event>>>);

impl EventSink {
    /// Hands `event` to the subscribers, if there ever was one.
    pub fn publish(&self, event: Event) {
        if let Some(tx) = self.0.get() {
            let _ = tx.send(event);
        }
    }

    /// Every event from now on (a subscriber lagging by more than 65536 loses the oldest).
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.0
            .get_or_init(|| broadcast::channel(CAPACITY).0)
            .subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::EventSink;
    use kvferry_core::{Event, RoomId};

    fn event(room: u64) -> Event {
        Event::Releasable {
            room: RoomId(room),
            generation: 0,
        }
    }

    #[test]
    fn a_subscriber_hears_what_is_published_after_it_subscribed() {
        let sink = EventSink::default();
        sink.publish(event(1));
        let mut rx = sink.clone().subscribe();
        sink.publish(event(2));
        assert!(matches!(
            rx.try_recv(),
            Ok(Event::Releasable {
                room: RoomId(2),
                ..
            })
        ));
        assert!(rx.try_recv().is_err());
    }
}
