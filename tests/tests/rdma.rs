//! The RDMA data plane end to end (feature `rdma`, each test on the tokio driver and on the
//! glommio driver, plus a tokio node and a glommio node together): rooms move as one-sided
//! RDMA WRITEs between two nodes on this host's first RDMA device, every byte verified, the
//! fence (QP to the error state, then drained) releasing aborted rooms' pages. On a host
//! without a device each test checks the typed refusal and says SKIPPED; `scripts/rdma-check.sh`
//! runs them where a device exists.
#![cfg(feature = "rdma")]
#![allow(clippy::unwrap_used)] // tests may panic

use std::sync::Arc;
use std::time::Duration;

use kvferry_core::{Config, Role};
use kvferry_memory::HostCopyEngine;
use kvferry_memory::MemoryMap;
use kvferry_testkit::{run_pair, DecodeRun, Node, Runtime, Shape};
use kvferry_tests::{
    assert_all_clean, device_memory, fast_core, rdma_config, rooms, staged_core, GLOMMIO,
};

/// Every test runs on both drivers: the RDMA data plane is the driver's, whatever the
/// runtime.
const RUNTIMES: [Runtime; 2] = [Runtime::Tokio, GLOMMIO];

fn start_rdma(
    rt: Runtime,
    role: Role,
    shape: &Shape,
    core: Config,
    seed: u64,
) -> Result<Node, String> {
    start_over(rt, role, shape, core, seed, host_memory(shape))
}

fn host_memory(shape: &Shape) -> Arc<MemoryMap> {
    Arc::new(MemoryMap::allocate(shape.layout()))
}

/// A node of `role` on `rt` over RDMA with `memory`.
fn start_over(
    rt: Runtime,
    role: Role,
    shape: &Shape,
    core: Config,
    seed: u64,
    memory: Arc<MemoryMap>,
) -> Result<Node, String> {
    let cfg = rdma_config(role, shape, core, seed);
    rt.start(cfg, memory).map_err(|e| e.to_string())
}

/// Both nodes over RDMA, or `None` (with the reason printed and checked) where the host has
/// no usable device.
fn pair_or_skip(rt: Runtime, shape: &Shape) -> Option<(Node, Node)> {
    started_or_skip(
        start_rdma(rt, Role::Prefill, shape, fast_core(), 1),
        start_rdma(rt, Role::Decode, shape, fast_core(), 2),
    )
}

/// Both nodes, or `None` (with the reason printed and checked) where the host has no usable
/// device.
fn started_or_skip(
    prefill: Result<Node, String>,
    decode: Result<Node, String>,
) -> Option<(Node, Node)> {
    match (prefill, decode) {
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
    for rt in RUNTIMES {
        eprintln!("{}", rt.name());
        let run = rooms(120, 1);
        let Some((prefill, decode)) = pair_or_skip(rt, &run.shape) else {
            return;
        };
        let report = run_pair(&prefill, &decode, run).await.unwrap();
        assert_eq!(report.backend, "rdma");
        assert_all_clean(&report, 120);
        assert_eq!(report.pages_verified, 120 * 8 * 4 * 2);
        assert_eq!(
            (report.prefill_path.as_str(), report.decode_path.as_str()),
            ("rdma", "rdma")
        );
    }
}

/// With the end-to-end checksum, every one-sided operation's source hash travels to decode,
/// which hashes the landed bytes before the room may succeed: every room succeeds with every
/// byte verified, and decode counts one passed check per operation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rooms_move_over_rdma_under_the_checksum_with_every_operation_checked_on_landing() {
    for rt in RUNTIMES {
        eprintln!("{}", rt.name());
        let run = rooms(100, 1);
        let checked = || Config {
            checksum: true,
            ..fast_core()
        };
        let Some((prefill, decode)) = started_or_skip(
            start_rdma(rt, Role::Prefill, &run.shape, checked(), 1),
            start_rdma(rt, Role::Decode, &run.shape, checked(), 2),
        ) else {
            return;
        };
        let report = run_pair(&prefill, &decode, run).await.unwrap();
        assert_eq!(
            (report.prefill_path.as_str(), report.decode_path.as_str()),
            ("rdma", "rdma")
        );
        assert_all_clean(&report, 100);
        let (pc, dc) = (prefill.counters().await, decode.counters().await);
        assert!(
            dc.landed_checks_passed >= 100,
            "checks passed: {}",
            dc.landed_checks_passed
        );
        assert_eq!(
            dc.landed_checks_passed, pc.ops_planned,
            "one check per operation"
        );
        assert_eq!(dc.protocol_errors, 0);
    }
}

