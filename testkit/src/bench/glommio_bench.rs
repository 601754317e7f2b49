//! The glommio data plane on the bench workloads.

use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::channels::local_channel;
use glommio::net::{TcpListener, TcpStream};
use glommio::{LocalExecutorBuilder, Placement};
use kvferry_core::{Slice, TransferOutcome};
use kvferry_memory::{MemoryMap, WriteCheck};
use kvferry_tcp::stream::serve_writes_on;
use kvferry_tcp::Limits;

use super::{bench_check, bench_op, flat_layout};

/// What to run back to back: `n` kvferry operations of the slices, or (`None`) `n` round
/// trips over the plain glommio socket pair; and where to send their times.
type Request = (
    Option<Arc<[Slice]>>,
    usize,
    tokio::sync::oneshot::Sender<std::io::Result<Vec<Duration>>>,
);

/// A glommio sender and receiver executor pair (one per core where the machine allows)
/// with one data connection between them, running operations on request, and a plain glommio
/// socket pair beside it: glommio's own round trip, the figure kvferry on glommio is held to.
pub(super) struct Pair {
    requests: flume::Sender<Request>,
    sender: glommio::ExecutorJoinHandle<std::io::Result<()>>,
    receiver: glommio::ExecutorJoinHandle<()>,
}

impl Pair {
    /// Starts both executors over memory of `pages` pages of `page_bytes`; a plain round
    /// trip sends `raw_len` bytes and reads a 1-byte reply.
    pub(super) async fn start(
        page_bytes: u32,
        pages: u32,
        raw_len: usize,
    ) -> std::io::Result<Pair> {
        tokio::task::spawn_blocking(move || spawn(page_bytes, pages, raw_len))
            .await
            .map_err(io_error)?
    }

    /// The times of `n` operations of `slices`, each written and acknowledged before the
    /// next.
    pub(super) async fn ops(
        &self,
        slices: Arc<[Slice]>,
        n: usize,
    ) -> std::io::Result<Vec<Duration>> {
        self.request(Some(slices), n).await
    }

    /// The times of `n` round trips over the plain glommio socket pair.
    pub(super) async fn raw_rounds(&self, n: usize) -> std::io::Result<Vec<Duration>> {
        self.request(None, n).await
    }

    async fn request(
        &self,
        slices: Option<Arc<[Slice]>>,
        n: usize,
    ) -> std::io::Result<Vec<Duration>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let gone = || io_error("the glommio sender executor ended");
        self.requests
            .send_async((slices, n, tx))
            .await
            .map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// Closes the connection and joins both executors.
    pub(super) async fn finish(self) -> std::io::Result<()> {
        let Pair {
            requests,
            sender,
            receiver,
        } = self;
        drop(requests);
        tokio::task::spawn_blocking(move || {
            let sent = sender.join().map_err(io_error)?;
            let _ = receiver.join();
            sent
        })
        .await
        .map_err(io_error)?
    }
}

