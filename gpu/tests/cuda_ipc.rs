//! CUDA IPC between two processes on GPU 0 (feature `gpu`; skips with its reason where no GPU
//! is usable): this test's process copies with its copy engine into memory another process
//! allocated and exported, and the other process checks every byte. Figures: GB/s of the
//! copies against the same run's `cuMemcpyDtoD` of the same bytes inside one process.
#![cfg(feature = "gpu")]
#![allow(clippy::unwrap_used)] // tests may panic

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Instant;

use kvferry_gpu::cuda::cudarc::driver::sys;
use kvferry_gpu::cuda::Gpu;
use kvferry_gpu::engine::CudaCopyEngine;
use kvferry_memory::{CopyEngine, CopyJob, IpcExport};

/// Set in the exporting process's environment.
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

/// The exporting process of the test below (started by it with `CHILD` set; returns at once
/// otherwise): allocates, exports to its parent, then answers `CHECK <seed> <paged>` with
/// what it finds in its memory, until `QUIT`.
#[test]
fn cuda_ipc_exporter_process() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let _g = Gpu::open(0).unwrap();
    let engine = CudaCopyEngine::open(&[0]).unwrap();
    let dst = alloc(BYTES);
    upload(dst, &vec![0u8; BYTES]);
    let parent = std::os::unix::process::parent_id();
    let export = engine.export_ipc(0, dst, BYTES as u64, parent).unwrap();
    println!("EXPORT {} {} {}", hex(&export.handle), export.offset, dst);
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
    // SAFETY: allocated above; the parent unmapped it (or is gone).
    let _ = unsafe { sys::cuMemFree_v2(dst) };
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
        .env(CHILD, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut to_child = child.stdin.take().unwrap();
    let mut from_child = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next = |prefix: &str| -> Vec<String> {
        loop {
            let line = from_child
                .next()
                .expect("the exporting process ended early")
                .unwrap();
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.split_whitespace().map(str::to_owned).collect();
            }
        }
    };
    let words = next("EXPORT ");
    let mut handle = [0u8; 64];
    handle.copy_from_slice(&unhex(&words[0]));
    let export = IpcExport {
        handle,
        offset: words[1].parse().unwrap(),
    };
    let owner_addr: u64 = words[2].parse().unwrap();
    let engine = CudaCopyEngine::open(&[0]).unwrap();
    let mapping = engine
        .import_ipc(0, child.id(), owner_addr, &export)
        .unwrap();
    let src = alloc(BYTES);
    let local = alloc(BYTES);
    let mut check = |seed: u64, paged: bool| -> usize {
        writeln!(to_child, "CHECK {seed} {}", u8::from(paged)).unwrap();
        next("CHECKED ")[0].parse().unwrap()
    };
    let fill = |seed: u64| {
        upload(
            src,
            &(0..BYTES).map(|i| pattern(seed, i)).collect::<Vec<_>>(),
        )
    };

    // One 64 MiB run.
    fill(1);
    let whole = [CopyJob {
        dst: mapping.addr as usize,
        src: src as usize,
        len: BYTES,
    }];
    let whole_s = best(|| engine.copy_to_peer(0, &whole).unwrap());
    assert_eq!(check(1, false), 0, "bytes wrong after the 64 MiB copy");

    // 4096 pages of 16 KiB, each to a page that is not its neighbour's neighbour.
    fill(2);
    let pages: Vec<CopyJob> = (0..PAGES)
        .map(|k| CopyJob {
            dst: mapping.addr as usize + (k * STEP % PAGES) * PAGE,
            src: src as usize + k * PAGE,
            len: PAGE,
        })
        .collect();
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
    drop(mapping);
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
    for (workload, s, target) in [
        ("contiguous_64MiB", whole_s, "0.8"),
        ("pages_16KiB", pages_s, "null"),
    ] {
        println!(
            "{{\"check\":\"cuda_ipc\",\"workload\":\"{workload}\",\"gbps\":{:.1},\"peak_gbps\":{:.1},\"ratio\":{:.3},\"target\":{target}}}",
            gbps(s),
            gbps(peak_s),
            peak_s / s
        );
    }
}
