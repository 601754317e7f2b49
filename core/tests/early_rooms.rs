//! A room opened on a session whose handshake has not completed yet: its messages wait for
//! the handshake (a peer refuses room messages before it), and the room then moves as usual.

mod common;

use common::*;
use kvferry_core::sim::{small_layout, Faults, Sim};
use kvferry_core::{Grant, KvPoll, RoomId};

#[test]
fn a_receiver_opened_while_its_session_handshakes_moves_once_the_handshake_completes() {
    let mut sim = Sim::new(61, Faults::default());
    let layout = small_layout(64);
    let p = sim.add_prefill(config(), layout, 0, 0..layout.layers);
    let d = sim.add_decode(config(), layout, 0);
    let (at_decode, _) = sim.connect(d, p);
    assert_eq!(
        sim.nodes[d].endpoint.session_state(at_decode),
        Some(kvferry_core::SessionState::Handshaking)
    );
    let now = sim.now;
    let room = RoomId(5);
    let dst = sim.nodes[d].alloc(room, 0, 2).expect("decode pages");
    sim.nodes[d]
        .endpoint
        .open_receiver(
            now,
            room,
            0,
            &[at_decode],
            Some(Grant::new(dst, Some(5), None)),
        )
        .expect("open receiver");
    sim.drain(d);
    sim.nodes[p]
        .endpoint
        .open_sender(now, room, 0)
        .expect("open sender");
    send_all(&mut sim, p, 5, 2, false);
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, d, 5), Some(KvPoll::Success));
    assert_eq!(state(&sim, p, 5), Some(KvPoll::Success));
    assert_eq!(sim.nodes[p].endpoint.counters().protocol_errors, 0);
    assert_invariants(&sim);
}
