//! Room identity across restarts and peers: `Success` on decode means every granted byte of
//! *this* room landed in *this* lifetime. A reused room id (a restarted decode, a second
//! decode with overlapping ids) is refused with `RoomIdReused`, never answered from an
//! earlier room's outcome; a restarted prefill serves the ids fresh.
#![allow(clippy::unwrap_used)] // tests may panic

mod common;

use std::time::Duration;

use common::{assert_invariants, failed, open_room, run_ms, send_all, state};
use kvferry_core::codec::Message;
use kvferry_core::sim::{small_layout, Faults, Sim};
use kvferry_core::{FailureReason as R, Grant, KvPoll, RoomId};

/// Decode `d` opens `room` (generation `generation`) toward prefill `p` with fresh pages,
/// without prefill opening anything: what a decode that re-runs a request does.
fn reopen_on_decode(sim: &mut Sim, d: usize, p: usize, room: u64, generation: u32) {
    let now = sim.now;
    let dst = sim.nodes[d].alloc(RoomId(room), generation, 4).unwrap();
    let sid = sim.session(d, p).unwrap();
    let grant = Grant {
        extras: Vec::new(),
        pages: dst,
        aux_slot: Some(room as u32),
        state_slot: None,
        receivers: 1,
        skip_pages: 0,
        idle_sources: 0,
        prompt: None,
    };
    sim.nodes[d]
        .endpoint
        .open_receiver(now, RoomId(room), generation, &[sid], Some(grant))
        .unwrap();
    sim.drain(d);
}

/// One prefill and two decodes (`a`, `b`) whose room ids overlap, past the handshake.
fn two_decodes(seed: u64) -> (Sim, usize, usize, usize) {
    let mut sim = Sim::new(seed, Faults::default());
    let layout = small_layout(1024);
    let config = common::config();
    let p = sim.add_prefill(config.clone(), layout, 0, 0..layout.layers);
    let a = sim.add_decode(config.clone(), layout, 0);
    let b = sim.add_decode(config, layout, 0);
    sim.connect(a, p);
    sim.connect(b, p);
    run_ms(&mut sim, 5);
    (sim, p, a, b)
}

fn succeed_room(sim: &mut Sim, d: usize, p: usize, room: u64) {
    open_room(sim, d, &[p], room, 4);
    send_all(sim, p, room, 4, false);
    run_ms(sim, 50);
    assert_eq!(state(sim, d, room), Some(KvPoll::Success));
}

#[test]
fn a_restarted_decode_reusing_a_concluded_room_id_is_refused_not_answered_success() {
    let (mut sim, p, d) = common::pair(1501, common::config());
    succeed_room(&mut sim, d, p, 1);
    sim.restart(d);
    sim.connect(d, p);
    run_ms(&mut sim, 20);
    reopen_on_decode(&mut sim, d, p, 1, 0);
    run_ms(&mut sim, 20);
    assert_eq!(state(&sim, d, 1), failed(R::RoomIdReused));
    assert_eq!(sim.nodes[p].endpoint.counters().rooms_refused_reused, 1);
    assert_invariants(&sim);
}

#[test]
fn a_second_decode_with_an_overlapping_concluded_room_id_is_refused() {
    let (mut sim, p, a, b) = two_decodes(1502);
    succeed_room(&mut sim, a, p, 7);
    reopen_on_decode(&mut sim, b, p, 7, 0);
    run_ms(&mut sim, 20);
    assert_eq!(state(&sim, b, 7), failed(R::RoomIdReused));
    assert_eq!(
        state(&sim, a, 7),
        Some(KvPoll::Success),
        "a's room stands as it was"
    );
    assert_invariants(&sim);
}

#[test]
fn two_decodes_requesting_one_room_id_at_once_get_one_room_and_one_refusal() {
    let (mut sim, p, a, b) = two_decodes(1503);
    // Both requests reach prefill before its sender room opens.
    reopen_on_decode(&mut sim, a, p, 9, 0);
    run_ms(&mut sim, 2);
    reopen_on_decode(&mut sim, b, p, 9, 0);
    run_ms(&mut sim, 2);
    let now = sim.now;
    sim.nodes[p]
        .endpoint
        .open_sender(now, RoomId(9), 0, None)
        .unwrap();
    sim.drain(p);
    send_all(&mut sim, p, 9, 4, false);
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, a, 9), Some(KvPoll::Success));
    assert_eq!(state(&sim, b, 9), failed(R::RoomIdReused));
    assert_invariants(&sim);
}

#[test]
fn a_live_room_already_served_refuses_a_late_request_from_another_decode() {
    let (mut sim, p, a, b) = two_decodes(1504);
    sim.faults.op_delay = (Duration::from_millis(5), Duration::from_millis(10));
    open_room(&mut sim, a, &[p], 3, 4);
    send_all(&mut sim, p, 3, 4, false);
    run_ms(&mut sim, 1);
    reopen_on_decode(&mut sim, b, p, 3, 0);
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, a, 3), Some(KvPoll::Success));
    assert_eq!(state(&sim, b, 3), failed(R::RoomIdReused));
    assert_invariants(&sim);
}

