//! A room request that cannot be served is answered at once: whatever `RoomRequest` a decode
//! sends, its room ends on both sides within the round trip (a request that cannot be
//! served), or is held and ends by the room's own deadline (one that can), never later.
#![allow(clippy::unwrap_used)] // tests may panic

mod common;

use std::time::Duration;

use common::{failed, state};
use kvferry_core::codec::{Message, RoomRequest, HEADER_LEN, SKIP_ALL};
use kvferry_core::sim::Sim;
use kvferry_core::{FailureReason as R, Grant, KvPoll, PageRun, RoomId};
use proptest::prelude::*;
use smallvec::SmallVec;

const ROOM: RoomId = RoomId(31);

/// A connected pair where decode opened `ROOM` (four pages, an aux row) and prefill opened
/// its sender if `sender`. The decode's own request is dropped: the test sends its own.
fn opened(sender: bool) -> (Sim, usize, usize) {
    let (mut sim, p, d) = common::pair(4700, common::config());
    let now = sim.now;
    let dst = sim.nodes[d].alloc(ROOM, 0, 4).unwrap();
    let sid = sim.session(d, p).unwrap();
    sim.nodes[d]
        .endpoint
        .open_receiver(now, ROOM, 0, &[sid], Some(Grant::new(dst, Some(1), None)))
        .unwrap();
    while sim.nodes[d].endpoint.poll_message().is_some() {}
    if sender {
        sim.nodes[p]
            .endpoint
            .open_sender(now, ROOM, 0, None)
            .unwrap();
        sim.drain(p);
    }
    (sim, p, d)
}

/// Delivers `frame` to prefill as decode's, and everything prefill answers back to decode,
/// at the same instant: one round trip, no time passing.
fn round_trip(sim: &mut Sim, p: usize, d: usize, frame: &[u8]) -> Vec<Message> {
    let now = sim.now;
    let sp = sim.session(p, d).unwrap();
    let sd = sim.session(d, p).unwrap();
    sim.nodes[p].endpoint.handle_input(now, sp, frame);
    let answers: Vec<Message> = std::iter::from_fn(|| sim.nodes[p].endpoint.poll_message())
        .filter(|(s, _)| *s == sp)
        .map(|(_, m)| m)
        .collect();
    let mut bytes = Vec::new();
    for m in &answers {
        m.encode(&mut bytes);
    }
    sim.nodes[d].endpoint.handle_input(now, sd, &bytes);
    answers
}

fn request(
    receivers: u8,
    skip_pages: u32,
    pages: &[(u32, u32)],
    aux: Option<u32>,
    extras: Vec<Vec<(u32, u32)>>,
) -> Vec<u8> {
    let runs = |r: &[(u32, u32)]| -> SmallVec<[PageRun; 4]> {
        r.iter()
            .map(|&(start, len)| PageRun { start, len })
            .collect()
    };
    let mut frame = Vec::new();
    Message::RoomRequest(RoomRequest {
        room: ROOM,
        generation: 0,
        receivers,
        skip_pages,
        pages: runs(pages),
        aux_slot: aux,
        state_slot: None,
        extras: extras.iter().map(|e| runs(e)).collect(),
        prompt: None,
    })
    .encode(&mut frame);
    frame
}

/// The requests a decode must never be left waiting on, each by name.
fn unservable() -> Vec<(&'static str, Vec<u8>)> {
    let mut truncated = request(1, 0, &[(0, 4)], Some(1), Vec::new());
    truncated.truncate(truncated.len() - 3);
    let len = (truncated.len() - 4) as u32;
    truncated[..4].copy_from_slice(&len.to_le_bytes());
    let mut trailing = request(1, 0, &[(0, 4)], Some(1), Vec::new());
    trailing.push(7);
    let len = (trailing.len() - 4) as u32;
    trailing[..4].copy_from_slice(&len.to_le_bytes());
    // The prompt's flag byte follows room, generation, receivers, skip_pages and two slots.
    let prompt_at = HEADER_LEN + 8 + 4 + 1 + 4 + 4 + 4;
    let mut bad_flag = request(1, 0, &[(0, 4)], Some(1), Vec::new());
    bad_flag[prompt_at] = 2;
    let mut digest_without_flag = request(1, 0, &[(0, 4)], Some(1), Vec::new());
    digest_without_flag[prompt_at + 1] = 1;
    vec![
        ("a prompt flag other than 0 or 1", bad_flag),
        ("a prompt digest without its flag", digest_without_flag),
        (
            "a run of length 0",
            request(1, 0, &[(0, 0)], Some(1), Vec::new()),
        ),
        (
            "a run that overflows",
            request(1, 0, &[(u32::MAX, 2)], Some(1), Vec::new()),
        ),
        (
            "no receivers",
            request(0, 0, &[(0, 4)], Some(1), Vec::new()),
        ),
        (
            "nothing wanted, with runs",
            request(1, SKIP_ALL, &[(0, 4)], None, Vec::new()),
        ),
        (
            "nothing wanted, with a slot",
            request(1, SKIP_ALL, &[], Some(1), Vec::new()),
        ),
        ("a body cut short", truncated),
        ("a trailing byte", trailing),
        (
            "pages outside decode's memory",
            request(1, 0, &[(4094, 4)], Some(1), Vec::new()),
        ),
        (
            "a slot outside decode's memory",
            request(1, 0, &[(0, 4)], Some(1 << 20), Vec::new()),
        ),
        (
            "an extra pool prefill lacks",
            request(1, 0, &[(0, 4)], Some(1), vec![vec![(0, 1)]]),
        ),
    ]
}

