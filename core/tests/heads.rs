//! Attention heads split across tensor-parallel ranks: head slices planned byte-exactly, a
//! decode room that succeeds only when every contributing rank's heads landed, writes of
//! heads a source does not share refused, and head geometries that disagree refused by name.

mod common;

use std::time::Duration;

use common::*;
use kvferry_core::plan::{plan_kv_heads, HeadSide, OpLimits};
use kvferry_core::sim::{small_layout, Faults, Sim};
use kvferry_core::{
    EndpointInfo, Event, Grant, Heads, Incarnation, KvPoll, Layout, NodeId, Region, RejectReason,
    Role, RoomId, Slice, WriteRefused,
};

const WIDE: OpLimits = OpLimits {
    max_bytes: u64::MAX,
    max_slices: u32::MAX,
};

/// 4 KV heads of 8 bytes, 4 tokens a page, over `tp` ranks: rank `r`'s heads and page size.
fn rank_of(tp: u16, r: u16) -> HeadSide {
    let total = 4u16;
    let per_rank = (total / tp).max(1);
    let replicas = (tp / total).max(1);
    let heads = Heads {
        total,
        start: (r / replicas) * per_rank,
        count: per_rank,
        head_bytes: 8,
    };
    HeadSide {
        page_bytes: 4 * heads.row_bytes() as u32,
        heads,
    }
}

/// The byte every rank holds for (page, token, global head, byte of head): the same value on
/// every rank that holds the head, so any rank's copy is the right one.
fn value(page: u64, token: u64, head: u64, b: u64) -> u8 {
    (page * 131 + token * 31 + head * 7 + b) as u8
}

/// A region of `pages` pages of `side`, filled with `value` for the heads it holds.
fn region(side: HeadSide, pages: u64) -> Vec<u8> {
    let (h, hb) = (side.heads, u64::from(side.heads.head_bytes));
    let tokens = u64::from(h.page_tokens(side.page_bytes).expect("whole token rows"));
    let mut v = vec![0u8; (pages * u64::from(side.page_bytes)) as usize];
    for p in 0..pages {
        for t in 0..tokens {
            for k in 0..u64::from(h.count) {
                for b in 0..hb {
                    let at = p * u64::from(side.page_bytes) + t * h.row_bytes() + k * hb + b;
                    v[at as usize] = value(p, t, u64::from(h.start) + k, b);
                }
            }
        }
    }
    v
}

/// Copies `src` pages 0..n of every prefill rank into a fresh decode region (pages 0..n) as
/// planned, and returns it with what decode rank `d` must hold.
fn move_heads(prefill_tp: u16, decode_tp: u16, d: u16, sources: &[u16]) -> (Vec<u8>, Vec<u8>) {
    let pages = [0u32, 1, 2];
    let dst_pages = [5u32, 6, 9];
    let to = rank_of(decode_tp, d);
    let mut dst = vec![0u8; (10 * to.page_bytes) as usize];
    for &p in sources {
        let from = rank_of(prefill_tp, p);
        let src = region(from, 3);
        for op in plan_kv_heads(1, from, to, 0..1, &pages, &dst_pages, WIDE) {
            for s in op.iter().flat_map(Slice::runs) {
                let (a, b, n) = (s.src_offset as usize, s.dst_offset as usize, s.len as usize);
                dst[b..b + n].copy_from_slice(&src[a..a + n]);
            }
        }
    }
    let mut want = vec![0u8; dst.len()];
    let held = region(to, 3);
    for (i, &d) in dst_pages.iter().enumerate() {
        let (pb, at) = (to.page_bytes as usize, d as usize * to.page_bytes as usize);
        want[at..at + pb].copy_from_slice(&held[i * pb..(i + 1) * pb]);
    }
    (dst, want)
}

#[test]
fn two_prefill_ranks_fill_every_head_of_one_decode_rank() {
    let (got, want) = move_heads(2, 1, 0, &[0, 1]);
    assert_eq!(got, want);
}

#[test]
fn one_prefill_rank_gives_each_of_two_decode_ranks_its_heads() {
    for d in 0..2 {
        let (got, want) = move_heads(1, 2, d, &[0]);
        assert_eq!(got, want, "decode rank {d}");
    }
}

#[test]
fn four_prefill_ranks_fill_two_decode_ranks() {
    for d in 0..2 {
        let (got, want) = move_heads(4, 2, d, &[2 * d, 2 * d + 1]);
        assert_eq!(got, want, "decode rank {d}");
    }
}

