//! Kept peers let go: a target no room has used for `peer_idle_timeout` (a prefill scaled
//! away, re-routed, or gone) is dialed no more, its session closes and its id becomes
//! unknown; a target in use is kept however long its rooms take, and the timeout counts from
//! the last room that left it.
#![allow(clippy::unwrap_used)] // tests may panic

mod common;

use std::time::Duration;

use common::{run_ms, send_all, state};
use kvferry_core::sim::{small_layout, Faults, Sim};
use kvferry_core::{ApiError, Config, Event, Grant, KvPoll, Link, RoomId, TargetId};

const IDLE_MS: u64 = 2_000;

fn config(idle_ms: u64) -> Config {
    Config {
        peer_idle_timeout: Duration::from_millis(idle_ms),
        ..common::config()
    }
}

/// A decode keeping one prefill as a target, connected.
fn kept(seed: u64, idle_ms: u64) -> (Sim, usize, usize, TargetId) {
    let mut sim = Sim::new(seed, Faults::default());
    let layout = small_layout(64);
    let d = sim.add_decode(config(idle_ms), layout, 0);
    let p = sim.add_prefill(config(idle_ms), layout, 0, 0..layout.layers);
    let target = sim.add_target(d, p);
    run_ms(&mut sim, 50);
    assert!(sim.nodes[d].endpoint.target_session(target).is_some());
    (sim, d, p, target)
}

/// Decode opens `room` toward the target with 4 pages; prefill opens its side.
fn open_via(sim: &mut Sim, d: usize, p: usize, room: u64, target: TargetId) {
    let now = sim.now;
    let id = RoomId(room);
    let pages = sim.nodes[d].alloc(id, 0, 4).unwrap();
    let grant = Grant::new(pages, Some(room as u32), None);
    sim.nodes[d]
        .endpoint
        .open_receiver_via(now, id, 0, &[Link::Target(target)], Some(grant))
        .unwrap();
    sim.drain(d);
    sim.nodes[p].endpoint.open_sender(now, id, 0, None).unwrap();
    sim.drain(p);
}

fn let_go(sim: &Sim, d: usize) -> usize {
    sim.nodes[d].count_events(|e| matches!(e, Event::TargetLetGo { .. }))
}

fn assert_let_go(sim: &Sim, d: usize, p: usize, target: TargetId) {
    assert_eq!(let_go(sim, d), 1);
    assert_eq!(sim.nodes[d].endpoint.counters().peers_let_go, 1);
    assert_eq!(sim.nodes[d].endpoint.target_session(target), None);
    assert!(sim.nodes[d].endpoint.session_ids().next().is_none());
    assert!(
        sim.nodes[p].endpoint.session_ids().next().is_none(),
        "the prefill closed its side too"
    );
    assert_eq!(sim.nodes[d].endpoint.dials_pending(), 0, "dialed no more");
}

#[test]
fn a_kept_peer_no_room_used_is_let_go_after_the_idle_timeout() {
    let (mut sim, d, p, target) = kept(6101, IDLE_MS);
    run_ms(&mut sim, IDLE_MS - 200);
    assert_eq!(let_go(&sim, d), 0, "not before its time");
    assert!(sim.nodes[d].endpoint.target_session(target).is_some());
    run_ms(&mut sim, 400);
    assert_let_go(&sim, d, p, target);
    run_ms(&mut sim, 5_000);
    assert!(
        sim.nodes[d].endpoint.session_ids().next().is_none(),
        "not dialed again"
    );
}

#[test]
fn the_idle_time_counts_from_the_last_room_that_left_the_peer() {
    // Shorter than the rooms' waiting timeout, so a room can outlive it.
    let idle = 1_000;
    let (mut sim, d, p, target) = kept(6102, idle);
    // A room that lives longer than the idle timeout: its prefill sends late.
    open_via(&mut sim, d, p, 1, target);
    run_ms(&mut sim, idle + 500);
    assert_eq!(let_go(&sim, d), 0, "kept while a room is open on it");
    send_all(&mut sim, p, 1, 4, false);
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, d, 1), Some(KvPoll::Success));
    run_ms(&mut sim, idle - 300);
    assert_eq!(let_go(&sim, d), 0, "the room's end restarted the idle time");
    run_ms(&mut sim, 1_000);
    assert_let_go(&sim, d, p, target);
}

#[test]
fn rooms_opened_now_and_then_keep_the_peer() {
    let (mut sim, d, p, target) = kept(6103, IDLE_MS);
    for room in 1..=6 {
        open_via(&mut sim, d, p, room, target);
        send_all(&mut sim, p, room, 4, false);
        run_ms(&mut sim, IDLE_MS / 2);
        assert_eq!(state(&sim, d, room), Some(KvPoll::Success));
    }
    assert_eq!(let_go(&sim, d), 0);
    assert_eq!(
        sim.nodes[d].count_events(|e| matches!(e, Event::SessionEstablished { .. })),
        1,
        "one session all along"
    );
}

#[test]
fn an_unreachable_kept_peer_is_let_go_and_dialed_no_more() {
    let (mut sim, d, p, target) = kept(6104, IDLE_MS);
    // The prefill host vanishes: its link swallows everything, dials go unanswered.
    let now = sim.now;
    sim.silence_dials(p, true);
    sim.blackhole(d, p, now + Duration::from_secs(3600));
    run_ms(&mut sim, IDLE_MS + 1_000);
    assert_eq!(let_go(&sim, d), 1);
    assert_eq!(sim.nodes[d].endpoint.target_session(target), None);
    run_ms(&mut sim, 10_000);
    assert_eq!(sim.nodes[d].endpoint.dials_pending(), 0, "dialed no more");
    assert!(sim.nodes[d].endpoint.session_ids().next().is_none());
}

#[test]
fn a_room_toward_a_peer_let_go_is_refused_as_an_unknown_target() {
    let (mut sim, d, _p, target) = kept(6105, IDLE_MS);
    run_ms(&mut sim, IDLE_MS + 500);
    let now = sim.now;
    let grant = Grant::new(vec![0], Some(0), None);
    assert_eq!(
        sim.nodes[d].endpoint.open_receiver_via(
            now,
            RoomId(9),
            0,
            &[Link::Target(target)],
            Some(grant)
        ),
        Err(ApiError::UnknownTarget(target))
    );
}

#[test]
fn an_idle_timeout_of_zero_keeps_a_peer_for_ever() {
    let (mut sim, d, _p, target) = kept(6106, 0);
    run_ms(&mut sim, 60_000);
    assert_eq!(let_go(&sim, d), 0);
    assert!(sim.nodes[d].endpoint.target_session(target).is_some());
}