/// A bit flipped on its way in a few writes (the prefill flips it in the source after hashing,
/// before the NIC reads it): under the checksum exactly the rooms hit fail with
/// `checksum_mismatch`, every other room succeeds, and no page is left corrupted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bit_flipped_in_an_rdma_write_fails_its_room_with_checksum_mismatch() {
    for rt in RUNTIMES {
        eprintln!("{}", rt.name());
        let report = flipped_bits(rt, true).await;
        let Some(report) = report else { return };
        let failed = report.failed_by_reason.get("checksum_mismatch").copied();
        eprintln!(
            "checksum on: {failed:?} rooms failed checksum_mismatch, {} succeeded, {} pages corrupted",
            report.rooms_succeeded, report.pages_corrupted
        );
        assert!(failed.unwrap_or(0) >= 1, "{report:?}");
        assert_eq!(report.failed_by_reason.len(), 1, "{report:?}");
        assert_eq!(report.rooms_succeeded + failed.unwrap_or(0), 100);
        assert_eq!(
            (report.pages_corrupted, report.rooms_unfinished),
            (0, 0),
            "{report:?}"
        );
    }
}

/// The same flips without the checksum: one-sided writes are never seen landing, so the rooms
/// succeed on the source's word and their pages (or the auxiliary data a hit write carried)
/// hold the flipped bit (the check can fail).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_checksum_a_bit_flipped_in_an_rdma_write_lands_as_a_corrupted_page() {
    for rt in RUNTIMES {
        eprintln!("{}", rt.name());
        let Some(report) = flipped_bits(rt, false).await else {
            return;
        };
        eprintln!(
            "checksum off: {} rooms succeeded, {} pages and {} aux corrupted",
            report.rooms_succeeded, report.pages_corrupted, report.aux_corrupted
        );
        assert_eq!(report.rooms_succeeded, 100, "{report:?}");
        assert!(
            report.pages_corrupted + report.aux_corrupted >= 1,
            "{report:?}"
        );
    }
}

/// 100 rooms over RDMA with bit flips injected into about 3 % of the writes.
async fn flipped_bits(rt: Runtime, checksum: bool) -> Option<kvferry_testkit::Report> {
    let run = rooms(100, 1);
    let core = || Config {
        checksum,
        ..fast_core()
    };
    let (prefill, decode) = started_or_skip(
        start_rdma(rt, Role::Prefill, &run.shape, core(), 1),
        start_rdma(rt, Role::Decode, &run.shape, core(), 2),
    )?;
    prefill
        .set_faults(Some(kvferry_tokio::FaultPlan {
            rate: 0.03,
            seed: 11,
            kind: kvferry_tokio::FaultKind::FlipBit,
        }))
        .await;
    Some(run_pair(&prefill, &decode, run).await.unwrap())
}

/// Device memory whose engine exports no dma-buf (the host engine; on soft-RoCE the NIC could
/// not register one either): the node starts, says why it stages, and every session of it
/// moves over TCP staged through host buffers; its RDMA peer hears it and follows. Every
/// byte verified, whichever side holds the device memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_memory_the_nic_cannot_register_moves_staged_over_tcp() {
    for rt in RUNTIMES {
        eprintln!("{}", rt.name());
        for device_side in [Role::Decode, Role::Prefill] {
            let shape = kvferry_tests::small_shape();
            let device = || device_memory(HostCopyEngine::new(Duration::ZERO), 4, 8192);
            let memory = |role| {
                if role == device_side {
                    device()
                } else {
                    host_memory(&shape)
                }
            };
            let Some((prefill, decode)) = started_or_skip(
                start_over(
                    rt,
                    Role::Prefill,
                    &shape,
                    staged_core(),
                    1,
                    memory(Role::Prefill),
                ),
                start_over(
                    rt,
                    Role::Decode,
                    &shape,
                    staged_core(),
                    2,
                    memory(Role::Decode),
                ),
            ) else {
                return;
            };
            let report = run_pair(&prefill, &decode, rooms(50, 1)).await.unwrap();
            assert_all_clean(&report, 50);
            assert_eq!(report.pages_verified, 50 * 8 * 4 * 2);
            let want = match device_side {
                Role::Decode => ("tcp", "tcp_staged"),
                Role::Prefill => ("tcp_staged", "tcp"),
            };
            let got = (report.prefill_path.as_str(), report.decode_path.as_str());
            assert_eq!(got, want, "{device_side:?}");
        }
    }
}

