//! The same-host path end to end (cross-memory attach): a prefill and a decode of one process
//! share its host, so with `SameHost::Auto` on both sides the prefill copies each operation
//! straight into the decode's memory. Every byte verified, on every driver. The driver suites
//! run over it as well (`KVFERRY_TEST_BACKEND=same_host`, in CI); these are the scenarios
//! that are about the path itself: who takes it, the checksum, fences and fallbacks.
#![allow(clippy::unwrap_used)] // tests may panic

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_core::{Config, FailureReason, Grant, KvPoll, Role, RoomId};
use kvferry_memory::{HostCopyEngine, MemoryMap};
use kvferry_testkit::{node_config, path_label, run_pair, Node, Report, SameHost, Shape};
use kvferry_tests::proxy::FaultProxy;
use kvferry_tests::{
    assert_all_clean, device_memory, fast_core, on_every_driver, rooms, small_shape, staged_core,
    Runtime,
};
use kvferry_tokio::{FaultKind, FaultPlan};

/// A node of `role` on `rt` whose sessions with peers on this host take the same-host path
/// where `same_host` says so.
fn start(
    rt: Runtime,
    role: Role,
    shape: &Shape,
    core: Config,
    seed: u64,
    same_host: SameHost,
) -> Node {
    let mut cfg = node_config(role, shape, core, b"test-token", seed);
    cfg.same_host = same_host;
    rt.start(cfg, Arc::new(MemoryMap::allocate(shape.layout())))
        .unwrap()
}

/// A node of `role` on `rt` over `memory`, taking the same-host path where it can.
fn start_over(rt: Runtime, role: Role, core: Config, seed: u64, memory: Arc<MemoryMap>) -> Node {
    let mut cfg = node_config(role, &small_shape(), core, b"test-token", seed);
    cfg.same_host = SameHost::Auto;
    rt.start(cfg, memory).unwrap()
}

/// Device memory (KV on "CUDA device 0", metadata in host memory) reached through the host
/// copy engine, whose exports map only in this process: both nodes of a test share it.
fn device() -> Arc<MemoryMap> {
    device_memory(HostCopyEngine::new(Duration::ZERO), 4, 8192)
}

/// Both sides with `same_host` each, `run` moved end to end.
async fn pair(
    p: Runtime,
    d: Runtime,
    core: Config,
    sides: [SameHost; 2],
    run: kvferry_testkit::DecodeRun,
) -> (Report, Node, Node) {
    let prefill = start(p, Role::Prefill, &run.shape, core.clone(), 1, sides[0]);
    let decode = start(d, Role::Decode, &run.shape, core, 2, sides[1]);
    let report = run_pair(&prefill, &decode, run).await.unwrap();
    (report, prefill, decode)
}

const BOTH: [SameHost; 2] = [SameHost::Auto, SameHost::Auto];

async fn rooms_move_over_the_same_host_path_with_every_byte_verified(p: Runtime, d: Runtime) {
    let (report, _, _) = pair(p, d, fast_core(), BOTH, rooms(300, 1)).await;
    assert_all_clean(&report, 300);
    assert_eq!(report.pages_verified, 300 * 8 * 4 * 2);
    assert_eq!(
        (report.prefill_path.as_str(), report.decode_path.as_str()),
        ("cma", "cma")
    );
}

/// Either side that forbids the path (`transport="tcp"`): the session moves over TCP, every
/// byte verified.
async fn a_side_that_forbids_the_same_host_path_keeps_the_session_on_tcp(p: Runtime, d: Runtime) {
    for sides in [
        [SameHost::Auto, SameHost::Off],
        [SameHost::Off, SameHost::Auto],
    ] {
        let (report, _, _) = pair(p, d, fast_core(), sides, rooms(40, 1)).await;
        assert_all_clean(&report, 40);
        assert_eq!(
            (report.prefill_path.as_str(), report.decode_path.as_str()),
            ("tcp", "tcp"),
            "{sides:?}"
        );
    }
}

