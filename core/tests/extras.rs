//! Extra pools that move with a room besides its KV pages (a model's recurrent state slots,
//! sliding-window pages with their own page size, indexer pages): planned item for item into
//! every tensor of the pool, required for the room's success, written only where granted,
//! and refused at the handshake when the peers' pools differ.

mod common;

use std::time::Duration;

use common::*;
use kvferry_core::plan::{plan_extras, OpLimits};
use kvferry_core::sim::{small_layout, Faults, Sim};
use kvferry_core::{
    ApiError, Chunk, EndpointInfo, Event, ExtraPool, FailureReason, Grant, Incarnation, KvPoll,
    NodeId, Region, RejectReason, Role, RoomId, Slice, WriteRefused,
};

const WIDE: OpLimits = OpLimits {
    max_bytes: u64::MAX,
    max_slices: u32::MAX,
};

/// A state pool (one slot per request, two tensors of different sizes) and a window pool
/// (pages of its own size, three tensors), `items` items each.
fn pools(items: u32) -> Vec<ExtraPool> {
    vec![
        ExtraPool {
            items,
            item_bytes: vec![48, 80],
            parts: Vec::new(),
        },
        ExtraPool {
            items,
            item_bytes: vec![256, 256, 256],
            parts: Vec::new(),
        },
    ]
}

/// One prefill and one decode, each registering `prefill` / `decode` extra pools.
fn pair_with(prefill: Vec<ExtraPool>, decode: Vec<ExtraPool>) -> (Sim, usize, usize) {
    let mut sim = Sim::new(17, Faults::default());
    let layout = small_layout(128);
    let mut node = |role: Role, extras: Vec<ExtraPool>| {
        let n = sim.nodes.len() as u64;
        let mut info = EndpointInfo::new(role, NodeId(500 + n), Incarnation(40 + n), layout);
        info.token = b"sim-token".to_vec();
        info.extras = extras;
        sim.add_node(config(), info)
    };
    let p = node(Role::Prefill, prefill);
    let d = node(Role::Decode, decode);
    sim.connect(d, p);
    run_ms(&mut sim, 5);
    (sim, p, d)
}

/// Prefill `p` (its sender open) sends the room's 4 pages in one chunk, with `extras` source items.
fn send_with(sim: &mut Sim, p: usize, room: u64, extras: Vec<Vec<u32>>) -> Result<(), ApiError> {
    let id = RoomId(room);
    let src = sim.nodes[p].alloc(id, 0, 4).expect("prefill pages");
    let chunk = Chunk {
        pages: src,
        last: true,
        aux_slot: Some(room as u32),
        state_slot: None,
        layerwise: false,
        extras,
    };
    let now = sim.now;
    let got = sim.nodes[p].endpoint.send_chunk(now, id, chunk);
    sim.drain(p);
    got
}

fn granting(extras: Vec<Vec<u32>>) -> impl FnOnce(Vec<u32>) -> Grant {
    move |dst| Grant {
        extras,
        ..Grant::new(dst, Some(1), None)
    }
}

fn kv_and_aux_bytes(pages: u64) -> u64 {
    let l = small_layout(1);
    pages * u64::from(l.page_bytes) * u64::from(l.layers) * u64::from(l.planes)
        + u64::from(l.aux_bytes)
}

#[test]
fn extra_items_move_with_the_room_into_every_tensor_of_their_pool() {
    let (mut sim, p, d) = pair_with(pools(64), pools(32));
    open_room_with(
        &mut sim,
        d,
        &[p],
        1,
        4,
        granting(vec![vec![5], vec![10, 11, 12]]),
    );
    send_with(&mut sim, p, 1, vec![vec![60], vec![3, 4, 40]]).expect("chunk");
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, d, 1), Some(KvPoll::Success));
    assert_eq!(state(&sim, p, 1), Some(KvPoll::Success));
    // One state slot of 48 + 80 bytes, three window pages in each of three 256-byte tensors.
    let extras = 48 + 80 + 3 * 3 * 256;
    assert_eq!(
        sim.nodes[p].endpoint.counters().bytes_planned,
        kv_and_aux_bytes(4) + extras
    );
    assert_invariants(&sim);
}

#[test]
fn extra_items_pair_by_position_and_coalesce_where_both_sides_run() {
    let ops = plan_extras(&pools(64), &Vec::new(), 1, &[3, 4, 40], &[10, 11, 12], WIDE);
    let slices: Vec<Slice> = ops.concat();
    let at = |tensor: u16, src: u64, dst: u64, items: u64| {
        Slice::run(
            Region::Extra { pool: 1, tensor },
            src * 256,
            dst * 256,
            items * 256,
        )
    };
    let want: Vec<Slice> = (0..3)
        .flat_map(|t| [at(t, 3, 10, 2), at(t, 40, 12, 1)])
        .collect();
    assert_eq!(slices, want);
}

