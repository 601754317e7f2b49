//! CUDA IPC between two processes on GPU 0 (feature `gpu`; skips with its reason where no GPU
//! is usable): this test's process copies with its copy engine into memory another process
//! allocated and exported, and the other process checks every byte; once for `cuMemAlloc`
//! memory (an IPC handle) and once for the VMM API's (two allocations mapped into one range,
//! each exported as a file descriptor). Figures: GB/s of the copies against the same run's
//! `cuMemcpyDtoD` of the same bytes inside one process.
#![cfg(feature = "gpu")]
#![allow(clippy::unwrap_used)] // tests may panic

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Instant;

use kvferry_gpu::cuda::cudarc::driver::sys;
use kvferry_gpu::cuda::Gpu;
use kvferry_gpu::engine::CudaCopyEngine;
use kvferry_memory::{CopyEngine, CopyJob, IpcExport, IpcHandleType, IpcMapping};

/// Set in the exporting process's environment: how it allocates (`legacy` or `vmm`).
const CHILD: &str = "KVFERRY_CUDA_IPC_CHILD";
/// Bytes exported and copied: 4096 pages of 16 KiB.
const BYTES: usize = 64 << 20;
const PAGE: usize = 16 << 10;
const PAGES: usize = BYTES / PAGE;
/// Page `k` of the source goes to page `k * STEP % PAGES` of the destination (odd: a
/// permutation, and no two neighbours stay neighbours).
const STEP: usize = 1031;

/// The byte at `i` of a source filled for `seed`.
fn pattern(seed: u64, i: usize) -> u8 {
    ((i as u64).wrapping_mul(2654435761).wrapping_add(seed * 977) >> 7) as u8
}

/// `bytes` of device memory from `cuMemAlloc` (the kind a handle exports: torch's caching
/// allocator makes these; a memory pool's would not export).
fn alloc(bytes: usize) -> u64 {
    let mut ptr = 0u64;
    // SAFETY: the context Gpu::open made current; the driver writes one address.
    unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }
        .result()
        .unwrap();
    ptr
}

fn upload(dst: u64, host: &[u8]) {
    // SAFETY: `dst` holds `host.len()` bytes of this context's memory; synchronous copy.
    unsafe { sys::cuMemcpyHtoD_v2(dst, host.as_ptr().cast(), host.len()) }
        .result()
        .unwrap();
}

fn download(src: u64, host: &mut [u8]) {
    // SAFETY: `src` holds `host.len()` bytes of this context's memory; synchronous copy.
    unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), src, host.len()) }
        .result()
        .unwrap();
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// `bytes` of device memory from the VMM API: two physical allocations, each requested
/// shareable as a file descriptor, mapped one after the other into one reservation (as
/// PyTorch's expandable segments grow). Returns the address and what frees it.
fn alloc_vmm(bytes: usize) -> (u64, Vec<sys::CUmemGenericAllocationHandle>) {
    let half = bytes / 2;
    // SAFETY (every call below): the context Gpu::open made current; each call writes only
    // the value it is given a pointer to.
    unsafe {
        let mut prop: sys::CUmemAllocationProp = std::mem::zeroed();
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = 0;
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        let mut granularity = 0usize;
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
        .result()
        .unwrap();
        assert_eq!(
            half % granularity,
            0,
            "half of {bytes} is not a multiple of {granularity}"
        );
        let mut base = 0u64;
        sys::cuMemAddressReserve(&mut base, bytes, 0, 0, 0)
            .result()
            .unwrap();
        let mut handles = Vec::new();
        for k in 0..2u64 {
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            sys::cuMemCreate(&mut h, half, &prop, 0).result().unwrap();
            sys::cuMemMap(base + k * half as u64, half, 0, h, 0)
                .result()
                .unwrap();
            handles.push(h);
        }
        let access = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        sys::cuMemSetAccess(base, bytes, &access, 1)
            .result()
            .unwrap();
        (base, handles)
    }
}

