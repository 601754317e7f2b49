//! `kvferry bench --copy-engine`: a copy engine moving the batches the staged data plane
//! gives it (1 MiB staging buffers: contiguous runs, scattered 4 KiB pages, 256 B head rows at
//! a stride), each as GB/s and as a ratio to the same run's peak: one copy of 64 MiB in a
//! single call, between the same memories. Through the host copy engine here (what the
//! figures show is the calls a batch becomes); through the CUDA engine on a GPU
//! (`--gpu`), where the targets apply.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_memory::{CopyCounts, CopyDirection, CopyEngine, CopyJob, HostBuffer};

/// A staging buffer's size, as the staged data plane uses by default.
const BUFFER: usize = 1 << 20;
/// Staging buffers the batches cycle through (the default pool).
const BUFFERS: usize = 16;
/// Bytes every workload moves (the rows move a quarter: 256 of every 1024).
const TOTAL: usize = 64 << 20;

/// One workload in one direction.
#[derive(Clone, Debug)]
pub struct CopyFigure {
    /// `contiguous`, `pages_4k`, `rows_256b`.
    pub workload: &'static str,
    /// `d2h` or `h2d`.
    pub direction: &'static str,
    /// The engine's name (`cuda`, `host`).
    pub engine: &'static str,
    /// Bytes moved.
    pub bytes: u64,
    /// Pieces per batch the data plane asked for.
    pub jobs_per_batch: f64,
    /// Calls per batch the engine made for them.
    pub calls_per_batch: f64,
    /// Throughput, median of the iterations.
    pub gbps: f64,
    /// The same run's single-call 64 MiB copy, same direction.
    pub peak_gbps: f64,
    /// `gbps / peak_gbps`.
    pub ratio: f64,
    /// The ratio a GPU must reach.
    pub target: f64,
}

impl CopyFigure {
    /// One JSON object (the GPU check's figure line).
    pub fn json(&self) -> String {
        format!(
            "{{\"check\":\"copy_engine\",\"workload\":\"{}\",\"direction\":\"{}\",\"engine\":\"{}\",\"bytes\":{},\"jobs_per_batch\":{:.1},\"calls_per_batch\":{:.1},\"gbps\":{:.3},\"peak_gbps\":{:.3},\"ratio\":{:.3},\"target\":{:.2}}}",
            self.workload,
            self.direction,
            self.engine,
            self.bytes,
            self.jobs_per_batch,
            self.calls_per_batch,
            self.gbps,
            self.peak_gbps,
            self.ratio,
            self.target
        )
    }

    /// One line for a person.
    pub fn text(&self) -> String {
        format!(
            "{:<10} {:>3}  {:>7.2} GB/s  peak {:>7.2} GB/s  ratio {:.2} (GPU target >= {:.2})  {:>5.0} pieces -> {:>4.0} calls per 1 MiB batch",
            self.workload,
            self.direction,
            self.gbps,
            self.peak_gbps,
            self.ratio,
            self.target,
            self.jobs_per_batch,
            self.calls_per_batch
        )
    }
}

/// The memory a bench copies from and into: "device" memory (a GPU's, or host memory for the
/// host engine) of at least 64 MiB.
#[derive(Clone, Copy, Debug)]
pub struct DeviceSpan {
    /// The device ordinal the engine copies on.
    pub device: u32,
    /// Its first byte's address.
    pub base: usize,
    /// Its length (at least 64 MiB).
    pub len: usize,
}

/// Runs every workload both ways through `engine` (whose counts are `counts`), `iterations`
/// times each; the median of each.
pub fn copy_engine(
    engine: Arc<dyn CopyEngine>,
    counts: &CopyCounts,
    span: DeviceSpan,
    iterations: usize,
) -> Result<Vec<CopyFigure>, String> {
    if span.len < TOTAL {
        return Err(format!("the bench needs {TOTAL} bytes of device memory"));
    }
    let mut buffers: Vec<HostBuffer> = (0..BUFFERS).map(|_| HostBuffer::new(BUFFER)).collect();
    let mut whole = HostBuffer::new(TOTAL);
    for b in buffers.iter_mut().chain(std::iter::once(&mut whole)) {
        engine.pin(b).map_err(|e| e.to_string())?;
    }
    let result = figures(&*engine, counts, span, &buffers, &whole, iterations.max(1));
    for b in buffers.iter_mut().chain(std::iter::once(&mut whole)) {
        engine.unpin(b);
    }
    result
}

