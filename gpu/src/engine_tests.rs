//! The CUDA engine, the probe and the kind check over the fake driver: which devices and
//! contexts they touch, what calls a batch becomes, what an older driver or a weaker device
//! gets, and how a lost batch ends.

#![allow(clippy::unwrap_used)] // tests may panic

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_core::{Layout, Region};
use kvferry_memory::{
    CopyDirection, CopyEngine, CopyError, CopyJob, IpcExport, IpcHandleType, MemoryKind, MemoryMap,
    Staging, StagingConfig,
};

use crate::cuda::probe_with;
use crate::engine::{verify_kinds_with, CudaCopyEngine, KindError, DEFAULT_COPY_TIMEOUT};
use crate::fake::{self, current, depth, push_own, state};
use crate::GpuError;

mod ipc;

/// The embedder's own context on the test thread (torch's, say).
const OWN: usize = 0xABC;

fn layout() -> Layout {
    Layout {
        layers: 2,
        planes: 2,
        page_bytes: 4096,
        pages: 8,
        aux_bytes: 0,
        state_bytes: 0,
        slots: 0,
    }
}

/// Registers every region of `memory` with the fake driver as an allocation of `device`.
fn allocate_on_fake(memory: &MemoryMap, device: u32) {
    for (region, len) in memory.region_lens() {
        let ptr = memory.range(region, 0, len).unwrap() as u64;
        state(|s| s.allocations.push((ptr, len as usize, device)));
    }
}

fn device_memory(device: u32) -> MemoryMap {
    let m = MemoryMap::allocate_as_device(layout(), device);
    allocate_on_fake(&m, device);
    m
}

fn first_region(memory: &MemoryMap) -> (u64, usize) {
    let (region, len) = memory.region_lens().next().unwrap();
    (memory.range(region, 0, len).unwrap() as u64, len as usize)
}

/// Starts `jobs` and waits for their end.
fn copy(
    engine: &CudaCopyEngine,
    direction: CopyDirection,
    jobs: Vec<CopyJob>,
) -> Result<(), CopyError> {
    let (tx, rx) = std::sync::mpsc::channel();
    engine.start(
        0,
        direction,
        jobs,
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    );
    rx.recv_timeout(Duration::from_secs(10)).unwrap()
}

fn assert_callers_context_kept() {
    assert_eq!(
        (current(), depth()),
        (OWN, 1),
        "the caller's context changed"
    );
    let stray = state(|s| s.without_context.clone());
    assert!(
        stray.is_empty(),
        "driver calls made with no context: {stray:?}"
    );
}

#[test]
fn the_probe_counts_devices_and_makes_no_context() {
    let _serial = fake::reset(2);
    push_own(OWN);
    let info = probe_with(fake::api(true, true)).unwrap();
    assert_eq!((info.devices, info.name.as_str()), (2, "Fake GPU 0"));
    assert!(
        state(|s| s.touched.is_empty()),
        "the probe retained a context"
    );
    assert_callers_context_kept();
}

#[test]
fn a_driver_with_no_device_is_a_typed_error() {
    let _serial = fake::reset(0);
    assert_eq!(probe_with(fake::api(true, true)), Err(GpuError::NoDevice));
}

#[test]
fn an_engine_for_device_1_never_touches_device_0_nor_the_callers_context() {
    let _serial = fake::reset(2);
    push_own(OWN);
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[1], DEFAULT_COPY_TIMEOUT).unwrap();
    assert_eq!(state(|s| s.touched.clone()), vec![1]);
    assert_eq!(engine.pci_bus_id(1).as_deref(), Some("0000:3c:00.0"));
    assert_callers_context_kept();
}

