//! What a glommio shard lends the driver's RDMA data plane ([`kvferry_driver::rdma`]):
//! completion channels awaited by a polling thread each
//! ([`kvferry_driver::rdma::PolledFd`]: glommio 0.9 cannot wait on an arbitrary descriptor).

use std::io;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use kvferry_driver::rdma::{self, CompletionFd, PolledFd, RdmaNode, RdmaPlane};
use kvferry_memory::MemoryMap;

/// A glommio node's RDMA side, shared by its shards: the device with the node's memory
/// registered, and the read end of the pipe every completion poller of the node also
/// watches (the node keeps the write end: when the node goes, so do the pollers).
#[derive(Clone)]
pub(crate) struct ShardRdma {
    pub(crate) node: Arc<RdmaNode>,
    pub(crate) stop: Arc<OwnedFd>,
}

/// Opens the device (`None`: the node stages over TCP, the log says why) and the pollers'
/// stop pipe, whose write end the caller keeps.
pub(crate) fn open(
    backend: &kvferry_driver::DataBackend,
    memory: &MemoryMap,
    remote_write: bool,
    checksum: bool,
) -> Result<(Option<ShardRdma>, Option<OwnedFd>), kvferry_driver::NodeError> {
    let Some(node) = rdma::open_backend(backend, memory, remote_write, checksum)? else {
        return Ok((None, None));
    };
    let (stop, keep) = rdma::poller_stop()?;
    Ok((Some(ShardRdma { node, stop }), Some(keep)))
}

impl ShardRdma {
    /// The driver's RDMA plane over this device and `memory`.
    pub(crate) fn plane(&self, memory: Arc<MemoryMap>) -> RdmaPlane {
        RdmaPlane::new(self.node.clone(), memory)
    }
}

/// Starts waiting on `fd` on a polling thread that also watches the node's stop pipe.
pub(crate) fn readable(device: &crate::RdmaDevice, fd: CompletionFd) -> io::Result<PolledFd> {
    let stop = device.as_ref().map(|r| r.stop.clone());
    PolledFd::new(fd, stop.ok_or(io::ErrorKind::NotConnected)?)
}