/// With the end-to-end checksum, every copy's source hash goes to the decode, which hashes
/// what landed before the room may succeed: one passed check per operation.
async fn under_the_checksum_every_same_host_copy_is_checked_on_landing(p: Runtime, d: Runtime) {
    let core = Config {
        checksum: true,
        ..fast_core()
    };
    let (report, prefill, decode) = pair(p, d, core, BOTH, rooms(100, 1)).await;
    assert_all_clean(&report, 100);
    assert_eq!(report.decode_path, "cma");
    let (pc, dc) = (prefill.counters().await, decode.counters().await);
    assert_eq!(
        dc.landed_checks_passed, pc.ops_planned,
        "one check per operation"
    );
    assert_eq!(dc.protocol_errors, 0);
}

/// 100 rooms with a bit flipped in about 3 % of the copies (the prefill flips its source
/// after hashing it and restores it after the copy).
async fn flipped(p: Runtime, d: Runtime, checksum: bool) -> Report {
    let run = rooms(100, 1);
    let core = Config {
        checksum,
        ..fast_core()
    };
    let prefill = start(
        p,
        Role::Prefill,
        &run.shape,
        core.clone(),
        1,
        SameHost::Auto,
    );
    let decode = start(d, Role::Decode, &run.shape, core, 2, SameHost::Auto);
    prefill
        .set_faults(Some(FaultPlan {
            rate: 0.03,
            seed: 11,
            kind: FaultKind::FlipBit,
        }))
        .await;
    let report = run_pair(&prefill, &decode, run).await.unwrap();
    assert_eq!(report.decode_path, "cma");
    report
}

/// Under the checksum exactly the rooms a flip hit fail with `checksum_mismatch`; no page is
/// left corrupted.
async fn a_bit_flipped_in_a_same_host_copy_fails_its_room_with_checksum_mismatch(
    p: Runtime,
    d: Runtime,
) {
    let report = flipped(p, d, true).await;
    let failed = report.failed_by_reason.get("checksum_mismatch").copied();
    assert!(failed.unwrap_or(0) >= 1, "{report:?}");
    assert_eq!(report.failed_by_reason.len(), 1, "{report:?}");
    assert_eq!(report.rooms_succeeded + failed.unwrap_or(0), 100);
    assert_eq!((report.pages_corrupted, report.rooms_unfinished), (0, 0));
}

/// The negative control: without the checksum the decode never sees a copy land, the rooms
/// succeed on the source's word, and the flipped bits are found in the pages.
async fn without_the_checksum_a_flipped_same_host_copy_lands_as_a_corrupted_page(
    p: Runtime,
    d: Runtime,
) {
    let report = flipped(p, d, false).await;
    assert_eq!(report.rooms_succeeded, 100, "{report:?}");
    assert!(
        report.pages_corrupted + report.aux_corrupted >= 1,
        "{report:?}"
    );
}

/// Copies that fail (injected: as a broken connection) are retried like any transfer: every
/// room succeeds, every byte verified.
async fn failed_same_host_copies_are_retried_and_every_room_lands(p: Runtime, d: Runtime) {
    let run = rooms(100, 1);
    // A broken copy fails the operations batched with it: at three retries one room in a
    // few hundred runs exhausted them; 16 attempts make that vanishingly rare.
    let core = Config {
        transfer_retries: 16,
        ..fast_core()
    };
    let prefill = start(
        p,
        Role::Prefill,
        &run.shape,
        core.clone(),
        1,
        SameHost::Auto,
    );
    let decode = start(d, Role::Decode, &run.shape, core, 2, SameHost::Auto);
    prefill
        .set_faults(Some(FaultPlan {
            rate: 0.05,
            seed: 3,
            kind: FaultKind::Break,
        }))
        .await;
    let report = run_pair(&prefill, &decode, run).await.unwrap();
    assert_all_clean(&report, 100);
    assert!(report.retries >= 1, "{report:?}");
    assert_eq!(report.decode_path, "cma");
}

/// KV in device memory on both sides: the decode exports it, the prefill maps it and its
/// copy engine writes each operation's pages straight into it (CUDA IPC); the metadata
/// regions, in host memory, go by cross-memory attach. Every byte verified.
async fn device_memory_on_both_sides_moves_over_cuda_ipc_with_every_byte_verified(
    p: Runtime,
    d: Runtime,
) {
    let run = rooms(100, 1);
    let prefill = start_over(p, Role::Prefill, staged_core(), 1, device());
    let decode = start_over(d, Role::Decode, staged_core(), 2, device());
    let report = run_pair(&prefill, &decode, run).await.unwrap();
    assert_all_clean(&report, 100);
    assert_eq!(
        (report.prefill_path.as_str(), report.decode_path.as_str()),
        ("cuda_ipc", "cuda_ipc")
    );
}

