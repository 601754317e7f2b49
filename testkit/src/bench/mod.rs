//! `kvferry bench`: kvferry's TCP data plane on tokio and on glommio against a plain TCP
//! socket pair, same workloads, one run. Each figure is the median of its iterations.
//!
//! The raw pair runs on tokio; the glommio data plane runs its sender and receiver on two
//! executors (one per core where the machine allows), each operation written and acknowledged
//! before the next as on tokio.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_core::{
    Layout, OpKind, Region, RoomId, SessionId, Slice, TransferId, TransferOp, TransferOutcome,
};
use kvferry_driver::{CoreCheck, EndpointAccess, FaultPlan};
use kvferry_memory::MemoryMap;
use kvferry_tcp::{serve_writes, DataSender, Limits, Report};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// One workload's figures on one runtime.
#[derive(Clone, Debug)]
pub struct BenchResult {
    /// Workload name.
    pub workload: &'static str,
    /// The runtime of kvferry's figure (`tokio`, `glommio`).
    pub runtime: &'static str,
    /// Unit of `kvferry` and `raw`.
    pub unit: &'static str,
    /// kvferry's figure.
    pub kvferry: f64,
    /// The plain socket pair's figure.
    pub raw: f64,
    /// kvferry / raw.
    pub ratio: f64,
    /// The same workload over a plain socket pair of kvferry's own runtime (glommio's sockets
    /// for glommio; tokio's are `raw`).
    pub own_raw: f64,
    /// kvferry / own_raw, in the orientation of `ratio`.
    pub own_ratio: f64,
    /// What the ratio must be for the target (">= x" or "<= x").
    pub target: &'static str,
}

/// The receiver's admission: the drivers' own [`CoreCheck`] over a decode endpoint that
/// completed a handshake and holds room 1 with every page granted, behind a lock; every write
/// takes a permit from its grant table (all slices checked, without the lock) and hands it
/// back under the lock.
pub type BenchCheck = CoreCheck<LockedEndpoint>;

/// The bench's endpoint behind a lock (nothing to drain: no session sends anything).
pub struct LockedEndpoint(std::sync::Mutex<kvferry_core::Endpoint>);

impl EndpointAccess for LockedEndpoint {
    fn run<T>(
        &self,
        f: impl FnOnce(&mut kvferry_core::Endpoint, Instant) -> T,
        _drain: impl FnOnce(&T) -> bool,
    ) -> Option<T> {
        let mut e = self.0.lock().unwrap_or_else(|p| p.into_inner());
        Some(f(&mut e, Instant::now()))
    }

    fn faults(&self) -> Option<FaultPlan> {
        None
    }
}

/// A decode endpoint for `layout` with room 1 (generation 0) granted all `pages`.
pub fn bench_check(layout: Layout) -> std::io::Result<BenchCheck> {
    use kvferry_core::{Config, Endpoint, EndpointInfo, Grant, Incarnation, NodeId, Role};
    let invalid = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);
    let now = Instant::now();
    // The bench never advances the endpoints' clocks: no deadline can end the room.
    let config = Config::default();
    let mut p = Endpoint::new(
        config.clone(),
        EndpointInfo::new(Role::Prefill, NodeId(1), Incarnation(1), layout),
        1,
        now,
    )
    .map_err(|e| invalid(e.to_string()))?;
    let mut d = Endpoint::new(
        config,
        EndpointInfo::new(Role::Decode, NodeId(2), Incarnation(2), layout),
        2,
        now,
    )
    .map_err(|e| invalid(e.to_string()))?;
    let sp = p.open_session(now);
    let sd = d.accept_session(now);
    for _ in 0..4 {
        let mut buf = Vec::new();
        while p.poll_transmit(&mut buf).is_some() {}
        d.handle_input(now, sd, &buf);
        buf.clear();
        while d.poll_transmit(&mut buf).is_some() {}
        p.handle_input(now, sp, &buf);
    }
    let grant = Grant {
        extras: Vec::new(),
        pages: (0..layout.pages).collect(),
        aux_slot: None,
        state_slot: None,
        receivers: 1,
        skip_pages: 0,
        idle_sources: 0,
        prompt: None,
    };
    d.open_receiver(now, RoomId(1), 0, &[sd], Some(grant))
        .map_err(|e| invalid(e.to_string()))?;
    Ok(CoreCheck::new(LockedEndpoint(std::sync::Mutex::new(d)), sd))
}

