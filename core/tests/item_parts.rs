//! Extra items split by tensor parallelism (a recurrent layer's state: conv channels and SSM
//! heads, each rank its share): planned row by row of the units both peers hold, byte-exact
//! between different TP sizes; a decode room that succeeds only once every contributing
//! rank's share landed; a write of units the source does not share refused; peers whose
//! parts disagree refused by name.

mod common;

use common::*;
use kvferry_core::plan::{plan_extras, OpLimits};
use kvferry_core::sim::{small_layout, Faults, Sim};
use kvferry_core::{
    Chunk, EndpointInfo, Event, ExtraPool, Grant, Heads, Incarnation, ItemPart, KvPoll, Layout,
    NodeId, Region, RejectReason, Role, RoomId, Slice, WriteRefused,
};

const WIDE: OpLimits = OpLimits {
    max_bytes: u64::MAX,
    max_slices: u32::MAX,
};

/// A GDN-like state item at TP `tp`, rank `r`: three conv rows, each the rank's query (4
/// units), key (4 units) and value (8 units) channels of 4 bytes, then its SSM state (8 value
/// heads of 16 bytes), then 8 bytes of padding. Returns the item's bytes and its parts.
fn state_item(tp: u16, r: u16) -> (u32, Vec<ItemPart>) {
    let (qk, v) = (4 / tp, 8 / tp);
    let row = u32::from(qk + qk + v) * 4;
    let conv = |offset: u32, units: u16, count: u16| ItemPart {
        offset,
        rows: 3,
        stride: row,
        units,
        first: r * count,
        count,
        unit_bytes: 4,
    };
    let ssm = ItemPart {
        offset: 3 * row,
        rows: 1,
        stride: 0,
        units: 8,
        first: r * v,
        count: v,
        unit_bytes: 16,
    };
    let parts = vec![
        conv(0, 4, qk),
        conv(u32::from(qk) * 4, 4, qk),
        conv(u32::from(2 * qk) * 4, 8, v),
        ssm,
    ];
    (3 * row + u32::from(v) * 16 + 8, parts)
}

fn pool(tp: u16, r: u16, items: u32) -> Vec<ExtraPool> {
    let (item, parts) = state_item(tp, r);
    vec![ExtraPool {
        items,
        item_bytes: vec![item],
        parts: vec![parts],
    }]
}

/// The byte every rank holding it has for (item, part, row, model unit, byte of unit).
fn value(item: u64, part: usize, row: u32, unit: u16, b: u32) -> u8 {
    (item * 97 + part as u64 * 61 + u64::from(row) * 29 + u64::from(unit) * 7 + u64::from(b)) as u8
}

/// A tensor of `items` items of rank `r` at TP `tp`, its shares filled with `value` (the
/// padding zero); `logical` names the item `i` holds.
fn tensor(tp: u16, r: u16, items: u32, logical: impl Fn(u32) -> Option<u64>) -> Vec<u8> {
    let (item, parts) = state_item(tp, r);
    let mut v = vec![0u8; (items * item) as usize];
    for i in 0..items {
        let Some(l) = logical(i) else { continue };
        for (k, p) in parts.iter().enumerate() {
            for row in 0..p.rows {
                for u in 0..p.count {
                    for b in 0..p.unit_bytes {
                        let at =
                            i * item + p.offset + row * p.stride + u32::from(u) * p.unit_bytes + b;
                        v[at as usize] = value(l, k, row, p.first + u, b);
                    }
                }
            }
        }
    }
    v
}

/// Items 0..3 of every prefill rank copied as planned into decode rank `d`'s items 5, 2, 7;
/// returns what landed and what rank `d` must hold.
fn move_state(prefill_tp: u16, decode_tp: u16, d: u16, sources: &[u16]) -> (Vec<u8>, Vec<u8>) {
    let (src_items, dst_items) = ([0u32, 1, 2], [5u32, 2, 7]);
    let mut got = vec![0u8; tensor(decode_tp, d, 8, |_| None).len()];
    for &p in sources {
        let (from, to) = (pool(prefill_tp, p, 3), pool(decode_tp, d, 8));
        let copies = ExtraPool::copies(&from, &to);
        let src = tensor(prefill_tp, p, 3, |i| Some(u64::from(i)));
        for op in plan_extras(&from, &copies, 0, &src_items, &dst_items, WIDE) {
            for s in op.iter().flat_map(Slice::runs) {
                let (a, b, n) = (s.src_offset as usize, s.dst_offset as usize, s.len as usize);
                got[b..b + n].copy_from_slice(&src[a..a + n]);
            }
        }
    }
    let want = tensor(decode_tp, d, 8, |i| {
        dst_items.iter().position(|x| *x == i).map(|l| l as u64)
    });
    (got, want)
}