fn figures(
    engine: &dyn CopyEngine,
    counts: &CopyCounts,
    span: DeviceSpan,
    buffers: &[HostBuffer],
    whole: &HostBuffer,
    iterations: usize,
) -> Result<Vec<CopyFigure>, String> {
    let addr = |b: &HostBuffer| b.as_slice().as_ptr() as usize;
    let staged: Vec<usize> = buffers.iter().map(addr).collect();
    let mut out = Vec::new();
    for (direction, name) in [
        (CopyDirection::DeviceToHost, "d2h"),
        (CopyDirection::HostToDevice, "h2d"),
    ] {
        // Host and device offsets of each piece: `(device offset, staged offset, len)`.
        let peak_plan = vec![vec![(0usize, 0usize, TOTAL)]];
        let peak = run(
            engine,
            counts,
            span,
            direction,
            &[addr(whole)],
            &peak_plan,
            iterations,
        )?;
        for (workload, target, plan) in [
            ("contiguous", 0.9, contiguous()),
            ("pages_4k", 0.8, scattered_pages()),
            ("rows_256b", 0.5, strided_rows()),
        ] {
            let m = run(engine, counts, span, direction, &staged, &plan, iterations)?;
            out.push(CopyFigure {
                workload,
                direction: name,
                engine: engine.name(),
                bytes: m.bytes,
                jobs_per_batch: m.jobs_per_batch,
                calls_per_batch: m.calls_per_batch,
                gbps: m.gbps,
                peak_gbps: peak.gbps,
                ratio: m.gbps / peak.gbps,
                target,
            });
        }
    }
    Ok(out)
}

/// One batch per staging buffer: `(device offset, offset in the buffer, len)` per piece.
type Plan = Vec<Vec<(usize, usize, usize)>>;

/// 64 batches of one 1 MiB run each.
fn contiguous() -> Plan {
    (0..TOTAL / BUFFER)
        .map(|i| vec![(i * BUFFER, 0, BUFFER)])
        .collect()
}

/// Every 4 KiB page of 64 MiB in a shuffled order, 256 to a batch (a room's pages as a
/// block allocator hands them out after a while).
fn scattered_pages() -> Plan {
    const PAGE: usize = 4096;
    let mut pages: Vec<usize> = (0..TOTAL / PAGE).collect();
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    for i in (1..pages.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        pages.swap(i, (seed % (i as u64 + 1)) as usize);
    }
    pages
        .chunks(BUFFER / PAGE)
        .map(|c| {
            c.iter()
                .enumerate()
                .map(|(k, &p)| (p * PAGE, k * PAGE, PAGE))
                .collect()
        })
        .collect()
}

/// 256 B rows 1 KiB apart (one of four heads' slices of each token), packed in the buffer.
fn strided_rows() -> Plan {
    const ROW: usize = 256;
    const PITCH: usize = 1024;
    let per_batch = BUFFER / ROW;
    (0..TOTAL / PITCH / per_batch)
        .map(|b| {
            (0..per_batch)
                .map(|k| ((b * per_batch + k) * PITCH, k * ROW, ROW))
                .collect()
        })
        .collect()
}

/// What one workload measured.
struct Measured {
    bytes: u64,
    jobs_per_batch: f64,
    calls_per_batch: f64,
    gbps: f64,
}

