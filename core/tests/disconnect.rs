//! The embedder letting a peer go: a session it no longer needs, a kept peer it removes.
#![allow(clippy::unwrap_used)] // tests may panic

mod common;

use std::time::{Duration, Instant};

use common::{config, open_room, run_ms};
use kvferry_core::sim::{small_layout, Faults, Sim};
use kvferry_core::{
    Action, Endpoint, EndpointInfo, FailureReason, Incarnation, KvPoll, NodeId, Role, RoomId,
    SessionState,
};

/// Faults whose closing writer sends what is queued before the connection ends (as a real
/// one does within its `close_linger`): the goodbye arrives before the close.
fn flushing() -> Faults {
    Faults {
        close_flush: Duration::from_millis(1),
        ..Faults::default()
    }
}

#[test]
fn a_disconnected_session_fails_its_rooms_locally_and_tells_the_peer_why() {
    let mut sim = Sim::new(31, flushing());
    let p = sim.add_prefill(config(), small_layout(64), 0, 0..4);
    let d = sim.add_decode(config(), small_layout(64), 0);
    sim.connect(d, p);
    run_ms(&mut sim, 5);
    open_room(&mut sim, d, &[p], 1, 4);
    run_ms(&mut sim, 5);
    let sd = sim.session(d, p).unwrap();
    let now = sim.now;
    sim.nodes[d].endpoint.disconnect(now, sd);
    sim.drain(d);
    run_ms(&mut sim, 50);
    let room = RoomId(1);
    assert_eq!(
        sim.nodes[d].endpoint.room_state(room),
        Some(KvPoll::Failed(FailureReason::AbortedLocally))
    );
    assert_eq!(
        sim.nodes[p].endpoint.room_state(room),
        Some(KvPoll::Failed(FailureReason::PeerShutdown)),
        "the peer heard an orderly goodbye"
    );
    assert_eq!(sim.session(d, p), None, "closed on both sides");
    assert!(sim.nodes[d].endpoint.session_ids().next().is_none());
    assert!(sim.nodes[p].endpoint.session_ids().next().is_none());
}

/// A decode keeping one prefill as a target, connected.
fn kept_pair(seed: u64) -> (Sim, usize, usize, kvferry_core::TargetId) {
    let mut sim = Sim::new(seed, flushing());
    let d = sim.add_decode(config(), small_layout(64), 0);
    let p = sim.add_prefill(config(), small_layout(64), 0, 0..4);
    let target = sim.add_target(d, p);
    run_ms(&mut sim, 100);
    assert!(sim.nodes[d].endpoint.target_session(target).is_some());
    (sim, d, p, target)
}

#[test]
fn a_disconnected_kept_peer_is_closed_and_dialed_no_more() {
    let (mut sim, d, p, target) = kept_pair(32);
    let now = sim.now;
    sim.nodes[d].endpoint.disconnect_target(now, target);
    sim.drain(d);
    run_ms(
        &mut sim,
        10 * config().reconnect_max_interval.as_millis() as u64,
    );
    assert_eq!(sim.nodes[d].endpoint.target_session(target), None);
    assert!(
        sim.nodes[d].endpoint.session_ids().next().is_none(),
        "no session again"
    );
    assert!(sim.nodes[p].endpoint.session_ids().next().is_none());
    assert_eq!(sim.nodes[d].endpoint.dials_pending(), 0, "nothing dialed");
}

#[test]
fn a_connection_that_arrives_for_a_removed_target_is_closed_at_once() {
    let now = Instant::now();
    let info = EndpointInfo::new(Role::Decode, NodeId(2), Incarnation(2), small_layout(64));
    let mut d = Endpoint::new(config(), info, 2, now).unwrap();
    let target = d.add_target(now);
    while d.poll_action().is_some() {}
    d.remove_target(target);
    // The attempt that was under way connects after the target went.
    let late = d.open_session_for(now, target);
    assert_eq!(d.session_state(late), Some(SessionState::Closing));
    let actions: Vec<Action> = std::iter::from_fn(|| d.poll_action()).collect();
    assert!(
        actions.contains(&Action::CloseSession(late)),
        "the driver is asked to close it: {actions:?}"
    );
}
