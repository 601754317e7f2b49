//! Tests that need a GPU (feature `gpu`); each says clearly when it skips.
#![cfg(feature = "gpu")]
#![allow(clippy::unwrap_used)] // tests may panic

use std::time::Duration;

use kvferry_gpu::cuda::{probe, Gpu};
use kvferry_gpu::{GpuError, LayerEvent};

fn gpu() -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("SKIPPED: no usable GPU here ({e})");
            None
        }
    }
}

#[test]
fn no_gpu_is_a_typed_error_and_never_a_panic() {
    match probe() {
        Ok(info) => eprintln!("GPU present: {} device(s), {}", info.devices, info.name),
        Err(e) => assert!(
            matches!(
                e,
                GpuError::NoLibcuda | GpuError::NoDevice | GpuError::Driver(_)
            ),
            "{e:?}"
        ),
    }
}

#[test]
fn a_device_region_round_trips_through_the_copy_stream() {
    let Some(g) = gpu() else { return };
    let host: Vec<u8> = (0..(1 << 20)).map(|i| (i * 7 + 3) as u8).collect();
    let mut region = g.alloc(host.len()).unwrap();
    g.upload(&host, &mut region).unwrap();
    let mut back = vec![0u8; host.len()];
    g.download(&region, &mut back).unwrap();
    assert_eq!(back, host);
}

#[test]
fn an_event_completes_after_the_work_recorded_before_it() {
    let Some(g) = gpu() else { return };
    let _region = g.alloc(64 << 20).unwrap();
    let mut ev = g.record(g.compute_stream()).unwrap();
    let t0 = std::time::Instant::now();
    while !ev.poll_complete().unwrap() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "event never completed"
        );
        std::thread::sleep(Duration::from_micros(50));
    }
}

#[test]
fn the_cuda_copy_engine_without_a_gpu_is_a_typed_error() {
    match kvferry_gpu::engine::CudaCopyEngine::open(&[0]) {
        Ok(_) => eprintln!("GPU present: the engine opened"),
        Err(e) => assert!(
            matches!(
                e,
                GpuError::NoLibcuda | GpuError::NoDevice | GpuError::Driver(_)
            ),
            "{e:?}"
        ),
    }
}

/// A layout of 2 layers x K/V, 64 pages of 16 KiB, over device regions of `g`.
fn device_memory(
    g: &Gpu,
) -> (
    Vec<kvferry_gpu::cuda::DeviceRegion>,
    kvferry_memory::MemoryMap,
) {
    use kvferry_memory::{ExternalRegion, MemoryKind, MemoryMap};
    let layout = kvferry_core::sim::small_layout(64);
    let layout = kvferry_core::Layout {
        page_bytes: 16384,
        ..layout
    };
    let bytes = layout.pages as usize * layout.page_bytes as usize;
    let regions: Vec<_> = (0..layout.kv_regions())
        .map(|_| g.alloc(bytes).unwrap())
        .collect();
    // The zeroing runs on the compute stream; the engine copies on its own.
    g.compute_stream().synchronize().unwrap();
    let kv: Vec<ExternalRegion> = regions
        .iter()
        .map(|r| ExternalRegion {
            ptr: r.device_addr(g) as *mut u8,
            len: bytes,
            kind: MemoryKind::Cuda { device: 0 },
        })
        .collect();
    let aux = (layout.aux_bytes > 0).then(|| vec![0u8; (layout.slots * layout.aux_bytes) as usize]);
    let aux = aux.map(|a| {
        let a = Box::leak(a.into_boxed_slice());
        ExternalRegion::host(a.as_mut_ptr(), a.len())
    });
    // SAFETY: device regions of `g`, alive as long as the returned vector; aux leaked.
    let map = unsafe { MemoryMap::register_regions(layout, &kv, aux, None) }.unwrap();
    (regions, map)
}

