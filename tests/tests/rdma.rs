//! The RDMA data plane end to end (feature `rdma`, tokio driver): rooms move as one-sided
//! RDMA WRITEs between two nodes on this host's first RDMA device, every byte verified, the
//! fence (QP to the error state, then drained) releasing aborted rooms' pages. On a host
//! without a device each test checks the typed refusal and says SKIPPED; `scripts/rdma-check.sh`
//! runs them where a device exists.
#![cfg(feature = "rdma")]
#![allow(clippy::unwrap_used)] // tests may panic

use std::sync::Arc;

use kvferry_core::{Config, Role};
use kvferry_memory::MemoryMap;
use kvferry_testkit::{run_pair, AnyNode, DecodeRun, Runtime, Shape};
use kvferry_tests::{assert_all_clean, fast_core, rdma_config, rooms, KvNode};

fn start_rdma(role: Role, shape: &Shape, core: Config, seed: u64) -> Result<AnyNode, String> {
    let cfg = rdma_config(role, shape, core, seed);
    Runtime::Tokio
        .start(cfg, Arc::new(MemoryMap::allocate(shape.layout())))
        .map_err(|e| e.to_string())
}

/// Both nodes over RDMA, or `None` (with the reason printed and checked) where the host has
/// no usable device.
fn pair_or_skip(shape: &Shape) -> Option<(AnyNode, AnyNode)> {
    match (
        start_rdma(Role::Prefill, shape, fast_core(), 1),
        start_rdma(Role::Decode, shape, fast_core(), 2),
    ) {
        (Ok(p), Ok(d)) => Some((p, d)),
        (Err(why), _) | (_, Err(why)) => {
            assert!(
                std::env::var_os("KVFERRY_REQUIRE_RDMA").is_none(),
                "KVFERRY_REQUIRE_RDMA is set and no RDMA node starts: {why}"
            );
            eprintln!("SKIPPED (no usable RDMA device here): {why}");
            assert!(
                why.contains("--backend tcp"),
                "the refusal offers TCP: {why}"
            );
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rooms_move_over_rdma_with_every_byte_verified() {
    let run = rooms(300, 1);
    let Some((prefill, decode)) = pair_or_skip(&run.shape) else {
        return;
    };
    let report = run_pair(&prefill, &decode, run).await.unwrap();
    assert_eq!(report.backend, "rdma");
    assert_all_clean(&report, 300);
    assert_eq!(report.pages_verified, 300 * 8 * 4 * 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_rooms_over_rdma_give_their_pages_back_clean() {
    let run = DecodeRun {
        abort_rate: 0.5,
        seed: 3,
        ..rooms(300, 1)
    };
    let Some((prefill, decode)) = pair_or_skip(&run.shape) else {
        return;
    };
    let report = run_pair(&prefill, &decode, run).await.unwrap();
    assert_eq!(
        (report.pages_corrupted, report.rooms_unfinished),
        (0, 0),
        "{report:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layerwise_rooms_move_over_rdma() {
    let run = DecodeRun {
        shape: Shape {
            layerwise: true,
            layer_compute: std::time::Duration::from_micros(300),
            chunks: 2,
            ..kvferry_tests::small_shape()
        },
        ..rooms(60, 1)
    };
    let Some((prefill, decode)) = pair_or_skip(&run.shape) else {
        return;
    };
    let report = run_pair(&prefill, &decode, run).await.unwrap();
    assert_all_clean(&report, 60);
    assert_eq!(decode.backend(), "rdma");
}

/// A write the peer's device refuses (it names a key the peer never registered, as when the
/// peer's memory went away) fails its room, with the refusal as the reason, and puts its
/// queue pair in the error state mid-room: the QP's other writes flush, a new QP and hello
/// replace it, and the core retries them there. Every room ends and no page is corrupted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_write_fails_its_room_and_the_flushed_writes_are_retried_on_a_new_queue_pair() {
    let run = rooms(100, 1);
    let Some((prefill, decode)) = pair_or_skip(&run.shape) else {
        return;
    };
    prefill
        .set_faults(Some(kvferry_tokio::FaultPlan {
            rate: 0.02,
            seed: 7,
        }))
        .await;
    let report = run_pair(&prefill, &decode, run).await.unwrap();
    assert_eq!(
        (report.pages_corrupted, report.rooms_unfinished),
        (0, 0),
        "{report:?}"
    );
    // The prefill saw its write refused by its peer; decode hears that reason.
    let reasons: Vec<&String> = report.failed_by_reason.keys().collect();
    assert_eq!(reasons, ["aborted_by_peer"], "{report:?}");
    assert!(
        report.retries > 0,
        "flushed writes were retried: {report:?}"
    );
    assert!(report.rooms_succeeded > 0, "{report:?}");
}
