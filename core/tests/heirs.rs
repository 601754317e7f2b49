//! A peer is one session: a second connection to the same peer process takes the first one
//! over. Whatever named the first session (an embedder's link, a target the core keeps
//! connected) names the session that took it over from then on, and a link to a session
//! that ended for good opens a room that fails with the reason the session ended for, never
//! a refusal an embedder cannot tell from its own mistake.
#![allow(clippy::unwrap_used)] // tests may panic

mod common;

use std::time::Duration;

use common::{assert_invariants, failed, run_ms, send_all, state};
use kvferry_core::sim::{small_layout, Faults, Sim};
use kvferry_core::{ApiError, Event, FailureReason as R, Grant, KvPoll, Link, RoomId, SessionId};

/// A prefill `p` and a decode `d`, not yet connected.
fn nodes(seed: u64) -> (Sim, usize, usize) {
    let mut sim = Sim::new(seed, Faults::default());
    let layout = small_layout(1024);
    let p = sim.add_prefill(common::config(), layout, 0, 0..layout.layers);
    let d = sim.add_decode(common::config(), layout, 0);
    (sim, p, d)
}

/// Decode `d` opens `room` over `links` with 4 fresh pages, and prefill `p` opens its side.
fn open_via(sim: &mut Sim, d: usize, p: usize, room: u64, links: &[Link]) {
    let now = sim.now;
    let id = RoomId(room);
    let pages = sim.nodes[d].alloc(id, 0, 4).unwrap();
    let grant = Grant {
        extras: Vec::new(),
        pages,
        aux_slot: Some(room as u32),
        state_slot: None,
        receivers: 1,
        skip_pages: 0,
        idle_sources: 0,
        prompt: None,
    };
    sim.nodes[d]
        .endpoint
        .open_receiver_via(now, id, 0, links, Some(grant))
        .unwrap();
    sim.drain(d);
    sim.nodes[p].endpoint.open_sender(now, id, 0, None).unwrap();
    sim.drain(p);
}

fn established(sim: &Sim, n: usize) -> usize {
    sim.nodes[n].count_events(|e| matches!(e, Event::SessionEstablished { .. }))
}

#[test]
fn a_second_connection_to_a_kept_peer_is_followed_by_the_target_not_redialed() {
    let (mut sim, p, d) = nodes(3501);
    let target = sim.add_target(d, p);
    run_ms(&mut sim, 20);
    assert!(sim.nodes[d].endpoint.target_session(target).is_some());
    // The embedder also connects to the same peer explicitly (`connect` beside
    // `connect_persistent`): the fresh session takes the target's over.
    let (explicit, _) = sim.connect(d, p);
    run_ms(&mut sim, 3_000);
    assert_eq!(
        established(&sim, d),
        2,
        "the target's session and the explicit one, then nothing: the target follows the take-over"
    );
    assert_eq!(sim.nodes[d].endpoint.counters().sessions_resumed, 1);
    assert_eq!(sim.nodes[d].endpoint.target_session(target), Some(explicit));
    open_via(&mut sim, d, p, 1, &[Link::Target(target)]);
    send_all(&mut sim, p, 1, 4, false);
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, d, 1), Some(KvPoll::Success));
    assert_invariants(&sim);
}

#[test]
fn a_room_over_a_session_taken_over_runs_on_the_session_that_took_it() {
    let (mut sim, p, d) = nodes(3502);
    let (first, _) = sim.connect(d, p);
    run_ms(&mut sim, 20);
    let (second, _) = sim.connect(d, p);
    // Long enough for the first connection to be closed and forgotten.
    run_ms(&mut sim, 1_000);
    assert_eq!(
        sim.nodes[d].endpoint.link_session(Link::Session(first)),
        Some(second)
    );
    open_via(&mut sim, d, p, 1, &[Link::Session(first)]);
    send_all(&mut sim, p, 1, 4, false);
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, d, 1), Some(KvPoll::Success));
    assert_eq!(state(&sim, p, 1), Some(KvPoll::Success));
    assert_invariants(&sim);
}

#[test]
fn a_room_over_a_session_that_ended_fails_with_its_reason_and_gives_its_pages_back() {
    let (mut sim, p, d) = nodes(3503);
    let (sid, _) = sim.connect(d, p);
    run_ms(&mut sim, 20);
    let now = sim.now;
    sim.blackhole(d, p, now + Duration::from_secs(3600));
    run_ms(&mut sim, 5_000);
    assert!(sim.session(d, p).is_none(), "the session ended as silent");
    open_via(&mut sim, d, p, 1, &[Link::Session(sid)]);
    assert_eq!(state(&sim, d, 1), failed(R::PeerSilent));
    run_ms(&mut sim, 10);
    assert!(
        sim.nodes[d].released.contains(&(RoomId(1), 0)),
        "no write can land: the pages are releasable at once"
    );
}

#[test]
fn a_session_id_never_given_out_is_still_refused_as_unknown() {
    let (mut sim, _p, d) = nodes(3504);
    let now = sim.now;
    let pages = sim.nodes[d].alloc(RoomId(1), 0, 4).unwrap();
    let grant = Grant {
        extras: Vec::new(),
        pages,
        aux_slot: Some(1),
        state_slot: None,
        receivers: 1,
        skip_pages: 0,
        idle_sources: 0,
        prompt: None,
    };
    assert_eq!(
        sim.nodes[d]
            .endpoint
            .open_receiver(now, RoomId(1), 0, &[SessionId(77)], Some(grant)),
        Err(ApiError::UnknownSession(SessionId(77)))
    );
}
