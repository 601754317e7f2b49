//! Data connections on tokio: vectored sends straight from registered memory, scatter
//! receives straight into it, one acknowledgement per operation after the bytes are applied.

use std::io;
use std::sync::Arc;

use kvferry_core::{TransferId, TransferOp, TransferOutcome};
use kvferry_sync::{Acked, OpLedger, Start};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, WriteHalf};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::frame::{
    decode_ack, decode_slices, encode_ack, AckStatus, DataHello, WriteHeader, ACK_LEN,
    DATA_CHALLENGE_LEN, DATA_HELLO_LEN, KIND_CONTROL, KIND_DATA, MAGIC, SLICE_DESC_LEN,
    WRITE_HEADER_LEN,
};
use crate::io_common::{
    admit, gather_iovecs, parse_preamble, prepare_op, scatter_iovecs, Admission, Limits, Preamble,
    ServeError, ServeStats, PREAMBLE_LEN,
};
use crate::tls::{Conn, TlsSetup};
use kvferry_memory::{MemoryMap, WriteCheck};

/// Called once per operation handed to a [`DataSender`], with how it ended.
pub type Report = Arc<dyn Fn(TransferId, TransferOutcome) + Send + Sync>;

/// The sending side of one data connection (prefill): operations are pipelined, each written
/// with one vectored write from registered memory, and completed by the peer's ack.
pub struct DataSender {
    ops: mpsc::UnboundedSender<TransferOp>,
    ledger: Arc<OpLedger>,
    report: Report,
    writer: JoinHandle<()>,
    reader: JoinHandle<()>,
}

impl std::fmt::Debug for DataSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataSender").finish_non_exhaustive()
    }
}

/// Marks the connection closed and reports every operation not acknowledged as transient.
fn fail_pending(ledger: &OpLedger, report: &Report) {
    for id in ledger.close() {
        report(id, TransferOutcome::Transient);
    }
}

impl DataSender {
    /// Takes over an established data connection (preamble already exchanged).
    pub fn spawn(conn: impl Into<Conn>, memory: Arc<MemoryMap>, report: Report) -> Self {
        let conn = conn.into();
        let _ = conn.tcp().set_nodelay(true);
        let (tx, rx) = mpsc::unbounded_channel();
        let ledger = Arc::new(OpLedger::new());
        let (writer, reader) = match conn {
            Conn::Plain(stream) => {
                let (read, write) = stream.into_split();
                (
                    tokio::spawn(write_loop(
                        Writer::Plain(write),
                        rx,
                        memory,
                        ledger.clone(),
                        report.clone(),
                    )),
                    tokio::spawn(ack_loop(read, ledger.clone(), report.clone())),
                )
            }
            tls @ Conn::Tls(_) => {
                let (read, write) = tokio::io::split(tls);
                (
                    tokio::spawn(write_loop(
                        Writer::Tls(write),
                        rx,
                        memory,
                        ledger.clone(),
                        report.clone(),
                    )),
                    tokio::spawn(ack_loop(read, ledger.clone(), report.clone())),
                )
            }
        };
        DataSender {
            ops: tx,
            ledger,
            report,
            writer,
            reader,
        }
    }

    /// Queues an operation. Gives it back if the connection is already closed.
    pub fn send(&self, op: TransferOp) -> Result<(), TransferOp> {
        if self.writer.is_finished() || !self.ledger.enqueue(op.id) {
            return Err(op);
        }
        self.ops.send(op).map_err(|e| {
            self.ledger.unqueue(e.0.id);
            e.0
        })
    }

    /// Whether the connection broke or was closed.
    pub fn is_closed(&self) -> bool {
        self.ledger.is_closed() || self.writer.is_finished()
    }

    /// Operations written and not yet acknowledged.
    pub fn in_flight(&self) -> usize {
        self.ledger.in_flight()
    }

    /// Closes the connection and waits until nothing of it can be written any more. Every
    /// operation not acknowledged is reported as transient.
    pub async fn close(self) {
        self.writer.abort();
        self.reader.abort();
        let _ = self.writer.await;
        let _ = self.reader.await;
        // The writer is gone: whatever it had not written, or was not acked, is reported.
        fail_pending(&self.ledger, &self.report);
    }
}

/// The writing half of a data connection.
enum Writer {
    /// Vectored writes straight from registered memory.
    Plain(OwnedWriteHalf),
    /// Through rustls: each piece is copied into TLS records.
    Tls(WriteHalf<Conn>),
}

