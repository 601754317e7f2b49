//! Grants that ask sources for less than the whole room: a prefix the decode already holds is
//! never sent, and an idle source (an MLA rank whose copy another rank sends) writes nothing
//! and still confirms the room.

mod common;

use common::*;
use kvferry_core::sim::{small_layout, Faults, Sim};
use kvferry_core::{Chunk, FailureReason, Grant, KvPoll, RoomId};

/// `prefills` whole-model prefill ranks and one decode, connected.
fn ranks(prefills: u16) -> (Sim, Vec<usize>, usize) {
    let mut sim = Sim::new(11, Faults::default());
    let layout = small_layout(256);
    let ps = (0..prefills)
        .map(|r| sim.add_prefill(config(), layout, r, 0..layout.layers))
        .collect::<Vec<_>>();
    let d = sim.add_decode(config(), layout, 0);
    for &p in &ps {
        sim.connect(d, p);
    }
    run_ms(&mut sim, 5);
    (sim, ps, d)
}

/// Prefill `p` sends the room's `pages` pages in chunks of `sizes`.
fn send(sim: &mut Sim, p: usize, room: u64, pages: u32, sizes: &[u32]) {
    let id = RoomId(room);
    let src = sim.nodes[p].alloc(id, 0, pages).expect("prefill pages");
    let mut at = 0usize;
    for (i, &n) in sizes.iter().enumerate() {
        let last = i + 1 == sizes.len();
        let chunk = Chunk {
            extras: Vec::new(),
            pages: src[at..at + n as usize].to_vec(),
            last,
            aux_slot: last.then_some(room as u32),
            state_slot: None,
            layerwise: false,
        };
        at += n as usize;
        let now = sim.now;
        sim.nodes[p]
            .endpoint
            .send_chunk(now, id, chunk)
            .expect("send chunk");
        sim.drain(p);
    }
}

fn kv_bytes(pages: u64) -> u64 {
    let l = small_layout(1);
    pages * u64::from(l.page_bytes) * u64::from(l.layers) * u64::from(l.planes)
}

#[test]
fn a_prefix_the_decode_holds_is_not_sent() {
    let (mut sim, ps, d) = ranks(1);
    // Six pages in the room, the decode holds the first two: it grants four.
    open_room_with(&mut sim, d, &ps, 1, 4, |dst| Grant {
        skip_pages: 2,
        ..Grant::new(dst, Some(1), None)
    });
    send(&mut sim, ps[0], 1, 6, &[1, 1, 3, 1]);
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, d, 1), Some(KvPoll::Success));
    assert_eq!(state(&sim, ps[0], 1), Some(KvPoll::Success));
    let aux = u64::from(small_layout(1).aux_bytes);
    assert_eq!(
        sim.nodes[ps[0]].endpoint.counters().bytes_planned,
        kv_bytes(4) + aux
    );
    assert_invariants(&sim);
}

#[test]
fn a_chunk_past_the_grant_after_the_prefix_fails_the_room() {
    let (mut sim, ps, d) = ranks(1);
    open_room_with(&mut sim, d, &ps, 2, 3, |dst| Grant {
        skip_pages: 2,
        ..Grant::new(dst, Some(2), None)
    });
    send(&mut sim, ps[0], 2, 6, &[6]);
    run_ms(&mut sim, 50);
    for n in [ps[0], d] {
        assert_eq!(state(&sim, n, 2), failed(FailureReason::GrantMismatch));
    }
}

#[test]
fn a_last_chunk_short_of_the_prefix_room_fails_the_room_on_both_sides() {
    let (mut sim, ps, d) = ranks(1);
    // The decode holds two pages and grants four: the room has six pages. A prefill that
    // sends only four leaves the last two granted pages unwritten.
    open_room_with(&mut sim, d, &ps, 12, 4, |dst| Grant {
        skip_pages: 2,
        ..Grant::new(dst, Some(12), None)
    });
    send(&mut sim, ps[0], 12, 4, &[4]);
    run_ms(&mut sim, 50);
    for n in [ps[0], d] {
        assert_eq!(state(&sim, n, 12), failed(FailureReason::GrantMismatch));
    }
    assert_eq!(sim.nodes[ps[0]].endpoint.counters().bytes_planned, 0);
    assert_eq!(sim.nodes[ps[0]].endpoint.counters().rooms_succeeded, 0);
}

#[test]
fn chunks_short_of_the_grant_fail_the_room_when_the_last_one_arrives() {
    let (mut sim, ps, d) = ranks(1);
    open_room_with(&mut sim, d, &ps, 13, 5, |dst| {
        Grant::new(dst, Some(13), None)
    });
    send(&mut sim, ps[0], 13, 3, &[2, 1]);
    run_ms(&mut sim, 50);
    for n in [ps[0], d] {
        assert_eq!(state(&sim, n, 13), failed(FailureReason::GrantMismatch));
    }
}

