//! The checksum option over a one-sided data plane (RDMA): decode never sees the writes
//! land, so each completed operation's source hash arrives as an `OpChecksum` frame, the
//! driver hashes the landed ranges, and the room succeeds only once every byte it needs was
//! verified.

mod common;

use std::time::Duration;

use common::*;
use kvferry_core::codec::{LandedRange, Message};
use kvferry_core::sim::Sim;
use kvferry_core::{
    Action, Config, FailureReason, Grant, KvPoll, Region, RoomId, SessionId, WritePermit,
};

const ROOM: u64 = 7;
const PAGES: u32 = 2;

fn checked() -> Config {
    Config {
        checksum: true,
        ..config()
    }
}

/// A decode whose session to the prefill is one-sided, with `ROOM` granted and not yet fed
/// (the prefill never opens its side: the test speaks for it).
fn one_sided_room(seed: u64, config: Config) -> (Sim, usize, SessionId, Vec<u32>) {
    let (mut sim, p, d) = pair(seed, config);
    let session = sim.session(d, p).expect("session");
    sim.nodes[d].endpoint.set_one_sided(session);
    let dst = open_receiver_with(&mut sim, d, &[p], ROOM, PAGES, |dst| {
        Grant::new(dst, Some(ROOM as u32), None)
    });
    (sim, d, session, dst)
}

/// Every range the prefill writes for the room: each layer and plane's granted pages, and
/// the aux row.
fn room_ranges(sim: &Sim, d: usize, dst: &[u32]) -> Vec<LandedRange> {
    let layout = sim.nodes[d].endpoint.info().layout;
    let page = u64::from(layout.page_bytes);
    let mut out = Vec::new();
    for layer in 0..layout.layers {
        for plane in 0..layout.planes {
            for &p in dst {
                out.push(LandedRange {
                    region: Region::Kv { layer, plane },
                    offset: u64::from(p) * page,
                    len: page,
                    rows: 1,
                    stride: 0,
                });
            }
        }
    }
    let aux = u64::from(layout.aux_bytes);
    out.push(LandedRange {
        region: Region::Aux,
        offset: ROOM * aux,
        len: aux,
        rows: 1,
        stride: 0,
    });
    out
}

/// Delivers `msg` to decode `d` as if its peer on `session` had sent it.
fn deliver(sim: &mut Sim, d: usize, session: SessionId, msg: Message) {
    let mut frame = Vec::new();
    msg.encode(&mut frame);
    let now = sim.now;
    let used = sim.nodes[d].endpoint.handle_input(now, session, &frame);
    assert_eq!(used, frame.len());
}

fn op_checksum(ranges: Vec<LandedRange>) -> Message {
    Message::OpChecksum {
        room: RoomId(ROOM),
        generation: 0,
        checksum: 0x5eed,
        ranges,
    }
}

fn success() -> Message {
    Message::RoomStatus {
        room: RoomId(ROOM),
        generation: 0,
        failure: None,
    }
}

/// The permits decode asked its driver to verify, with the checksum each must match.
fn verifications(sim: &mut Sim, d: usize) -> Vec<(WritePermit, Vec<kvferry_core::Slice>, u64)> {
    let mut out = Vec::new();
    while let Some(a) = sim.nodes[d].endpoint.poll_action() {
        if let Action::VerifyLanded {
            permit,
            ranges,
            checksum,
        } = a
        {
            out.push((permit, ranges, checksum));
        }
    }
    out
}

#[test]
fn a_one_sided_room_succeeds_once_every_range_was_verified() {
    let (mut sim, d, session, dst) = one_sided_room(41, checked());
    let ranges = room_ranges(&sim, d, &dst);
    deliver(&mut sim, d, session, op_checksum(ranges.clone()));
    let asked = verifications(&mut sim, d);
    assert_eq!(asked.len(), 1);
    let (permit, slices, checksum) = asked[0].clone();
    assert_eq!(checksum, 0x5eed);
    let passed = sim.nodes[d].endpoint.counters().landed_checks_passed;
    assert_eq!(slices.len(), ranges.len());
    assert!(slices
        .iter()
        .zip(&ranges)
        .all(|(s, r)| s.region == r.region && s.dst_offset == r.offset && s.len == r.len));
    let now = sim.now;
    sim.nodes[d].endpoint.end_write(now, permit.applied(), &[]);
    assert_eq!(
        sim.nodes[d].endpoint.counters().landed_checks_passed,
        passed + 1
    );
    deliver(&mut sim, d, session, success());
    assert_eq!(state(&sim, d, ROOM), Some(KvPoll::Success));
}

#[test]
fn the_source_success_waits_for_a_verification_still_running() {
    let (mut sim, d, session, dst) = one_sided_room(42, checked());
    let ranges = room_ranges(&sim, d, &dst);
    deliver(&mut sim, d, session, op_checksum(ranges));
    let (permit, _, _) = verifications(&mut sim, d).remove(0);
    deliver(&mut sim, d, session, success());
    assert_ne!(state(&sim, d, ROOM), Some(KvPoll::Success));
    let now = sim.now;
    sim.nodes[d].endpoint.end_write(now, permit.applied(), &[]);
    assert_eq!(state(&sim, d, ROOM), Some(KvPoll::Success));
}

