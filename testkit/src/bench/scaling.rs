//! Room lifecycles per second through the glommio driver as shards are added.

use super::*;

/// One point of the glommio scaling sweep.
#[derive(Clone, Debug)]
pub struct ScalePoint {
    /// Shards of both the prefill and the decode node.
    pub shards: usize,
    /// Room lifecycles (open, transfer, verify, release) per second.
    pub rooms_per_s: f64,
    /// Payload throughput.
    pub gbps: f64,
    /// rooms/s relative to one shard.
    pub speedup: f64,
    /// speedup / shards (1.0 is linear).
    pub efficiency: f64,
    /// Every room succeeded and every page verified.
    pub clean: bool,
}

/// Room lifecycles per second through a glommio prefill and decode pair on loopback, with 1,
/// 2, ... shards each up to `most` (default: the number of cores; small rooms: 2 layers x
/// K/V x one 4 KiB page).
///
/// A point with `k` shards runs on cores `0..k` only: both nodes are started from a thread
/// confined to those cores (their unpinned shards keep its affinity), and the embedder that
/// opens, fills, verifies and releases the rooms runs on a tokio runtime of `k` threads
/// confined to the same cores. Otherwise the one-shard point
/// would get a second core for free (the embedder's), and the curve would say nothing about
/// how the driver scales with cores.
pub async fn scaling(
    rooms: u64,
    most: Option<usize>,
) -> Result<Vec<ScalePoint>, kvferry_tokio::NodeError> {
    use crate::{node_config, run_pair, DecodeRun, Runtime, Shape};
    use kvferry_core::Role;
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let mut points: Vec<ScalePoint> = Vec::new();
    for shards in 1..=most.unwrap_or(cores).max(1) {
        let shape = Shape {
            layers: 2,
            planes: 2,
            page_bytes: 4096,
            pages_per_room: 1,
            prefix_pages: 0,
            chunks: 1,
            concurrency: 64 * shards,
            layerwise: false,
            layer_compute: Duration::ZERO,
            data_connections: 1,
        };
        let runtime = Runtime::Glommio { shards, pin: false };
        let core = kvferry_core::Config::default();
        let token = b"kvferry-bench";
        let nodes_shape = shape.clone();
        let (p, d) = on_cores(shards, move || {
            let shape = nodes_shape;
            let p = runtime.start_paired(
                node_config(Role::Prefill, &shape, core.clone(), token, 1),
                Arc::new(MemoryMap::allocate(shape.layout())),
            )?;
            let d = runtime.start_paired(
                node_config(Role::Decode, &shape, core, token, 2),
                Arc::new(MemoryMap::allocate(shape.layout())),
            )?;
            Ok((p, d))
        })?;
        let run = DecodeRun {
            rooms,
            shape: shape.clone(),
            first_room: 1,
            progress: None,
            deadline: Duration::from_secs(120),
            abort_rate: 0.0,
            seed: 0,
        };
        let embedder = confined_runtime(shards)?;
        let report = embedder
            .spawn(async move { run_pair(&p, &d, run).await })
            .await
            .map_err(|e| kvferry_tokio::NodeError::Io(std::io::Error::other(e.to_string())))??;
        embedder.shutdown_background();
        let rooms_per_s = report.rooms_succeeded as f64 / report.elapsed_s.max(1e-9);
        let base = points.first().map_or(rooms_per_s, |p| p.rooms_per_s);
        points.push(ScalePoint {
            shards,
            rooms_per_s,
            gbps: report.throughput_gbps,
            speedup: rooms_per_s / base,
            efficiency: rooms_per_s / base / shards as f64,
            clean: report.rooms_succeeded == rooms && report.pages_corrupted == 0,
        });
    }
    Ok(points)
}

/// A tokio runtime of `cores` threads, every one of them confined to cores `0..cores`.
/// Runs `start` on a thread confined to cores `0..cores`: threads it starts (a glommio node's
/// unpinned shards) keep that affinity.
fn on_cores<T: Send + 'static>(
    cores: usize,
    start: impl FnOnce() -> Result<T, kvferry_tokio::NodeError> + Send + 'static,
) -> Result<T, kvferry_tokio::NodeError> {
    let mut set = rustix::process::CpuSet::new();
    for cpu in 0..cores {
        set.set(cpu);
    }
    std::thread::spawn(move || {
        // Unconfined is still a valid (if less telling) measurement: carry on.
        let _ = rustix::process::sched_setaffinity(None, &set);
        start()
    })
    .join()
    .map_err(|_| {
        kvferry_tokio::NodeError::Io(std::io::Error::other("starting the nodes panicked"))
    })?
}

fn confined_runtime(cores: usize) -> Result<tokio::runtime::Runtime, kvferry_tokio::NodeError> {
    let mut set = rustix::process::CpuSet::new();
    for cpu in 0..cores {
        set.set(cpu);
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores)
        .on_thread_start(move || {
            // Unconfined is still a valid (if less telling) measurement: carry on.
            let _ = rustix::process::sched_setaffinity(None, &set);
        })
        .enable_all()
        .build()
        .map_err(|e| kvferry_tokio::NodeError::Io(std::io::Error::other(e.to_string())))
}
