//! The data plane on tokio: tokio's sockets (and TLS over them) plugged into the one data
//! plane of this crate through [`TokioIo`]; plain TCP gets the `sendmsg`/`recvmsg` fast paths.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use kvferry_core::{TransferId, TransferOutcome};
use kvferry_memory::{MemoryMap, WriteCheck};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

use crate::fd::{GatherConn, ScatterConn};
use crate::io_common::{Limits, Preamble, ServeError, ServeStats};
use crate::polled::Polled;
use crate::send::{Copying, Task};
use crate::stream::{
    answer_data_on, challenge_data_on, hello_control, hello_data, read_preamble_on, serve_writes_on,
};
use crate::tls::{Conn, TlsSetup};

/// Called once per operation handed to a [`DataSender`], with how it ended.
pub type Report = Arc<dyn Fn(TransferId, TransferOutcome) + Send + Sync>;

/// The sending side of one data connection on tokio.
pub type DataSender = crate::send::DataSender<JoinHandle<()>, Report>;

/// A tokio stream seen through the `futures-io` traits the data plane is written against.
#[derive(Debug)]
pub struct TokioIo<T>(pub T);

impl<T: AsyncRead + Unpin> futures_io::AsyncRead for TokioIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let mut read = ReadBuf::new(buf);
        match Pin::new(&mut self.0).poll_read(cx, &mut read) {
            Poll::Ready(Ok(())) => Poll::Ready(Ok(read.filled().len())),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncWrite + Unpin> futures_io::AsyncWrite for TokioIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl AsRawFd for TokioIo<TcpStream> {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl AsRawFd for TokioIo<OwnedWriteHalf> {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_ref().as_raw_fd()
    }
}

impl AsRawFd for TokioIo<OwnedReadHalf> {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_ref().as_raw_fd()
    }
}

impl Task for JoinHandle<()> {
    async fn stop(self) {
        JoinHandle::abort(&self);
        let _ = self.await;
    }

    fn abort(self) {
        JoinHandle::abort(&self);
    }
}

impl DataSender {
    /// Takes over an established data connection (preamble already exchanged); on plain TCP
    /// its acknowledgements are read as [`Polled`] with `spin`.
    pub fn spawn(
        conn: impl Into<Conn>,
        memory: Arc<MemoryMap>,
        report: Report,
        spin: Duration,
    ) -> Self {
        let conn = conn.into();
        let _ = conn.tcp().set_nodelay(true);
        match conn {
            Conn::Plain(stream) => {
                let (read, write) = stream.into_split();
                Self::start(
                    GatherConn(TokioIo(write)),
                    Polled::new(TokioIo(read), spin),
                    memory,
                    report,
                    |w, a| [tokio::spawn(w.run()), tokio::spawn(a.run())],
                )
            }
            tls @ Conn::Tls(_) => {
                let (read, write) = tokio::io::split(tls);
                Self::start(
                    Copying(TokioIo(write)),
                    TokioIo(read),
                    memory,
                    report,
                    |w, a| [tokio::spawn(w.run()), tokio::spawn(a.run())],
                )
            }
        }
    }
}

/// Serves write batches on a data connection (decode): validates each header and table with
/// `check`, scatters the payload straight into registered memory, then acknowledges.
///
/// Refused writes are read into a discard buffer (never into registered memory) and
/// acknowledged as refused. A malformed header ends the connection. Returns on EOF. Plain
/// TCP is read as [`Polled`] with `spin`.
pub async fn serve_writes(
    stream: impl Into<Conn>,
    memory: Arc<MemoryMap>,
    check: Arc<dyn WriteCheck + Send + Sync>,
    limits: Limits,
    spin: Duration,
) -> Result<ServeStats, ServeError> {
    match stream.into() {
        Conn::Plain(tcp) => {
            let _ = tcp.set_nodelay(true);
            let mut conn = ScatterConn::new(Polled::new(TokioIo(tcp), spin), crate::RECV_BUF);
            serve_writes_on(&mut conn, &memory, check, limits).await
        }
        tls @ Conn::Tls(_) => {
            let mut conn =
                futures_lite::io::BufReader::with_capacity(crate::RECV_BUF, TokioIo(tls));
            serve_writes_on(&mut conn, &memory, check, limits).await
        }
    }
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
    hello_data(&mut TokioIo(&mut stream), key).await?;
    Ok(stream)
}

/// Listener side of a data connection, after its preamble: sends `challenge` and reads the
/// hello that answers it (the caller checks it, then [`answer_data`]).
pub async fn challenge_data<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    challenge: &kvferry_core::auth::Nonce,
) -> io::Result<crate::DataHello> {
    challenge_data_on(&mut TokioIo(stream), challenge).await
}

/// Opens a control connection to a kvferry listener (TLS first when `tls` is given).
pub async fn connect_control(
    addr: std::net::SocketAddr,
    tls: Option<&TlsSetup>,
) -> io::Result<Conn> {
    let mut stream = open(addr, tls).await?;
    hello_control(&mut TokioIo(&mut stream)).await?;
    Ok(stream)
}

/// Reads the preamble of an accepted connection (bounded, total).
pub async fn read_preamble<S: AsyncRead + Unpin>(stream: &mut S) -> Result<Preamble, ServeError> {
    read_preamble_on(&mut TokioIo(stream)).await
}

/// Accepts (0) or refuses (1) a data connection after its preamble.
pub async fn answer_data<S: AsyncWrite + Unpin>(stream: &mut S, accept: bool) -> io::Result<()> {
    answer_data_on(&mut TokioIo(stream), accept).await
}