impl Writer {
    async fn write_gather(&mut self, header: &[u8], sources: &[(usize, usize)]) -> io::Result<()> {
        match self {
            Writer::Plain(w) => write_gather(w, header, sources).await,
            Writer::Tls(w) => {
                let total = header.len() + sources.iter().map(|s| s.1).sum::<usize>();
                let mut done = 0usize;
                while done < total {
                    let iov = gather_iovecs(header, sources, done);
                    let Some(first) = iov.first() else { break };
                    let n = w.write(first).await?;
                    if n == 0 {
                        return Err(io::ErrorKind::WriteZero.into());
                    }
                    done += n;
                }
                w.flush().await
            }
        }
    }

    async fn shutdown(&mut self) {
        let _ = match self {
            Writer::Plain(w) => w.shutdown().await,
            Writer::Tls(w) => w.shutdown().await,
        };
    }
}

async fn write_loop(
    mut write: Writer,
    mut rx: mpsc::UnboundedReceiver<TransferOp>,
    memory: Arc<MemoryMap>,
    ledger: Arc<OpLedger>,
    report: Report,
) {
    let mut header = Vec::with_capacity(WRITE_HEADER_LEN + 64 * SLICE_DESC_LEN);
    while let Some(op) = rx.recv().await {
        let (sources, bad) = prepare_op(&op, &memory, &mut header);
        // The ledger hands each operation to exactly one reporter: close, this writer, or
        // the ack reader.
        match ledger.start(op.id, bad) {
            Start::Gone => continue,
            Start::Closed => {
                report(op.id, Start::unsent(bad));
                continue;
            }
            Start::Write => {}
        }
        if let Err(e) = write.write_gather(&header, &sources).await {
            debug!(error = %e, "data connection write failed");
            break;
        }
    }
    // Everything queued or unacknowledged failed transiently.
    fail_pending(&ledger, &report);
    rx.close();
    write.shutdown().await;
}