/// The exporting process of the tests below (started by them with `CHILD` set; returns at
/// once otherwise): allocates, exports to its parent (one `PIECE` line each), then answers
/// `CHECK <seed> <paged>` with what it finds in its memory, until `QUIT`.
#[test]
fn cuda_ipc_exporter_process() {
    let Some(kind) = std::env::var_os(CHILD) else {
        return;
    };
    let _g = Gpu::open(0).unwrap();
    let engine = CudaCopyEngine::open(&[0]).unwrap();
    let (dst, vmm) = if kind == "vmm" {
        alloc_vmm(BYTES)
    } else {
        (alloc(BYTES), Vec::new())
    };
    upload(dst, &vec![0u8; BYTES]);
    let parent = std::os::unix::process::parent_id();
    let pieces = engine.export_ipc(0, dst, BYTES as u64, parent).unwrap();
    for p in &pieces {
        println!(
            "PIECE {} {} {} {} {}",
            p.handle_type.code(),
            hex(&p.handle),
            p.offset,
            p.addr,
            p.len
        );
    }
    println!("EXPORTED");
    let mut got = vec![0u8; BYTES];
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["CHECK", seed, paged] => {
                let seed: u64 = seed.parse().unwrap();
                download(dst, &mut got);
                let wrong = (0..PAGES)
                    .flat_map(|k| {
                        let to = if *paged == "1" { k * STEP % PAGES } else { k };
                        (0..PAGE).map(move |b| (to * PAGE + b, k * PAGE + b))
                    })
                    .filter(|&(at, from)| got[at] != pattern(seed, from))
                    .count();
                println!("CHECKED {wrong}");
            }
            _ => break,
        }
    }
    drop(pieces);
    // SAFETY: allocated above; the parent unmapped it (or is gone).
    unsafe {
        if vmm.is_empty() {
            let _ = sys::cuMemFree_v2(dst);
        } else {
            let _ = sys::cuMemUnmap(dst, BYTES);
            let _ = sys::cuMemAddressFree(dst, BYTES);
            for h in vmm {
                let _ = sys::cuMemRelease(h);
            }
        }
    }
}

