//! Peers as the embedder names them, room sharding, and the book that turns the core's room
//! events into handle updates (the embedder's API itself is [`crate::Node`]).

use crate::{role_label, RoomHandle, RoomView};
use std::time::Instant;

use foldhash::fast::FixedState;
use kvferry_core::{Event, KvPoll, Role, RoomId};
use tokio::sync::watch;

type Map<K, V> = std::collections::HashMap<K, V, FixedState>;

/// A peer as the embedder names it: the list of its addresses (one per shard of the peer;
/// one for a tokio node). Room `r` moves over the session to address `r mod len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u32);

/// The shard (or peer address) that owns room `room` among `n`: `room mod n`. Both sides of
/// a transfer apply it, so a room meets its peer on the same shard whatever the runtimes.
pub fn shard_of(room: RoomId, n: usize) -> usize {
    (room.0 % n.max(1) as u64) as usize
}

/// The driver's room handles: turns the core's room events into [`RoomHandle`] updates and
/// measures how long failed rooms' pages stayed quarantined.
#[derive(Debug)]
pub struct RoomBook {
    role: Role,
    rooms: Map<RoomId, watch::Sender<RoomView>>,
    failed_at: Map<RoomId, Instant>,
}

impl RoomBook {
    /// An empty book for a node of `role`.
    pub fn new(role: Role) -> Self {
        RoomBook {
            role,
            rooms: Map::default(),
            failed_at: Map::default(),
        }
    }

    /// A handle on `room`, starting from `state` unless the room is already watched.
    pub fn watch(&mut self, room: RoomId, state: KvPoll) -> RoomHandle {
        let tx = self.rooms.entry(room).or_insert_with(|| {
            watch::channel(RoomView {
                state,
                releasable: false,
                delivered_through: None,
            })
            .0
        });
        RoomHandle::new(room, tx.subscribe())
    }

    /// Drops the handles of a room that was never opened after all.
    pub fn forget(&mut self, room: RoomId) {
        self.rooms.remove(&room);
    }

    /// Whether `event` is one the book follows (drivers hand it these).
    pub fn follows(event: &Event) -> bool {
        matches!(
            event,
            Event::RoomState { .. } | Event::Releasable { .. } | Event::LayerDelivered { .. }
        )
    }

    /// Applies a room event of the core to its handles.
    pub fn on_event(&mut self, event: &Event) {
        match *event {
            Event::RoomState { room, state, .. } => {
                if let Some(tx) = self.rooms.get(&room) {
                    tx.send_modify(|v| v.state = state);
                }
                if matches!(state, KvPoll::Failed(_)) {
                    self.failed_at.insert(room, Instant::now());
                }
            }
            Event::LayerDelivered { room, layer, .. } => {
                if let Some(tx) = self.rooms.get(&room) {
                    tx.send_modify(|v| v.delivered_through = Some(layer));
                }
            }
            Event::Releasable { room, .. } => {
                if let Some(t) = self.failed_at.remove(&room) {
                    metrics::histogram!("kvferry_quarantine_seconds", "role" => role_label(self.role))
                        .record(t.elapsed().as_secs_f64());
                }
                if let Some(tx) = self.rooms.remove(&room) {
                    tx.send_modify(|v| v.releasable = true);
                }
            }
            _ => {}
        }
    }
}
