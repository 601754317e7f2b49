//! The sending side of a data connection, written once for every runtime: a writer task that
//! gathers each operation from registered memory, an acknowledgement reader task, and the
//! ledger between them that hands every operation to exactly one reporter. A runtime only
//! spawns the two tasks ([`DataSender::start`]) and says how to stop one ([`Task`]).

use crate::io_common::Checksum;
use std::future::Future;
use std::io;
use std::rc::Rc;
use std::sync::Arc;

use futures_io::{AsyncRead, AsyncWrite};
use futures_lite::io::BufReader;
use futures_lite::AsyncWriteExt;
use kvferry_core::{TransferId, TransferOp, TransferOutcome};
use kvferry_memory::MemoryMap;
use kvferry_sync::{Acked, OpLedger, Start};
use tracing::{debug, warn};

use crate::frame::{AckStatus, CHECKSUM_LEN, SLICE_DESC_LEN, WRITE_HEADER_LEN};
use crate::io_common::{checksum_of, gather_iovecs, prepare_op};
use crate::staged;
use crate::stream::read_ack;

/// Where a [`DataSender`] reports how each operation ended, exactly once per operation.
pub trait Report: Clone + 'static {
    /// Operation `id` ended with `outcome`.
    fn report(&self, id: TransferId, outcome: TransferOutcome);
}

impl Report for Arc<dyn Fn(TransferId, TransferOutcome) + Send + Sync> {
    fn report(&self, id: TransferId, outcome: TransferOutcome) {
        self(id, outcome);
    }
}

impl Report for Rc<dyn Fn(TransferId, TransferOutcome)> {
    fn report(&self, id: TransferId, outcome: TransferOutcome) {
        self(id, outcome);
    }
}

/// A spawned task of a runtime, as a [`DataSender`] needs it: stopped when the connection
/// closes.
pub trait Task {
    /// Cancels the task and waits until it can no longer run.
    fn stop(self) -> impl Future<Output = ()>;

    /// Cancels the task without waiting.
    fn abort(self);
}

/// How the writing half of a data connection puts one operation on the wire.
pub trait GatherWrite {
    /// Writes `header`, then every `(address, length)` source range, in order.
    fn write_gather(
        &mut self,
        header: &[u8],
        sources: &[(usize, usize)],
    ) -> impl Future<Output = io::Result<()>>;

    /// Ends the write direction (the peer reads end of stream).
    fn finish(&mut self) -> impl Future<Output = ()>;

    /// Writes what the socket takes of `header` and `sources` now, without waiting, and says
    /// how many bytes that was; `None`: this transport only writes from its task (it cannot
    /// resume an operation part-way, [`GatherWrite::write_rest`]).
    fn write_now(
        &mut self,
        _header: &[u8],
        _sources: &[(usize, usize)],
    ) -> Option<io::Result<usize>> {
        None
    }

    /// Writes what is left of `header` and `sources` after their first `done` bytes (an
    /// operation [`GatherWrite::write_now`] began).
    fn write_rest(
        &mut self,
        header: &[u8],
        sources: &[(usize, usize)],
        done: usize,
    ) -> impl Future<Output = io::Result<()>> {
        async move {
            if done == 0 {
                self.write_gather(header, sources).await
            } else {
                Err(io::ErrorKind::Unsupported.into())
            }
        }
    }

    /// As [`GatherWrite::write_gather`], then the XXH3-64 of the sources' bytes (the
    /// checksum trailer of a checked batch). A transport that can hash each piece as it
    /// sends it (while it is in the cache) overrides this.
    fn write_gather_checked(
        &mut self,
        header: &[u8],
        sources: &[(usize, usize)],
    ) -> impl Future<Output = io::Result<()>> {
        async move {
            // SAFETY: `sources` are host ranges of registered memory of the operation being
            // written, which the core keeps unchanged until the operation is reported.
            let trailer = unsafe { checksum_of(sources) }.to_le_bytes();
            let mut with = sources.to_vec();
            with.push((trailer.as_ptr() as usize, CHECKSUM_LEN));
            self.write_gather(header, &with).await
        }
    }
}

/// A writing half that copies anyway (TLS): each contiguous piece goes through the stream's
/// own `write`, and the operation is flushed at its end.
#[derive(Debug)]
pub struct Copying<S>(pub S);

impl<S: AsyncWrite + Unpin> GatherWrite for Copying<S> {
    async fn write_gather(&mut self, header: &[u8], sources: &[(usize, usize)]) -> io::Result<()> {
        let total = header.len() + sources.iter().map(|s| s.1).sum::<usize>();
        let mut done = 0usize;
        while done < total {
            let iov = gather_iovecs(header, sources, done);
            let Some(first) = iov.first() else { break };
            let n = self.0.write(first).await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            done += n;
        }
        self.0.flush().await
    }