#[test]
fn replicated_heads_land_once_per_decode_rank() {
    // 8 prefill ranks over 4 heads: ranks 2k and 2k+1 hold head k; both write it.
    let (got, want) = move_heads(8, 1, 0, &[0, 1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(got, want);
}

#[test]
fn one_missing_contributor_leaves_its_heads_unwritten() {
    let (got, want) = move_heads(2, 1, 0, &[0]);
    assert_ne!(got, want, "rank 1's heads cannot appear from rank 0 alone");
}

#[test]
fn a_swapped_head_is_caught_by_the_byte_check() {
    // The check these tests make is sensitive to a head-slice mix-up (sglang #23746).
    let (mut got, want) = move_heads(2, 1, 0, &[0, 1]);
    let to = rank_of(1, 0);
    let (hb, row) = (8usize, to.heads.row_bytes() as usize);
    let at = 5 * to.page_bytes as usize + row; // page 5, token 1: swap heads 1 and 2
    let (a, b) = (at + hb, at + 2 * hb);
    for i in 0..hb {
        got.swap(a + i, b + i);
    }
    assert_ne!(got, want);
}

#[test]
fn a_pages_head_slices_are_one_strided_slice() {
    // Decode rank 1 of 2 holds heads 2..4 of the prefill rank's 4: each of the page's 4 token
    // rows gives its last 16 bytes of 32, into whole rows of 16 on decode.
    let (from, to) = (rank_of(1, 0), rank_of(2, 1));
    let ops = plan_kv_heads(1, from, to, 0..1, &[1], &[3], WIDE);
    assert_eq!(
        ops.concat(),
        vec![Slice {
            region: Region::Kv { layer: 0, plane: 0 },
            src_offset: 128 + 16,
            dst_offset: 3 * 64,
            len: 16,
            rows: 4,
            src_stride: 32,
            dst_stride: 16,
        }]
    );
}

#[test]
fn a_slices_rows_are_cut_to_the_operation_limits() {
    let (from, to) = (rank_of(1, 0), rank_of(2, 0));
    let limits = OpLimits {
        max_bytes: u64::MAX,
        max_slices: 3,
    };
    let ops = plan_kv_heads(1, from, to, 0..1, &[0], &[0], limits);
    let rows: Vec<Vec<u32>> = ops
        .iter()
        .map(|op| op.iter().map(|s| s.rows).collect())
        .collect();
    assert_eq!(rows, vec![vec![3], vec![1]], "at most 3 rows an operation");
    let limits = OpLimits {
        max_bytes: 32,
        max_slices: u32::MAX,
    };
    let ops = plan_kv_heads(1, from, to, 0..1, &[0], &[0], limits);
    assert!(ops
        .iter()
        .all(|op| op.iter().map(Slice::bytes).sum::<u64>() <= 32));
    assert_eq!(ops.concat().iter().map(Slice::bytes).sum::<u64>(), 64);
}

#[test]
fn whole_pages_merge_where_both_sides_hold_the_same_heads() {
    let from = rank_of(1, 0);
    let ops = plan_kv_heads(2, from, from, 0..2, &[0, 1], &[3, 4], WIDE);
    assert_eq!(
        ops.concat(),
        (0..2u16)
            .flat_map(|layer| (0..2u8).map(move |plane| (layer, plane)))
            .map(|(layer, plane)| Slice::run(Region::Kv { layer, plane }, 0, 3 * 128, 2 * 128))
            .collect::<Vec<_>>()
    );
}

#[test]
fn ranks_that_share_no_head_plan_nothing() {
    let ops = plan_kv_heads(1, rank_of(2, 0), rank_of(2, 1), 0..1, &[0], &[0], WIDE);
    assert!(ops.is_empty());
}

/// Sim: `prefill_tp` prefill ranks and `decode_tp` decode ranks of the 4-head model.
fn split_cluster(prefill_tp: u16, decode_tp: u16) -> (Sim, Vec<usize>, Vec<usize>) {
    let mut sim = Sim::new(7, Faults::default());
    let layout_of = |side: HeadSide| Layout {
        page_bytes: side.page_bytes,
        ..small_layout(512)
    };
    let node = |sim: &mut Sim, role: Role, rank: u16, side: HeadSide| {
        let layout = layout_of(side);
        let mut info = EndpointInfo::new(
            role,
            NodeId(1000 + sim.nodes.len() as u64),
            Incarnation(9 + sim.nodes.len() as u64),
            layout,
        );
        info.rank = rank;
        info.heads = side.heads;
        info.token = b"sim-token".to_vec();
        sim.add_node(config(), info)
    };
    let ps: Vec<usize> = (0..prefill_tp)
        .map(|r| node(&mut sim, Role::Prefill, r, rank_of(prefill_tp, r)))
        .collect();
    let ds: Vec<usize> = (0..decode_tp)
        .map(|r| node(&mut sim, Role::Decode, r, rank_of(decode_tp, r)))
        .collect();
    for &d in &ds {
        for &p in &ps {
            sim.connect(d, p);
        }
    }
    run_ms(&mut sim, 5);
    (sim, ps, ds)
}

/// Decode `d` opens `room` from `ps` with 3 pages; `receivers` decode ranks ask each source.
fn open_split(sim: &mut Sim, d: usize, ps: &[usize], room: u64, receivers: u8) -> Vec<u32> {
    open_receiver_with(sim, d, ps, room, 3, |dst| Grant {
        receivers,
        ..Grant::new(dst, Some(room as u32), None)
    })
}

fn open_and_send(sim: &mut Sim, p: usize, room: u64) {
    let now = sim.now;
    sim.nodes[p]
        .endpoint
        .open_sender(now, RoomId(room), 0, None)
        .expect("open sender");
    sim.drain(p);
    send_all(sim, p, room, 3, false);
}

#[test]
fn a_decode_room_fed_by_two_head_ranks_succeeds_when_both_landed() {
    let (mut sim, ps, ds) = split_cluster(2, 1);
    open_split(&mut sim, ds[0], &ps, 1, 1);
    open_and_send(&mut sim, ps[0], 1);
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, ps[0], 1), Some(KvPoll::Success));
    assert_ne!(
        state(&sim, ds[0], 1),
        Some(KvPoll::Success),
        "rank 1's heads are missing"
    );
    open_and_send(&mut sim, ps[1], 1);
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, ds[0], 1), Some(KvPoll::Success));
    assert_invariants(&sim);
}