/// Operation `id` of the bench's one room: `slices` of its KV, as the core would plan it.
pub fn bench_op(id: u64, slices: Arc<[Slice]>) -> TransferOp {
    let bytes = slices.iter().map(Slice::bytes).sum();
    TransferOp {
        checksum: false,
        id: TransferId(id),
        session: SessionId(1),
        room: Some(RoomId(1)),
        generation: 0,
        kind: OpKind::Kv,
        attempt: 1,
        slices,
        bytes,
    }
}

/// The bench's memory: one KV region of `pages` pages, nothing else.
pub fn flat_layout(page_bytes: u32, pages: u32) -> Layout {
    Layout {
        layers: 1,
        planes: 1,
        page_bytes,
        pages,
        aux_bytes: 0,
        state_bytes: 0,
        slots: 0,
    }
}

async fn socket_pair() -> std::io::Result<(TcpStream, TcpStream)> {
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let a = TcpStream::connect(l.local_addr()?).await?;
    let (b, _) = l.accept().await?;
    a.set_nodelay(true)?;
    b.set_nodelay(true)?;
    Ok((a, b))
}

struct Kv {
    sender: DataSender,
    done: mpsc::UnboundedReceiver<(TransferId, TransferOutcome)>,
    next: u64,
}

impl Kv {
    async fn new(page_bytes: u32, pages: u32) -> std::io::Result<Kv> {
        let layout = flat_layout(page_bytes, pages);
        let src = Arc::new(MemoryMap::allocate(layout));
        let dst = Arc::new(MemoryMap::allocate(layout));
        let (a, b) = socket_pair().await?;
        let check = Arc::new(bench_check(layout)?);
        let limits = Limits {
            checksum: false,
            max_slices: 8192,
            max_bytes: 1 << 30,
        };
        let spin = tokio_spin();
        tokio::spawn(serve_writes(b, dst, check, limits, spin));
        let (tx, done) = mpsc::unbounded_channel();
        let report: Report = Arc::new(move |id, outcome| {
            let _ = tx.send((id, outcome));
        });
        Ok(Kv {
            sender: DataSender::spawn(a, src, report, spin),
            done,
            next: 0,
        })
    }

    /// Sends one operation and waits for its acknowledgement; an operation that is not
    /// applied is an error (a bench figure is only worth something if every byte landed).
    async fn op(&mut self, slices: Arc<[Slice]>) -> std::io::Result<Duration> {
        self.next += 1;
        let op = bench_op(self.next, slices);
        let t0 = Instant::now();
        if self.sender.send(op).is_err() {
            return Err(std::io::Error::other("the tokio data connection closed"));
        }
        match self.done.recv().await {
            Some((_, TransferOutcome::Done)) => Ok(t0.elapsed()),
            other => Err(std::io::Error::other(format!(
                "the tokio data plane did not apply an operation: {other:?}"
            ))),
        }
    }
}

/// How long the tokio data plane's reads spin: `KVFERRY_READ_SPIN_US`, as a node's would.
fn tokio_spin() -> std::time::Duration {
    kvferry_tokio::read_spin_from_vars(std::env::vars()).unwrap_or(kvferry_tokio::DEFAULT_READ_SPIN)
}

struct Raw {
    a: TcpStream,
    buf: Vec<u8>,
}

impl Raw {
    /// A socket pair whose far end reads `len` bytes per message and answers one byte.
    async fn new(len: usize) -> std::io::Result<Raw> {
        let (a, mut b) = socket_pair().await?;
        tokio::spawn(async move {
            let mut sink = vec![0u8; len];
            while b.read_exact(&mut sink).await.is_ok() {
                if b.write_all(&[1]).await.is_err() {
                    break;
                }
            }
        });
        Ok(Raw {
            a,
            buf: vec![7u8; len],
        })
    }

