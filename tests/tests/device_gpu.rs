//! KV in GPU memory end to end (feature `gpu`): a prefill and a decode node over device
//! regions of GPU 0, staged through the CUDA copy engine over loopback TCP, every byte checked
//! by copying it back from the device; and the same rooms over the same-host path, whose
//! copies go GPU to GPU (CUDA IPC; in one process the exporter's addresses serve as they
//! are). Skips with its reason where no GPU is usable. The same pipelines run without a GPU
//! in tests/device.rs and tests/same_host.rs through the host copy engine.
#![cfg(feature = "gpu")]
#![allow(clippy::unwrap_used)] // tests may panic

use std::sync::Arc;
use std::time::Instant;

use kvferry_core::Role;
use kvferry_gpu::cuda::{DeviceRegion, Gpu};
use kvferry_gpu::engine::CudaCopyEngine;
use kvferry_memory::{ExternalRegion, MemoryKind, MemoryMap, Staging, StagingConfig};
use kvferry_testkit::{node_config, run_pair, DecodeRun, SameHost, Shape};
use kvferry_tests::{assert_all_clean, fast_core, Runtime, GLOMMIO};

/// 8 layers x K/V of 16 KiB pages, 32 pages a room: 8 MiB a room.
fn shape() -> Shape {
    Shape {
        layers: 8,
        planes: 2,
        page_bytes: 16384,
        pages_per_room: 32,
        prefix_pages: 0,
        chunks: 1,
        concurrency: 8,
        layerwise: false,
        layer_compute: std::time::Duration::ZERO,
        data_connections: 2,
    }
}

/// Device memory for `shape` on `gpu`, reached through the CUDA engine.
fn device_memory(gpu: &Gpu, shape: &Shape) -> (Vec<DeviceRegion>, Arc<MemoryMap>) {
    let layout = shape.layout();
    let bytes = layout.pages as usize * layout.page_bytes as usize;
    let regions: Vec<DeviceRegion> = (0..layout.kv_regions())
        .map(|_| gpu.alloc(bytes).unwrap())
        .collect();
    // The zeroing runs on the compute stream; the engine copies on its own.
    gpu.compute_stream().synchronize().unwrap();
    let kv: Vec<ExternalRegion> = regions
        .iter()
        .map(|r| ExternalRegion {
            ptr: r.device_addr(gpu) as *mut u8,
            len: bytes,
            kind: MemoryKind::Cuda { device: 0 },
        })
        .collect();
    let host = |len: usize| {
        let b: &'static mut [u8] = Box::leak(vec![0u8; len.max(1)].into_boxed_slice());
        ExternalRegion::host(b.as_mut_ptr(), len)
    };
    let aux = (layout.aux_bytes > 0).then(|| host((layout.slots * layout.aux_bytes) as usize));
    let state =
        (layout.state_bytes > 0).then(|| host((layout.slots * layout.state_bytes) as usize));
    // SAFETY: device regions that live as long as the returned vector, host rows leaked.
    let map = unsafe { MemoryMap::register_regions(layout, &kv, aux, state) }.unwrap();
    let engine = CudaCopyEngine::for_memory(&map).unwrap();
    let staging = Staging::new(engine, StagingConfig::default()).unwrap();
    (regions, Arc::new(map.with_staging(staging)))
}

/// GPU 0, or `None` after saying why the test skips.
fn gpu_or_skip() -> Option<Gpu> {
    Gpu::open(0)
        .map_err(|e| eprintln!("SKIPPED: no usable GPU here ({e})"))
        .ok()
}

/// The rooms of `run_rooms` for `shape`: 64 rooms, every byte verified.
fn rooms(shape: &Shape, abort_rate: f64) -> DecodeRun {
    DecodeRun {
        rooms: 64,
        shape: shape.clone(),
        first_room: 1,
        progress: None,
        deadline: std::time::Duration::from_secs(120),
        abort_rate,
        seed: 0,
    }
}

/// Rooms between two nodes over `memory()` each; the decode's report.
async fn run_rooms(
    runtime: Runtime,
    shape: &Shape,
    memory: impl Fn() -> Arc<MemoryMap>,
) -> kvferry_testkit::Report {
    run_rooms_over(runtime, shape, memory, None).await
}

/// [`run_rooms`] with both nodes' same-host choice set to `same_host` where given.
async fn run_rooms_over(
    runtime: Runtime,
    shape: &Shape,
    memory: impl Fn() -> Arc<MemoryMap>,
    same_host: Option<SameHost>,
) -> kvferry_testkit::Report {
    let mut pc = node_config(Role::Prefill, shape, fast_core(), b"gpu", 1);
    let mut dc = node_config(Role::Decode, shape, fast_core(), b"gpu", 2);
    kvferry_tests::use_test_backend(&mut pc);
    kvferry_tests::use_test_backend(&mut dc);
    if let Some(choice) = same_host {
        pc.same_host = choice;
        dc.same_host = choice;
    }
    let prefill = runtime.start(pc, memory()).unwrap();
    let decode = runtime.start(dc, memory()).unwrap();
    let report = run_pair(&prefill, &decode, rooms(shape, 0.0))
        .await
        .unwrap();
    decode.shutdown().await;
    prefill.shutdown().await;
    report
}