#[test]
fn a_granted_aux_row_the_last_chunk_does_not_name_fails_the_room() {
    let (mut sim, ps, d) = ranks(1);
    open_room_with(&mut sim, d, &ps, 14, 2, |dst| {
        Grant::new(dst, Some(14), None)
    });
    let id = RoomId(14);
    let src = sim.nodes[ps[0]].alloc(id, 0, 2).expect("prefill pages");
    let chunk = Chunk {
        extras: Vec::new(),
        pages: src,
        last: true,
        aux_slot: None,
        state_slot: None,
        layerwise: false,
    };
    let now = sim.now;
    sim.nodes[ps[0]]
        .endpoint
        .send_chunk(now, id, chunk)
        .expect("send chunk");
    sim.drain(ps[0]);
    run_ms(&mut sim, 50);
    for n in [ps[0], d] {
        assert_eq!(state(&sim, n, 14), failed(FailureReason::GrantMismatch));
    }
}

#[test]
fn an_idle_source_writes_nothing_and_confirms_the_room() {
    let (mut sim, ps, d) = ranks(2);
    open_room_with(&mut sim, d, &ps, 3, 4, |dst| Grant {
        idle_sources: 0b10,
        ..Grant::new(dst, Some(3), None)
    });
    send(&mut sim, ps[0], 3, 4, &[4]);
    send(&mut sim, ps[1], 3, 4, &[2, 2]);
    run_ms(&mut sim, 50);
    for n in [d, ps[0], ps[1]] {
        assert_eq!(state(&sim, n, 3), Some(KvPoll::Success), "node {n}");
    }
    assert_eq!(sim.nodes[ps[1]].endpoint.counters().bytes_planned, 0);
    assert_invariants(&sim);
}

#[test]
fn the_decode_room_waits_for_its_idle_source_to_confirm() {
    let (mut sim, ps, d) = ranks(2);
    open_room_with(&mut sim, d, &ps, 4, 4, |dst| Grant {
        idle_sources: 0b10,
        ..Grant::new(dst, Some(4), None)
    });
    send(&mut sim, ps[0], 4, 4, &[4]);
    run_ms(&mut sim, 50);
    assert_ne!(
        state(&sim, d, 4),
        Some(KvPoll::Success),
        "rank 1 has not confirmed"
    );
    let now = sim.now;
    sim.nodes[ps[1]]
        .endpoint
        .abort(now, RoomId(4))
        .expect("abort");
    sim.drain(ps[1]);
    run_ms(&mut sim, 50);
    assert!(matches!(state(&sim, d, 4), Some(KvPoll::Failed(_))));
}

#[test]
fn a_grant_that_skips_every_page_is_refused_at_the_call() {
    let (mut sim, ps, d) = ranks(1);
    let now = sim.now;
    let sources = [sim.session(d, ps[0]).expect("session")];
    let grant = Grant {
        skip_pages: u32::MAX,
        ..Grant::new(vec![1], None, None)
    };
    assert!(sim.nodes[d]
        .endpoint
        .open_receiver(now, RoomId(5), 0, &sources, Some(grant))
        .is_err());
}

#[test]
fn a_write_from_an_idle_source_is_refused() {
    let (mut sim, ps, d) = ranks(2);
    open_room_with(&mut sim, d, &ps, 6, 2, |dst| Grant {
        idle_sources: 0b10,
        ..Grant::new(dst, Some(6), None)
    });
    run_ms(&mut sim, 5);
    let session = sim.session(d, ps[1]).expect("session");
    let slice = [kvferry_core::Slice::run(
        kvferry_core::Region::Aux,
        0,
        6 * u64::from(small_layout(1).aux_bytes),
        u64::from(small_layout(1).aux_bytes),
    )];
    let now = sim.now;
    assert_eq!(
        sim.nodes[d]
            .endpoint
            .begin_write(now, session, RoomId(6), 0, &slice)
            .err(),
        Some(kvferry_core::WriteRefused::NotASource)
    );
}

#[test]
fn a_room_fed_by_only_some_pipeline_stages_fails_at_once() {
    let mut sim = Sim::new(12, Faults::default());
    let layout = small_layout(64);
    let first = sim.add_prefill(config(), layout, 0, 0..2);
    let last = sim.add_prefill(config(), layout, 1, 2..layout.layers);
    let d = sim.add_decode(config(), layout, 0);
    sim.connect(d, first);
    sim.connect(d, last);
    run_ms(&mut sim, 5);
    // Layers 0..2 have no source: nobody would ever write them.
    open_receiver_with(&mut sim, d, &[last], 9, 2, |dst| {
        Grant::new(dst, Some(9), None)
    });
    assert_eq!(
        state(&sim, d, 9),
        failed(kvferry_core::FailureReason::IncompatiblePeer)
    );
    // Both stages together cover every layer.
    open_room_with(&mut sim, d, &[first, last], 10, 2, |dst| {
        Grant::new(dst, Some(10), None)
    });
    assert_ne!(
        state(&sim, d, 10),
        failed(kvferry_core::FailureReason::IncompatiblePeer)
    );
}

#[test]
fn a_room_whose_only_writer_is_idle_fails_at_once() {
    let (mut sim, ps, d) = ranks(2);
    open_receiver_with(&mut sim, d, &ps, 11, 2, |dst| Grant {
        idle_sources: 0b11,
        ..Grant::new(dst, Some(11), None)
    });
    assert_eq!(
        state(&sim, d, 11),
        failed(kvferry_core::FailureReason::IncompatiblePeer)
    );
}