#[test]
fn two_decode_ranks_each_take_their_heads_from_one_prefill_rank() {
    let (mut sim, ps, ds) = split_cluster(1, 2);
    for &d in &ds {
        open_split(&mut sim, d, &ps, 2, 2);
    }
    open_and_send(&mut sim, ps[0], 2);
    run_ms(&mut sim, 50);
    for n in [ps[0], ds[0], ds[1]] {
        assert_eq!(state(&sim, n, 2), Some(KvPoll::Success), "node {n}");
    }
    assert_invariants(&sim);
}

#[test]
fn a_failed_head_rank_fails_the_decode_room_with_its_reason() {
    let (mut sim, ps, ds) = split_cluster(2, 1);
    open_split(&mut sim, ds[0], &ps, 3, 1);
    open_and_send(&mut sim, ps[0], 3);
    let now = sim.now;
    sim.nodes[ps[1]]
        .endpoint
        .open_sender(now, RoomId(3), 0, None)
        .expect("open sender");
    sim.nodes[ps[1]]
        .endpoint
        .abort(now, RoomId(3))
        .expect("abort");
    sim.drain(ps[1]);
    run_ms(&mut sim, 50);
    assert!(
        matches!(state(&sim, ds[0], 3), Some(KvPoll::Failed(_))),
        "{:?}",
        state(&sim, ds[0], 3)
    );
}

#[test]
fn a_write_of_heads_the_source_does_not_share_is_refused_and_fails_the_room() {
    // Rank 1 holds heads 2..4 of the decode's 0..4: bytes 16..32 of every 32-byte row.
    let cases = [
        (32 + 16, 16, true),
        (0, 16, false),
        (8, 16, false),
        (16, 8, false),
        (16, 32, false),
    ];
    for (i, (offset, len, admitted)) in cases.into_iter().enumerate() {
        let room = 4 + i as u64;
        let (mut sim, ps, ds) = split_cluster(2, 1);
        let page = open_split(&mut sim, ds[0], &ps, room, 1)[0];
        run_ms(&mut sim, 5);
        let session = sim.session(ds[0], ps[1]).expect("session");
        let at = u64::from(page) * u64::from(rank_of(1, 0).page_bytes);
        let slice = [Slice::run(
            Region::Kv { layer: 0, plane: 0 },
            0,
            at + offset,
            len,
        )];
        let now = sim.now;
        let got = sim.nodes[ds[0]]
            .endpoint
            .begin_write(now, session, RoomId(room), 0, &slice);
        if admitted {
            assert!(got.is_ok(), "offset {offset} len {len}: {got:?}");
            assert_eq!(state(&sim, ds[0], room), Some(KvPoll::WaitingForInput));
        } else {
            assert_eq!(
                got.err(),
                Some(WriteRefused::HeadsNotShared),
                "offset {offset} len {len}"
            );
            // Bytes in another rank's heads broke the protocol: the room fails.
            assert_eq!(
                state(&sim, ds[0], room),
                Some(KvPoll::Failed(kvferry_core::FailureReason::ProtocolError))
            );
        }
    }
}