/// Writes `header` then every source range with as few `writev` calls as the kernel allows.
async fn write_gather(
    write: &mut OwnedWriteHalf,
    header: &[u8],
    sources: &[(usize, usize)],
) -> io::Result<()> {
    let total = header.len() + sources.iter().map(|s| s.1).sum::<usize>();
    let mut done = 0usize;
    while done < total {
        write.writable().await?;
        let result = {
            let iov = gather_iovecs(header, sources, done);
            write.try_write_vectored(&iov)
        };
        match result {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

async fn ack_loop<R: AsyncRead + Unpin>(mut read: R, ledger: Arc<OpLedger>, report: Report) {
    let mut buf = [0u8; ACK_LEN];
    loop {
        if let Err(e) = read.read_exact(&mut buf).await {
            debug!(error = %e, "data connection closed");
            break;
        }
        let Ok((id, status)) = decode_ack(&buf) else {
            warn!("malformed acknowledgement, closing the data connection");
            break;
        };
        if let Acked::OutOfOrder(expected) = ledger.acked(id) {
            warn!(got = %id, ?expected, "acknowledgement out of order, closing the data connection");
            if let Some(e) = expected {
                report(e, TransferOutcome::Transient);
            }
            break;
        }
        let outcome = match status {
            AckStatus::Applied => TransferOutcome::Done,
            AckStatus::Refused => TransferOutcome::Refused,
        };
        report(id, outcome);
    }
    fail_pending(&ledger, &report);
}

/// Serves write batches on a data connection (decode): validates each header and table with
/// `check`, scatters the payload straight into registered memory, then acknowledges.
///
/// Refused writes are read into a discard buffer (never into registered memory) and
/// acknowledged as refused. A malformed header ends the connection. Returns on EOF.
pub async fn serve_writes(
    stream: impl Into<Conn>,
    memory: Arc<MemoryMap>,
    check: Arc<dyn WriteCheck + Send + Sync>,
    limits: Limits,
) -> Result<ServeStats, ServeError> {
    let mut stream = stream.into();
    let _ = stream.tcp().set_nodelay(true);
    let mut stats = ServeStats::default();
    let mut header = [0u8; WRITE_HEADER_LEN];
    let mut table = Vec::new();
    loop {
        match stream.read_exact(&mut header).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(stats),
            Err(e) => return Err(e.into()),
        }
        let h = WriteHeader::decode(&header, limits.max_slices, limits.max_bytes)
            .map_err(ServeError::Frame)?;
        table.resize(h.slices as usize * SLICE_DESC_LEN, 0);
        stream.read_exact(&mut table).await?;
        let slices = decode_slices(&table, h.payload).map_err(ServeError::Frame)?;
        let status = match admit(&check, &memory, &h, &slices)? {
            Admission::Apply { landing, targets } => {
                read_scatter(&mut stream, &targets).await?;
                landing.applied();
                stats.applied += 1;
                stats.bytes += h.payload;
                AckStatus::Applied
            }
            Admission::Refuse(refused) => {
                discard(&mut stream, h.payload).await?;
                stats.refused += 1;
                debug!(room = %h.room, op = %h.op, ?refused, "write refused");
                AckStatus::Refused
            }
        };
        stream.write_all(&encode_ack(h.op, status)).await?;
        stream.flush().await?;
    }
}

/// Reads exactly the bytes of `targets` into them: with as few `readv` calls as possible on
/// plain TCP, through rustls's buffers on TLS.
async fn read_scatter(stream: &mut Conn, targets: &[(usize, usize)]) -> io::Result<()> {
    let total: usize = targets.iter().map(|t| t.1).sum();
    let mut done = 0usize;
    let stream = match stream {
        Conn::Plain(s) => s,
        tls @ Conn::Tls(_) => {
            while done < total {
                let mut iov = scatter_iovecs(targets, done);
                let Some(first) = iov.first_mut() else { break };
                let n = tls.read(first).await?;
                if n == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                done += n;
            }
            return Ok(());
        }
    };
    while done < total {
        stream.readable().await?;
        let result = {
            let mut iov = scatter_iovecs(targets, done);
            stream.try_read_vectored(&mut iov)
        };
        match result {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

async fn discard<R: AsyncRead + Unpin>(stream: &mut R, mut n: u64) -> io::Result<()> {
    let mut sink = vec![0u8; 64 * 1024];
    while n > 0 {
        let k = (n as usize).min(sink.len());
        stream.read_exact(&mut sink[..k]).await?;
        n -= k as u64;
    }
    Ok(())
}

/// Opens a TCP connection to `addr` (with TLS on top when `tls` is given).
async fn open(addr: std::net::SocketAddr, tls: Option<&TlsSetup>) -> io::Result<Conn> {
    let tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    match tls {
        Some(tls) => tls.connect(tcp).await,
        None => Ok(Conn::Plain(tcp)),
    }
}

/// Takes an accepted TCP connection (running the server side of TLS when `tls` is given).
pub async fn accept_conn(tcp: TcpStream, tls: Option<&TlsSetup>) -> io::Result<Conn> {
    let _ = tcp.set_nodelay(true);
    match tls {
        Some(tls) => tls.accept(tcp).await,
        None => Ok(Conn::Plain(tcp)),
    }
}

/// Opens a data connection to a kvferry listener and proves it belongs to the session of
/// `key`: reads the listener's challenge, answers it, and waits for the verdict.
pub async fn connect_data(
    addr: std::net::SocketAddr,
    key: &kvferry_core::SessionKey,
    tls: Option<&TlsSetup>,
) -> io::Result<Conn> {
    let mut stream = open(addr, tls).await?;
    stream.write_all(&MAGIC).await?;
    stream.write_all(&[KIND_DATA]).await?;
    stream.flush().await?;
    let mut challenge = [0u8; DATA_CHALLENGE_LEN];
    stream.read_exact(&mut challenge).await?;
    stream
        .write_all(&DataHello::answer(key, &challenge).encode())
        .await?;
    stream.flush().await?;
    let mut answer = [0u8; 1];
    stream.read_exact(&mut answer).await?;
    if answer[0] != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "data connection refused by the peer",
        ));
    }
    Ok(stream)
}

/// Listener side of a data connection, after its preamble: sends `challenge` and reads the
/// hello that answers it (the caller checks it, then [`answer_data`]).
pub async fn challenge_data<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    challenge: &kvferry_core::auth::Nonce,
) -> io::Result<DataHello> {
    stream.write_all(challenge).await?;
    stream.flush().await?;
    let mut hello = [0u8; DATA_HELLO_LEN];
    stream.read_exact(&mut hello).await?;
    Ok(DataHello::decode(&hello))
}

/// Opens a control connection to a kvferry listener (TLS first when `tls` is given).
pub async fn connect_control(
    addr: std::net::SocketAddr,
    tls: Option<&TlsSetup>,
) -> io::Result<Conn> {
    let mut stream = open(addr, tls).await?;
    stream.write_all(&MAGIC).await?;
    stream.write_all(&[KIND_CONTROL]).await?;
    stream.flush().await?;
    Ok(stream)
}

/// Reads the preamble of an accepted connection (bounded, total).
pub async fn read_preamble<S: AsyncRead + Unpin>(stream: &mut S) -> Result<Preamble, ServeError> {
    let mut head = [0u8; PREAMBLE_LEN];
    stream.read_exact(&mut head).await?;
    parse_preamble(&head)
}

/// Accepts (0) or refuses (1) a data connection after its preamble.
pub async fn answer_data<S: AsyncWrite + Unpin>(stream: &mut S, accept: bool) -> io::Result<()> {
    stream.write_all(&[u8::from(!accept)]).await?;
    stream.flush().await
}