#[test]
fn every_engine_call_leaves_the_callers_current_context_as_it_was() {
    let _serial = fake::reset(1);
    state(|s| s.ordering[0] = 0);
    push_own(OWN);
    let memory = device_memory(0);
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    assert_callers_context_kept();
    let staging = Staging::new(
        engine.clone(),
        StagingConfig {
            buffers: 2,
            buffer_bytes: 4096,
            ..StagingConfig::default()
        },
    )
    .unwrap();
    assert_callers_context_kept();
    let buffer = staging.try_acquire().unwrap();
    let (base, len) = first_region(&memory);
    copy(
        &engine,
        CopyDirection::DeviceToHost,
        vec![CopyJob {
            dst: buffer.addr(),
            src: base as usize,
            len: 4096,
        }],
    )
    .unwrap();
    assert_callers_context_kept();
    let dma_buf = engine.export_dma_buf(0, base, len).unwrap();
    assert_eq!(dma_buf.offset, 0);
    engine.flush_remote_writes(0).unwrap();
    assert_callers_context_kept();
    drop(buffer);
    drop(staging);
    assert_callers_context_kept();
}

#[test]
fn dropping_the_engine_releases_its_contexts_streams_events_and_pins() {
    let _serial = fake::reset(2);
    let before = crate::engine::held();
    push_own(OWN);
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[0, 1], DEFAULT_COPY_TIMEOUT).unwrap();
    let staging = Staging::new(
        engine.clone(),
        StagingConfig {
            buffers: 3,
            buffer_bytes: 4096,
            ..StagingConfig::default()
        },
    )
    .unwrap();
    let mut host = vec![0u8; 4096];
    let buffer = staging.try_acquire().unwrap();
    copy(
        &engine,
        CopyDirection::HostToDevice,
        vec![CopyJob {
            dst: host.as_mut_ptr() as usize,
            src: buffer.addr(),
            len: 4096,
        }],
    )
    .unwrap();
    assert!(state(|s| s.pinned == 3 && s.events >= 1 && s.streams == 2));
    drop((buffer, staging, engine));
    let t0 = Instant::now();
    while state(|s| s.retained.iter().any(|r| *r != 0)) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "a context was never released"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    state(|s| assert_eq!((s.streams, s.events, s.pinned), (0, 0, 0), "{s:?}"));
    assert_eq!(
        crate::engine::held(),
        before,
        "what kvferry counts it holds"
    );
    assert_callers_context_kept();
}