#[test]
fn a_strided_write_is_admitted_only_as_the_shared_heads_of_whole_token_rows() {
    // Rank 1 holds heads 2..4 of the decode's 0..4: bytes 16..32 of every 32-byte row.
    let kv = Region::Kv { layer: 0, plane: 0 };
    let strided = |offset: u64, len: u64, rows: u32, stride: u64| Slice {
        region: kv,
        src_offset: 0,
        dst_offset: offset,
        len,
        rows,
        src_stride: stride,
        dst_stride: stride,
    };
    let cases = [
        (strided(16, 16, 4, 32), None),
        (strided(16, 16, 2, 64), None),
        (strided(16, 16, 4, 48), Some(WriteRefused::HeadsNotShared)),
        (strided(0, 16, 4, 32), Some(WriteRefused::HeadsNotShared)),
        (strided(16, 16, 4, 8), Some(WriteRefused::BadRows)),
        (strided(16, 16, 1, 32), Some(WriteRefused::BadRows)),
        (strided(16, 16, 0, 0), Some(WriteRefused::BadRows)),
        (strided(16, 16, 13, 32), Some(WriteRefused::PageNotGranted)),
        (
            Slice {
                region: Region::Aux,
                ..strided(0, 4, 2, 4)
            },
            Some(WriteRefused::BadRows),
        ),
    ];
    for (i, (slice, refused)) in cases.into_iter().enumerate() {
        let room = 20 + i as u64;
        let (mut sim, ps, ds) = split_cluster(2, 1);
        let page = open_split(&mut sim, ds[0], &ps, room, 1)[2];
        run_ms(&mut sim, 5);
        let session = sim.session(ds[0], ps[1]).expect("session");
        let at = u64::from(page) * u64::from(rank_of(1, 0).page_bytes);
        let slice = Slice {
            dst_offset: slice.dst_offset + if slice.region == kv { at } else { 0 },
            ..slice
        };
        let now = sim.now;
        let got = sim.nodes[ds[0]]
            .endpoint
            .begin_write(now, session, RoomId(room), 0, &[slice]);
        assert_eq!(got.as_ref().err(), refused.as_ref(), "{slice:?}");
        let want = if refused.is_some() {
            Some(KvPoll::Failed(kvferry_core::FailureReason::ProtocolError))
        } else {
            Some(KvPoll::WaitingForInput)
        };
        assert_eq!(state(&sim, ds[0], room), want, "{slice:?}");
    }
}

#[test]
fn a_peer_with_another_head_count_is_refused_naming_both_values() {
    let mut sim = Sim::new(3, Faults::default());
    let side = rank_of(1, 0);
    let mut node = |role: Role, total: u16| {
        let heads = Heads {
            total,
            ..side.heads
        };
        let heads = Heads {
            count: total,
            ..heads
        };
        let layout = Layout {
            page_bytes: 4 * heads.row_bytes() as u32,
            ..small_layout(64)
        };
        let mut info = EndpointInfo::new(role, NodeId(u64::from(total)), Incarnation(5), layout);
        info.heads = heads;
        info.token = b"sim-token".to_vec();
        sim.add_node(config(), info)
    };
    let p = node(Role::Prefill, 4);
    let d = node(Role::Decode, 8);
    sim.connect(d, p);
    sim.run_for(Duration::from_millis(5), 10_000)
        .expect("handshake");
    let named = |n: usize| {
        sim.nodes[n].count_events(|e| {
            matches!(e, Event::SessionRejected { reason: RejectReason::IncompatibleLayout(m), .. }
                if m.field == "heads_total" && m.ours + m.theirs == 12)
        })
    };
    assert!(named(p) + named(d) >= 1);
    assert_eq!(sim.session(d, p), None);
}

#[test]
fn a_room_whose_sources_hold_only_some_of_its_heads_fails_at_once() {
    // Decode TP 1 holds heads 0..4; only prefill rank 0 (heads 0..2) is named as a source.
    let (mut sim, ps, ds) = split_cluster(2, 1);
    open_receiver_with(&mut sim, ds[0], &ps[..1], 8, 3, |dst| {
        Grant::new(dst, Some(8), None)
    });
    assert_eq!(
        state(&sim, ds[0], 8),
        Some(KvPoll::Failed(
            kvferry_core::FailureReason::IncompatiblePeer
        ))
    );
}