    /// One message out and its one-byte answer back.
    async fn round(&mut self) -> std::io::Result<Duration> {
        let t0 = Instant::now();
        let mut ack = [0u8; 1];
        self.a.write_all(&self.buf).await?;
        self.a.read_exact(&mut ack).await?;
        Ok(t0.elapsed())
    }
}

/// The median of `v` (zero when empty).
pub fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Alternating pages on both sides, so no two slices coalesce: a paged batch.
pub fn scattered(n: u32, page: u64) -> Arc<[Slice]> {
    let region = Region::Kv { layer: 0, plane: 0 };
    (0..u64::from(n))
        .map(|i| Slice::run(region, 2 * i * page, (2 * i + 1) * page, page))
        .collect::<Vec<_>>()
        .into()
}

/// Which runtimes a bench run measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Runtimes {
    /// Measure the tokio data plane.
    pub tokio: bool,
    /// Measure the glommio data plane.
    pub glommio: bool,
}

/// How many times better glommio did than tokio on each workload both ran (1.0 is a tie;
/// the thread-per-core issue's target is at least 1.0 everywhere in one run).
pub fn glommio_vs_tokio(results: &[BenchResult]) -> Vec<(&'static str, f64)> {
    let mut out = Vec::new();
    for t in results.iter().filter(|r| r.runtime == "tokio") {
        let glommio = |r: &&BenchResult| r.workload == t.workload && r.runtime == "glommio";
        let Some(g) = results.iter().find(glommio) else {
            continue;
        };
        // `ratio` is kvferry against raw: higher is better except for a latency (us).
        let advantage = match t.unit {
            "us" => t.ratio / g.ratio,
            _ => g.ratio / t.ratio,
        };
        out.push((t.workload, advantage));
    }
    out
}

/// One bench workload: what each operation moves and how its figure reads.
struct Workload {
    name: &'static str,
    /// `GB/s` (higher is better), `ms` per batch or `us` per acknowledged operation.
    unit: &'static str,
    target: &'static str,
    page: u32,
    pages: u32,
    slices: Arc<[Slice]>,
    /// Operations per runtime per block.
    ops: usize,
}

fn workloads(iterations: usize) -> [Workload; 4] {
    let whole = |len: u64, dst_offset: u64| -> Arc<[Slice]> {
        vec![Slice::run(
            Region::Kv { layer: 0, plane: 0 },
            0,
            dst_offset,
            len,
        )]
        .into()
    };
    [
        Workload {
            name: "transfer_64MiB",
            unit: "GB/s",
            target: ">= 0.9",
            page: 16 * 1024,
            pages: 4096,
            slices: whole(64 << 20, 0),
            ops: iterations,
        },
        // Paged batches against raw bulk throughput of the same bytes.
        Workload {
            name: "batch_1024x16KiB",
            unit: "ms",
            target: ">= 0.8",
            page: 16 * 1024,
            pages: 2048,
            slices: scattered(1024, 16 * 1024),
            ops: iterations,
        },
        Workload {
            name: "batch_4096x4KiB",
            unit: "ms",
            target: "works",
            page: 4096,
            pages: 8192,
            slices: scattered(4096, 4096),
            ops: iterations,
        },
        // One acknowledged 4 KiB operation against a 4 KiB request / 1 byte reply round trip.
        Workload {
            name: "op_4KiB_acked",
            unit: "us",
            target: "<= 2.0",
            page: 4096,
            pages: 16,
            slices: whole(4096, 4096),
            ops: iterations * 100,
        },
    ]
}

/// The data-plane workloads' names, in the order [`run_rounds`] runs them.
pub fn workload_names() -> Vec<&'static str> {
    workloads(1).iter().map(|w| w.name).collect()
}

