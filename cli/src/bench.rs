//! `kvferry bench`: kvferry's TCP data plane against a plain TCP socket pair, same workloads,
//! same runtime, one run. Each figure is the median of its iterations.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_core::layout::PageSet;
use kvferry_core::{
    Generation, Layout, OpKind, Region, RoomId, SessionId, Slice, TransferId, TransferOp,
    TransferOutcome, WritePermit, WriteRefused,
};
use kvferry_tcp::{serve_writes, DataSender, Limits, MemoryMap, Report, WriteCheck};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// One workload's figures.
#[derive(Clone, Debug)]
pub struct BenchResult {
    /// Workload name.
    pub workload: &'static str,
    /// Unit of `kvferry` and `raw`.
    pub unit: &'static str,
    /// kvferry's figure.
    pub kvferry: f64,
    /// The plain socket pair's figure.
    pub raw: f64,
    /// kvferry / raw.
    pub ratio: f64,
    /// What the ratio must be for the target (">= x" or "<= x").
    pub target: &'static str,
}

/// Receiver-side validation as the core does it: every slice must stay inside the pages
/// granted to the room.
struct GrantCheck {
    pages: PageSet,
    page_bytes: u64,
}

impl WriteCheck for GrantCheck {
    fn begin(
        &self,
        room: RoomId,
        generation: Generation,
        slices: &[Slice],
    ) -> Result<WritePermit, WriteRefused> {
        for s in slices {
            let first = (s.dst_offset / self.page_bytes) as u32;
            let last = ((s.dst_offset + s.len - 1) / self.page_bytes) as u32;
            if !self.pages.contains_range(first, last) {
                return Err(WriteRefused::PageNotGranted);
            }
        }
        Ok(WritePermit {
            session: SessionId(1),
            room: Some(room),
            generation,
            epoch: 0,
        })
    }

    fn end(&self, _permit: WritePermit) {}
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
        let layout = Layout {
            layers: 1,
            planes: 1,
            page_bytes,
            pages,
            aux_bytes: 0,
            state_bytes: 0,
            slots: 0,
        };
        let src = Arc::new(MemoryMap::allocate(layout));
        let dst = Arc::new(MemoryMap::allocate(layout));
        let (a, b) = socket_pair().await?;
        let all: Vec<u32> = (0..pages).collect();
        let check = Arc::new(GrantCheck {
            pages: PageSet::new(&all),
            page_bytes: u64::from(page_bytes),
        });
        let limits = Limits {
            max_slices: 8192,
            max_bytes: 1 << 30,
        };
        tokio::spawn(serve_writes(b, dst, check, limits));
        let (tx, done) = mpsc::unbounded_channel();
        let report: Report = Arc::new(move |id, outcome| {
            let _ = tx.send((id, outcome));
        });
        Ok(Kv {
            sender: DataSender::spawn(a, src, report),
            done,
            next: 0,
        })
    }

    /// Sends one operation and waits for its acknowledgement.
    async fn op(&mut self, slices: Arc<[Slice]>) -> Duration {
        self.next += 1;
        let bytes = slices.iter().map(|s| s.len).sum();
        let op = TransferOp {
            id: TransferId(self.next),
            session: SessionId(1),
            room: Some(RoomId(1)),
            generation: 0,
            kind: OpKind::Kv,
            attempt: 1,
            slices,
            bytes,
        };
        let t0 = Instant::now();
        if self.sender.send(op).is_err() {
            return Duration::MAX;
        }
        match self.done.recv().await {
            Some((_, TransferOutcome::Done)) => t0.elapsed(),
            _ => Duration::MAX,
        }
    }
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

    async fn round(&mut self) -> Duration {
        let t0 = Instant::now();
        let mut ack = [0u8; 1];
        if self.a.write_all(&self.buf).await.is_err() || self.a.read_exact(&mut ack).await.is_err()
        {
            return Duration::MAX;
        }
        t0.elapsed()
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Alternating pages on both sides, so no two slices coalesce: a paged batch.
fn scattered(n: u32, page: u64) -> Arc<[Slice]> {
    let region = Region::Kv { layer: 0, plane: 0 };
    (0..u64::from(n))
        .map(|i| Slice {
            region,
            src_offset: 2 * i * page,
            dst_offset: (2 * i + 1) * page,
            len: page,
        })
        .collect::<Vec<_>>()
        .into()
}

/// Runs every workload `iterations` times (the 4 KiB round trip 100x that) and reports.
pub async fn run(iterations: usize) -> std::io::Result<Vec<BenchResult>> {
    let iterations = iterations.max(1);
    let mut out = Vec::new();
    let gb = |bytes: u64, d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;

    // 64 MiB transfers.
    let big = 64u64 << 20;
    let mut kv = Kv::new(16 * 1024, 4096).await?;
    let whole: Arc<[Slice]> = vec![Slice {
        region: Region::Kv { layer: 0, plane: 0 },
        src_offset: 0,
        dst_offset: 0,
        len: big,
    }]
    .into();
    let mut raw = Raw::new(big as usize).await?;
    let (mut k, mut r) = (Vec::new(), Vec::new());
    for _ in 0..iterations {
        k.push(kv.op(whole.clone()).await);
        r.push(raw.round().await);
    }
    let (kt, rt) = (median(k), median(r));
    out.push(result(
        "transfer_64MiB",
        "GB/s",
        gb(big, kt),
        gb(big, rt),
        ">= 0.9",
    ));

    // Paged batches against raw bulk throughput of the same bytes.
    for (name, n, page) in [
        ("batch_1024x16KiB", 1024u32, 16 * 1024u32),
        ("batch_4096x4KiB", 4096, 4 * 1024),
    ] {
        let bytes = u64::from(n) * u64::from(page);
        let mut kv = Kv::new(page, 2 * n).await?;
        let slices = scattered(n, u64::from(page));
        let mut raw = Raw::new(bytes as usize).await?;
        let (mut k, mut r) = (Vec::new(), Vec::new());
        for _ in 0..iterations {
            k.push(kv.op(slices.clone()).await);
            r.push(raw.round().await);
        }
        let (kt, rt) = (median(k), median(r));
        let target = if n == 1024 { ">= 0.8" } else { "works" };
        out.push(BenchResult {
            workload: name,
            unit: "ms",
            kvferry: kt.as_secs_f64() * 1e3,
            raw: rt.as_secs_f64() * 1e3,
            ratio: rt.as_secs_f64() / kt.as_secs_f64(),
            target,
        });
    }

    // One acknowledged 4 KiB operation against a 4 KiB request / 1 byte reply round trip.
    let mut kv = Kv::new(4096, 16).await?;
    let one: Arc<[Slice]> = vec![Slice {
        region: Region::Kv { layer: 0, plane: 0 },
        src_offset: 0,
        dst_offset: 4096,
        len: 4096,
    }]
    .into();
    let mut raw = Raw::new(4096).await?;
    let (mut k, mut r) = (Vec::new(), Vec::new());
    for _ in 0..iterations * 100 {
        k.push(kv.op(one.clone()).await);
        r.push(raw.round().await);
    }
    let (kt, rt) = (median(k), median(r));
    out.push(result(
        "op_4KiB_acked",
        "us",
        kt.as_secs_f64() * 1e6,
        rt.as_secs_f64() * 1e6,
        "<= 2.0",
    ));
    Ok(out)
}

fn result(
    workload: &'static str,
    unit: &'static str,
    kvferry: f64,
    raw: f64,
    target: &'static str,
) -> BenchResult {
    BenchResult {
        workload,
        unit,
        kvferry,
        raw,
        ratio: kvferry / raw,
        target,
    }
}