#[test]
fn landed_bytes_that_do_not_match_fail_the_room_with_checksum_mismatch() {
    let (mut sim, d, session, dst) = one_sided_room(43, checked());
    let ranges = room_ranges(&sim, d, &dst);
    let (kv, aux) = ranges.split_at(ranges.len() - 1);
    deliver(&mut sim, d, session, op_checksum(kv.to_vec()));
    deliver(&mut sim, d, session, op_checksum(aux.to_vec()));
    let asked = verifications(&mut sim, d);
    assert_eq!(asked.len(), 2);
    let now = sim.now;
    sim.nodes[d]
        .endpoint
        .end_write(now, asked[0].0.corrupt(), &[]);
    sim.nodes[d]
        .endpoint
        .end_write(now, asked[1].0.applied(), &[]);
    deliver(&mut sim, d, session, success());
    assert_eq!(
        state(&sim, d, ROOM),
        Some(KvPoll::Failed(FailureReason::ChecksumMismatch))
    );
}

#[test]
fn a_success_without_a_checksum_for_every_page_fails_the_room_as_a_protocol_error() {
    let (mut sim, d, session, dst) = one_sided_room(44, checked());
    let mut ranges = room_ranges(&sim, d, &dst);
    ranges.remove(0);
    deliver(&mut sim, d, session, op_checksum(ranges));
    let (permit, _, _) = verifications(&mut sim, d).remove(0);
    let now = sim.now;
    sim.nodes[d].endpoint.end_write(now, permit.applied(), &[]);
    deliver(&mut sim, d, session, success());
    assert_eq!(
        state(&sim, d, ROOM),
        Some(KvPoll::Failed(FailureReason::ProtocolError))
    );
}

#[test]
fn a_checksum_for_a_page_the_room_was_not_granted_fails_the_room() {
    let (mut sim, d, session, dst) = one_sided_room(45, checked());
    let page = u64::from(sim.nodes[d].endpoint.info().layout.page_bytes);
    let outside = dst.iter().max().copied().unwrap_or(0) + 1;
    deliver(
        &mut sim,
        d,
        session,
        op_checksum(vec![LandedRange {
            region: Region::Kv { layer: 0, plane: 0 },
            offset: u64::from(outside) * page,
            len: page,
            rows: 1,
            stride: 0,
        }]),
    );
    assert!(verifications(&mut sim, d).is_empty());
    assert_eq!(
        state(&sim, d, ROOM),
        Some(KvPoll::Failed(FailureReason::ProtocolError))
    );
}

#[test]
fn without_the_option_a_one_sided_room_succeeds_on_the_word_and_a_checksum_is_refused() {
    let (mut sim, d, session, dst) = one_sided_room(46, config());
    let ranges = room_ranges(&sim, d, &dst);
    let strikes = sim.nodes[d].endpoint.counters().protocol_errors;
    deliver(&mut sim, d, session, op_checksum(ranges));
    assert!(verifications(&mut sim, d).is_empty());
    assert!(sim.nodes[d].endpoint.counters().protocol_errors > strikes);
    deliver(&mut sim, d, session, success());
    assert_eq!(state(&sim, d, ROOM), Some(KvPoll::Success));
}

#[test]
fn a_fence_of_the_session_does_not_void_a_check_of_bytes_that_already_landed() {
    let (mut sim, d, session, dst) = one_sided_room(47, checked());
    // A second room on the same session, aborted with no drain acknowledgement: the core
    // fences the session, which voids its write permits.
    let other = RoomId(9);
    let pages = sim.nodes[d].alloc(other, 0, 1).expect("pages");
    let now = sim.now;
    sim.nodes[d]
        .endpoint
        .open_receiver(
            now,
            other,
            0,
            &[session],
            Some(Grant::new(pages, Some(3), None)),
        )
        .expect("second room");
    let ranges = room_ranges(&sim, d, &dst);
    deliver(&mut sim, d, session, op_checksum(ranges));
    let (permit, _, _) = verifications(&mut sim, d).remove(0);
    deliver(&mut sim, d, session, success());
    sim.nodes[d].endpoint.abort(now, other).expect("abort");
    let later = now + sim.nodes[d].endpoint.config().abort_ack_timeout + Duration::from_millis(1);
    sim.nodes[d].endpoint.handle_timeout(later);
    let fenced = std::iter::from_fn(|| sim.nodes[d].endpoint.poll_action())
        .any(|a| a == Action::FenceSession(session));
    assert!(
        fenced,
        "the abort's missing acknowledgement fences the session"
    );
    sim.nodes[d].endpoint.handle_fence_complete(later, session);
    sim.nodes[d]
        .endpoint
        .end_write(later, permit.applied(), &[]);
    assert_eq!(state(&sim, d, ROOM), Some(KvPoll::Success));
}

#[test]
fn an_op_checksum_whose_ranges_carry_more_rows_than_one_operation_is_malformed() {
    let range = |rows: u32| LandedRange {
        region: Region::Kv { layer: 0, plane: 0 },
        offset: 0,
        len: 1,
        rows,
        stride: if rows > 1 { 1 } else { 0 },
    };
    let decoded = |rows: u32| {
        let mut frame = Vec::new();
        op_checksum(vec![range(rows)]).encode(&mut frame);
        Message::decode(&frame, u32::MAX).map(|m| m.map(|(m, _)| m))
    };
    assert!(matches!(
        decoded(4096),
        Ok(Some(Message::OpChecksum { .. }))
    ));
    assert!(
        decoded(4097).is_err(),
        "a peer cannot make decode hash millions of rows"
    );
}
