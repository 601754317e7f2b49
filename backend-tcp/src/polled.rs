//! A socket read that calls `recv` itself before it waits on its runtime, and keeps trying
//! for a while after the last bytes came: what makes a small operation's round trip cost
//! syscalls, not wake-ups.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_io::{AsyncRead, AsyncWrite};

/// A plain socket whose reads call `recv` first and, for `spin` after the last bytes came,
/// keep calling it before they wait on the runtime. A runtime learns that bytes came through
/// its poller and wakes the waiting task after: on glommio a readiness poll on its ring,
/// armed at once after a partial read and completed ~40 us after the bytes were there on
/// this VM; on tokio an epoll wake-up, then a parked worker thread woken across cores. The
/// runtime's own read runs only after a `recv` found nothing, within the same call (glommio's
/// waits for readiness; tokio's reads and returns what it read), so the stream stays in
/// order. A read within its spin keeps its task ready: on glommio, what waits on the shard's
/// ring then waits up to its preempt timer (100 ms) while bytes keep coming less than `spin`
/// apart; on tokio each try is a yield, which may wake a parked worker to look for work.
/// After [`READY_RUN`] reads in a row that found bytes, one read yields first: the runtime's
/// own reads would have spent their task's budget by then (tokio's cooperative scheduling),
/// and a connection that always has bytes must not keep its thread from other tasks.
pub struct Polled<S> {
    stream: S,
    spin: Duration,
    last: Instant,
    /// Reads in a row that returned bytes without a yield.
    ready_run: u32,
}

/// How many reads in a row may return bytes before one yields to the executor.
pub const READY_RUN: u32 = 64;

impl<S> Polled<S> {
    /// Wraps `stream`; `spin` is how long after its last bytes a read keeps trying before it
    /// waits (zero: one try, then the runtime).
    pub fn new(stream: S, spin: Duration) -> Self {
        Polled {
            stream,
            spin,
            last: Instant::now(),
            ready_run: 0,
        }
    }

    /// The wrapped stream.
    pub fn get_ref(&self) -> &S {
        &self.stream
    }
}

impl<S: AsRawFd> AsRawFd for Polled<S> {
    fn as_raw_fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }
}

impl<S: AsyncRead + AsRawFd + Unpin> AsyncRead for Polled<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.ready_run >= READY_RUN {
            this.ready_run = 0;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        loop {
            // SAFETY: the descriptor stays open for as long as `this.stream`, which outlives
            // the call.
            let fd = unsafe { BorrowedFd::borrow_raw(this.stream.as_raw_fd()) };
            match rustix::net::recv(fd, buf, rustix::net::RecvFlags::DONTWAIT) {
                Ok(n) => {
                    this.last = Instant::now();
                    this.ready_run += 1;
                    return Poll::Ready(Ok(n));
                }
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::AGAIN) => break,
                Err(e) => return Poll::Ready(Err(e.into())),
            }
        }
        this.ready_run = 0;
        if this.last.elapsed() < this.spin {
            // Still within the spin: run again after the executor's other ready tasks.
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let read = Pin::new(&mut this.stream).poll_read(cx, buf);
        if matches!(read, Poll::Ready(Ok(n)) if n > 0) {
            this.last = Instant::now();
        }
        read
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Polled<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_close(cx)
    }
}
