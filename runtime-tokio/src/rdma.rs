//! What the tokio runtime lends the driver's RDMA data plane ([`kvferry_driver::rdma`]):
//! completion channels awaited with `AsyncFd` (no spinning, no thread).

use std::io;

use kvferry_driver::rdma::CompletionFd;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// A completion channel registered with tokio's reactor.
pub struct TokioReadable(AsyncFd<CompletionFd>);

/// Registers `fd` with the reactor for readability.
pub(crate) fn readable(fd: CompletionFd) -> io::Result<TokioReadable> {
    // SAFETY: the descriptor belongs to the completion channel of the QP that
    // `CompletionFd` keeps alive (an `Arc`), so it stays open and the same for the
    // AsyncFd's lifetime; `as_raw_fd` always returns it.
    let registered = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) };
    registered.map(TokioReadable).map_err(io::Error::from)
}

/// Waits for the channel's next readiness.
pub(crate) async fn wait(readable: &mut TokioReadable) -> io::Result<()> {
    // Cleared before the caller consumes: a completion that comes after is a new edge.
    readable.0.readable().await?.clear_ready();
    Ok(())
}