#[test]
fn two_prefill_ranks_fill_every_part_of_one_decode_ranks_state() {
    let (got, want) = move_state(2, 1, 0, &[0, 1]);
    assert_eq!(got, want);
}

#[test]
fn one_prefill_rank_gives_each_of_two_decode_ranks_its_share_of_the_state() {
    for d in 0..2 {
        let (got, want) = move_state(1, 2, d, &[0]);
        assert_eq!(got, want, "decode rank {d}");
    }
}

#[test]
fn four_prefill_ranks_fill_two_decode_ranks_state() {
    for d in 0..2 {
        let (got, want) = move_state(4, 2, d, &[2 * d, 2 * d + 1]);
        assert_eq!(got, want, "decode rank {d}");
    }
}

#[test]
fn one_missing_rank_leaves_its_share_of_the_state_unwritten() {
    let (got, want) = move_state(2, 1, 0, &[0]);
    assert_ne!(got, want);
}

#[test]
fn a_conv_part_is_one_strided_slice_per_item() {
    // Prefill rank 1 of 2 into decode TP 1: per item, each conv part's 3 rows are one slice
    // (2 units of 4 bytes, rows 32 bytes apart at the source and 64 at the decode).
    let (from, to) = (pool(2, 1, 3), pool(1, 0, 8));
    let copies = ExtraPool::copies(&from, &to);
    let ops = plan_extras(&from, &copies, 0, &[0], &[5], WIDE);
    let slices: Vec<Slice> = ops.concat();
    assert_eq!(slices.len(), 4);
    let (item_d, _) = state_item(1, 0);
    assert_eq!(
        slices[0],
        Slice {
            region: Region::Extra { pool: 0, tensor: 0 },
            src_offset: 0,
            dst_offset: 5 * u64::from(item_d) + 8,
            len: 8,
            rows: 3,
            src_stride: 32,
            dst_stride: 64,
        }
    );
}

#[test]
fn a_parts_rows_are_cut_to_the_operation_limits() {
    let (from, to) = (pool(2, 0, 3), pool(1, 0, 8));
    let copies = ExtraPool::copies(&from, &to);
    let limits = OpLimits {
        max_bytes: u64::MAX,
        max_slices: 2,
    };
    let ops = plan_extras(&from, &copies, 0, &[0], &[5], limits);
    assert!(ops
        .iter()
        .all(|op| op.iter().map(|s| s.rows).sum::<u32>() <= 2));
    let rows: u32 = ops.iter().flatten().map(|s| s.rows).sum();
    assert_eq!(rows, 3 * 3 + 1);
}

#[test]
fn equal_shares_move_whole_items() {
    let (from, to) = (pool(2, 1, 3), pool(2, 1, 8));
    let copies = ExtraPool::copies(&from, &to);
    let ops = plan_extras(&from, &copies, 0, &[0, 1], &[5, 6], WIDE);
    let (item, _) = state_item(2, 1);
    assert_eq!(
        ops.concat(),
        vec![Slice::run(
            Region::Extra { pool: 0, tensor: 0 },
            0,
            5 * u64::from(item),
            2 * u64::from(item)
        )]
    );
}

/// 4 KV heads of 8 bytes, 4 tokens a page, over `tp` ranks: rank `r`'s heads.
fn heads_of(tp: u16, r: u16) -> Heads {
    Heads {
        total: 4,
        start: r * (4 / tp),
        count: 4 / tp,
        head_bytes: 8,
    }
}