/// Starts every batch of `plan` (batch `i` through `staged[i % len]`), waits for all; the
/// median over `iterations`.
fn run(
    engine: &dyn CopyEngine,
    counts: &CopyCounts,
    span: DeviceSpan,
    direction: CopyDirection,
    staged: &[usize],
    plan: &Plan,
    iterations: usize,
) -> Result<Measured, String> {
    let bytes: usize = plan.iter().flatten().map(|p| p.2).sum();
    let (b0, j0, c0, _) = counts.snapshot();
    let mut times = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let (tx, rx) = std::sync::mpsc::channel();
        let t0 = Instant::now();
        for (i, batch) in plan.iter().enumerate() {
            let buffer = staged[i % staged.len()];
            let jobs = batch
                .iter()
                .map(|&(dev, at, len)| match direction {
                    CopyDirection::DeviceToHost => CopyJob {
                        dst: buffer + at,
                        src: span.base + dev,
                        len,
                    },
                    CopyDirection::HostToDevice => CopyJob {
                        dst: span.base + dev,
                        src: buffer + at,
                        len,
                    },
                })
                .collect();
            let tx = tx.clone();
            engine.start(
                span.device,
                direction,
                jobs,
                Box::new(move |r| {
                    let _ = tx.send(r);
                }),
            );
        }
        for _ in 0..plan.len() {
            rx.recv_timeout(Duration::from_secs(60))
                .map_err(|_| "a copy batch did not end within 60 s".to_owned())?
                .map_err(|e| e.to_string())?;
        }
        times.push(t0.elapsed());
    }
    times.sort();
    let median = times[times.len() / 2].as_secs_f64();
    let (b1, j1, c1, _) = counts.snapshot();
    let batches = (b1 - b0).max(1) as f64;
    Ok(Measured {
        bytes: bytes as u64,
        jobs_per_batch: (j1 - j0) as f64 / batches,
        calls_per_batch: (c1 - c0) as f64 / batches,
        gbps: bytes as f64 / median / 1e9,
    })
}

/// The host copy engine over 64 MiB of host memory standing in for device memory.
pub fn copy_engine_host(iterations: usize) -> Result<Vec<CopyFigure>, String> {
    let engine = kvferry_memory::HostCopyEngine::new(Duration::ZERO);
    let device = HostBuffer::new(TOTAL);
    let span = DeviceSpan {
        device: 0,
        base: device.as_slice().as_ptr() as usize,
        len: TOTAL,
    };
    copy_engine(engine.clone(), engine.counts(), span, iterations)
}

/// The CUDA copy engine over 64 MiB of GPU 0's memory (feature `gpu`).
#[cfg(feature = "gpu")]
pub fn copy_engine_cuda(iterations: usize) -> Result<Vec<CopyFigure>, String> {
    let gpu = kvferry_gpu::cuda::Gpu::open(0).map_err(|e| e.to_string())?;
    let region = gpu.alloc_ordered(TOTAL).map_err(|e| e.to_string())?;
    let engine = kvferry_gpu::engine::CudaCopyEngine::open(&[0]).map_err(|e| e.to_string())?;
    let span = DeviceSpan {
        device: 0,
        base: region.device_addr(&gpu) as usize,
        len: TOTAL,
    };
    copy_engine(engine.clone(), engine.counts(), span, iterations)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests may panic

    use super::*;

    #[test]
    fn the_host_engine_bench_reports_every_workload_and_the_calls_they_became() {
        let figures = copy_engine_host(1).unwrap();
        assert_eq!(figures.len(), 6);
        let calls = |w: &str| {
            figures
                .iter()
                .find(|f| f.workload == w)
                .map(|f| (f.jobs_per_batch, f.calls_per_batch))
                .unwrap()
        };
        assert_eq!(calls("contiguous"), (1.0, 1.0));
        assert_eq!(
            calls("rows_256b"),
            (4096.0, 1.0),
            "rows become one strided copy"
        );
        let (jobs, pages) = calls("pages_4k");
        assert_eq!(jobs, 256.0);
        // Shuffled pages merge only where two happen to line up as rows.
        assert!(
            (100.0..256.0).contains(&pages),
            "scattered pages stay about one call each: {pages}"
        );
        assert!(figures.iter().all(|f| f.gbps > 0.0 && f.ratio > 0.0));
    }
}