/// Measures every workload on raw TCP and the chosen runtimes, in `rounds` interleaved blocks.
///
/// Per workload, each block runs `iterations` operations (the 4 KiB round trip 100x that)
/// on each of raw, tokio and glommio back to back, after one warm-up operation each, in an
/// order that goes through all six permutations from block to block. A machine whose load
/// drifts (a shared CI box) then slows every contender alike, and each figure is the median
/// of all its operations. Glommio's turn also runs the workload over a plain glommio socket
/// pair between its two executors (`own_raw`): what glommio's sockets cost before kvferry.
///
/// `only` names one workload to run alone (to profile it); an unknown name is an
/// `InvalidInput` error that lists the names.
pub async fn run_rounds(
    iterations: usize,
    runtimes: Runtimes,
    rounds: usize,
    only: Option<&str>,
) -> std::io::Result<Vec<BenchResult>> {
    let all = workloads(iterations.max(1));
    if let Some(name) = only {
        if !all.iter().any(|w| w.name == name) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "no workload {name:?}; the workloads are {}",
                    workload_names().join(", ")
                ),
            ));
        }
    }
    let mut out = Vec::new();
    for w in all
        .iter()
        .filter(|w| only.map_or(true, |name| w.name == name))
    {
        out.extend(measure(w, runtimes, rounds.max(1)).await?);
    }
    Ok(out)
}

async fn measure(
    w: &Workload,
    runtimes: Runtimes,
    blocks: usize,
) -> std::io::Result<Vec<BenchResult>> {
    let bytes: u64 = w.slices.iter().map(Slice::bytes).sum();
    let mut raw = Raw::new(bytes as usize).await?;
    let mut kv = match runtimes.tokio {
        true => Some(Kv::new(w.page, w.pages).await?),
        false => None,
    };
    let pair = match runtimes.glommio {
        true => Some(glommio_bench::Pair::start(w.page, w.pages, bytes as usize).await?),
        false => None,
    };
    let (mut r, mut k, mut g, mut gr) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for block in 0..blocks {
        // Each contender warms up, then runs its share. The order goes through all six
        // permutations: a rotation alone keeps who follows whom, and position alone moved an
        // A/A pair of identical glommio contenders by 11-16 % on 4 KiB batches.
        const ORDERS: [[usize; 3]; 6] = [
            [0, 1, 2],
            [1, 2, 0],
            [2, 0, 1],
            [0, 2, 1],
            [2, 1, 0],
            [1, 0, 2],
        ];
        for turn in ORDERS[block % ORDERS.len()] {
            match turn {
                0 => {
                    raw.round().await?;
                    for _ in 0..w.ops {
                        r.push(raw.round().await?);
                    }
                }
                1 => {
                    if let Some(kv) = kv.as_mut() {
                        kv.op(w.slices.clone()).await?;
                        for _ in 0..w.ops {
                            k.push(kv.op(w.slices.clone()).await?);
                        }
                    }
                }
                _ => {
                    if let Some(pair) = pair.as_ref() {
                        let mut times = pair.ops(w.slices.clone(), w.ops + 1).await?;
                        times.remove(0);
                        g.extend(times);
                        let mut times = pair.raw_rounds(w.ops + 1).await?;
                        times.remove(0);
                        gr.extend(times);
                    }
                }
            }
        }
    }
    if let Some(pair) = pair {
        pair.finish().await?;
    }
    let raw_t = median(r);
    let glommio_raw_t = (!gr.is_empty()).then(|| median(gr));
    let mut out = Vec::new();
    for (runtime, times, own) in [
        ("tokio", k, raw_t),
        ("glommio", g, glommio_raw_t.unwrap_or(raw_t)),
    ] {
        if times.is_empty() {
            continue;
        }
        let t = median(times);
        // Throughputs and batch times: raw / kvferry (above 1, kvferry is faster); latencies:
        // kvferry / raw.
        let figure = |d: Duration| match w.unit {
            "GB/s" => bytes as f64 / d.as_secs_f64() / 1e9,
            "ms" => d.as_secs_f64() * 1e3,
            _ => d.as_secs_f64() * 1e6,
        };
        let ratio = |against: Duration| match w.unit {
            "GB/s" | "ms" => against.as_secs_f64() / t.as_secs_f64(),
            _ => t.as_secs_f64() / against.as_secs_f64(),
        };
        out.push(BenchResult {
            workload: w.name,
            runtime,
            unit: w.unit,
            kvferry: figure(t),
            raw: figure(raw_t),
            ratio: ratio(raw_t),
            own_raw: figure(own),
            own_ratio: ratio(own),
            target: w.target,
        });
    }
    Ok(out)
}