/// A tokio node and a glommio node, both over RDMA, move rooms to each other over RDMA,
/// every byte verified: the RDMA hello and the one-sided path are the same on both drivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokio_node_and_a_glommio_node_move_rooms_over_rdma() {
    for (p, d) in [(Runtime::Tokio, GLOMMIO), (GLOMMIO, Runtime::Tokio)] {
        eprintln!("{} -> {}", p.name(), d.name());
        let run = rooms(100, 1);
        let Some((prefill, decode)) = started_or_skip(
            start_rdma(p, Role::Prefill, &run.shape, fast_core(), 1),
            start_rdma(d, Role::Decode, &run.shape, fast_core(), 2),
        ) else {
            return;
        };
        let report = run_pair(&prefill, &decode, run).await.unwrap();
        assert_all_clean(&report, 100);
        assert_eq!(
            (report.prefill_path.as_str(), report.decode_path.as_str()),
            ("rdma", "rdma")
        );
    }
}

/// An RDMA prefill and a decode configured for TCP: the decode says so, and the session moves
/// over TCP rather than waiting for a hello that never comes.
/// Where this host has a usable RDMA device: `list_devices` finds one.
fn rdma_here() -> bool {
    kvferry_rdma::device::list_devices().is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_nodes_move_over_rdma_where_the_host_can_and_over_tcp_where_it_cannot() {
    let want = if rdma_here() { "rdma" } else { "tcp" };
    if std::env::var_os("KVFERRY_REQUIRE_RDMA").is_some() {
        assert_eq!(
            want, "rdma",
            "KVFERRY_REQUIRE_RDMA is set and no device is found"
        );
    }
    for rt in RUNTIMES {
        let shape = kvferry_tests::small_shape();
        let auto = |role, seed| {
            let mut cfg = rdma_config(role, &shape, fast_core(), seed);
            cfg.backend = kvferry_testkit::DataBackend::Auto {
                device: None,
                port: 1,
            };
            rt.start(cfg, host_memory(&shape)).unwrap()
        };
        let (prefill, decode) = (auto(Role::Prefill, 1), auto(Role::Decode, 2));
        let report = run_pair(&prefill, &decode, rooms(30, 1)).await.unwrap();
        assert_all_clean(&report, 30);
        let got = (report.prefill_path.as_str(), report.decode_path.as_str());
        assert_eq!(got, (want, want), "{}", rt.name());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rdma_node_refuses_to_start_where_the_host_cannot_naming_why() {
    if rdma_here() {
        // The guest's device: every other test here covers the nodes that start.
        assert!(start_rdma(
            Runtime::Tokio,
            Role::Decode,
            &kvferry_tests::small_shape(),
            fast_core(),
            1
        )
        .is_ok());
        return;
    }
    for rt in RUNTIMES {
        let why = start_rdma(
            rt,
            Role::Decode,
            &kvferry_tests::small_shape(),
            fast_core(),
            1,
        )
        .err()
        .unwrap();
        assert!(
            why.contains("RDMA") && why.contains("--backend tcp"),
            "{why}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rdma_node_and_a_tcp_node_move_rooms_over_tcp() {
    kvferry_tests::log_if_asked();
    for rt in RUNTIMES {
        eprintln!("{}", rt.name());
        let shape = kvferry_tests::small_shape();
        let cfg = kvferry_testkit::node_config(Role::Decode, &shape, fast_core(), b"test-token", 2);
        // On the other runtime: the two drivers agree on the data path too.
        let other = if rt == Runtime::Tokio {
            GLOMMIO
        } else {
            Runtime::Tokio
        };
        let tcp_decode = other
            .start(cfg, host_memory(&shape))
            .map_err(|e| e.to_string());
        let Some((prefill, decode)) = started_or_skip(
            start_rdma(rt, Role::Prefill, &shape, fast_core(), 1),
            tcp_decode,
        ) else {
            return;
        };
        let report = run_pair(&prefill, &decode, rooms(50, 1)).await.unwrap();
        assert_all_clean(&report, 50);
        let got = (report.prefill_path.as_str(), report.decode_path.as_str());
        assert_eq!(got, ("tcp", "tcp"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_rooms_over_rdma_give_their_pages_back_clean() {
    for rt in RUNTIMES {
        eprintln!("{}", rt.name());
        let run = DecodeRun {
            abort_rate: 0.5,
            seed: 3,
            ..rooms(120, 1)
        };
        let Some((prefill, decode)) = pair_or_skip(rt, &run.shape) else {
            return;
        };
        let report = run_pair(&prefill, &decode, run).await.unwrap();
        assert_eq!(
            (report.pages_corrupted, report.rooms_unfinished),
            (0, 0),
            "{report:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layerwise_rooms_move_over_rdma() {
    for rt in RUNTIMES {
        eprintln!("{}", rt.name());
        let run = DecodeRun {
            shape: Shape {
                layerwise: true,
                layer_compute: std::time::Duration::from_micros(300),
                chunks: 2,
                ..kvferry_tests::small_shape()
            },
            ..rooms(60, 1)
        };
        let Some((prefill, decode)) = pair_or_skip(rt, &run.shape) else {
            return;
        };
        let report = run_pair(&prefill, &decode, run).await.unwrap();
        assert_all_clean(&report, 60);
        assert_eq!(decode.backend(), "rdma");
    }
}

/// A write the peer's device refuses (it names a key the peer never registered, as when the
/// peer's memory went away) fails its room, with the refusal as the reason, and puts its
/// queue pair in the error state mid-room: the QP's other writes flush, a new QP and hello
/// replace it, and the core retries them there. Every room ends and no page is corrupted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_write_fails_its_room_and_the_flushed_writes_are_retried_on_a_new_queue_pair() {
    kvferry_tests::log_if_asked();
    // One glommio shard: two shards split the rooms over two queue pairs, and a refused
    // write then often has no other write outstanding behind it to flush.
    let one_shard = Runtime::Glommio {
        shards: 1,
        pin: false,
    };
    // Only writes posted behind the refused one flush, and whether one is queued there when
    // the device refuses it is the device's timing: on soft-RoCE a run had at times nothing
    // behind any refused write. So up to three runs with other refused writes, each on a
    // fresh pair: every run must end every room clean, and at least one must have flushed
    // writes to retry.
    const RUNS: u64 = 3;
    for rt in [Runtime::Tokio, one_shard] {
        eprintln!("{}", rt.name());
        let mut retried = Vec::new();
        for k in 0..RUNS {
            let run = rooms(100, 1);
            let Some((prefill, decode)) = pair_or_skip(rt, &run.shape) else {
                return;
            };
            prefill
                .set_faults(Some(kvferry_tokio::FaultPlan {
                    rate: 0.02,
                    seed: 7 + k,
                    kind: kvferry_tokio::FaultKind::Break,
                }))
                .await;
            let report = run_pair(&prefill, &decode, run).await.unwrap();
            assert_eq!(
                (report.pages_corrupted, report.rooms_unfinished),
                (0, 0),
                "{report:?}"
            );
            // The prefill saw its write refused by its peer; decode hears that reason. No
            // other room fails: a flushed write is its neighbour's failure, not its own.
            assert!(
                report
                    .failed_by_reason
                    .keys()
                    .all(|reason| reason == "aborted_by_peer"),
                "{report:?}"
            );
            assert!(report.rooms_succeeded > 0, "{report:?}");
            retried.push(report.retries);
            if report.retries > 0 {
                break;
            }
        }
        eprintln!("retries per run: {retried:?}");
        assert!(
            retried.iter().any(|&r| r > 0),
            "no flushed write was retried in {RUNS} runs: {retried:?}"
        );
    }
}

/// The completion pollers of a glommio node (a thread per live queue pair, blocked in
/// `poll(2)`) end with the node, even when it is dropped with its sessions open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_glommio_nodes_completion_pollers_end_with_the_node() {
    let pollers = || {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|name| name.trim() == "kvferry-cq-poll")
            .count()
    };
    let before = pollers();
    {
        let run = rooms(20, 1);
        let Some((prefill, decode)) = pair_or_skip(GLOMMIO, &run.shape) else {
            return;
        };
        // Rooms move, then the nodes are dropped with their sessions open (no shutdown).
        let addrs = prefill
            .listen("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let shape = run.shape.clone();
        let server = tokio::spawn(kvferry_testkit::serve_prefill(prefill.clone(), shape));
        let peer = decode.connect(addrs).await.unwrap();
        let report = kvferry_testkit::run_decode(&decode, peer, run).await;
        assert_eq!(report.rooms_succeeded, 20, "{report:?}");
        assert!(pollers() > before, "each live queue pair has its poller");
        server.abort();
        let _ = server.await;
    }
    // Every clone of both nodes is gone: their pollers end (bounded wait, not a timing).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while pollers() > before && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        pollers(),
        before,
        "pollers left after the nodes were dropped"
    );
}