#[test]
fn extra_slices_respect_the_operation_limits() {
    let limits = OpLimits {
        max_bytes: 512,
        max_slices: 2,
    };
    let src: Vec<u32> = (0..8).collect();
    let ops = plan_extras(&pools(64), &Vec::new(), 1, &src, &src, limits);
    // 8 pages of 256 bytes in each of 3 tensors, at most 2 pages (512 bytes) an operation.
    assert_eq!(ops.len(), 12);
    assert!(ops
        .iter()
        .all(|op| op.iter().map(|s| s.len).sum::<u64>() <= 512 && op.len() <= 2));
}

#[test]
fn a_source_holding_other_than_the_granted_item_count_fails_the_room() {
    let (mut sim, p, d) = pair_with(pools(64), pools(32));
    open_room_with(
        &mut sim,
        d,
        &[p],
        2,
        4,
        granting(vec![vec![5], vec![10, 11, 12]]),
    );
    // The window pool: the decode asked for three pages, this prefill holds two.
    send_with(&mut sim, p, 2, vec![vec![60], vec![3, 4]]).expect("chunk");
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, p, 2), failed(FailureReason::GrantMismatch));
    assert_eq!(state(&sim, d, 2), failed(FailureReason::GrantMismatch));
}

#[test]
fn a_room_that_asks_no_extra_items_moves_only_its_pages() {
    let (mut sim, p, d) = pair_with(pools(64), pools(32));
    open_room_with(&mut sim, d, &[p], 3, 4, granting(Vec::new()));
    send_with(&mut sim, p, 3, vec![vec![60], vec![3, 4, 40]]).expect("chunk");
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, d, 3), Some(KvPoll::Success));
    assert_eq!(
        sim.nodes[p].endpoint.counters().bytes_planned,
        kv_and_aux_bytes(4)
    );
}

#[test]
fn a_grant_of_an_item_outside_its_pool_is_refused() {
    let (mut sim, p, d) = pair_with(pools(64), pools(32));
    let now = sim.now;
    let session = sim.session(d, p).expect("session");
    let grant = Grant {
        extras: vec![vec![5], vec![31, 32]],
        ..Grant::new(vec![0], Some(1), None)
    };
    let got = sim.nodes[d]
        .endpoint
        .open_receiver(now, RoomId(4), 0, &[session], Some(grant));
    assert_eq!(
        got.err(),
        Some(ApiError::ExtraOutOfRange {
            pool: 1,
            item: 32,
            items: 32
        })
    );
    let grant = Grant {
        extras: vec![vec![], vec![], vec![0]],
        ..Grant::new(vec![0], Some(1), None)
    };
    let got = sim.nodes[d]
        .endpoint
        .open_receiver(now, RoomId(4), 0, &[session], Some(grant));
    assert!(matches!(
        got,
        Err(ApiError::ExtraOutOfRange { pool: 2, .. })
    ));
}

#[test]
fn a_chunk_naming_an_item_outside_its_pool_is_refused() {
    let (mut sim, p, d) = pair_with(pools(64), pools(32));
    open_room_with(&mut sim, d, &[p], 5, 4, granting(vec![vec![5]]));
    let got = send_with(&mut sim, p, 5, vec![vec![64]]);
    assert_eq!(
        got.err(),
        Some(ApiError::ExtraOutOfRange {
            pool: 0,
            item: 64,
            items: 64
        })
    );
}

#[test]
fn a_write_outside_the_granted_items_is_refused() {
    // Window pool, tensor 2: the room granted items 10..=12 of 256 bytes.
    let cases = [
        (10 * 256, 256, true),
        (11 * 256, 512, true),
        (12 * 256, 512, false),
        (9 * 256, 256, false),
        (10 * 256 + 8, 256, false),
        (10 * 256, 100, false),
    ];
    for (i, (offset, len, admitted)) in cases.into_iter().enumerate() {
        let room = 10 + i as u64;
        let (mut sim, p, d) = pair_with(pools(64), pools(32));
        open_room_with(
            &mut sim,
            d,
            &[p],
            room,
            4,
            granting(vec![vec![5], vec![10, 11, 12]]),
        );
        let session = sim.session(d, p).expect("session");
        let slice = [Slice::run(
            Region::Extra { pool: 1, tensor: 2 },
            0,
            offset,
            len,
        )];
        let now = sim.now;
        let got = sim.nodes[d]
            .endpoint
            .begin_write(now, session, RoomId(room), 0, &slice);
        if admitted {
            assert!(got.is_ok(), "offset {offset} len {len}: {got:?}");
        } else {
            assert_eq!(
                got.err(),
                Some(WriteRefused::ItemNotGranted),
                "offset {offset} len {len}"
            );
        }
    }
}