    async fn finish(&mut self) {
        let _ = self.0.close().await;
    }
}

/// A data connection's writing half, plain or through TLS (one sender type for both).
#[derive(Debug)]
pub enum Writer<P, S> {
    /// Plain TCP.
    Plain(P),
    /// Through a TLS session.
    Tls(S),
}

impl<P: GatherWrite, S: GatherWrite> GatherWrite for Writer<P, S> {
    async fn write_gather(&mut self, header: &[u8], sources: &[(usize, usize)]) -> io::Result<()> {
        match self {
            Writer::Plain(w) => w.write_gather(header, sources).await,
            Writer::Tls(w) => w.write_gather(header, sources).await,
        }
    }

    async fn finish(&mut self) {
        match self {
            Writer::Plain(w) => w.finish().await,
            Writer::Tls(w) => w.finish().await,
        }
    }

    async fn write_gather_checked(
        &mut self,
        header: &[u8],
        sources: &[(usize, usize)],
    ) -> io::Result<()> {
        match self {
            Writer::Plain(w) => w.write_gather_checked(header, sources).await,
            Writer::Tls(w) => w.write_gather_checked(header, sources).await,
        }
    }

    fn write_now(
        &mut self,
        header: &[u8],
        sources: &[(usize, usize)],
    ) -> Option<io::Result<usize>> {
        match self {
            Writer::Plain(w) => w.write_now(header, sources),
            Writer::Tls(w) => w.write_now(header, sources),
        }
    }

    async fn write_rest(
        &mut self,
        header: &[u8],
        sources: &[(usize, usize)],
        done: usize,
    ) -> io::Result<()> {
        match self {
            Writer::Plain(w) => w.write_rest(header, sources, done).await,
            Writer::Tls(w) => w.write_rest(header, sources, done).await,
        }
    }
}

/// The largest lone operation [`DataSender::send`] writes itself (bigger ones go through the
/// writer task, so the caller never copies much into the socket).
pub const WRITE_NOW_MAX: u64 = 64 * 1024;

/// The sending side of one data connection (prefill): operations are pipelined, each
/// gathered straight from registered memory, and completed by the peer's acknowledgement.
/// Every operation handed to [`DataSender::send`] is reported exactly once.
pub struct DataSender<W, T, R> {
    ops: flume::Sender<Job>,
    ledger: Arc<OpLedger>,
    report: R,
    tasks: [T; 2],
    /// The writing half, while the writer task does not hold it.
    slot: Arc<Slot<W>>,
    memory: Arc<MemoryMap>,
}

/// What the writer task is asked to do.
enum Job {
    /// Write this operation.
    Op(TransferOp),
    /// Finish the operation the sender began writing itself.
    Resume,
}

/// The writing half of a data connection and what it was left in the middle of. Whoever
/// holds the writing half is the only one putting bytes on the wire, and starts each
/// operation in the ledger just before writing it, so acknowledgements come back in the
/// order the ledger expects.
pub struct Slot<W> {
    state: std::sync::Mutex<SlotState<W>>,
}

struct SlotState<W> {
    /// `None` while the writer task writes with it.
    write: Option<W>,
    /// An operation the sender began and the socket did not take whole: finished first by
    /// the next holder of `write` (the writer task, woken with [`Job::Resume`]).
    rest: Option<Rest>,
    /// Scratch for the sender's own writes.
    header: Vec<u8>,
}

/// What is left of an operation: its encoded header, source ranges, and bytes sent.
struct Rest {
    header: Vec<u8>,
    sources: Vec<(usize, usize)>,
    done: usize,
}

impl<W> Slot<W> {
    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState<W>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the writing half and any operation left half-written; `None` if someone holds it.
    fn take(&self) -> Option<(W, Option<Rest>)> {
        let mut s = self.lock();
        let w = s.write.take()?;
        Some((w, s.rest.take()))
    }

    /// Gives the writing half back.
    fn put(&self, w: W) {
        self.lock().write = Some(w);
    }
}

impl<W, T, R> std::fmt::Debug for DataSender<W, T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataSender")
            .field("in_flight", &self.ledger.in_flight())
            .finish_non_exhaustive()
    }
}

/// The writer task of a [`DataSender`], for its runtime to spawn.
pub struct Writing<W, R> {
    slot: Arc<Slot<W>>,
    ops: flume::Receiver<Job>,
    /// Disconnected once the acknowledgement reader ended: the connection is over.
    reader_gone: flume::Receiver<()>,
    memory: Arc<MemoryMap>,
    ledger: Arc<OpLedger>,
    report: R,
}

/// The acknowledgement reader task of a [`DataSender`], for its runtime to spawn.
pub struct Acking<A, R> {
    read: A,
    ledger: Arc<OpLedger>,
    report: R,
    /// Dropped when this reader ends, which stops the writer (see [`Writing`]).
    _alive: flume::Sender<()>,
}