#[test]
fn a_restarted_prefill_serves_a_room_id_fresh_and_every_page_lands_again() {
    let (mut sim, p, d) = common::pair(1505, common::config());
    succeed_room(&mut sim, d, p, 1);
    sim.restart(p);
    sim.connect(d, p);
    run_ms(&mut sim, 20);
    // Decode's own record of room 1 generation 0 stands: the retry is generation 1.
    reopen_on_decode(&mut sim, d, p, 1, 1);
    let now = sim.now;
    sim.nodes[p]
        .endpoint
        .open_sender(now, RoomId(1), 1, None)
        .unwrap();
    sim.drain(p);
    let src = sim.nodes[p].alloc(RoomId(1), 1, 4).unwrap();
    let now = sim.now;
    sim.nodes[p]
        .endpoint
        .send_chunk(
            now,
            RoomId(1),
            kvferry_core::Chunk {
                extras: Vec::new(),
                pages: src,
                last: true,
                aux_slot: Some(1),
                state_slot: None,
                layerwise: false,
            },
        )
        .unwrap();
    sim.drain(p);
    run_ms(&mut sim, 50);
    assert_eq!(
        sim.nodes[d].states.get(&(RoomId(1), 1)),
        Some(&KvPoll::Success)
    );
    assert_invariants(&sim);
}

#[test]
fn a_success_word_without_the_bytes_fails_the_room_as_a_protocol_error() {
    let (mut sim, p, d) = common::pair(1506, common::config());
    open_room(&mut sim, d, &[p], 5, 4);
    run_ms(&mut sim, 5);
    // A broken (or old, tombstone-answering) prefill claims success with nothing written.
    let sid = sim.session(d, p).unwrap();
    let mut frame = Vec::new();
    Message::RoomStatus {
        room: RoomId(5),
        generation: 0,
        failure: None,
    }
    .encode(&mut frame);
    let now = sim.now;
    sim.nodes[d].endpoint.handle_input(now, sid, &frame);
    sim.drain(d);
    assert_eq!(state(&sim, d, 5), failed(R::ProtocolError));
    assert!(sim.violations.is_empty(), "{:?}", sim.violations);
}

/// An older attempt's request from a decode that took part in the newer one (a late or
/// foreign duplicate: this crate's decode refuses to open it locally) is answered at once.
#[test]
fn a_request_for_an_older_generation_than_prefill_holds_is_answered_stale_at_once() {
    let (mut sim, p, d) = common::pair(1510, common::config());
    reopen_on_decode(&mut sim, d, p, 9, 1);
    let now = sim.now;
    sim.nodes[p]
        .endpoint
        .open_sender(now, RoomId(9), 1, None)
        .unwrap();
    sim.drain(p);
    run_ms(&mut sim, 5);
    let sp = sim.session(p, d).unwrap();
    let mut old = Vec::new();
    Message::RoomRequest(kvferry_core::codec::RoomRequest {
        extras: Vec::new(),
        room: RoomId(9),
        generation: 0,
        receivers: 1,
        skip_pages: 0,
        pages: smallvec::smallvec![kvferry_core::PageRun { start: 0, len: 4 }],
        aux_slot: None,
        state_slot: None,
        prompt: None,
    })
    .encode(&mut old);
    sim.nodes[p].endpoint.handle_input(now, sp, &old);
    let answers: Vec<_> = std::iter::from_fn(|| sim.nodes[p].endpoint.poll_message()).collect();
    assert!(
        answers.iter().any(|(s, m)| *s == sp
            && *m
                == Message::RoomStatus {
                    room: RoomId(9),
                    generation: 0,
                    failure: Some(R::StaleGeneration),
                }),
        "{answers:?}"
    );
    assert_eq!(
        state(&sim, p, 9),
        Some(KvPoll::WaitingForInput),
        "the newer attempt is untouched"
    );
}

#[test]
fn a_grant_larger_than_what_prefill_sends_fails_on_both_sides() {
    let (mut sim, p, d) = common::pair(1511, common::config());
    common::open_room(&mut sim, d, &[p], 3, 6);
    send_all(&mut sim, p, 3, 4, false);
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, p, 3), failed(R::GrantMismatch));
    assert_eq!(state(&sim, d, 3), failed(R::GrantMismatch));
    assert_invariants(&sim);
}

#[test]
fn a_chunk_reaching_past_the_grant_fails_the_room_on_both_sides() {
    let (mut sim, p, d) = common::pair(1512, common::config());
    common::open_room(&mut sim, d, &[p], 4, 2);
    send_all(&mut sim, p, 4, 4, false);
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, p, 4), failed(R::GrantMismatch));
    assert_eq!(state(&sim, d, 4), failed(R::GrantMismatch));
    assert_invariants(&sim);
}
