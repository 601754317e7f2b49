//! What a glommio shard lends the driver's RDMA data plane ([`kvferry_driver::rdma`]): its
//! tasks, and completion channels awaited by a polling thread each
//! ([`kvferry_driver::rdma::PolledFd`]: glommio 0.9 cannot wait on an arbitrary descriptor).

use std::io;
use std::sync::Arc;

use kvferry_core::SessionId;
use kvferry_driver::rdma::{self, CompletionFd, PolledFd, RdmaHost, RdmaNode, SharedQp};
use kvferry_memory::MemoryMap;
use tokio::sync::oneshot;

use crate::ShardHost;

impl RdmaHost for ShardHost {
    type Readable = PolledFd;

    fn rdma(&self) -> Option<&Arc<RdmaNode>> {
        self.rdma.as_ref()
    }

    fn memory(&self) -> &Arc<MemoryMap> {
        &self.memory
    }

    fn readable(fd: CompletionFd) -> io::Result<PolledFd> {
        PolledFd::new(fd)
    }

    async fn wait(readable: &mut PolledFd) -> io::Result<()> {
        readable.wait().await
    }

    fn spawn_watch(&self, session: SessionId, qp: SharedQp, stop: oneshot::Receiver<()>) {
        self.spawn(rdma::watch(self.clone(), session, qp, stop));
    }
}