/// Best of three timings of `f`, in seconds.
fn best(mut f: impl FnMut()) -> f64 {
    (0..3)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

#[test]
fn copies_into_another_processs_exported_memory_land_every_byte() {
    copy_into_another_process("legacy", "cuda_ipc");
}

#[test]
fn copies_into_another_processs_vmm_memory_land_every_byte() {
    copy_into_another_process("vmm", "cuda_ipc_vmm");
}

/// Copies into memory of `kind` another process exported, checked there; prints the
/// figures under `check`.
// Runs only where a GPU is lent (none has been yet): kept in one piece, as written against
// the driver's documentation, until a GPU run has checked it; split it after that run.
fn copy_into_another_process(kind: &str, check_name: &str) {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let g = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("SKIPPED: no usable GPU here ({e})");
            return;
        }
    };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "cuda_ipc_exporter_process",
            "--exact",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD, kind)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut to_child = child.stdin.take().unwrap();
    let mut from_child = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut lines = || -> (String, Vec<String>) {
        loop {
            let line = from_child
                .next()
                .expect("the exporting process ended early")
                .unwrap();
            let mut words = line.split_whitespace().map(str::to_owned);
            let first = words.next().unwrap_or_default();
            if ["PIECE", "EXPORTED", "CHECKED"].contains(&first.as_str()) {
                return (first, words.collect());
            }
        }
    };
    let engine = CudaCopyEngine::open(&[0]).unwrap();
    // Each piece mapped here, with where it starts in the exported range.
    let mut pieces: Vec<(usize, usize, IpcMapping)> = Vec::new();
    loop {
        let (what, words) = lines();
        if what == "EXPORTED" {
            break;
        }
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&unhex(&words[1]));
        let export = IpcExport {
            handle_type: IpcHandleType::from_code(words[0].parse().unwrap()).unwrap(),
            handle,
            offset: words[2].parse().unwrap(),
            addr: words[3].parse().unwrap(),
            len: words[4].parse().unwrap(),
            keep: None,
        };
        let mapping = engine.import_ipc(0, child.id(), &export).unwrap();
        pieces.push((0, export.len as usize, mapping));
    }
    let mut at = 0;
    for piece in &mut pieces {
        piece.0 = at;
        at += piece.1;
    }
    assert_eq!(at, BYTES, "the pieces cover the export");
    if kind == "vmm" {
        assert_eq!(pieces.len(), 2, "one piece per allocation");
    }
    // `len` bytes to `offset` of the exported range from `src`, one job per piece it touches.
    let jobs_to = |offset: usize, src: usize, len: usize, jobs: &mut Vec<CopyJob>| {
        let mut done = 0;
        while done < len {
            let at = offset + done;
            let (start, plen, mapping) = pieces
                .iter()
                .find(|(start, plen, _)| at >= *start && at < start + plen)
                .unwrap();
            let n = (len - done).min(start + plen - at);
            jobs.push(CopyJob {
                dst: mapping.addr as usize + (at - start),
                src: src + done,
                len: n,
            });
            done += n;
        }
    };
    let src = alloc(BYTES);
    let local = alloc(BYTES);
    let mut check = |seed: u64, paged: bool| -> usize {
        writeln!(to_child, "CHECK {seed} {}", u8::from(paged)).unwrap();
        lines().1[0].parse().unwrap()
    };
    let fill = |seed: u64| {
        upload(
            src,
            &(0..BYTES).map(|i| pattern(seed, i)).collect::<Vec<_>>(),
        )
    };

    // One 64 MiB run (one job per piece).
    fill(1);
    let mut whole = Vec::new();
    jobs_to(0, src as usize, BYTES, &mut whole);
    let whole_s = best(|| engine.copy_to_peer(0, &whole).unwrap());
    assert_eq!(check(1, false), 0, "bytes wrong after the 64 MiB copy");

    // 4096 pages of 16 KiB, each to a page that is not its neighbour's neighbour.
    fill(2);
    let mut pages = Vec::new();
    for k in 0..PAGES {
        jobs_to(
            (k * STEP % PAGES) * PAGE,
            src as usize + k * PAGE,
            PAGE,
            &mut pages,
        );
    }
    let pages_s = best(|| engine.copy_to_peer(0, &pages).unwrap());
    assert_eq!(check(2, true), 0, "bytes wrong after the paged copy");

    // The same bytes inside this process, one cuMemcpyDtoD each.
    let peak_s = best(|| {
        // SAFETY: two allocations of this context of BYTES each; synchronous copy.
        unsafe { sys::cuMemcpyDtoD_v2(local, src, BYTES) }
            .result()
            .unwrap();
        // SAFETY: waits for this context's work; no pointers.
        unsafe { sys::cuCtxSynchronize() }.result().unwrap();
    });
    drop(pieces);
    writeln!(to_child, "QUIT").unwrap();
    drop(to_child);
    assert!(
        child.wait().unwrap().success(),
        "the exporting process failed"
    );
    // SAFETY: allocated above, no copy in flight.
    unsafe {
        let _ = sys::cuMemFree_v2(src);
        let _ = sys::cuMemFree_v2(local);
    }
    drop(g);
    let gbps = |s: f64| BYTES as f64 / s / 1e9;
    // The handle's figures are the gated ones; the VMM API's are reported beside them.
    let gated = |target: &'static str| if kind == "legacy" { target } else { "null" };
    for (workload, s, target) in [
        ("contiguous_64MiB", whole_s, gated("0.8")),
        ("pages_16KiB", pages_s, "null"),
    ] {
        println!(
            "{{\"check\":\"{check_name}\",\"workload\":\"{workload}\",\"gbps\":{:.1},\"peak_gbps\":{:.1},\"ratio\":{:.3},\"target\":{target}}}",
            gbps(s),
            gbps(peak_s),
            peak_s / s
        );
    }
}
