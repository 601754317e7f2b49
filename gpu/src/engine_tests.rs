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

/// A process id that is not this test's: the engine maps its exports as another process's.
fn other_process() -> u32 {
    std::process::id() + 1
}

#[test]
fn an_ipc_export_names_the_allocation_and_where_the_region_starts_in_it() {
    let _serial = fake::reset(1);
    let host = vec![0u8; 3 * 4096];
    let base = host.as_ptr() as u64;
    state(|s| s.allocations.push((base, host.len(), 0)));
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    push_own(OWN);
    let export = engine
        .export_ipc(0, base + 4096, 4096, other_process())
        .unwrap()
        .remove(0);
    assert_eq!(export.offset, 4096);
    assert_eq!(&export.handle[..8], b"fakeipc\0");
    assert_eq!(state(|s| s.exported.clone()), vec![base]);
    let err = engine
        .export_ipc(0, base + 4096, 3 * 4096, other_process())
        .unwrap_err();
    assert!(err.0.contains("more than one CUDA allocation"), "{err}");
    assert_callers_context_kept();
}

#[test]
fn memory_the_driver_does_not_know_is_not_exported_and_the_error_says_why() {
    let _serial = fake::reset(1);
    let host = vec![0u8; 4096];
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    let err = engine
        .export_ipc(0, host.as_ptr() as u64, 4096, other_process())
        .unwrap_err();
    assert!(err.0.contains("cuMemGetAddressRange"), "{err}");
}

#[test]
fn a_peer_allocation_is_mapped_once_per_device_and_unmapped_when_its_last_region_lets_go() {
    let _serial = fake::reset(1);
    let peer = vec![0u8; 2 * 4096];
    let base = peer.as_ptr() as u64;
    state(|s| s.allocations.push((base, peer.len(), 0)));
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    push_own(OWN);
    let first = engine
        .export_ipc(0, base, 4096, other_process())
        .unwrap()
        .remove(0);
    let second = engine
        .export_ipc(0, base + 4096, 4096, other_process())
        .unwrap()
        .remove(0);
    let a = engine.import_ipc(0, other_process(), &first).unwrap();
    let b = engine.import_ipc(0, other_process(), &second).unwrap();
    assert_eq!((a.addr, b.addr), (base, base + 4096));
    assert_eq!(state(|s| (s.ipc_opens, s.ipc_open)), (1, 1), "one mapping");
    drop(a);
    assert_eq!(state(|s| s.ipc_open), 1, "the second region still uses it");
    drop(b);
    assert_eq!(state(|s| s.ipc_open), 0, "unmapped with its last region");
    let again = engine.import_ipc(0, other_process(), &first).unwrap();
    assert_eq!(state(|s| (s.ipc_opens, s.ipc_open)), (2, 1), "mapped anew");
    drop(again);
    assert_callers_context_kept();
}

#[test]
fn an_export_of_this_very_process_is_used_in_place_and_never_opened() {
    let _serial = fake::reset(1);
    let memory = device_memory(0);
    let (base, len) = first_region(&memory);
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    let export = engine
        .export_ipc(0, base, len as u64, std::process::id())
        .unwrap()
        .remove(0);
    assert!(
        state(|s| s.exported.is_empty()),
        "no handle for this process"
    );
    let mapping = engine.import_ipc(0, std::process::id(), &export).unwrap();
    assert_eq!(mapping.addr, base);
    assert!(mapping.keep.is_none());
    assert_eq!(state(|s| s.ipc_opens), 0);
}

#[test]
fn a_mapping_the_driver_refuses_fails_with_the_reason() {
    let _serial = fake::reset(1);
    let memory = device_memory(0);
    let (base, len) = first_region(&memory);
    state(|s| s.ipc_refused = true);
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    let export = engine
        .export_ipc(0, base, len as u64, other_process())
        .unwrap()
        .remove(0);
    let err = engine.import_ipc(0, other_process(), &export).unwrap_err();
    assert!(err.0.contains("cuIpcOpenMemHandle"), "{err}");
    assert!(err.0.contains("PEER_ACCESS_UNSUPPORTED"), "{err}");
}

