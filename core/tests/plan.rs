//! Transfer planning: coalesced runs, per-layer order, bounded operations, aux last.

use kvferry_core::plan::{plan_aux, plan_kv, OpLimits};
use kvferry_core::sim::small_layout;
use kvferry_core::{Region, Slice};

const WIDE: OpLimits = OpLimits {
    max_bytes: u64::MAX,
    max_slices: u32::MAX,
};

#[test]
fn contiguous_pages_on_both_sides_become_one_slice_per_region() {
    let l = small_layout(1024);
    let ops = plan_kv(&l, 0..1, &[10, 11, 12, 13], &[50, 51, 52, 53], WIDE);
    assert_eq!(ops.len(), 1);
    assert_eq!(
        ops[0],
        vec![
            Slice::run(
                Region::Kv { layer: 0, plane: 0 },
                10 * 1024,
                50 * 1024,
                4 * 1024
            ),
            Slice::run(
                Region::Kv { layer: 0, plane: 1 },
                10 * 1024,
                50 * 1024,
                4 * 1024
            ),
        ]
    );
}

#[test]
fn a_break_on_either_side_starts_a_new_run() {
    let l = small_layout(1024);
    let ops = plan_kv(&l, 0..1, &[1, 2, 3, 7], &[4, 5, 9, 10], WIDE);
    let lens: Vec<u64> = ops[0]
        .iter()
        .filter(|s| s.region == Region::Kv { layer: 0, plane: 0 })
        .map(|s| s.len / 1024)
        .collect();
    assert_eq!(lens, vec![2, 1, 1]);
}

#[test]
fn slices_are_ordered_by_layer_then_plane() {
    let l = small_layout(1024);
    let ops = plan_kv(&l, 1..3, &[0], &[0], WIDE);
    let regions: Vec<Region> = ops[0].iter().map(|s| s.region).collect();
    assert_eq!(
        regions,
        vec![
            Region::Kv { layer: 1, plane: 0 },
            Region::Kv { layer: 1, plane: 1 },
            Region::Kv { layer: 2, plane: 0 },
            Region::Kv { layer: 2, plane: 1 },
        ]
    );
}

#[test]
fn operations_respect_slice_and_byte_bounds() {
    let l = small_layout(8192);
    let src: Vec<u32> = (0..4096).map(|i| i * 2).collect();
    let dst: Vec<u32> = (0..4096).collect();
    let limits = OpLimits {
        max_bytes: 1 << 20,
        max_slices: 100,
    };
    let ops = plan_kv(&l, 0..4, &src, &dst, limits);
    assert!(ops.iter().all(|op| op.len() <= 100));
    assert!(ops
        .iter()
        .all(|op| op.iter().map(|s| s.len).sum::<u64>() <= 1 << 20));
    let total: u64 = ops.iter().flatten().map(|s| s.len).sum();
    assert_eq!(
        total,
        4096 * 1024 * 8,
        "every page of every layer and plane, once"
    );
}

#[test]
fn a_run_longer_than_an_operation_is_split_at_page_boundaries() {
    let l = small_layout(8192);
    let pages: Vec<u32> = (0..1000).collect();
    let ops = plan_kv(
        &l,
        0..1,
        &pages,
        &pages,
        OpLimits {
            max_bytes: 64 * 1024,
            max_slices: 4096,
        },
    );
    assert!(ops
        .iter()
        .flatten()
        .all(|s| s.len <= 64 * 1024 && s.len % 1024 == 0));
}

#[test]
fn aux_and_state_slices_use_their_slots() {
    let mut l = small_layout(16);
    l.state_bytes = 256;
    let s = plan_aux(&l, Some(2), Some(7), Some(1), Some(3));
    assert_eq!(s[0], Slice::run(Region::Aux, 128, 448, 64));
    assert_eq!(s[1], Slice::run(Region::State, 256, 768, 256));
    assert!(plan_aux(&l, None, Some(1), None, None).is_empty());
}