fn io_error(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// The driver's default spin, or `KVFERRY_SPIN_US` (0 turns it off, for A/B runs).
fn spin() -> Duration {
    std::env::var("KVFERRY_SPIN_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(
            kvferry_glommio::DEFAULT_SPIN_BEFORE_PARK,
            Duration::from_micros,
        )
}

fn placement(cpu: usize) -> Placement {
    let cpus = std::thread::available_parallelism().map_or(1, |c| c.get());
    if cpus > 1 {
        Placement::Fixed(cpu % cpus)
    } else {
        Placement::Unbound
    }
}

fn spawn(page_bytes: u32, pages: u32, raw_len: usize) -> std::io::Result<Pair> {
    kvferry_glommio::ensure_memlock(2).map_err(io_error)?;
    let layout = flat_layout(page_bytes, pages);
    let src = Arc::new(MemoryMap::allocate(layout));
    let dst = Arc::new(MemoryMap::allocate(layout));
    let check = bench_check(layout)?;
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let receiver = LocalExecutorBuilder::new(placement(1))
        .io_memory(1 << 20)
        .spin_before_park(spin())
        .spawn(move || async move {
            let Ok(listener) = TcpListener::bind("127.0.0.1:0") else {
                return;
            };
            let Ok(addr) = listener.local_addr() else {
                return;
            };
            let _ = addr_tx.send(addr);
            let Ok(stream) = listener.accept().await else {
                return;
            };
            let _ = stream.set_nodelay(true);
            // The plain pair's echo: `raw_len` bytes in, one byte back.
            let Ok(mut plain) = listener.accept().await else {
                return;
            };
            let _ = plain.set_nodelay(true);
            glommio::spawn_local(async move {
                let mut sink = vec![0u8; raw_len];
                while plain.read_exact(&mut sink).await.is_ok() {
                    if plain.write_all(&[1]).await.is_err() {
                        break;
                    }
                }
            })
            .detach();
            let check: Rc<dyn WriteCheck> = Rc::new(check);
            let limits = Limits {
                checksum: false,
                max_slices: 8192,
                max_bytes: 1 << 30,
            };
            // KVFERRY_GLOMMIO_STAGED=1: read payloads through the buffer (A/B).
            if std::env::var_os("KVFERRY_GLOMMIO_STAGED").is_some() {
                let mut stream =
                    futures_lite::io::BufReader::with_capacity(kvferry_tcp::RECV_BUF, stream);
                let _ = serve_writes_on(&mut stream, &dst, check, limits).await;
            } else {
                let _ =
                    kvferry_tcp::glommio::serve_local(stream, &dst, check, limits, spin()).await;
            }
        })
        .map_err(io_error)?;
    let addr = addr_rx
        .recv_timeout(Duration::from_secs(5))
        .map_err(io_error)?;
    let (requests, incoming) = flume::unbounded::<Request>();
    let sender = LocalExecutorBuilder::new(placement(0))
        .io_memory(1 << 20)
        .spin_before_park(spin())
        .spawn(move || async move {
            let stream = TcpStream::connect(addr).await.map_err(io_error)?;
            let _ = stream.set_nodelay(true);
            let mut plain = TcpStream::connect(addr).await.map_err(io_error)?;
            let _ = plain.set_nodelay(true);
            let bytes = vec![7u8; raw_len];
            // The driver's own sending side: writer task, ack reader task, ledger.
            let (done_tx, done_rx) = local_channel::new_unbounded();
            let report: kvferry_tcp::glommio::LocalReport = Rc::new(move |id, outcome| {
                let _ = done_tx.try_send((id, outcome));
            });
            let sender = kvferry_tcp::glommio::LocalDataSender::spawn(stream, src, report, spin())?;
            let mut next = 0u64;
            let mut failed = None;
            while let Ok((slices, n, reply)) = incoming.recv_async().await {
                let mut times = Vec::with_capacity(n);
                let Some(slices) = slices else {
                    let _ = reply.send(plain_rounds(&mut plain, &bytes, n).await);
                    continue;
                };
                for _ in 0..n {
                    next += 1;
                    let op = bench_op(next, slices.clone());
                    let t0 = Instant::now();
                    if sender.send(op).is_err() {
                        failed = Some(io_error("the glommio data connection closed"));
                        break;
                    }
                    match done_rx.recv().await {
                        Some((_, TransferOutcome::Done)) => times.push(t0.elapsed()),
                        other => {
                            failed = Some(io_error(format!(
                                "the glommio data plane did not apply an operation: {other:?}"
                            )));
                            break;
                        }
                    }
                }
                match &failed {
                    None => {
                        let _ = reply.send(Ok(times));
                    }
                    Some(e) => {
                        let _ = reply.send(Err(io_error(e)));
                        break;
                    }
                }
            }
            sender.close().await;
            failed.map_or(Ok(()), Err)
        })
        .map_err(io_error)?;
    Ok(Pair {
        requests,
        sender,
        receiver,
    })
}

/// `n` round trips of `bytes` out and one byte back over the plain glommio socket pair.
async fn plain_rounds(
    plain: &mut TcpStream,
    bytes: &[u8],
    n: usize,
) -> std::io::Result<Vec<Duration>> {
    let mut times = Vec::with_capacity(n);
    let mut ack = [0u8; 1];
    for _ in 0..n {
        let t0 = Instant::now();
        plain.write_all(bytes).await?;
        plain.read_exact(&mut ack).await?;
        times.push(t0.elapsed());
    }
    Ok(times)
}