#[test]
fn copies_into_a_mapped_peer_land_every_byte_runs_that_continue_each_other_in_one_call() {
    let _serial = fake::reset(1);
    let mut src = vec![0u8; 4 * 4096];
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let dst = vec![0u8; 4 * 4096];
    let (s0, d0) = (src.as_ptr() as usize, dst.as_ptr() as usize);
    state(|s| {
        s.allocations
            .extend([(s0 as u64, src.len(), 0), (d0 as u64, dst.len(), 0)])
    });
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    push_own(OWN);
    let export = engine
        .export_ipc(0, d0 as u64, dst.len() as u64, other_process())
        .unwrap()
        .remove(0);
    let mapping = engine.import_ipc(0, other_process(), &export).unwrap();
    let to = mapping.addr as usize;
    // Pages 0 and 1 continue each other on both sides; page 3 goes to page 2.
    let jobs = [
        CopyJob {
            dst: to,
            src: s0,
            len: 4096,
        },
        CopyJob {
            dst: to + 4096,
            src: s0 + 4096,
            len: 4096,
        },
        CopyJob {
            dst: to + 2 * 4096,
            src: s0 + 3 * 4096,
            len: 4096,
        },
    ];
    engine.copy_to_peer(0, &jobs).unwrap();
    assert_eq!(state(|s| s.copies_dtod), 2);
    assert_eq!(&dst[..2 * 4096], &src[..2 * 4096]);
    assert_eq!(&dst[2 * 4096..3 * 4096], &src[3 * 4096..]);
    assert!(
        dst[3 * 4096..].iter().all(|b| *b == 0),
        "nothing else written"
    );
    drop(mapping);
    assert_callers_context_kept();
}

