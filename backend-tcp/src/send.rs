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

/// The sending side of one data connection (prefill): operations are pipelined, each
/// gathered straight from registered memory, and completed by the peer's acknowledgement.
/// Every operation handed to [`DataSender::send`] is reported exactly once.
pub struct DataSender<T, R> {
    ops: flume::Sender<TransferOp>,
    ledger: Arc<OpLedger>,
    report: R,
    tasks: [T; 2],
}

impl<T, R> std::fmt::Debug for DataSender<T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataSender")
            .field("in_flight", &self.ledger.in_flight())
            .finish_non_exhaustive()
    }
}

/// The writer task of a [`DataSender`], for its runtime to spawn.
pub struct Writing<W, R> {
    write: W,
    ops: flume::Receiver<TransferOp>,
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

impl<T: Task, R: Report> DataSender<T, R> {
    /// Takes over an established data connection (preamble and hello exchanged): `write` and
    /// `read` are its two halves, `spawn` starts the writer and the acknowledgement reader on
    /// the caller's runtime and returns their tasks.
    pub fn start<W, A>(
        write: W,
        read: A,
        memory: Arc<MemoryMap>,
        report: R,
        spawn: impl FnOnce(Writing<W, R>, Acking<A, R>) -> [T; 2],
    ) -> Self
    where
        W: GatherWrite,
        A: AsyncRead + Unpin,
    {
        let (tx, rx) = flume::unbounded();
        let (alive, reader_gone) = flume::bounded(1);
        let ledger = Arc::new(OpLedger::new());
        let tasks = spawn(
            Writing {
                write,
                ops: rx,
                reader_gone,
                memory,
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
        }
    }

    /// Queues an operation. Gives it back if the connection is already closed.
    pub fn send(&self, op: TransferOp) -> Result<(), TransferOp> {
        if !self.ledger.enqueue(op.id) {
            return Err(op);
        }
        self.ops.send(op).map_err(|e| {
            self.ledger.unqueue(e.0.id);
            e.0
        })
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
    pub async fn run(mut self) {
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
            let Some(op) = next.await else { break };
            let (sources, bad) = prepare_op(&op, &self.memory, &mut header);
            let device =
                self.memory.staging().is_some() && staged::on_device(&self.memory, &op.slices);
            // The ledger hands each operation to exactly one reporter: close, this writer, or
            // the ack reader.
            match self.ledger.start(op.id, bad) {
                Start::Gone => continue,
                Start::Closed => {
                    self.report.report(op.id, Start::unsent(bad));
                    continue;
                }
                Start::Write => {}
            }
            let written = match self.memory.staging() {
                Some(staging) if device => {
                    let pieces = staged::pieces(&self.memory, &op.slices, &sources);
                    match staged::lane_of(&mut lane, staging) {
                        Ok(own) => {
                            // A checked batch hashes the staged bytes it sends.
                            let hasher = op.checksum.then(Checksum::new);
                            staged::write_staged(
                                &mut self.write,
                                &header,
                                &pieces,
                                &own,
                                staging,
                                hasher,
                            )
                            .await
                        }
                        Err(e) => Err(e),
                    }
                }
                // A checked batch: the XXH3-64 of exactly the bytes sent follows them.
                _ if op.checksum => self.write.write_gather_checked(&header, &sources).await,
                _ => self.write.write_gather(&header, &sources).await,
            };
            if let Err(e) = written {
                debug!(error = %e, "data connection write failed");
                break;
            }
        }
        // Everything queued or unacknowledged failed transiently.
        fail_pending(&self.ledger, &self.report);
        drop(self.ops);
        self.write.finish().await;
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