/// The decode's device regions exported in pieces (a region over several allocations of the
/// VMM API: one piece each; here a piece ends at every 100000 bytes of address, inside a
/// page, about four pieces a region): every
/// page that crosses a piece's end lands in two copies, every byte verified.
async fn device_regions_exported_in_pieces_move_over_cuda_ipc_with_every_byte_verified(
    p: Runtime,
    d: Runtime,
) {
    let run = rooms(100, 1);
    // The writer's engine refuses a copy that crosses a piece's end, as a GPU's mapping would.
    let pieces = || device_memory(HostCopyEngine::exporting_in_pieces(100_000), 4, 8192);
    let prefill = start_over(p, Role::Prefill, staged_core(), 1, pieces());
    let decode = start_over(d, Role::Decode, staged_core(), 2, pieces());
    let report = run_pair(&prefill, &decode, run).await.unwrap();
    assert_all_clean(&report, 100);
    assert_eq!(
        (report.prefill_path.as_str(), report.decode_path.as_str()),
        ("cuda_ipc", "cuda_ipc")
    );
}

/// A prefill whose KV is device memory and a decode whose KV is host memory: no copy engine
/// reaches host memory of another process, so the session keeps the staged TCP path, and
/// says why.
async fn a_device_source_for_a_host_destination_keeps_the_staged_path(p: Runtime, d: Runtime) {
    let run = rooms(40, 1);
    let prefill = start_over(p, Role::Prefill, staged_core(), 1, device());
    let decode = start_over(
        d,
        Role::Decode,
        staged_core(),
        2,
        Arc::new(MemoryMap::allocate(small_shape().layout())),
    );
    let report = run_pair(&prefill, &decode, run).await.unwrap();
    assert_all_clean(&report, 40);
    assert_eq!(
        (report.prefill_path.as_str(), report.decode_path.as_str()),
        ("tcp_staged", "tcp")
    );
}

/// With the end-to-end checksum, device memory keeps the staged path (the CPU hashes bytes
/// only in host buffers), every byte verified.
async fn under_the_checksum_device_memory_keeps_the_staged_path(p: Runtime, d: Runtime) {
    let core = Config {
        checksum: true,
        ..staged_core()
    };
    let run = rooms(40, 1);
    let prefill = start_over(p, Role::Prefill, core.clone(), 1, device());
    let decode = start_over(d, Role::Decode, core, 2, device());
    let report = run_pair(&prefill, &decode, run).await.unwrap();
    assert_all_clean(&report, 40);
    assert_eq!(
        (report.prefill_path.as_str(), report.decode_path.as_str()),
        ("tcp_staged", "tcp_staged")
    );
}

/// A node that requires the path (`transport="same-host"`) and a peer that forbids it: the
/// session is refused, every room fails `incompatible_peer` within its deadline, none moves
/// over TCP. Either side may be the one that requires it.
async fn a_node_that_requires_the_same_host_path_refuses_a_peer_that_forbids_it(
    p: Runtime,
    d: Runtime,
) {
    for sides in [
        [SameHost::Required, SameHost::Off],
        [SameHost::Off, SameHost::Required],
    ] {
        let (report, _, _) = pair(p, d, fast_core(), sides, rooms(8, 1)).await;
        assert_eq!(report.rooms_failed, 8, "{sides:?}: {report:?}");
        assert_eq!(
            report.failed_by_reason.get("incompatible_peer"),
            Some(&8),
            "{sides:?}: {report:?}"
        );
        assert_eq!(report.pages_verified, 0, "{sides:?}: {report:?}");
    }
}

/// Both sides require the path and share the host: it is taken, every byte verified.
async fn nodes_that_require_the_same_host_path_take_it(p: Runtime, d: Runtime) {
    let sides = [SameHost::Required, SameHost::Required];
    let (report, _, _) = pair(p, d, fast_core(), sides, rooms(40, 1)).await;
    assert_all_clean(&report, 40);
    assert_eq!(
        (report.prefill_path.as_str(), report.decode_path.as_str()),
        ("cma", "cma")
    );
}

on_every_driver!(
    a_node_that_requires_the_same_host_path_refuses_a_peer_that_forbids_it,
    nodes_that_require_the_same_host_path_take_it,
);

