//! Rooms bound to their prompt: a decode that asks for a room's KV for other tokens than the
//! prefill opened it for is refused (`prompt_mismatch`) on both sides before any byte moves,
//! whichever side spoke first; the same tokens, or a side that names none, move as before.
#![allow(clippy::unwrap_used)] // tests may panic

mod common;

use common::{failed, run_ms, send_all, state};
use kvferry_core::sim::Sim;
use kvferry_core::{ApiError, Chunk, FailureReason as R, Grant, KvPoll, PromptDigest, RoomId};

const ROOM: u64 = 5;
const PAGES: u32 = 4;

/// Which side opens the room first.
#[derive(Clone, Copy, Debug)]
enum First {
    /// Prefill opens, then the decode's request arrives.
    Prefill,
    /// The decode's request waits at prefill before prefill opens.
    Decode,
}

/// Opens `ROOM` with prefill holding `held` and decode asking for `asked`, sends every page,
/// runs 50 ms, and returns (decode's state, prefill's state, bytes prefill moved).
fn run_room(
    held: Option<PromptDigest>,
    asked: Option<PromptDigest>,
    first: First,
) -> (Option<KvPoll>, Option<KvPoll>, u64) {
    let (mut sim, p, d) = common::pair(5100, common::config());
    let open_sender = |sim: &mut Sim| {
        let now = sim.now;
        sim.nodes[p]
            .endpoint
            .open_sender(now, RoomId(ROOM), 0, held)
            .unwrap();
        sim.drain(p);
    };
    if let First::Prefill = first {
        open_sender(&mut sim);
    }
    common::open_receiver_with(&mut sim, d, &[p], ROOM, PAGES, |dst| Grant {
        prompt: asked,
        ..Grant::new(dst, Some(0), None)
    });
    run_ms(&mut sim, 5);
    if let First::Decode = first {
        open_sender(&mut sim);
    }
    if state(&sim, p, ROOM).is_some_and(|s| !s.is_terminal()) {
        send_all(&mut sim, p, ROOM, PAGES, false);
    }
    run_ms(&mut sim, 50);
    (
        state(&sim, d, ROOM),
        state(&sim, p, ROOM),
        sim.nodes[p].endpoint.counters().bytes_transferred,
    )
}

fn digest(tokens: &[u32]) -> Option<PromptDigest> {
    Some(PromptDigest::of_tokens(tokens))
}

#[test]
fn a_room_asked_for_other_tokens_fails_prompt_mismatch_on_both_sides_and_moves_nothing() {
    for first in [First::Prefill, First::Decode] {
        let (decode, prefill, bytes) = run_room(digest(&[1, 2, 3]), digest(&[1, 2, 4]), first);
        assert_eq!(decode, failed(R::PromptMismatch), "{first:?}");
        assert_eq!(prefill, failed(R::PromptMismatch), "{first:?}");
        assert_eq!(bytes, 0, "{first:?}");
    }
}

#[test]
fn a_room_asked_for_a_shorter_prefix_of_its_tokens_is_refused_too() {
    let (decode, prefill, bytes) = run_room(digest(&[7, 8, 9]), digest(&[7, 8]), First::Prefill);
    assert_eq!(decode, failed(R::PromptMismatch));
    assert_eq!(prefill, failed(R::PromptMismatch));
    assert_eq!(bytes, 0);
}

#[test]
fn a_room_asked_for_its_own_tokens_moves() {
    for first in [First::Prefill, First::Decode] {
        let same = digest(&[1, 2, 3]);
        let (decode, prefill, bytes) = run_room(same, same, first);
        assert_eq!(decode, Some(KvPoll::Success), "{first:?}");
        assert_eq!(prefill, Some(KvPoll::Success), "{first:?}");
        assert!(bytes > 0);
    }
}

#[test]
fn a_side_that_names_no_tokens_checks_nothing() {
    for (held, asked) in [(None, digest(&[1])), (digest(&[1]), None), (None, None)] {
        let (decode, prefill, _) = run_room(held, asked, First::Prefill);
        assert_eq!(decode, Some(KvPoll::Success), "{held:?} {asked:?}");
        assert_eq!(prefill, Some(KvPoll::Success), "{held:?} {asked:?}");
    }
}

#[test]
fn a_chunk_for_a_room_refused_at_its_open_says_how_the_room_ended() {
    let (mut sim, p, d) = common::pair(5102, common::config());
    common::open_receiver_with(&mut sim, d, &[p], ROOM, PAGES, |dst| Grant {
        prompt: digest(&[2]),
        ..Grant::new(dst, Some(0), None)
    });
    run_ms(&mut sim, 5);
    let now = sim.now;
    let ep = &mut sim.nodes[p].endpoint;
    ep.open_sender(now, RoomId(ROOM), 0, digest(&[1])).unwrap();
    let chunk = Chunk {
        extras: Vec::new(),
        pages: vec![0],
        last: true,
        aux_slot: None,
        state_slot: None,
        layerwise: false,
    };
    assert_eq!(
        ep.send_chunk(now, RoomId(ROOM), chunk),
        Err(ApiError::RoomConcluded(
            RoomId(ROOM),
            KvPoll::Failed(R::PromptMismatch)
        ))
    );
    assert_eq!(
        ep.abort(now, RoomId(ROOM)),
        Err(ApiError::RoomConcluded(
            RoomId(ROOM),
            KvPoll::Failed(R::PromptMismatch)
        ))
    );
}

#[test]
fn a_prompt_mismatch_is_counted_as_a_failure_on_both_sides() {
    let (mut sim, p, d) = common::pair(5101, common::config());
    let now = sim.now;
    sim.nodes[p]
        .endpoint
        .open_sender(now, RoomId(ROOM), 0, digest(&[1]))
        .unwrap();
    common::open_receiver_with(&mut sim, d, &[p], ROOM, PAGES, |dst| Grant {
        prompt: digest(&[2]),
        ..Grant::new(dst, Some(0), None)
    });
    run_ms(&mut sim, 5);
    for n in [p, d] {
        let c = sim.nodes[n].endpoint.counters();
        assert_eq!(c.rooms_failed[R::PromptMismatch.index()], 1);
    }
    common::assert_invariants(&sim);
}

#[test]
fn the_digest_is_xxh3_of_the_token_ids_as_little_endian_u32() {
    // The same bytes hashed in one call: the streaming digest must not depend on chunking.
    let tokens: Vec<u32> = (0..10_000u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    assert_eq!(
        PromptDigest::of_tokens(&tokens),
        PromptDigest(twox_hash::XxHash3_64::oneshot(&bytes))
    );
    assert_ne!(
        PromptDigest::of_tokens(&[1, 2]),
        PromptDigest::of_tokens(&[2, 1]),
        "order counts"
    );
}