/// The glommio data plane on the bench workloads.
mod copy_engine;
mod glommio_bench;
mod layer_events;
mod links;
mod same_host;
mod scaling;

pub use copy_engine::*;
pub use layer_events::*;
pub use links::*;
pub use same_host::*;
pub use scaling::*;

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_core::WriteRefused;
    use kvferry_memory::WriteCheck;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_round_measures_every_workload_on_both_runtimes_against_raw() {
        let both = Runtimes {
            tokio: true,
            glommio: true,
        };
        let results = run_rounds(1, both, 1, None).await.unwrap();
        let names: Vec<_> = results.iter().map(|r| (r.workload, r.runtime)).collect();
        let mut expected = Vec::new();
        for w in workloads(1) {
            expected.push((w.name, "tokio"));
            expected.push((w.name, "glommio"));
        }
        assert_eq!(names, expected);
        for r in &results {
            assert!(r.kvferry.is_finite() && r.kvferry > 0.0, "{r:?}");
            assert!(r.raw.is_finite() && r.raw > 0.0, "{r:?}");
            assert!(r.own_raw.is_finite() && r.own_raw > 0.0, "{r:?}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_workload_runs_alone_and_an_unknown_one_is_refused_with_the_names() {
        let tokio_only = Runtimes {
            tokio: true,
            glommio: false,
        };
        let results = run_rounds(1, tokio_only, 1, Some("op_4KiB_acked"))
            .await
            .unwrap();
        let names: Vec<_> = results.iter().map(|r| (r.workload, r.runtime)).collect();
        assert_eq!(names, [("op_4KiB_acked", "tokio")]);
        let e = run_rounds(1, tokio_only, 1, Some("op_4kib"))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("op_4KiB_acked"), "{e}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_scaling_sweep_has_a_clean_point_per_core() {
        let points = scaling(300, None).await.unwrap();
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        assert_eq!(points.len(), cores);
        for (i, p) in points.iter().enumerate() {
            assert_eq!(p.shards, i + 1);
            assert!(p.clean && p.rooms_per_s > 0.0, "{p:?}");
        }
    }

    #[test]
    fn glommio_against_tokio_is_better_when_faster_whatever_the_unit() {
        let r = |workload, runtime, unit, ratio| BenchResult {
            workload,
            runtime,
            unit,
            kvferry: 1.0,
            raw: 1.0,
            ratio,
            own_raw: 1.0,
            own_ratio: ratio,
            target: "",
        };
        let results = [
            r("bulk", "tokio", "GB/s", 1.0),
            r("bulk", "glommio", "GB/s", 1.2),
            r("batch", "tokio", "ms", 0.9),
            r("batch", "glommio", "ms", 0.6),
            r("op", "tokio", "us", 1.5),
            r("op", "glommio", "us", 0.75),
            r("tokio only", "tokio", "us", 1.0),
        ];
        let v = glommio_vs_tokio(&results);
        let names: Vec<_> = v.iter().map(|(w, _)| *w).collect();
        assert_eq!(names, ["bulk", "batch", "op"]);
        assert!((v[0].1 - 1.2).abs() < 1e-9);
        assert!((v[1].1 - 0.6 / 0.9).abs() < 1e-9);
        assert!((v[2].1 - 2.0).abs() < 1e-9);
    }

    #[test]
    fn the_bench_admits_writes_through_a_real_core_and_refuses_others() {
        let check = bench_check(flat_layout(4096, 16)).unwrap();
        let slice = |off: u64, len: u64| Slice::run(Region::Kv { layer: 0, plane: 0 }, 0, off, len);
        let whole = [slice(0, 16 * 4096)];
        let permit = check.begin(RoomId(1), 0, &whole).unwrap();
        check.end(permit, &whole);
        assert_eq!(
            check.begin(RoomId(2), 0, &[slice(0, 4096)]),
            Err(WriteRefused::UnknownRoom)
        );
        assert_eq!(
            check.begin(RoomId(1), 0, &[slice(16 * 4096, 4096)]),
            Err(WriteRefused::OutOfRegion)
        );
    }
}
