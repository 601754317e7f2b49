//! Room announcements reach the prefill's embedder whenever it subscribes: a decode may ask
//! for a room between `listen` and the embedder's subscription, or while it swaps receivers.

#![allow(clippy::unwrap_used)] // tests may panic

use kvferry_core::{Event, RoomId, SessionId};
use kvferry_driver::{Announcement, Announcer};

fn asked(room: u64) -> Event {
    Event::RoomAnnounced {
        room: RoomId(room),
        generation: 0,
        session: SessionId(1),
        pages: 4,
        skip_pages: 0,
    }
}

fn rooms(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Announcement>) -> Vec<u64> {
    std::iter::from_fn(|| rx.try_recv().ok().map(|a| a.room.0)).collect()
}

#[test]
fn a_room_asked_for_before_anyone_subscribed_reaches_the_first_subscriber() {
    let announcer = Announcer::default();
    announcer.on_event(&asked(64));
    announcer.on_event(&asked(1));
    let mut rx = announcer.subscribe();
    announcer.on_event(&asked(2));
    assert_eq!(rooms(&mut rx), [64, 1, 2]);
}

#[test]
fn a_room_asked_for_while_no_receiver_is_held_reaches_the_next_subscriber() {
    let announcer = Announcer::default();
    drop(announcer.subscribe());
    announcer.on_event(&asked(7));
    let mut rx = announcer.subscribe();
    assert_eq!(rooms(&mut rx), [7]);
}

#[test]
fn a_new_subscriber_replaces_the_old_one_and_gets_only_what_the_old_one_did_not() {
    let announcer = Announcer::default();
    let mut old = announcer.subscribe();
    announcer.on_event(&asked(1));
    let mut new = announcer.subscribe();
    announcer.on_event(&asked(2));
    assert_eq!(rooms(&mut old), [1]);
    assert_eq!(rooms(&mut new), [2]);
}

#[test]
fn events_other_than_announcements_are_not_kept() {
    let announcer = Announcer::default();
    announcer.on_event(&Event::Releasable {
        room: RoomId(3),
        generation: 0,
    });
    assert!(rooms(&mut announcer.subscribe()).is_empty());
}

#[test]
fn the_backlog_keeps_the_newest_announcements_when_nobody_ever_subscribes() {
    let announcer = Announcer::default();
    let n = Announcer::BACKLOG as u64 + 2;
    for room in 0..n {
        announcer.on_event(&asked(room));
    }
    let got = rooms(&mut announcer.subscribe());
    assert_eq!(got.len(), Announcer::BACKLOG);
    assert_eq!(got.first(), Some(&2));
    assert_eq!(got.last(), Some(&(n - 1)));
}