/// Marks the connection closed and reports every operation not acknowledged as transient.
fn fail_pending<R: Report>(ledger: &OpLedger, report: &R) {
    for id in ledger.close() {
        report.report(id, TransferOutcome::Transient);
    }
}

impl<W: GatherWrite, T: Task, R: Report> DataSender<W, T, R> {
    /// Takes over an established data connection (preamble and hello exchanged): `write` and
    /// `read` are its two halves, `spawn` starts the writer and the acknowledgement reader on
    /// the caller's runtime and returns their tasks.
    pub fn start<A>(
        write: W,
        read: A,
        memory: Arc<MemoryMap>,
        report: R,
        spawn: impl FnOnce(Writing<W, R>, Acking<A, R>) -> [T; 2],
    ) -> Self
    where
        A: AsyncRead + Unpin,
    {
        let (tx, rx) = flume::unbounded();
        let slot = Arc::new(Slot {
            state: std::sync::Mutex::new(SlotState {
                write: Some(write),
                rest: None,
                header: Vec::with_capacity(WRITE_HEADER_LEN + 64 * SLICE_DESC_LEN),
            }),
        });
        let (alive, reader_gone) = flume::bounded(1);
        let ledger = Arc::new(OpLedger::new());
        let tasks = spawn(
            Writing {
                slot: slot.clone(),
                ops: rx,
                reader_gone,
                memory: memory.clone(),
                ledger: ledger.clone(),
                report: report.clone(),
            },
            Acking {
                read,
                ledger: ledger.clone(),
                report: report.clone(),
                _alive: alive,
            },
        );
        DataSender {
            ops: tx,
            ledger,
            report,
            tasks,
            slot,
            memory,
        }
    }

    /// Sends an operation: a lone small one (nothing else queued or unacknowledged) is
    /// written at once by the caller, without waking the writer task; any other is queued
    /// for it. Gives the operation back if the connection is already closed. Never reports
    /// (the caller may hold what a report takes).
    pub fn send(&self, op: TransferOp) -> Result<(), TransferOp> {
        let op = match self.write_alone(op) {
            Ok(()) => return Ok(()),
            Err(op) => op,
        };
        if !self.ledger.enqueue(op.id) {
            return Err(op);
        }
        self.ops.send(Job::Op(op)).map_err(|e| {
            let Job::Op(op) = e.0 else {
                unreachable!("only an operation was sent")
            };
            self.ledger.unqueue(op.id);
            op
        })
    }

    /// Writes `op` here if it is small, plain (no checksum, host memory), and alone on the
    /// connection, and the writer task does not hold the writing half; gives it back
    /// otherwise. What the socket does not take now, the writer task finishes.
    fn write_alone(&self, op: TransferOp) -> Result<(), TransferOp> {
        if op.checksum || op.bytes > WRITE_NOW_MAX || self.ledger.in_flight() > 0 {
            return Err(op);
        }
        let mut slot = self.slot.lock();
        let state = &mut *slot;
        if state.rest.is_some() {
            return Err(op);
        }
        let Some(write) = state.write.as_mut() else {
            return Err(op);
        };
        if self.memory.staging().is_some() && staged::on_device(&self.memory, &op.slices) {
            return Err(op);
        }
        let (sources, bad) = prepare_op(&op, &self.memory, &mut state.header);
        if bad || !self.ledger.start_alone(op.id) {
            return Err(op);
        }
        let done = match write.write_now(&state.header, &sources) {
            None => 0,
            Some(Ok(n)) => n,
            // The writer task meets the error again and ends the connection.
            Some(Err(_)) => 0,
        };
        let total = state.header.len() + sources.iter().map(|s| s.1).sum::<usize>();
        if done < total {
            state.rest = Some(Rest {
                header: state.header.clone(),
                sources,
                done,
            });
            drop(slot);
            // A closed queue: the writer is gone, and the close reports the operation.
            let _ = self.ops.send(Job::Resume);
        }
        Ok(())
    }

    /// Whether the connection broke or was closed.
    pub fn is_closed(&self) -> bool {
        self.ledger.is_closed()
    }

    /// Operations written and not yet acknowledged.
    pub fn in_flight(&self) -> usize {
        self.ledger.in_flight()
    }

    /// Stops the connection's tasks without waiting for them (a sender its driver did not
    /// take). Every operation not acknowledged is reported as transient.
    pub fn abort(self) {
        let [writer, reader] = self.tasks;
        writer.abort();
        reader.abort();
        fail_pending(&self.ledger, &self.report);
    }

