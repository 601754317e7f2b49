//! What the tokio runtime lends the driver's RDMA data plane ([`kvferry_driver::rdma`]):
//! completion channels awaited with `AsyncFd` (no spinning, no thread), and its tasks.

use std::io;
use std::sync::Arc;

use kvferry_core::SessionId;
use kvferry_driver::rdma::{self, CompletionFd, RdmaHost, RdmaNode, SharedQp};
use kvferry_memory::MemoryMap;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::oneshot;

use crate::TokioHost;

/// A completion channel registered with tokio's reactor.
pub struct TokioReadable(AsyncFd<CompletionFd>);

impl RdmaHost for TokioHost {
    type Readable = TokioReadable;

    fn rdma(&self) -> Option<&Arc<RdmaNode>> {
        self.rdma.as_ref()
    }

    fn memory(&self) -> &Arc<MemoryMap> {
        &self.memory
    }

    fn readable(&self, fd: CompletionFd) -> io::Result<TokioReadable> {
        // SAFETY: the descriptor belongs to the completion channel of the QP that
        // `CompletionFd` keeps alive (an `Arc`), so it stays open and the same for the
        // AsyncFd's lifetime; `as_raw_fd` always returns it.
        let registered = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) };
        registered.map(TokioReadable).map_err(io::Error::from)
    }

    async fn wait(readable: &mut TokioReadable) -> io::Result<()> {
        // Cleared before the caller consumes: a completion that comes after is a new edge.
        readable.0.readable().await?.clear_ready();
        Ok(())
    }

    fn spawn_watch(&self, session: SessionId, qp: SharedQp, stop: oneshot::Receiver<()>) {
        self.runtime
            .spawn(rdma::watch(self.clone(), session, qp, stop));
    }
}
