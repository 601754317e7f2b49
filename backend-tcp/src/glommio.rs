//! The data plane on glommio: its io_uring sockets plugged into the one data plane of this
//! crate, with the `sendmsg`/`recvmsg` fast paths on plain TCP (TLS goes through rustls's
//! buffers), on the shard's own thread.

use std::io;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_io::{AsyncRead, AsyncWrite};

use glommio::net::TcpStream;
use kvferry_core::{TransferId, TransferOutcome};
use kvferry_memory::{MemoryMap, WriteCheck};

use crate::fd::{second_handle, GatherConn, ScatterConn};
use crate::io_common::{Limits, ServeError, ServeStats};
pub use crate::polled::Polled;
use crate::send::{Copying, Task};
use crate::stream::serve_writes_on;

/// A control or data connection on a glommio shard: plain TCP, or TLS over it.
pub enum LocalConn {
    /// Plain TCP: the data plane moves registered memory with vectored syscalls.
    Plain(TcpStream),
    /// TLS ([`crate::TlsSetup::connect_on`], [`crate::TlsSetup::accept_on`]).
    Tls(Box<futures_rustls::TlsStream<TcpStream>>),
}

impl std::fmt::Debug for LocalConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LocalConn::Plain(_) => "LocalConn::Plain",
            LocalConn::Tls(_) => "LocalConn::Tls",
        })
    }
}

impl From<TcpStream> for LocalConn {
    fn from(s: TcpStream) -> Self {
        LocalConn::Plain(s)
    }
}

impl LocalConn {
    /// The TCP socket underneath.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            LocalConn::Plain(s) => s,
            LocalConn::Tls(t) => t.get_ref().0,
        }
    }
}

impl AsyncRead for LocalConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            LocalConn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            LocalConn::Tls(t) => Pin::new(t.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for LocalConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            LocalConn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            LocalConn::Tls(t) => Pin::new(t.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            LocalConn::Plain(s) => Pin::new(s).poll_flush(cx),
            LocalConn::Tls(t) => Pin::new(t.as_mut()).poll_flush(cx),
        }
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            LocalConn::Plain(s) => Pin::new(s).poll_close(cx),
            LocalConn::Tls(t) => Pin::new(t.as_mut()).poll_close(cx),
        }
    }
}

/// Where a [`LocalDataSender`] reports each operation's outcome (on the shard's own thread).
pub type LocalReport = Rc<dyn Fn(TransferId, TransferOutcome)>;

/// The sending side of one data connection on a glommio shard.
pub type LocalDataSender = crate::send::DataSender<glommio::Task<()>, LocalReport>;

impl Task for glommio::Task<()> {
    async fn stop(self) {
        let _ = self.cancel().await;
    }

    fn abort(self) {
        // Dropping a glommio task cancels it.
    }
}

impl LocalDataSender {
    /// Starts the writer and ack reader of `conn` on the current glommio executor (plain TCP:
    /// over two handles of its socket, acks read as [`Polled`] with `spin`; TLS: over the two
    /// halves of its stream); sources are read from `memory`.
    pub fn spawn(
        conn: impl Into<LocalConn>,
        memory: Arc<MemoryMap>,
        report: LocalReport,
        spin: Duration,
    ) -> io::Result<Self> {
        let conn = conn.into();
        let _ = conn.tcp().set_nodelay(true);
        Ok(match conn {
            LocalConn::Plain(stream) => {
                let read = Polled::new(second_handle(&stream)?, spin);
                Self::start(GatherConn(stream), read, memory, report, |w, a| {
                    [glommio::spawn_local(w.run()), glommio::spawn_local(a.run())]
                })
            }
            tls @ LocalConn::Tls(_) => {
                let (read, write) = futures_lite::io::split(tls);
                Self::start(Copying(write), read, memory, report, |w, a| {
                    [glommio::spawn_local(w.run()), glommio::spawn_local(a.run())]
                })
            }
        })
    }
}

/// Serves write batches on a data connection (decode) on the current glommio executor:
/// validates each write with `check`, scatters it into registered memory, acknowledges.
/// Plain TCP is read as [`Polled`] with `spin`.
pub async fn serve_local(
    conn: impl Into<LocalConn>,
    memory: &MemoryMap,
    check: Rc<dyn WriteCheck>,
    limits: Limits,
    spin: Duration,
) -> Result<ServeStats, ServeError> {
    let conn = conn.into();
    let _ = conn.tcp().set_nodelay(true);
    match conn {
        LocalConn::Plain(stream) => {
            let mut conn = ScatterConn::new(Polled::new(stream, spin), crate::RECV_BUF);
            serve_writes_on(&mut conn, memory, check, limits).await
        }
        tls @ LocalConn::Tls(_) => {
            let mut conn = futures_lite::io::BufReader::with_capacity(crate::RECV_BUF, tls);
            serve_writes_on(&mut conn, memory, check, limits).await
        }
    }
}
