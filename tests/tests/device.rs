//! KV in device memory over TCP, staged through host buffers, on every driver. The KV regions
//! are registered as CUDA device 0 memory and reached only through a copy engine: here the
//! host engine (a thread that copies after a delay), which runs the same staged pipeline the
//! CUDA engine does. Every byte is verified through the engine; a node over device memory it
//! cannot reach refuses to start, naming the region.
#![allow(clippy::unwrap_used)] // tests may panic

use std::sync::Arc;
use std::time::Duration;

use kvferry_core::{Region, Role};
use kvferry_memory::{
    CopyDirection, HostCopyEngine, MemoryKind, MemoryMap, Staging, StagingConfig,
};
use kvferry_testkit::{node_config, run_pair, DecodeRun, Report};
use kvferry_tests::{
    assert_all_clean, device_memory, fast_core, on_every_driver, rooms, small_shape, staged_core,
    use_test_backend, Runtime,
};
use kvferry_tokio::NodeError;

/// Moves `run` between a prefill over `prefill_memory` and a decode over `decode_memory`.
async fn move_rooms(
    p: Runtime,
    d: Runtime,
    prefill_memory: Arc<MemoryMap>,
    decode_memory: Arc<MemoryMap>,
    run: DecodeRun,
) -> Report {
    move_rooms_with(staged_core(), p, d, prefill_memory, decode_memory, run).await
}

/// As [`move_rooms`], with the core's knobs `core` (with the checksum on, over TCP even
/// where the test backend is RDMA: RDMA nodes refuse the option).
async fn move_rooms_with(
    core: kvferry_core::Config,
    p: Runtime,
    d: Runtime,
    prefill_memory: Arc<MemoryMap>,
    decode_memory: Arc<MemoryMap>,
    run: DecodeRun,
) -> Report {
    move_rooms_over(core, p, d, prefill_memory, decode_memory, run, false).await
}

/// As [`move_rooms_with`]; `copies_failed`: the prefill's engine fails copies, so a session
/// on the same-host path may end on the staged path.
async fn move_rooms_over(
    core: kvferry_core::Config,
    p: Runtime,
    d: Runtime,
    prefill_memory: Arc<MemoryMap>,
    decode_memory: Arc<MemoryMap>,
    run: DecodeRun,
    copies_failed: bool,
) -> Report {
    let shape = small_shape();
    let checksum = core.checksum;
    let mut pc = node_config(Role::Prefill, &shape, core.clone(), b"test-token", 1);
    let mut dc = node_config(Role::Decode, &shape, core, b"test-token", 2);
    if !checksum {
        use_test_backend(&mut pc);
        use_test_backend(&mut dc);
    }
    let staged = |memory: &MemoryMap| {
        if memory.staging().is_some() {
            "tcp_staged"
        } else {
            "tcp"
        }
    };
    let device = |memory: &MemoryMap| memory.staging().is_some();
    let same_host = pc.same_host != kvferry_testkit::SameHost::Off
        && dc.same_host != kvferry_testkit::SameHost::Off;
    let want = match (device(&prefill_memory), device(&decode_memory)) {
        // Over the same-host path device memory on both sides goes GPU to GPU (the host
        // engine maps exports of its own process), host memory on both by cross-memory
        // attach; a mix of the two has no copy that reaches it.
        (true, true) if same_host => ("cuda_ipc", "cuda_ipc"),
        (false, false) if same_host => ("cma", "cma"),
        _ => (staged(&prefill_memory), staged(&decode_memory)),
    };
    let prefill = p.start(pc, prefill_memory).unwrap();
    let decode = d.start(dc, decode_memory).unwrap();
    let report = run_pair(&prefill, &decode, run).await.unwrap();
    // Otherwise device memory moves over TCP staged here (the host engine exports no
    // dma-buf, so not even an RDMA node registers it), and its peer follows onto TCP.
    let got = (report.prefill_path.as_str(), report.decode_path.as_str());
    // A GPU-to-GPU copy that fails moves its session to the staged path, saying so.
    let fell_back = |path: &str| path.ends_with("tcp_staged");
    let failing_engine_fell_back =
        want == ("cuda_ipc", "cuda_ipc") && copies_failed && fell_back(got.0) && fell_back(got.1);
    assert!(
        got == want || failing_engine_fell_back,
        "{got:?}, want {want:?}"
    );
    report
}

