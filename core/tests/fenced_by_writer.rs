//! Sessions only their writer can fence (the same-host path: the prefill copies into the
//! decode's process from its own): closing the connections stops nothing, so the decode keeps
//! the pages of rooms such a session could still write until the writer can no longer write,
//! and the writer copies only while it hears its receiver.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvferry_core::sim::Sim;
use kvferry_core::{Event, RoomId, SessionId};

const ROOM: u64 = 21;

/// A decode whose session to the prefill is one-sided and fenced by its writer, `ROOM`
/// granted to it (the prefill never sends: its copies are what the decode must outwait).
fn writer_fenced_room(seed: u64, fenced_by_writer: bool) -> (Sim, usize, usize, SessionId) {
    let (mut sim, p, d) = pair(seed, config());
    let session = sim.session(d, p).expect("session");
    sim.nodes[d].endpoint.set_one_sided(session);
    if fenced_by_writer {
        sim.nodes[d].endpoint.set_fenced_by_writer(session);
    }
    open_receiver_with(&mut sim, d, &[p], ROOM, 2, |dst| {
        kvferry_core::Grant::new(dst, Some(ROOM as u32), None)
    });
    (sim, p, d, session)
}

/// When node `n` first emitted an event matching `f`.
fn first(sim: &Sim, n: usize, f: impl Fn(&Event) -> bool) -> Option<Instant> {
    sim.nodes[n]
        .events
        .iter()
        .find(|(_, e)| f(e))
        .map(|(t, _)| *t)
}

fn released(e: &Event) -> bool {
    matches!(e, Event::Releasable { room, .. } if *room == RoomId(ROOM))
}

fn closed(e: &Event) -> bool {
    matches!(e, Event::SessionClosed { .. })
}

/// The link of a `writer_fenced_room` goes dark for good: when the decode gave the session
/// up, and when the room's pages went back.
fn silent_link(fenced_by_writer: bool) -> (Instant, Instant) {
    let (mut sim, p, d, _) = writer_fenced_room(71, fenced_by_writer);
    let far = sim.now + Duration::from_secs(60);
    sim.blackhole(d, p, far);
    sim.run_for(Duration::from_secs(5), 1_000_000)
        .expect("runs");
    let ended = first(&sim, d, closed).expect("the decode gave the session up");
    let back = first(&sim, d, released).expect("the pages went back");
    (ended, back)
}

/// The link goes dark: the decode gives the silent session up after its liveness window, and
/// the room's pages go back only a window and a heartbeat after that.
#[test]
fn pages_a_silent_writer_could_still_copy_into_outlive_the_session_by_its_liveness_window() {
    let (ended, back) = silent_link(true);
    let c = config();
    let window = c.heartbeat_interval * c.heartbeat_misses;
    assert!(
        back >= ended + window + c.heartbeat_interval,
        "released {:?} after the session ended",
        back - ended
    );
}

/// The negative control: without the writer fencing the session, closing it releases the
/// pages at once (over TCP the decode's own sockets stop every write).
#[test]
fn without_a_writer_fence_the_same_silence_releases_the_pages_when_the_session_ends() {
    let (ended, back) = silent_link(false);
    let c = config();
    assert!(
        back < ended + c.heartbeat_interval * c.heartbeat_misses,
        "{:?}",
        back - ended
    );
}

/// The writer's exit ends the wait at once.
#[test]
fn a_writer_that_exited_gives_its_pages_back_at_once() {
    let (mut sim, p, d, session) = writer_fenced_room(72, true);
    let far = sim.now + Duration::from_secs(60);
    sim.blackhole(d, p, far);
    sim.run_until(1_000_000, |s| first(s, d, closed).is_some())
        .expect("the decode gives the session up");
    assert!(first(&sim, d, released).is_none(), "still quarantined");
    let now = sim.now;
    sim.nodes[d].endpoint.handle_writer_exited(now, session);
    sim.drain(d);
    assert!(first(&sim, d, released).is_some());
}

/// A writer copies unseen only while it hears its receiver within the liveness window, and
/// never into a session it is closing.
#[test]
fn a_writer_may_copy_unseen_only_while_it_hears_its_receiver() {
    let (sim, p, d) = pair(73, config());
    let session = sim.session(p, d).expect("session");
    let c = config();
    let window = c.heartbeat_interval * c.heartbeat_misses;
    let e = &sim.nodes[p].endpoint;
    assert!(e.may_write_unseen(session, sim.now));
    assert!(!e.may_write_unseen(session, sim.now + window + Duration::from_millis(1)));
    assert!(!e.may_write_unseen(SessionId(999), sim.now));
}