/// Sim: `prefill_tp` prefill ranks and `decode_tp` decode ranks, each with its share of a
/// split state pool (`split`: false registers the pool unsplit).
fn state_cluster(prefill_tp: u16, decode_tp: u16, split: bool) -> (Sim, Vec<usize>, Vec<usize>) {
    let mut sim = Sim::new(11, Faults::default());
    let node = |sim: &mut Sim, role: Role, tp: u16, rank: u16| {
        let heads = heads_of(tp, rank);
        let layout = Layout {
            page_bytes: 4 * heads.row_bytes() as u32,
            ..small_layout(512)
        };
        let n = sim.nodes.len() as u64;
        let mut info = EndpointInfo::new(role, NodeId(2000 + n), Incarnation(70 + n), layout);
        info.rank = rank;
        info.heads = heads;
        info.token = b"sim-token".to_vec();
        info.extras = pool(tp, rank, 16);
        if !split {
            info.extras[0].parts.clear();
        }
        sim.add_node(config(), info)
    };
    let ps: Vec<usize> = (0..prefill_tp)
        .map(|r| node(&mut sim, Role::Prefill, prefill_tp, r))
        .collect();
    let ds: Vec<usize> = (0..decode_tp)
        .map(|r| node(&mut sim, Role::Decode, decode_tp, r))
        .collect();
    for &d in &ds {
        for &p in &ps {
            sim.connect(d, p);
        }
    }
    run_ms(&mut sim, 5);
    (sim, ps, ds)
}

/// Decode `d` opens `room` from `ps` (3 pages, state item 9); `receivers` decode ranks ask.
fn open_state_room(sim: &mut Sim, d: usize, ps: &[usize], room: u64, receivers: u8) {
    open_receiver_with(sim, d, ps, room, 3, |dst| Grant {
        receivers,
        extras: vec![vec![9]],
        ..Grant::new(dst, Some(room as u32), None)
    });
}

/// Prefill `p` opens and sends `room`: 3 pages and its state item 4.
fn send_state_room(sim: &mut Sim, p: usize, room: u64) {
    let now = sim.now;
    let id = RoomId(room);
    sim.nodes[p]
        .endpoint
        .open_sender(now, id, 0, None)
        .expect("open sender");
    let pages = sim.nodes[p].alloc(id, 0, 3).expect("prefill pages");
    let chunk = Chunk {
        pages,
        last: true,
        aux_slot: Some(room as u32),
        state_slot: None,
        layerwise: false,
        extras: vec![vec![4]],
    };
    sim.nodes[p]
        .endpoint
        .send_chunk(now, id, chunk)
        .expect("send chunk");
    sim.drain(p);
}

#[test]
fn a_decode_room_fed_by_two_ranks_state_shares_succeeds_when_both_landed() {
    let (mut sim, ps, ds) = state_cluster(2, 1, true);
    open_state_room(&mut sim, ds[0], &ps, 1, 1);
    send_state_room(&mut sim, ps[0], 1);
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, ps[0], 1), Some(KvPoll::Success));
    assert_ne!(
        state(&sim, ds[0], 1),
        Some(KvPoll::Success),
        "rank 1's heads and share of the state are missing"
    );
    send_state_room(&mut sim, ps[1], 1);
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, ds[0], 1), Some(KvPoll::Success));
    // Each rank's half of every conv part (3 rows) and of the SSM state, one unit each.
    let planned = |p: usize| sim.nodes[p].endpoint.counters().bytes_planned;
    let (_, parts) = state_item(2, 0);
    let state_bytes: u64 = parts
        .iter()
        .map(|p| u64::from(p.rows) * p.row_bytes())
        .sum();
    assert_eq!(planned(ps[0]), planned(ps[1]));
    assert!(planned(ps[0]) > state_bytes);
    assert_invariants(&sim);
}

#[test]
fn two_decode_ranks_each_take_their_share_of_the_state_from_one_prefill_rank() {
    let (mut sim, ps, ds) = state_cluster(1, 2, true);
    for &d in &ds {
        open_state_room(&mut sim, d, &ps, 2, 2);
    }
    send_state_room(&mut sim, ps[0], 2);
    run_ms(&mut sim, 50);
    for n in [ps[0], ds[0], ds[1]] {
        assert_eq!(state(&sim, n, 2), Some(KvPoll::Success), "node {n}");
    }
    assert_invariants(&sim);
}

