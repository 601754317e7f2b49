//! Prefill's announcements of rooms a decode asked for that it has not opened yet.

use std::sync::Arc;

use kvferry_core::{Event, Generation, RoomId};
use tokio::sync::mpsc;

/// Prefill: a decode asked for a room this node has not opened (lossless, unlike events).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Announcement {
    /// The room.
    pub room: RoomId,
    /// Its generation.
    pub generation: Generation,
    /// Pages the decode granted (0 while it waits for pages).
    pub pages: u32,
    /// Room pages the decode already holds: the room has `skip_pages + pages` pages
    /// (`SKIP_ALL`: the decode wants nothing from this rank).
    pub skip_pages: u32,
}

/// Where a prefill's room announcements go: the one receiver the embedder holds (the latest
/// [`Announcer::subscribe`] wins). Lossless, unlike an event broadcast: an announcement that
/// no receiver takes (none subscribed yet, or the last one was dropped) waits in a backlog
/// that the next subscriber receives first, so a decode that asks for a room before the
/// embedder subscribes is not left waiting for a sender that never opens. Cheap to clone;
/// every shard of a node holds the same one.
#[derive(Clone, Debug, Default)]
pub struct Announcer(Arc<std::sync::Mutex<Announcements>>);

/// The receiver's sender and the announcements no receiver took yet.
#[derive(Debug, Default)]
struct Announcements {
    tx: Option<mpsc::UnboundedSender<Announcement>>,
    backlog: std::collections::VecDeque<Announcement>,
}

impl Announcer {
    /// Announcements kept for a subscriber to come; beyond it the oldest are dropped (their
    /// rooms fail `bootstrap_timeout` on both sides, as any room nobody opens).
    pub const BACKLOG: usize = 65536;

    /// A new receiver: first every announcement no receiver took, then every later one
    /// (replaces the previous receiver).
    pub fn subscribe(&self) -> mpsc::UnboundedReceiver<Announcement> {
        let (tx, rx) = mpsc::unbounded_channel();
        if let Ok(mut a) = self.0.lock() {
            for announcement in std::mem::take(&mut a.backlog) {
                let _ = tx.send(announcement);
            }
            a.tx = Some(tx);
        }
        rx
    }

    /// Forwards a [`Event::RoomAnnounced`] to the receiver, or keeps it for the next one;
    /// other events are ignored.
    pub fn on_event(&self, event: &Event) {
        let Event::RoomAnnounced {
            room,
            generation,
            pages,
            skip_pages,
            ..
        } = *event
        else {
            return;
        };
        let announcement = Announcement {
            room,
            generation,
            pages,
            skip_pages,
        };
        let Ok(mut a) = self.0.lock() else {
            return;
        };
        let unsent = match a.tx.as_ref() {
            Some(tx) => tx.send(announcement).err().map(|e| e.0),
            None => Some(announcement),
        };
        if let Some(announcement) = unsent {
            a.tx = None;
            if a.backlog.len() == Self::BACKLOG {
                a.backlog.pop_front();
                tracing::warn!(%room, "no receiver takes room announcements: dropped the oldest");
            }
            a.backlog.push_back(announcement);
        }
    }
}