/// Each operation (a room's pages of one layer and plane, 32 KiB) spans four 8 KiB buffers,
/// and each copy takes 200 us: slices are copied while earlier ones are on the wire.
async fn device_rooms_move_staged_with_every_byte_verified(p: Runtime, d: Runtime) {
    let engine = || HostCopyEngine::new(Duration::from_micros(200));
    let (prefill, decode) = (
        device_memory(engine(), 4, 8192),
        device_memory(engine(), 4, 8192),
    );
    let report = move_rooms(p, d, prefill.clone(), decode.clone(), rooms(20, 1)).await;
    assert_all_clean(&report, 20);
    assert_eq!(report.pages_verified, 20 * 8 * 4 * 2);
    // Only the staged data plane takes the shared pool's buffers (each connection stages
    // through a buffer of its own first, verification through buffers of its own): both sides
    // staged, with a second buffer in flight at times. GPU-to-GPU copies take none.
    if report.decode_path == "cuda_ipc" {
        return;
    }
    for side in [&prefill, &decode] {
        let taken = side.staging().unwrap().taken();
        assert!(taken > 0, "{taken} shared buffers taken");
    }
}

/// A device prefill feeds a host decode and the other way round: the wire is the same.
async fn device_and_host_nodes_move_rooms_between_them(p: Runtime, d: Runtime) {
    let engine = || HostCopyEngine::new(Duration::ZERO);
    let host = || Arc::new(MemoryMap::allocate(small_shape().layout()));
    let to_host = move_rooms(p, d, device_memory(engine(), 4, 8192), host(), rooms(10, 1)).await;
    assert_all_clean(&to_host, 10);
    let to_device = move_rooms(p, d, host(), device_memory(engine(), 4, 8192), rooms(10, 1)).await;
    assert_all_clean(&to_device, 10);
}

/// Layer by layer, in two chunks, with 300 us of compute per layer: each layer's operations
/// stage and leave once the layer is marked ready, as for host memory.
async fn layerwise_device_rooms_move_each_layer_once_ready(p: Runtime, d: Runtime) {
    let engine = || HostCopyEngine::new(Duration::from_micros(100));
    let shape = kvferry_testkit::Shape {
        layerwise: true,
        layer_compute: Duration::from_micros(300),
        chunks: 2,
        ..small_shape()
    };
    let run = DecodeRun {
        shape,
        ..rooms(20, 1)
    };
    let report = move_rooms(
        p,
        d,
        device_memory(engine(), 4, 8192),
        device_memory(engine(), 4, 8192),
        run,
    )
    .await;
    assert_all_clean(&report, 20);
}

/// One staging buffer for the whole node, shared by two data connections each way: a
/// connection waits for the pool only while it holds no buffer, so they never block each
/// other for good.
async fn a_pool_of_one_buffer_serves_every_connection(p: Runtime, d: Runtime) {
    let engine = || HostCopyEngine::new(Duration::from_micros(50));
    let report = move_rooms(
        p,
        d,
        device_memory(engine(), 1, 4096),
        device_memory(engine(), 1, 4096),
        rooms(20, 1),
    )
    .await;
    assert_all_clean(&report, 20);
}

/// Operations of 2 MiB through buffers of 4 MiB, one shared buffer per node and two data
/// connections each way: a connection that holds a buffer while its socket is full (the
/// peer's reader waits for a buffer) must not stall the other. Each connection has a buffer
/// of its own and takes shared ones only when free; with only the shared pool, prefill's
/// writer and decode's reader of two connections could wait on each other for good.
async fn connections_sharing_a_one_buffer_pool_never_wait_on_each_other(p: Runtime, d: Runtime) {
    let shape = kvferry_testkit::Shape {
        layers: 2,
        page_bytes: 65536,
        pages_per_room: 32,
        concurrency: 4,
        ..small_shape()
    };
    let memory = || {
        let staging = Staging::new(
            HostCopyEngine::new(Duration::ZERO),
            StagingConfig {
                buffers: 1,
                buffer_bytes: 4 << 20,
                ..StagingConfig::default()
            },
        )
        .unwrap();
        Arc::new(MemoryMap::allocate_as_device(shape.layout(), 0).with_staging(staging))
    };
    let mut pc = node_config(Role::Prefill, &shape, staged_core(), b"test-token", 1);
    let mut dc = node_config(Role::Decode, &shape, staged_core(), b"test-token", 2);
    use_test_backend(&mut pc);
    use_test_backend(&mut dc);
    let prefill = p.start(pc, memory()).unwrap();
    let decode = d.start(dc, memory()).unwrap();
    let run = DecodeRun {
        shape: shape.clone(),
        deadline: Duration::from_secs(60),
        ..rooms(12, 1)
    };
    let report = tokio::time::timeout(Duration::from_secs(90), run_pair(&prefill, &decode, run))
        .await
        .expect("the connections blocked each other")
        .unwrap();
    assert_all_clean(&report, 12);
}