#[test]
fn a_peer_whose_extra_pools_differ_is_refused_naming_both_values() {
    let mut theirs = pools(32);
    theirs[1].item_bytes[2] = 128;
    let (mut sim, p, d) = pair_with(pools(64), theirs);
    sim.run_for(Duration::from_millis(5), 10_000)
        .expect("handshake");
    let named = |n: usize| {
        sim.nodes[n].count_events(|e| {
            matches!(e, Event::SessionRejected { reason: RejectReason::IncompatibleLayout(m), .. }
                if m.field == "extra_item_bytes" && m.ours + m.theirs == 384)
        })
    };
    assert!(named(p) + named(d) >= 1);
    assert_eq!(sim.session(d, p), None);
}

#[test]
fn a_peer_without_the_extra_pools_is_refused() {
    let (mut sim, p, d) = pair_with(pools(64), Vec::new());
    sim.run_for(Duration::from_millis(5), 10_000)
        .expect("handshake");
    let named = |n: usize| {
        sim.nodes[n].count_events(|e| {
            matches!(e, Event::SessionRejected { reason: RejectReason::IncompatibleLayout(m), .. }
                if m.field == "extra_pools" && m.ours + m.theirs == 2)
        })
    };
    assert!(named(p) + named(d) >= 1);
    assert_eq!(sim.session(d, p), None);
}

/// Decode `d` applies writes of `slices` from `p`'s session into `room`, then hears `p` say
/// the room succeeded.
fn write_then_success(sim: &mut Sim, d: usize, p: usize, room: u64, slices: &[Slice]) {
    let session = sim.session(d, p).expect("session");
    let now = sim.now;
    for slice in slices {
        let permit = sim.nodes[d]
            .endpoint
            .begin_write(now, session, RoomId(room), 0, std::slice::from_ref(slice))
            .expect("write admitted");
        sim.nodes[d]
            .endpoint
            .end_write(now, permit.applied(), std::slice::from_ref(slice));
    }
    let mut frame = Vec::new();
    kvferry_core::codec::Message::RoomStatus {
        room: RoomId(room),
        generation: 0,
        failure: None,
    }
    .encode(&mut frame);
    sim.nodes[d].endpoint.handle_input(now, session, &frame);
    sim.drain(d);
}

/// Every KV page and the aux row of a 4-page room granted `dst` and aux row 1.
fn pages_and_aux(dst: &[u32]) -> Vec<Slice> {
    let l = small_layout(1);
    let page = u64::from(l.page_bytes);
    let mut out = Vec::new();
    for layer in 0..l.layers {
        for plane in 0..l.planes {
            for &p in dst {
                out.push(Slice::run(
                    Region::Kv { layer, plane },
                    0,
                    u64::from(p) * page,
                    page,
                ));
            }
        }
    }
    out.push(Slice::run(
        Region::Aux,
        0,
        u64::from(l.aux_bytes),
        u64::from(l.aux_bytes),
    ));
    out
}

/// The state slot's two tensors, item 5.
fn state_slot_5() -> Vec<Slice> {
    [48u64, 80]
        .iter()
        .enumerate()
        .map(|(t, &b)| {
            Slice::run(
                Region::Extra {
                    pool: 0,
                    tensor: t as u16,
                },
                0,
                5 * b,
                b,
            )
        })
        .collect()
}

#[test]
fn a_success_word_before_the_extra_items_landed_fails_the_room() {
    let (mut sim, p, d) = pair_with(pools(64), pools(32));
    let dst = open_receiver_with(&mut sim, d, &[p], 20, 4, granting(vec![vec![5]]));
    run_ms(&mut sim, 5);
    // Every page and the aux row landed; one of the state slot's tensors did not.
    let mut slices = pages_and_aux(&dst);
    slices.push(state_slot_5()[0]);
    write_then_success(&mut sim, d, p, 20, &slices);
    assert_eq!(state(&sim, d, 20), failed(FailureReason::ProtocolError));
}

#[test]
fn a_success_word_after_every_extra_item_landed_succeeds() {
    let (mut sim, p, d) = pair_with(pools(64), pools(32));
    let dst = open_receiver_with(&mut sim, d, &[p], 21, 4, granting(vec![vec![5]]));
    run_ms(&mut sim, 5);
    let mut slices = pages_and_aux(&dst);
    slices.extend(state_slot_5());
    write_then_success(&mut sim, d, p, 21, &slices);
    assert_eq!(state(&sim, d, 21), Some(KvPoll::Success));
}
