//! KV in GPU memory end to end (feature `gpu`): a prefill and a decode node over device
//! regions of GPU 0, staged through the CUDA copy engine over loopback TCP, every byte checked
//! by copying it back from the device. Skips with its reason where no GPU is usable. The same
//! pipeline runs without a GPU in tests/device.rs through the host copy engine.
#![cfg(feature = "gpu")]
#![allow(clippy::unwrap_used)] // tests may panic

use std::sync::Arc;
use std::time::Instant;

use kvferry_core::Role;
use kvferry_gpu::cuda::{DeviceRegion, Gpu};
use kvferry_gpu::engine::CudaCopyEngine;
use kvferry_memory::{ExternalRegion, MemoryKind, MemoryMap, Staging, StagingConfig};
use kvferry_testkit::{node_config, run_pair, DecodeRun, Shape};
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

async fn device_rooms(runtime: Runtime) {
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("SKIPPED: no usable GPU here ({e})");
            return;
        }
    };
    let shape = shape();
    let (_p_regions, p_memory) = device_memory(&gpu, &shape);
    let (_d_regions, d_memory) = device_memory(&gpu, &shape);
    let mut pc = node_config(Role::Prefill, &shape, fast_core(), b"gpu", 1);
    let mut dc = node_config(Role::Decode, &shape, fast_core(), b"gpu", 2);
    kvferry_tests::use_test_backend(&mut pc);
    kvferry_tests::use_test_backend(&mut dc);
    let prefill = runtime.start(pc, p_memory).unwrap();
    let decode = runtime.start(dc, d_memory).unwrap();
    let run = DecodeRun {
        rooms: 64,
        shape: shape.clone(),
        first_room: 1,
        progress: None,
        deadline: std::time::Duration::from_secs(120),
        abort_rate: 0.0,
        seed: 0,
    };
    let t0 = Instant::now();
    let report = run_pair(&prefill, &decode, run).await.unwrap();
    assert_all_clean(&report, 64);
    let gb = report.bytes_transferred as f64 / 1e9;
    println!(
        "{{\"check\":\"device_rooms\",\"runtime\":\"{}\",\"rooms\":64,\"gb\":{gb:.3},\"seconds\":{:.3},\"gbps\":{:.3}}}",
        runtime.name(),
        t0.elapsed().as_secs_f64(),
        report.throughput_gbps
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn device_to_device_rooms_over_tcp_verify_every_byte_on_tokio() {
    device_rooms(Runtime::Tokio).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn device_to_device_rooms_over_tcp_verify_every_byte_on_glommio() {
    device_rooms(GLOMMIO).await;
}
