//! The engine between processes on one host: cudaIpc and VMM exports, mappings, copies.

use super::*;

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