/// Prefill's engine fails every device-to-host copy after its 40th: the connection carrying
/// the half-written operation closes, the core retries, and every room ends, in `Success` with
/// every byte right or in `Failed` with a reason; none hangs, none lands garbage.
async fn a_copy_engine_failing_mid_transfer_never_lands_garbage(p: Runtime, d: Runtime) {
    let failing = HostCopyEngine::failing(Duration::ZERO, Some((CopyDirection::DeviceToHost, 40)));
    let run = DecodeRun {
        deadline: Duration::from_secs(20),
        ..rooms(20, 1)
    };
    let report = move_rooms_over(
        staged_core(),
        p,
        d,
        device_memory(failing, 4, 8192),
        device_memory(HostCopyEngine::new(Duration::ZERO), 4, 8192),
        run,
        true,
    )
    .await;
    assert_eq!(report.pages_corrupted, 0, "{report:?}");
    assert_eq!(report.free_pages_written, 0, "{report:?}");
    assert_eq!(report.rooms_unfinished, 0, "{report:?}");
    assert_eq!(
        report.rooms_succeeded + report.rooms_failed,
        20,
        "{report:?}"
    );
    assert!(
        report.rooms_failed > 0,
        "the engine failed for good: {report:?}"
    );
}

/// With the checksum on, every staged batch is hashed as its bytes are staged (prefill) and
/// as they arrive in the staging buffers (decode), and verified before it is acknowledged.
async fn device_rooms_move_with_the_checksum_on(p: Runtime, d: Runtime) {
    let engine = || HostCopyEngine::new(Duration::from_micros(100));
    let core = kvferry_core::Config {
        checksum: true,
        ..staged_core()
    };
    let (prefill, decode) = (
        device_memory(engine(), 4, 8192),
        device_memory(engine(), 4, 8192),
    );
    let report = move_rooms_with(core, p, d, prefill, decode, rooms(20, 1)).await;
    assert_all_clean(&report, 20);
}

on_every_driver!(
    device_rooms_move_with_the_checksum_on,
    device_rooms_move_staged_with_every_byte_verified,
    device_and_host_nodes_move_rooms_between_them,
    layerwise_device_rooms_move_each_layer_once_ready,
    a_pool_of_one_buffer_serves_every_connection,
    connections_sharing_a_one_buffer_pool_never_wait_on_each_other,
    a_copy_engine_failing_mid_transfer_never_lands_garbage,
);

/// Device memory without a copy engine: refused at start with the region and the fix, on
/// both drivers (nothing reads a device address on the CPU).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_memory_without_a_copy_engine_is_refused_at_start_naming_the_region() {
    for runtime in [Runtime::Tokio, kvferry_tests::GLOMMIO] {
        let shape = small_shape();
        let mut cfg = node_config(Role::Decode, &shape, fast_core(), b"test-token", 3);
        use_test_backend(&mut cfg);
        let memory = Arc::new(MemoryMap::allocate_as_device(shape.layout(), 1));
        let err = runtime.start(cfg, memory).unwrap_err();
        let NodeError::UnreachableMemory { region, kind, .. } = &err else {
            panic!("not an unreachable-memory error: {err}");
        };
        assert_eq!(*region, Region::Kv { layer: 0, plane: 0 });
        assert_eq!(*kind, MemoryKind::Cuda { device: 1 });
        let said = err.to_string();
        assert!(said.contains("CUDA device 1"), "{said}");
        assert!(said.contains("copy engine"), "names the fix: {said}");
    }
}