#[test]
fn an_unservable_request_for_an_open_room_ends_it_on_both_sides_within_the_round_trip() {
    for (what, frame) in unservable() {
        let (mut sim, p, d) = opened(true);
        let answers = round_trip(&mut sim, p, d, &frame);
        assert!(
            answers.contains(&Message::RoomStatus {
                room: ROOM,
                generation: 0,
                failure: Some(R::ProtocolError),
            }),
            "{what}: {answers:?}"
        );
        assert_eq!(state(&sim, d, ROOM.0), failed(R::ProtocolError), "{what}");
        assert_eq!(state(&sim, p, ROOM.0), failed(R::ProtocolError), "{what}");
    }
}

#[test]
fn an_unservable_request_for_a_room_not_opened_yet_is_answered_and_its_open_fails_at_once() {
    for (what, frame) in unservable() {
        let (mut sim, p, d) = opened(false);
        round_trip(&mut sim, p, d, &frame);
        assert_eq!(state(&sim, d, ROOM.0), failed(R::ProtocolError), "{what}");
        let now = sim.now;
        sim.nodes[p]
            .endpoint
            .open_sender(now, ROOM, 0, None)
            .unwrap();
        assert_eq!(state(&sim, p, ROOM.0), failed(R::ProtocolError), "{what}");
    }
}

/// Any value of each field, the edge values over-represented.
fn field() -> impl Strategy<Value = u32> {
    prop_oneof![
        Just(0u32),
        Just(1),
        Just(3),
        Just(4095),
        Just(4096),
        Just(u32::MAX - 1),
        Just(u32::MAX),
        any::<u32>(),
    ]
}

fn runs() -> impl Strategy<Value = Vec<(u32, u32)>> {
    proptest::collection::vec((field(), field()), 0..4)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn any_request_ends_the_room_within_the_round_trip_or_its_own_deadline(
        sender in any::<bool>(),
        receivers in 0u8..3,
        skip in field(),
        pages in runs(),
        aux in proptest::option::of(field()),
        extras in proptest::collection::vec(runs(), 0..3),
        cut in 0usize..4,
    ) {
        let (mut sim, p, d) = opened(sender);
        let run_ok = |&(s, l): &(u32, u32)| l >= 1 && s.checked_add(l).is_some();
        // `0xFFFFFFFF` is the wire's "no slot": a request carrying it asks for no aux row.
        let asks_aux = aux.is_some_and(|a| a != u32::MAX);
        let wellformed = cut == 0
            && receivers >= 1
            && pages.iter().chain(extras.iter().flatten()).all(run_ok)
            && (skip != SKIP_ALL
                || (pages.is_empty() && !asks_aux && extras.iter().all(Vec::is_empty)));
        let mut frame = request(receivers, skip, &pages, aux, extras);
        if cut > 0 {
            frame.truncate(frame.len().saturating_sub(cut).max(19));
            let len = (frame.len() - 4) as u32;
            frame[..4].copy_from_slice(&len.to_le_bytes());
        }
        round_trip(&mut sim, p, d, &frame);
        let decode_ended = state(&sim, d, ROOM.0).is_some_and(|s| s.is_terminal());
        if !decode_ended {
            // Held: only a request a prefill could serve is.
            prop_assert!(wellformed, "a held request must be one prefill can serve");
        }
        // Nothing moves for the room: by its own deadlines it has ended on both sides.
        let c = common::config();
        let limit = c.bootstrap_timeout.max(c.waiting_timeout) + Duration::from_secs(1);
        sim.run_for(limit, 5_000_000).unwrap();
        prop_assert!(state(&sim, d, ROOM.0).is_none_or(|s| s.is_terminal()));
        prop_assert!(state(&sim, p, ROOM.0).is_none_or(|s| s.is_terminal()));
    }
}

#[test]
fn a_servable_request_is_held_not_answered() {
    let (mut sim, p, d) = opened(true);
    let answers = round_trip(
        &mut sim,
        p,
        d,
        &request(1, 0, &[(0, 4)], Some(1), Vec::new()),
    );
    assert!(
        !answers
            .iter()
            .any(|m| matches!(m, Message::RoomStatus { .. })),
        "{answers:?}"
    );
    assert_eq!(state(&sim, p, ROOM.0), Some(KvPoll::WaitingForInput));
}