#[test]
fn device_pages_stage_through_the_cuda_engine_both_ways() {
    use kvferry_core::Region;
    use kvferry_memory::{Staging, StagingConfig};
    let Some(g) = gpu() else { return };
    let (_regions, map) = device_memory(&g);
    let engine = kvferry_gpu::engine::CudaCopyEngine::for_memory(&map).unwrap();
    let staging = Staging::new(engine, StagingConfig::default()).unwrap();
    let map = map.with_staging(staging);
    let page: Vec<u8> = (0..16384).map(|i| (i * 13 + 5) as u8).collect();
    let region = Region::Kv { layer: 1, plane: 1 };
    map.write(region, 7 * 16384, &page).unwrap();
    let mut back = vec![0u8; page.len()];
    map.read(region, 7 * 16384, &mut back).unwrap();
    assert_eq!(back, page);
}

#[test]
fn the_driver_tells_a_device_pointer_from_a_host_one() {
    use kvferry_gpu::engine::{check_kinds, pointer_kind};
    use kvferry_memory::MemoryKind;
    let Some(g) = gpu() else { return };
    let (regions, map) = device_memory(&g);
    assert_eq!(
        pointer_kind(regions[0].device_addr(&g) as *const u8).unwrap(),
        MemoryKind::Cuda { device: 0 }
    );
    let host = [0u8; 64];
    assert_eq!(pointer_kind(host.as_ptr()).unwrap(), MemoryKind::Host);
    assert_eq!(check_kinds(&map).unwrap(), None);
    // The same device pointers registered as host memory: named, never read.
    let layout = *map.layout();
    let bytes = layout.pages as usize * layout.page_bytes as usize;
    let kv: Vec<(*mut u8, usize)> = regions
        .iter()
        .map(|r| (r.device_addr(&g) as *mut u8, bytes))
        .collect();
    let aux = vec![0u8; (layout.slots * layout.aux_bytes).max(1) as usize];
    let aux = (layout.aux_bytes > 0).then_some((aux.as_ptr() as *mut u8, aux.len()));
    // SAFETY: registered only to be checked; never read.
    let wrong =
        unsafe { kvferry_memory::MemoryMap::register_external(layout, &kv, aux, None) }.unwrap();
    let found = check_kinds(&wrong)
        .unwrap()
        .expect("a device pointer registered as host");
    assert_eq!(found.actual, MemoryKind::Cuda { device: 0 });
    assert_eq!(found.registered, MemoryKind::Host);
}

/// The context current on this thread, as the driver says (null: none).
fn current_context() -> usize {
    let mut ctx: kvferry_gpu::cuda::cudarc::driver::sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one handle; the driver is loaded (a GPU was opened).
    unsafe { kvferry_gpu::cuda::cudarc::driver::sys::cuCtxGetCurrent(&mut ctx) }
        .result()
        .unwrap();
    ctx as usize
}

#[test]
fn the_node_leaves_the_callers_current_context_as_it_was() {
    use kvferry_memory::{MemoryMap, Staging, StagingConfig};
    let Some(g) = gpu() else { return };
    // Gpu::open made device 0's context current here, as torch does for its user.
    let before = current_context();
    assert_ne!(before, 0);
    let (_regions, map) = device_memory(&g);
    let engine = kvferry_gpu::engine::CudaCopyEngine::for_memory(&map).unwrap();
    let staging = Staging::new(engine, StagingConfig::default()).unwrap();
    let map = map.with_staging(staging);
    let page = vec![7u8; 16384];
    map.write(kvferry_core::Region::Kv { layer: 0, plane: 0 }, 0, &page)
        .unwrap();
    kvferry_gpu::engine::verify_kinds(&map).unwrap();
    let host = MemoryMap::allocate(*map.layout());
    kvferry_gpu::engine::verify_kinds(&host).unwrap();
    kvferry_gpu::cuda::probe().unwrap();
    assert_eq!(current_context(), before, "the caller's context changed");
    // A thread with no context current: the node's calls leave it with none.
    std::thread::spawn(move || {
        assert_eq!(current_context(), 0);
        let mut back = vec![0u8; 16384];
        map.read(
            kvferry_core::Region::Kv { layer: 0, plane: 0 },
            0,
            &mut back,
        )
        .unwrap();
        assert_eq!(back, page);
        kvferry_gpu::engine::verify_kinds(&map).unwrap();
        assert_eq!(current_context(), 0, "a context was left current");
    })
    .join()
    .unwrap();
}