async fn device_rooms(runtime: Runtime) {
    let Some(gpu) = gpu_or_skip() else {
        return;
    };
    let shape = shape();
    // The same rooms between host memories first: the loopback TCP the device rooms share.
    let host = run_rooms(runtime, &shape, || {
        Arc::new(MemoryMap::allocate(shape.layout()))
    })
    .await;
    assert_all_clean(&host, 64);
    let regions = std::sync::Mutex::new(Vec::new());
    let device = run_rooms(runtime, &shape, || {
        let (r, m) = device_memory(&gpu, &shape);
        regions.lock().unwrap().push(r);
        m
    })
    .await;
    assert_all_clean(&device, 64);
    assert!(device.decode_path.contains("staged"), "{device:?}");
    println!(
        "{{\"check\":\"device_rooms\",\"runtime\":\"{}\",\"rooms\":64,\"gb\":{:.3},\"gbps\":{:.3},\"host_gbps\":{:.3},\"ratio\":{:.3},\"target\":0.70}}",
        runtime.name(),
        device.bytes_transferred as f64 / 1e9,
        device.throughput_gbps,
        host.throughput_gbps,
        device.throughput_gbps / host.throughput_gbps
    );
}

/// Device rooms staged over TCP, then the same rooms over the same-host path (GPU-to-GPU
/// copies, CUDA IPC), every byte verified both times.
async fn ipc_rooms(runtime: Runtime) {
    let Some(gpu) = gpu_or_skip() else {
        return;
    };
    let shape = shape();
    let regions = std::sync::Mutex::new(Vec::new());
    let memory = || {
        let (r, m) = device_memory(&gpu, &shape);
        regions.lock().unwrap().push(r);
        m
    };
    let staged = run_rooms_over(runtime, &shape, memory, Some(SameHost::Off)).await;
    assert_all_clean(&staged, 64);
    assert!(staged.decode_path.contains("staged"), "{staged:?}");
    let ipc = run_rooms_over(runtime, &shape, memory, Some(SameHost::Auto)).await;
    assert_all_clean(&ipc, 64);
    assert_eq!(
        (ipc.prefill_path.as_str(), ipc.decode_path.as_str()),
        ("cuda_ipc", "cuda_ipc"),
        "{ipc:?}"
    );
    println!(
        "{{\"check\":\"ipc_rooms\",\"runtime\":\"{}\",\"rooms\":64,\"gbps\":{:.3},\"staged_gbps\":{:.3},\"ratio\":{:.3},\"target\":1.0}}",
        runtime.name(),
        ipc.throughput_gbps,
        staged.throughput_gbps,
        ipc.throughput_gbps / staged.throughput_gbps
    );
}

/// Rooms aborted mid-copy, then a prefill shut down with copies in flight: every run ends
/// within its deadline, no landed page is corrupt, and once the nodes are gone kvferry holds
/// the same contexts, pinned buffers and streams as before.
async fn faults_on_the_cuda_engine(runtime: Runtime) {
    let Some(gpu) = gpu_or_skip() else {
        return;
    };
    let before = kvferry_gpu::engine::held();
    {
        let shape = shape();
        let (_p_regions, p_memory) = device_memory(&gpu, &shape);
        let (_d_regions, d_memory) = device_memory(&gpu, &shape);
        let mut pc = node_config(Role::Prefill, &shape, fast_core(), b"gpu", 1);
        let mut dc = node_config(Role::Decode, &shape, fast_core(), b"gpu", 2);
        kvferry_tests::use_test_backend(&mut pc);
        kvferry_tests::use_test_backend(&mut dc);
        let prefill = runtime.start(pc, p_memory).unwrap();
        let decode = runtime.start(dc, d_memory).unwrap();
        let aborted = run_pair(&prefill, &decode, rooms(&shape, 0.5))
            .await
            .unwrap();
        assert_eq!(aborted.pages_corrupted, 0, "{aborted:?}");
        assert_eq!(aborted.rooms_unfinished, 0, "{aborted:?}");
        // The prefill goes while rooms are being staged through the engine.
        let cut = async {
            tokio::time::sleep(std::time::Duration::from_millis(30)).await;
            prefill.shutdown().await;
        };
        let mut run = rooms(&shape, 0.0);
        run.first_room = 1000;
        run.deadline = std::time::Duration::from_secs(30);
        let (report, ()) = tokio::join!(run_pair(&prefill, &decode, run), cut);
        if let Ok(r) = &report {
            assert_eq!(r.pages_corrupted, 0, "{r:?}");
            assert_eq!(r.rooms_unfinished, 0, "{r:?}");
        }
        decode.shutdown().await;
        println!(
            "{{\"check\":\"gpu_faults\",\"runtime\":\"{}\",\"aborted_run_failed\":{},\"cut_run\":\"{}\"}}",
            runtime.name(),
            aborted.rooms_failed,
            report.map_or_else(|e| e.to_string(), |r| format!("{} succeeded, {} failed", r.rooms_succeeded, r.rooms_failed))
        );
    }
    let t0 = Instant::now();
    while kvferry_gpu::engine::held() != before {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(15),
            "kvferry still holds {:?} (before: {before:?})",
            kvferry_gpu::engine::held()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rooms_aborted_mid_copy_and_a_prefill_gone_with_copies_in_flight_end_and_leak_nothing() {
    faults_on_the_cuda_engine(Runtime::Tokio).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn device_to_device_rooms_over_cuda_ipc_verify_every_byte_and_outrun_staged_tcp() {
    ipc_rooms(Runtime::Tokio).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn device_to_device_rooms_over_tcp_verify_every_byte_on_tokio() {
    device_rooms(Runtime::Tokio).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn device_to_device_rooms_over_tcp_verify_every_byte_on_glommio() {
    device_rooms(GLOMMIO).await;
}