on_every_driver!(
    device_memory_on_both_sides_moves_over_cuda_ipc_with_every_byte_verified,
    device_regions_exported_in_pieces_move_over_cuda_ipc_with_every_byte_verified,
    a_device_source_for_a_host_destination_keeps_the_staged_path,
    under_the_checksum_device_memory_keeps_the_staged_path,
);

on_every_driver!(
    rooms_move_over_the_same_host_path_with_every_byte_verified,
    a_side_that_forbids_the_same_host_path_keeps_the_session_on_tcp,
    under_the_checksum_every_same_host_copy_is_checked_on_landing,
    a_bit_flipped_in_a_same_host_copy_fails_its_room_with_checksum_mismatch,
    without_the_checksum_a_flipped_same_host_copy_lands_as_a_corrupted_page,
    failed_same_host_copies_are_retried_and_every_room_lands,
);

/// The control link goes dark right when the decode aborts a room the prefill is copying:
/// the decode cannot stop a same-host writer itself, and its fence is a message the writer
/// never gets. Its pages stay quarantined past the session's end for the liveness window
/// (where TCP would release them at the abort deadline): by then the writer, which hears
/// nothing either, has ended its side, and copies nothing into them afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_abort_keeps_same_host_pages_quarantined_until_the_writer_gave_up() {
    // 64 chunks, each after a simulated forward pass of 8 x 5 ms: the room takes seconds.
    let shape = Shape {
        page_bytes: 64 * 1024,
        pages_per_room: 64,
        chunks: 64,
        layer_compute: Duration::from_millis(5),
        ..small_shape()
    };
    // Liveness 1 s; the abort's acknowledgement is due after 500 ms.
    let core = Config {
        waiting_timeout: Duration::from_secs(30),
        heartbeat_interval: Duration::from_millis(200),
        heartbeat_misses: 5,
        ..fast_core()
    };
    let prefill = start(
        Runtime::Tokio,
        Role::Prefill,
        &shape,
        core.clone(),
        81,
        SameHost::Auto,
    );
    let addrs = prefill
        .listen("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let mut proxies = Vec::new();
    for (i, &addr) in addrs.iter().enumerate() {
        proxies.push(FaultProxy::start(addr, 5 + i as u64).await.unwrap());
    }
    let behind: Vec<SocketAddr> = proxies.iter().map(|p| p.addr).collect();
    let decode = start(
        Runtime::Tokio,
        Role::Decode,
        &shape,
        core,
        82,
        SameHost::Auto,
    );
    let peer = decode.connect(behind).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(path_label(&decode).await.contains("cma"));
    let grant = Grant {
        extras: Vec::new(),
        pages: (0..64).collect(),
        aux_slot: Some(0),
        state_slot: None,
        receivers: 1,
        skip_pages: 0,
        idle_sources: 0,
        prompt: None,
    };
    let server = tokio::spawn(kvferry_testkit::serve_prefill(
        prefill.clone(),
        shape.clone(),
    ));
    let mut h = decode
        .open_receiver(RoomId(1), 0, vec![peer], Some(grant))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    for proxy in &proxies {
        proxy.set(|f| f.blackhole_until = Some(Instant::now() + Duration::from_secs(30)));
    }
    let t0 = Instant::now();
    decode.abort(RoomId(1)).await.unwrap();
    assert_eq!(
        h.terminal().await,
        KvPoll::Failed(FailureReason::AbortedLocally)
    );
    tokio::time::timeout(Duration::from_secs(10), h.releasable())
        .await
        .expect("released once the writer's liveness window passed");
    let held = t0.elapsed();
    // The writer last heard the decode before the link went dark, so it copies nothing
    // after t0 + its window (1 s). The decode ends the session (its abort unacknowledged
    // after 500 ms, or 1 s of silence, whichever comes first) and holds the pages the window
    // and a heartbeat past that: never before t0 + 1.2 s, where TCP releases at 500 ms.
    assert!(
        held >= Duration::from_millis(1200),
        "released after {held:?}"
    );
    assert!(
        prefill.data_paths().await.is_empty(),
        "the writer had ended its side of the session when the pages went back"
    );
    assert!(
        decode.counters().await.fences >= 1,
        "the session was fenced"
    );
    server.abort();
}
