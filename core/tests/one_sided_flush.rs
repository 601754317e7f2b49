//! One-sided writes into memory whose device sees a NIC's writes only after a flush
//! (GPUDirect RDMA with write ordering weaker than the owner's): a room whose sources all
//! reported Success asks its driver to flush ([`Action::FlushLanded`]) and succeeds only when
//! the flush ended; a failed or lost flush never reports the room landed.

mod common;

use std::time::Duration;

use common::*;
use kvferry_core::codec::Message;
use kvferry_core::sim::Sim;
use kvferry_core::{Action, FailureReason, Generation, Grant, KvPoll, RoomId, SessionId};

const ROOM: u64 = 11;

/// A decode whose one-sided session to the prefill needs flushes, with `ROOM` granted (the
/// test speaks for the prefill).
fn flushing_room(seed: u64) -> (Sim, usize, SessionId) {
    let (mut sim, p, d) = pair(seed, config());
    let session = sim.session(d, p).expect("session");
    sim.nodes[d].endpoint.set_one_sided(session);
    sim.nodes[d].endpoint.flush_landed_writes(session);
    open_receiver_with(&mut sim, d, &[p], ROOM, 2, |dst| {
        Grant::new(dst, Some(ROOM as u32), None)
    });
    (sim, d, session)
}

/// The source's word that every write of the room completed.
fn source_success(sim: &mut Sim, d: usize, session: SessionId) {
    let mut frame = Vec::new();
    Message::RoomStatus {
        room: RoomId(ROOM),
        generation: 0,
        failure: None,
    }
    .encode(&mut frame);
    let now = sim.now;
    assert_eq!(
        sim.nodes[d].endpoint.handle_input(now, session, &frame),
        frame.len()
    );
}

/// The flushes decode asked for.
fn flushes(sim: &mut Sim, d: usize) -> Vec<(RoomId, Generation)> {
    std::iter::from_fn(|| sim.nodes[d].endpoint.poll_action())
        .filter_map(|a| match a {
            Action::FlushLanded { room, generation } => Some((room, generation)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_room_over_writes_that_need_a_flush_succeeds_only_after_the_flush() {
    let (mut sim, d, session) = flushing_room(61);
    source_success(&mut sim, d, session);
    assert_eq!(flushes(&mut sim, d), vec![(RoomId(ROOM), 0)]);
    assert_ne!(
        state(&sim, d, ROOM),
        Some(KvPoll::Success),
        "success before the flush"
    );
    let now = sim.now;
    sim.nodes[d]
        .endpoint
        .end_flush(now, RoomId(ROOM), 0, Ok(()));
    assert_eq!(state(&sim, d, ROOM), Some(KvPoll::Success));
}

#[test]
fn a_flush_that_fails_fails_the_room_as_a_transfer_failure() {
    let (mut sim, d, session) = flushing_room(62);
    source_success(&mut sim, d, session);
    assert_eq!(flushes(&mut sim, d).len(), 1);
    let now = sim.now;
    sim.nodes[d].endpoint.end_flush(
        now,
        RoomId(ROOM),
        0,
        Err("cuFlushGPUDirectRDMAWrites: CUDA_ERROR_UNKNOWN".to_owned()),
    );
    assert_eq!(state(&sim, d, ROOM), failed(FailureReason::TransferFailed));
}

#[test]
fn a_flush_that_never_ends_leaves_the_room_to_its_deadline() {
    let (mut sim, d, session) = flushing_room(63);
    source_success(&mut sim, d, session);
    assert_eq!(flushes(&mut sim, d).len(), 1);
    let later = sim.now + sim.nodes[d].endpoint.config().waiting_timeout + Duration::from_millis(1);
    sim.nodes[d].endpoint.handle_timeout(later);
    assert!(
        matches!(state(&sim, d, ROOM), Some(KvPoll::Failed(_))),
        "{:?}",
        state(&sim, d, ROOM)
    );
    // The flush's late end changes nothing.
    sim.nodes[d]
        .endpoint
        .end_flush(later, RoomId(ROOM), 0, Ok(()));
    assert!(matches!(state(&sim, d, ROOM), Some(KvPoll::Failed(_))));
}

#[test]
fn a_second_word_while_flushing_asks_for_no_second_flush() {
    let (mut sim, d, session) = flushing_room(64);
    source_success(&mut sim, d, session);
    source_success(&mut sim, d, session);
    assert_eq!(flushes(&mut sim, d).len(), 1);
}

#[test]
fn without_the_need_a_one_sided_room_succeeds_on_the_word_with_no_flush() {
    let (mut sim, p, d) = pair(65, config());
    let session = sim.session(d, p).expect("session");
    sim.nodes[d].endpoint.set_one_sided(session);
    open_receiver_with(&mut sim, d, &[p], ROOM, 2, |dst| {
        Grant::new(dst, Some(ROOM as u32), None)
    });
    source_success(&mut sim, d, session);
    assert!(flushes(&mut sim, d).is_empty());
    assert_eq!(state(&sim, d, ROOM), Some(KvPoll::Success));
}