    /// Closes the connection and waits until nothing of it can be written any more. Every
    /// operation not acknowledged is reported as transient.
    pub async fn close(self) {
        let [writer, reader] = self.tasks;
        writer.stop().await;
        reader.stop().await;
        fail_pending(&self.ledger, &self.report);
    }
}

impl<W: GatherWrite, R: Report> Writing<W, R> {
    /// Writes queued operations until the connection fails, the acknowledgement reader ends
    /// (the peer closed or broke the protocol) or the sender is dropped; then ends the write
    /// direction, so the peer sees the connection end.
    pub async fn run(self) {
        let slot = self.slot.clone();
        let held = self.write_jobs().await;
        // Everything queued or unacknowledged failed transiently.
        fail_pending(&self.ledger, &self.report);
        drop(self.ops);
        if let Some(mut write) = held.or_else(|| slot.take().map(|(w, _)| w)) {
            write.finish().await;
        }
    }

    /// The job loop: each job takes the writing half from the slot (finishing first what the
    /// sender left half-written), writes, and puts it back. Returns the writing half if it
    /// ended holding it.
    async fn write_jobs(&self) -> Option<W> {
        let mut header = Vec::with_capacity(WRITE_HEADER_LEN + 64 * SLICE_DESC_LEN);
        // This connection's own staging buffer, made at its first staged operation.
        let mut lane = None;
        // One wait for the reader's end, kept across operations (polled only while idle).
        let reader_gone = self.reader_gone.clone();
        let mut gone = std::pin::pin!(async move {
            let _ = reader_gone.recv_async().await;
        });
        loop {
            let next =
                futures_lite::future::or(async { self.ops.recv_async().await.ok() }, async {
                    (&mut gone).await;
                    None
                });
            let job = next.await?;
            // The sender holds the slot only while it writes, never across a wait.
            let (mut write, rest) = self.slot.take()?;
            if let Some(rest) = rest {
                if let Err(e) = write
                    .write_rest(&rest.header, &rest.sources, rest.done)
                    .await
                {
                    debug!(error = %e, "data connection write failed");
                    return Some(write);
                }
            }
            if let Job::Op(op) = job {
                if let Err(e) = self.write_op(&mut write, op, &mut header, &mut lane).await {
                    debug!(error = %e, "data connection write failed");
                    return Some(write);
                }
            }
            self.slot.put(write);
        }
    }

    /// Writes one queued operation (reports it if the ledger hands it back unwritten).
    async fn write_op(
        &self,
        write: &mut W,
        op: TransferOp,
        header: &mut Vec<u8>,
        lane: &mut Option<std::sync::Arc<kvferry_memory::Staging>>,
    ) -> io::Result<()> {
        let (sources, bad) = prepare_op(&op, &self.memory, header);
        let device = self.memory.staging().is_some() && staged::on_device(&self.memory, &op.slices);
        // The ledger hands each operation to exactly one reporter: close, this writer, or
        // the ack reader.
        match self.ledger.start(op.id, bad) {
            Start::Gone => return Ok(()),
            Start::Closed => {
                self.report.report(op.id, Start::unsent(bad));
                return Ok(());
            }
            Start::Write => {}
        }
        match self.memory.staging() {
            Some(staging) if device => {
                let pieces = staged::pieces(&self.memory, &op.slices, &sources);
                let own = staged::lane_of(lane, staging)?;
                // A checked batch hashes the staged bytes it sends.
                let hasher = op.checksum.then(Checksum::new);
                staged::write_staged(write, header, &pieces, &own, staging, hasher).await
            }
            // A checked batch: the XXH3-64 of exactly the bytes sent follows them.
            _ if op.checksum => write.write_gather_checked(header, &sources).await,
            _ => write.write_gather(header, &sources).await,
        }
    }
}

impl<A: AsyncRead + Unpin, R: Report> Acking<A, R> {
    /// Reads acknowledgements until the connection ends or one is out of order.
    pub async fn run(self) {
        // Pipelined operations' acknowledgements arrive together: read them in one go.
        let mut read = BufReader::with_capacity(4096, self.read);
        loop {
            let (id, status) = match read_ack(&mut read).await {
                Ok(ack) => ack,
                Err(e) => {
                    debug!(error = %e, "data connection closed");
                    break;
                }
            };
            if let Acked::OutOfOrder(expected) = self.ledger.acked(id) {
                warn!(got = %id, ?expected, "acknowledgement out of order, closing the data connection");
                if let Some(e) = expected {
                    self.report.report(e, TransferOutcome::Transient);
                }
                break;
            }
            let outcome = match status {
                AckStatus::Applied => TransferOutcome::Done,
                // The destination failed its room (`checksum_mismatch`): like a refusal, never
                // retried.
                AckStatus::Refused | AckStatus::Corrupt => TransferOutcome::Refused,
            };
            self.report.report(id, outcome);
        }
        fail_pending(&self.ledger, &self.report);
    }
}
