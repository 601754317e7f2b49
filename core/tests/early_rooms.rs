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
        .open_sender(now, room, 0, None)
        .expect("open sender");
    send_all(&mut sim, p, 5, 2, false);
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, d, 5), Some(KvPoll::Success));
    assert_eq!(state(&sim, p, 5), Some(KvPoll::Success));
    assert_eq!(sim.nodes[p].endpoint.counters().protocol_errors, 0);
    assert_invariants(&sim);
}

#[test]
fn a_receiver_opened_on_an_accepted_session_still_handshaking_moves_too() {
    let mut sim = Sim::new(62, Faults::default());
    let layout = small_layout(64);
    let p = sim.add_prefill(config(), layout, 0, 0..layout.layers);
    let d = sim.add_decode(config(), layout, 0);
    // The prefill dials; decode accepts, and opens the room before the handshake completes.
    let (_, at_decode) = sim.connect(p, d);
    let now = sim.now;
    let room = RoomId(6);
    let dst = sim.nodes[d].alloc(room, 0, 2).expect("decode pages");
    sim.nodes[d]
        .endpoint
        .open_receiver(
            now,
            room,
            0,
            &[at_decode],
            Some(Grant::new(dst, Some(6), None)),
        )
        .expect("open receiver");
    sim.nodes[p]
        .endpoint
        .open_sender(now, room, 0, None)
        .expect("open sender");
    send_all(&mut sim, p, 6, 2, false);
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, d, 6), Some(KvPoll::Success));
    assert_eq!(sim.nodes[p].endpoint.counters().protocol_errors, 0);
    assert_invariants(&sim);
}

/// Every frame `from` has queued, encoded.
fn frames(from: &mut kvferry_core::Endpoint) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut buf = Vec::new();
    while from.poll_transmit(&mut buf).is_some() {
        out.push(std::mem::take(&mut buf));
    }
    out
}

/// Whether one of `frames` has frame type `ty` (the byte after the length and version).
fn has_type(frames: &[Vec<u8>], ty: u8) -> bool {
    frames.iter().any(|f| f.get(5) == Some(&ty))
}

#[test]
fn room_messages_queued_while_the_accepting_side_handshakes_go_after_its_hello() {
    use kvferry_core::{Config, Endpoint, EndpointInfo, Incarnation, NodeId, Role};
    let layout = small_layout(64);
    let now = std::time::Instant::now();
    let endpoint = |role, id| {
        let mut info = EndpointInfo::new(role, NodeId(id), Incarnation(id), layout);
        info.token = b"t".to_vec();
        Endpoint::new(Config::default(), info, id, now).expect("endpoint")
    };
    let mut p = endpoint(Role::Prefill, 1);
    let mut d = endpoint(Role::Decode, 2);
    // The prefill dials, decode accepts; each sends its challenge.
    let at_p = p.open_session(now);
    let at_d = d.accept_session(now);
    for f in frames(&mut p) {
        d.handle_input(now, at_d, &f);
    }
    for f in frames(&mut d) {
        p.handle_input(now, at_p, &f);
    }
    // The prefill's hello is on its way; before decode reads it (and without polling in
    // between), the embedder opens a room on the session.
    let hello = frames(&mut p);
    d.open_receiver(
        now,
        RoomId(7),
        0,
        &[at_d],
        Some(Grant::new(vec![1, 2], Some(7), None)),
    )
    .expect("open receiver");
    for f in &hello {
        d.handle_input(now, at_d, f);
    }
    // Whatever decode sends now, the prefill takes it in order without a protocol error.
    let out = frames(&mut d);
    assert!(
        has_type(&out, 3),
        "the room request goes out once established"
    );
    let errors = p.counters().protocol_errors;
    for f in &out {
        p.handle_input(now, at_p, f);
    }
    assert_eq!(p.counters().protocol_errors, errors);
    assert_eq!(
        p.session_state(at_p),
        Some(kvferry_core::SessionState::Established)
    );
}