#[test]
fn a_write_of_state_units_the_source_does_not_share_is_refused() {
    let (mut sim, ps, ds) = state_cluster(2, 1, true);
    open_state_room(&mut sim, ds[0], &ps, 3, 1);
    let (item, parts) = state_item(1, 0);
    let at = 9 * u64::from(item);
    let region = Region::Extra { pool: 0, tensor: 0 };
    // Rank 0 holds query units 0..2: its row lands at the part's start, 8 bytes.
    let theirs = Slice::run(region, 0, at + u64::from(parts[0].offset), 8);
    // Units 2..4 of the query channels are rank 1's.
    let others = Slice::run(region, 8, at + u64::from(parts[0].offset) + 8, 8);
    // A whole item from a rank that holds half of it.
    let whole = Slice::run(region, 0, at, u64::from(item));
    let session = sim.session(ds[0], ps[0]).expect("session");
    let now = sim.now;
    let d = &mut sim.nodes[ds[0]].endpoint;
    assert!(d
        .begin_write(now, session, RoomId(3), 0, std::slice::from_ref(&theirs))
        .is_ok());
    for bad in [others, whole] {
        assert_eq!(
            d.begin_write(now, session, RoomId(3), 0, std::slice::from_ref(&bad))
                .err(),
            Some(WriteRefused::ItemNotGranted),
            "{bad:?}"
        );
    }
}

#[test]
fn peers_that_hold_other_heads_and_state_unsplit_are_refused_naming_its_size() {
    let (sim, ps, ds) = state_cluster(2, 1, false);
    assert_eq!(sim.session(ds[0], ps[0]), None);
    let named = |n: usize| {
        sim.nodes[n].count_events(|e| {
            matches!(e, Event::SessionRejected { reason: RejectReason::IncompatibleLayout(m), .. }
                if m.field == "extra_item_bytes")
        })
    };
    assert!(named(ps[0]) + named(ds[0]) >= 1);
}

#[test]
fn peers_whose_parts_differ_are_refused_naming_the_field() {
    let mut theirs = pool(1, 0, 4);
    theirs[0].parts[0][3].unit_bytes = 32;
    assert_eq!(
        ExtraPool::compatible(&pool(2, 0, 4), &theirs)
            .err()
            .map(|m| m.field),
        Some("extra_part_unit_bytes")
    );
    let mut fewer = pool(1, 0, 4);
    fewer[0].parts[0].pop();
    assert_eq!(
        ExtraPool::compatible(&pool(2, 0, 4), &fewer)
            .err()
            .map(|m| m.field),
        Some("extra_parts")
    );
}

#[test]
fn a_room_whose_sources_hold_only_some_of_its_state_fails_at_once() {
    // Both hold every KV head, but the prefill declares only rank 0 of 2's share of the state.
    let mut sim = Sim::new(13, Faults::default());
    let heads = heads_of(1, 0);
    let layout = Layout {
        page_bytes: 4 * heads.row_bytes() as u32,
        ..small_layout(512)
    };
    let mut node = |role: Role, extras: Vec<ExtraPool>| {
        let n = sim.nodes.len() as u64;
        let mut info = EndpointInfo::new(role, NodeId(3000 + n), Incarnation(90 + n), layout);
        info.heads = heads;
        info.token = b"sim-token".to_vec();
        info.extras = extras;
        sim.add_node(config(), info)
    };
    let p = node(Role::Prefill, pool(2, 0, 16));
    let d = node(Role::Decode, pool(1, 0, 16));
    sim.connect(d, p);
    run_ms(&mut sim, 5);
    open_state_room(&mut sim, d, &[p], 4, 1);
    assert_eq!(
        state(&sim, d, 4),
        Some(KvPoll::Failed(
            kvferry_core::FailureReason::IncompatiblePeer
        ))
    );
}

#[test]
fn an_endpoint_whose_own_parts_overlap_or_leave_their_item_is_refused_at_creation() {
    let (item, parts) = state_item(2, 0);
    let make = |parts: Vec<ItemPart>| {
        let mut info = EndpointInfo::new(Role::Decode, NodeId(1), Incarnation(1), small_layout(16));
        info.extras = vec![ExtraPool {
            items: 4,
            item_bytes: vec![item],
            parts: vec![parts],
        }];
        kvferry_core::Endpoint::new(config(), info, 1, std::time::Instant::now()).err()
    };
    assert!(make(parts.clone()).is_none());
    // The key channels' rows start where the query channels' do.
    let mut overlap = parts.clone();
    overlap[1].offset = overlap[0].offset;
    let err = make(overlap).expect("overlapping parts refused");
    assert_eq!(err.name, "extras");
    assert!(err.value.contains("overlap"), "{}", err.value);
    // A conv part with rows but no stride between them.
    let mut flat = parts.clone();
    flat[0].stride = 0;
    assert!(make(flat).is_some());
    let mut past = parts;
    past[3].offset = item;
    let err = make(past).expect("a part past its item refused");
    assert!(err.value.contains("not inside"), "{}", err.value);
}