#[test]
fn a_copy_into_a_peer_that_never_completes_fails_at_the_timeout_and_its_device_takes_no_more() {
    let _serial = fake::reset(1);
    state(|s| s.hang = true);
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[0], Duration::from_millis(50)).unwrap();
    let t0 = Instant::now();
    let err = engine.copy_to_peer(0, &[]).unwrap_err();
    assert!(err.0.contains("took over"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    state(|s| s.hang = false);
    let err = engine.copy_to_peer(0, &[]).unwrap_err();
    assert!(err.0.contains("stalled"), "{err}");
}

#[test]
fn on_a_driver_with_batched_copies_many_peer_runs_are_one_call() {
    let _serial = fake::reset(1);
    let src = vec![5u8; 8 * 4096];
    let dst = vec![0u8; 8 * 4096];
    let (s0, d0) = (src.as_ptr() as usize, dst.as_ptr() as usize);
    state(|s| {
        s.allocations
            .extend([(s0 as u64, src.len(), 0), (d0 as u64, dst.len(), 0)])
    });
    let engine =
        CudaCopyEngine::open_with(fake::api_batched(), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    let export = engine
        .export_ipc(0, d0 as u64, dst.len() as u64, other_process())
        .unwrap()
        .remove(0);
    let mapping = engine.import_ipc(0, other_process(), &export).unwrap();
    // Every other page: four runs that continue nothing.
    let jobs: Vec<CopyJob> = (0..4)
        .map(|i| CopyJob {
            dst: mapping.addr as usize + 2 * i * 4096,
            src: s0 + 2 * i * 4096,
            len: 4096,
        })
        .collect();
    engine.copy_to_peer(0, &jobs).unwrap();
    assert_eq!(state(|s| (s.batches, s.batched, s.copies_dtod)), (1, 4, 0));
    for i in 0..8 {
        let want = if i % 2 == 0 { 5 } else { 0 };
        assert!(
            dst[i * 4096..(i + 1) * 4096].iter().all(|b| *b == want),
            "page {i}"
        );
    }
}

/// Registers `len` bytes at `base` with the fake driver as an allocation the VMM API made.
fn vmm_allocation(base: u64, len: usize) {
    state(|s| {
        s.allocations.push((base, len, 0));
        s.vmm.push(base);
    });
}

#[test]
fn a_vmm_region_over_two_allocations_is_exported_as_one_descriptor_each() {
    let _serial = fake::reset(1);
    let memory = vec![0u8; 3 * 4096];
    let base = memory.as_ptr() as u64;
    vmm_allocation(base, 2 * 4096);
    vmm_allocation(base + 2 * 4096, 4096);
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    push_own(OWN);
    let pieces = engine
        .export_ipc(0, base + 4096, 2 * 4096, other_process())
        .unwrap();
    let shape: Vec<(u64, u64, u64, IpcHandleType)> = pieces
        .iter()
        .map(|p| (p.addr, p.len, p.offset, p.handle_type))
        .collect();
    assert_eq!(
        shape,
        vec![
            (base + 4096, 4096, 4096, IpcHandleType::PosixFd),
            (base + 2 * 4096, 4096, 0, IpcHandleType::PosixFd),
        ]
    );
    let sizes: Vec<u64> = pieces
        .iter()
        .map(|p| u64::from_le_bytes(p.handle[8..16].try_into().unwrap()))
        .collect();
    assert_eq!(sizes, vec![2 * 4096, 4096], "each allocation's whole size");
    assert!(
        pieces.iter().all(|p| p.keep.is_some()),
        "the descriptors are held"
    );
    assert_eq!(
        state(|s| (s.vmm_exports, s.vmm_refs)),
        (2, 0),
        "handles released"
    );
    assert!(
        state(|s| s.exported.is_empty()),
        "no legacy handle asked for"
    );
    assert_callers_context_kept();
}

#[test]
fn a_vmm_piece_is_mapped_through_the_exporters_descriptor_and_copies_land_in_its_allocation() {
    let _serial = fake::reset(1);
    let peer = vec![0u8; 3 * 4096];
    let base = peer.as_ptr() as u64;
    vmm_allocation(base, 2 * 4096);
    vmm_allocation(base + 2 * 4096, 4096);
    let src: Vec<u8> = (0..3 * 4096).map(|i| (i % 251) as u8).collect();
    state(|s| s.allocations.push((src.as_ptr() as u64, src.len(), 0)));
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    push_own(OWN);
    let pieces = engine
        .export_ipc(0, base, 3 * 4096, other_process())
        .unwrap();
    // The descriptors are this process's: it stands for the exporter here.
    let owner = std::process::id();
    let mappings: Vec<_> = pieces
        .iter()
        .map(|p| engine.import_ipc(0, owner, p).unwrap())
        .collect();
    drop(pieces);
    assert!(
        mappings.iter().all(|m| m.addr >= 0x6000_0000_0000),
        "mapped over reservations, not at the exporter's addresses"
    );
    assert_eq!(state(|s| (s.vmm_imports, s.vmm_maps.len())), (2, 2));
    let jobs = [
        CopyJob {
            dst: mappings[0].addr as usize,
            src: src.as_ptr() as usize,
            len: 2 * 4096,
        },
        CopyJob {
            dst: mappings[1].addr as usize,
            src: src.as_ptr() as usize + 2 * 4096,
            len: 4096,
        },
    ];
    engine.copy_to_peer(0, &jobs).unwrap();
    assert_eq!(peer, src, "every byte in the exporter's allocations");
    drop(mappings);
    assert_eq!(
        state(|s| (s.vmm_refs, s.vmm_maps.len(), s.reserved)),
        (0, 0, 0),
        "unmapped, freed and released with the last mapping"
    );
    assert_callers_context_kept();
}

#[test]
fn a_vmm_export_of_a_process_that_is_gone_is_refused_naming_why() {
    let _serial = fake::reset(1);
    let peer = vec![0u8; 4096];
    let base = peer.as_ptr() as u64;
    vmm_allocation(base, 4096);
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    let piece = engine
        .export_ipc(0, base, 4096, other_process())
        .unwrap()
        .remove(0);
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    gone.wait().unwrap();
    let err = engine.import_ipc(0, gone.id(), &piece).unwrap_err();
    assert!(err.0.contains("pidfd_open"), "{err}");
    assert_eq!(state(|s| (s.vmm_refs, s.reserved)), (0, 0));
}

#[test]
fn memory_offered_in_place_by_another_process_is_refused() {
    let _serial = fake::reset(1);
    let memory = device_memory(0);
    let (base, len) = first_region(&memory);
    let engine =
        CudaCopyEngine::open_with(fake::api(true, true), &[0], DEFAULT_COPY_TIMEOUT).unwrap();
    let piece = IpcExport {
        handle_type: IpcHandleType::InPlace,
        handle: [0; 64],
        addr: base,
        len: len as u64,
        offset: 0,
        keep: None,
    };
    let err = engine.import_ipc(0, other_process(), &piece).unwrap_err();
    assert!(err.0.contains("in place"), "{err}");
}