#[test]
fn strided_rows_are_one_2d_copy_and_pages_that_continue_each_other_one_copy() {
    let _serial = fake::reset(1);
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    let device: Vec<u8> = (0..65536u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut staged = vec![0u8; 8192];
    let (d, h) = (device.as_ptr() as usize, staged.as_mut_ptr() as usize);
    // 16 head rows of 256 B, 1 KiB apart on the device, packed in the buffer.
    let rows: Vec<CopyJob> = (0..16)
        .map(|i| CopyJob {
            dst: h + i * 256,
            src: d + i * 1024,
            len: 256,
        })
        .collect();
    copy(&engine, CopyDirection::DeviceToHost, rows).unwrap();
    // Then one 4 KiB page after them, in two pieces that continue each other.
    let page = vec![
        CopyJob {
            dst: h + 4096,
            src: d + 32768,
            len: 2048,
        },
        CopyJob {
            dst: h + 6144,
            src: d + 34816,
            len: 2048,
        },
    ];
    copy(&engine, CopyDirection::DeviceToHost, page).unwrap();
    state(|s| assert_eq!((s.copies_2d, s.rows, s.copies), (1, 16, 1)));
    for i in 0..16 {
        assert_eq!(
            &staged[i * 256..(i + 1) * 256],
            &device[i * 1024..i * 1024 + 256]
        );
    }
    assert_eq!(&staged[4096..8192], &device[32768..36864]);
    assert_eq!(engine.counts().snapshot(), (2, 18, 2, 8192));
}

#[test]
fn a_driver_without_dma_buf_export_refuses_export_with_its_reason_and_never_panics() {
    let _serial = fake::reset(1);
    let memory = device_memory(0);
    let engine =
        CudaCopyEngine::open_with(fake::api(false, true), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    let (base, len) = first_region(&memory);
    let err = engine.export_dma_buf(0, base, len).unwrap_err();
    assert!(err.0.contains("cuMemGetHandleForAddressRange"), "{err}");
}

#[test]
fn a_device_without_dma_buf_support_refuses_export_naming_the_attribute() {
    let _serial = fake::reset(1);
    state(|s| s.dma_buf[0] = 0);
    let memory = device_memory(0);
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    let (base, len) = first_region(&memory);
    let err = engine.export_dma_buf(0, base, len).unwrap_err();
    assert!(err.0.contains("DMA_BUF_SUPPORTED"), "{err}");
}

#[test]
fn a_range_over_two_allocations_is_refused_as_spanning_them() {
    let _serial = fake::reset(1);
    let host = vec![0u8; 8192];
    let base = host.as_ptr() as u64;
    // An expandable segment: two allocations back to back.
    state(|s| {
        s.allocations
            .extend([(base, 4096, 0), (base + 4096, 4096, 0)])
    });
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    let err = engine.export_dma_buf(0, base, 8192).unwrap_err();
    assert!(err.0.contains("more than one CUDA allocation"), "{err}");
}

#[test]
fn weak_rdma_write_ordering_is_flushed_and_owner_ordering_needs_no_flush() {
    let _serial = fake::reset(2);
    state(|s| s.ordering = vec![0, 100]);
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[0, 1], DEFAULT_COPY_TIMEOUT).unwrap();
    assert!(engine.remote_writes_need_flush(0));
    assert!(!engine.remote_writes_need_flush(1));
    engine.flush_remote_writes(1).unwrap();
    assert_eq!(state(|s| s.flushes), 0);
    engine.flush_remote_writes(0).unwrap();
    assert_eq!(state(|s| s.flushes), 1);
}

#[test]
fn weak_ordering_on_a_driver_without_the_flush_gives_no_dma_buf() {
    let _serial = fake::reset(1);
    state(|s| s.ordering[0] = 0);
    let memory = device_memory(0);
    let engine =
        CudaCopyEngine::open_with(fake::api(true, false), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    let (base, len) = first_region(&memory);
    let err = engine.export_dma_buf(0, base, len).unwrap_err();
    assert!(err.0.contains("cuFlushGPUDirectRDMAWrites"), "{err}");
    assert!(engine.flush_remote_writes(0).is_err());
}

#[test]
fn a_batch_that_never_completes_fails_at_the_timeout_and_its_device_takes_no_more() {
    let _serial = fake::reset(1);
    state(|s| s.hang = true);
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[0], Duration::from_millis(50)).unwrap();
    let t0 = Instant::now();
    let err = copy(&engine, CopyDirection::DeviceToHost, vec![]).unwrap_err();
    assert!(err.0.contains("did not complete"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    state(|s| s.hang = false);
    let err = copy(&engine, CopyDirection::DeviceToHost, vec![]).unwrap_err();
    assert!(err.0.contains("stalled"), "{err}");
}

#[test]
fn a_device_pointer_registered_as_host_is_refused_naming_the_region() {
    let _serial = fake::reset(1);
    let memory = MemoryMap::allocate(layout());
    allocate_on_fake(&memory, 0);
    match verify_kinds_with(Ok(fake::api(true, true)), &memory) {
        Err(KindError::Mismatch(m)) => {
            assert_eq!(
                (m.registered, m.actual),
                (MemoryKind::Host, MemoryKind::Cuda { device: 0 })
            );
            assert_eq!(m.region, memory.kinds().next().unwrap().0);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_pointer_query_that_needs_a_context_is_asked_in_contexts_already_made_and_makes_none() {
    let _serial = fake::reset(3);
    state(|s| {
        s.pointers_need_context = true;
        s.active[2] = true;
    });
    let memory = MemoryMap::allocate(layout());
    allocate_on_fake(&memory, 2);
    match verify_kinds_with(Ok(fake::api(true, true)), &memory) {
        Err(KindError::Mismatch(m)) => assert_eq!(m.actual, MemoryKind::Cuda { device: 2 }),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        state(|s| s.touched.clone()),
        vec![2],
        "only the context someone made"
    );
    assert_eq!((current(), depth()), (0, 0));
}

#[test]
fn host_memory_in_a_process_with_no_device_context_is_host() {
    let _serial = fake::reset(2);
    state(|s| s.pointers_need_context = true);
    let memory = MemoryMap::allocate(layout());
    assert_eq!(
        verify_kinds_with(Ok(fake::api(true, true)), &memory),
        Ok(())
    );
    assert!(state(|s| s.touched.is_empty()));
}

#[test]
fn without_a_driver_host_memory_passes_and_device_memory_is_refused_naming_why() {
    let host = MemoryMap::allocate(layout());
    assert_eq!(verify_kinds_with(Err(GpuError::NoLibcuda), &host), Ok(()));
    assert_eq!(verify_kinds_with(Err(GpuError::NoDevice), &host), Ok(()));
    let device = MemoryMap::allocate_as_device(layout(), 0);
    match verify_kinds_with(Err(GpuError::NoLibcuda), &device) {
        Err(KindError::Unknown { why, .. }) => assert_eq!(why, GpuError::NoLibcuda),
        other => panic!("{other:?}"),
    }
    // A driver that cannot start in this process: no one here made device memory, so host
    // regions are host; device regions cannot be reached, and say why.
    let failing = GpuError::Driver("cuInit: CUDA_ERROR_SYSTEM_DRIVER_MISMATCH".to_owned());
    assert_eq!(verify_kinds_with(Err(failing.clone()), &host), Ok(()));
    match verify_kinds_with(Err(failing.clone()), &device) {
        Err(KindError::Unknown {
            region,
            registered,
            why,
        }) => {
            assert_eq!(why, failing);
            assert_eq!(registered, MemoryKind::Cuda { device: 0 });
            assert_ne!(region, Region::Scratch);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_node_over_fake_device_memory_moves_bytes_through_the_engine() {
    let _serial = fake::reset(1);
    let memory = device_memory(0);
    let engine: Arc<CudaCopyEngine> =
        CudaCopyEngine::open_with(fake::api(true, true), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    let staging = Staging::new(
        engine,
        StagingConfig {
            buffers: 2,
            buffer_bytes: 4096,
            ..StagingConfig::default()
        },
    )
    .unwrap();
    let memory = memory.with_staging(staging);
    let (region, _) = memory.region_lens().next().unwrap();
    let data: Vec<u8> = (0..10_000u32).map(|i| (i % 253) as u8).collect();
    memory.write(region, 100, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    memory.read(region, 100, &mut back).unwrap();
    assert_eq!(back, data);
}

#[test]
fn scattered_pages_are_one_batched_copy_where_the_driver_has_it() {
    let _serial = fake::reset(1);
    let engine =
        CudaCopyEngine::open_with(fake::api_batched(), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    let device: Vec<u8> = (0..65536u32).map(|i| (i * 13 % 251) as u8).collect();
    let mut staged = vec![0u8; 4 * 4096 + 16 * 256];
    let (d, h) = (device.as_ptr() as usize, staged.as_mut_ptr() as usize);
    // Four pages scattered on the device (two of them happen to line up as rows), then 16
    // strided rows.
    let order = [9usize, 2, 14, 5];
    let mut jobs: Vec<CopyJob> = order
        .iter()
        .enumerate()
        .map(|(i, &p)| CopyJob {
            dst: h + i * 4096,
            src: d + p * 4096,
            len: 4096,
        })
        .collect();
    jobs.extend((0..16).map(|i| CopyJob {
        dst: h + 4 * 4096 + i * 256,
        src: d + 40_000 + i * 1024,
        len: 256,
    }));
    copy(&engine, CopyDirection::DeviceToHost, jobs).unwrap();
    state(|s| {
        assert_eq!((s.batches, s.batched), (1, 4), "{s:?}");
        assert_eq!((s.copies, s.copies_2d), (0, 1), "{s:?}");
    });
    for (i, &p) in order.iter().enumerate() {
        assert_eq!(
            &staged[i * 4096..(i + 1) * 4096],
            &device[p * 4096..(p + 1) * 4096]
        );
    }
    for i in 0..16 {
        let (at, from) = (16384 + i * 256, 40_000 + i * 1024);
        assert_eq!(&staged[at..at + 256], &device[from..from + 256]);
    }
}
