//! What a driver needs to carry a session's operations over RDMA, runtime-neutral: a node's
//! registered memory ([`RdmaNode`]) and one session's queue pair with the hello exchange
//! around it ([`RdmaLink`]).
//!
//! The hello rule, which keeps both sides on one pair of connected QPs without a loop: a
//! side creates a QP (INIT) when the session is established or after its fence completed,
//! and sends its hello. A hello that finds the local QP in INIT connects it. A hello that
//! finds the local QP already connected means the peer started over (it fenced): the local
//! QP is replaced by a new one, connected to the hello, and the new QP's hello goes back. The
//! peer's QP is in INIT then, so that hello only connects it.

use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex, MutexGuard};

use kvferry_core::{Region, TransferId, TransferOp, TransferOutcome};

use crate::device::{Device, RdmaError};
use crate::verbs::{LocalPiece, MemoryRegistration, RcQueuePair};
use crate::{writable, HandshakeError, QpState, RdmaHello, RemoteRegion};

/// The deepest send queue a session's QP asks for. An operation is one work request per
/// row of each slice, so the core's `max_ops_in_flight x max_op_slices` can exceed any device: a post
/// that does not fit fails at once (a full send queue) and the core retries it later.
const QP_DEPTH_MAX: u32 = 16384;

/// Where a region's bytes are, for registration.
#[derive(Debug)]
pub enum RegionMemory<'a> {
    /// Host memory.
    Host {
        /// First byte.
        ptr: *mut u8,
        /// Bytes.
        len: usize,
    },
    /// Device memory exported as a dma-buf, addressed by its own device address.
    DmaBuf {
        /// The dma-buf.
        fd: BorrowedFd<'a>,
        /// Where the region starts inside it.
        offset: u64,
        /// The region's device address (operations name it).
        iova: u64,
        /// Bytes.
        len: usize,
    },
}

/// A node's RDMA side: the device, the port, and every region of its layout registered.
#[derive(Debug)]
pub struct RdmaNode {
    device: Arc<Device>,
    port: u8,
    regions: Vec<(Region, MemoryRegistration)>,
    announce: Vec<RemoteRegion>,
    /// Send queue (and completion queue) depth: the device's limit, at most `QP_DEPTH_MAX`.
    depth: u32,
    /// Whether some region is device memory registered through its dma-buf.
    dma_buf: bool,
}

impl RdmaNode {
    /// Opens `device` (or the first one) and registers `regions`. A decode
    /// (`remote_write`) lets its peers write every region [`writable`] names and announces
    /// them in its hello; a prefill registers for local access only and announces nothing.
    ///
    /// # Safety
    ///
    /// Every region's memory must stay allocated and in place while the node lives.
    pub unsafe fn open(
        device: Option<&str>,
        port: u8,
        regions: &[(Region, RegionMemory<'_>)],
        remote_write: bool,
    ) -> Result<RdmaNode, RdmaError> {
        let device = Arc::new(Device::open(device)?);
        let depth = device.max_qp_wr()?.min(QP_DEPTH_MAX);
        let mut registered = Vec::with_capacity(regions.len());
        let mut announce = Vec::new();
        let mut dma_buf = false;
        for (region, memory) in regions {
            let remote = remote_write && writable(*region);
            let mr = match *memory {
                // SAFETY: the caller keeps the range allocated and in place while we live.
                RegionMemory::Host { ptr, len } => unsafe {
                    MemoryRegistration::new(&device, ptr, len, remote)?
                },
                RegionMemory::DmaBuf {
                    fd,
                    offset,
                    iova,
                    len,
                } => {
                    dma_buf = true;
                    MemoryRegistration::dma_buf(&device, fd, offset, iova, len, remote)?
                }
            };
            if remote {
                announce.push(mr.announce(region.code()));
            }
            registered.push((*region, mr));
        }
        Ok(RdmaNode {
            device,
            port,
            regions: registered,
            announce,
            depth,
            dma_buf,
        })
    }

    /// Whether some region is device memory the NIC reaches directly (dma-buf).
    pub fn registers_device_memory(&self) -> bool {
        self.dma_buf
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        self.device.name()
    }

    /// A new queue pair for a session, and the hello to send the peer.
    pub fn link(&self, psn: u32) -> Result<(RdmaLink, Vec<u8>), RdmaError> {
        let qp = RcQueuePair::new(&self.device, self.port, self.depth, psn)?;
        let hello = self.hello(&qp)?;
        Ok((
            RdmaLink {
                qp: Arc::new(Mutex::new(qp)),
                peer: None,
            },
            hello,
        ))
    }

    fn hello(&self, qp: &RcQueuePair) -> Result<Vec<u8>, RdmaError> {
        let mut out = Vec::new();
        qp.hello(self.announce.clone())?.encode(&mut out);
        Ok(out)
    }

    /// The registered bytes `[offset, offset + len)` of `region`, as a scatter/gather piece.
    fn local(&self, region: Region, offset: u64, len: u64) -> Option<LocalPiece> {
        let (_, mr) = self.regions.iter().find(|(r, _)| *r == region)?;
        let addr = mr.base().checked_add(offset)?;
        (mr.contains(addr, len) && len <= u64::from(u32::MAX >> 1)).then(|| LocalPiece {
            addr,
            len: len as u32,
            lkey: mr.lkey(),
        })
    }
}

/// Why an operation could not be posted.
#[derive(Debug)]
pub enum PostError {
    /// The QP is not connected yet (or is being replaced): hold the operation until
    /// [`HelloOutcome`] says it is.
    NotConnected,
    /// A slice's source is not registered on this node, or the peer announced no region that
    /// holds its destination: no retry can fix that.
    NoTarget {
        /// The slice's region.
        region: Region,
    },
    /// The verbs post failed (the QP is in the error state, the send queue is full).
    Verbs(RdmaError),
}

impl PostError {
    /// How the core should hear of it: `None` to hold the operation, else its outcome.
    pub fn outcome(&self) -> Option<TransferOutcome> {
        match self {
            PostError::NotConnected => None,
            PostError::NoTarget { .. } => Some(TransferOutcome::Fatal),
            PostError::Verbs(_) => Some(TransferOutcome::Transient),
        }
    }
}

/// What a received hello did to the link.
#[derive(Debug)]
pub enum HelloOutcome {
    /// The QP is connected: held operations may be posted.
    Connected,
    /// The peer started over; a new QP replaced the connected one and is connected to the
    /// peer's. Send `hello`, and watch the new QP's completions ([`RdmaLink::queue_pair`]).
    Replaced {
        /// This side's new hello.
        hello: Vec<u8>,
    },
}

/// Why a received hello was not used.
#[derive(Debug)]
pub enum HelloError {
    /// It did not decode.
    Malformed(HandshakeError),
    /// Connecting or replacing the QP failed.
    Verbs(RdmaError),
}

impl std::fmt::Display for HelloError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HelloError::Malformed(e) => write!(f, "{e}"),
            HelloError::Verbs(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for HelloError {}

/// One session's queue pair and what the peer announced.
#[derive(Debug)]
pub struct RdmaLink {
    qp: Arc<Mutex<RcQueuePair>>,
    peer: Option<RdmaHello>,
}

fn lock(qp: &Mutex<RcQueuePair>) -> MutexGuard<'_, RcQueuePair> {
    qp.lock().unwrap_or_else(|p| p.into_inner())
}

impl RdmaLink {
    /// The current QP, for the task that awaits its completion channel. A replaced QP stays
    /// alive until that task lets go of it, so its descriptor is never reused under it.
    pub fn queue_pair(&self) -> Arc<Mutex<RcQueuePair>> {
        self.qp.clone()
    }

    /// Whether `qp` is this link's current queue pair.
    pub fn is_current(&self, qp: &Arc<Mutex<RcQueuePair>>) -> bool {
        Arc::ptr_eq(&self.qp, qp)
    }

    /// Whether operations can be posted.
    pub fn is_connected(&self) -> bool {
        self.peer.is_some() && lock(&self.qp).state() == QpState::Rts
    }

    /// Applies the peer's hello (see the module doc for the rule).
    pub fn on_hello(
        &mut self,
        node: &RdmaNode,
        payload: &[u8],
        psn: u32,
    ) -> Result<HelloOutcome, HelloError> {
        let hello = RdmaHello::decode(payload).map_err(HelloError::Malformed)?;
        let fresh = lock(&self.qp).state() == QpState::Init;
        if fresh {
            lock(&self.qp).connect(&hello).map_err(HelloError::Verbs)?;
            self.peer = Some(hello);
            return Ok(HelloOutcome::Connected);
        }
        let mut qp = RcQueuePair::new(&node.device, node.port, node.depth, psn)
            .map_err(HelloError::Verbs)?;
        qp.connect(&hello).map_err(HelloError::Verbs)?;
        let ours = node.hello(&qp).map_err(HelloError::Verbs)?;
        // The old QP goes to the error state so nothing of it lands any more; its task
        // reports what it flushes and then drops it.
        let _ = lock(&self.qp).fence();
        self.qp = Arc::new(Mutex::new(qp));
        self.peer = Some(hello);
        Ok(HelloOutcome::Replaced { hello: ours })
    }

    /// Posts `op`: one RDMA WRITE per row of each slice, chained, the last one signalled.
    pub fn post(&mut self, node: &RdmaNode, op: &TransferOp) -> Result<(), PostError> {
        self.post_as(node, op, false)
    }

    /// [`RdmaLink::post`], with `wrong_rkey` set: the first write names a key the peer never
    /// registered, so the peer's device refuses it, this QP goes to the error state and the
    /// rest of its work flushes, as when a peer's memory goes away (fault injection for demos
    /// and tests; nothing is written anywhere).
    pub fn post_as(
        &mut self,
        node: &RdmaNode,
        op: &TransferOp,
        wrong_rkey: bool,
    ) -> Result<(), PostError> {
        let peer = self.peer.as_ref().ok_or(PostError::NotConnected)?;
        let mut local = Vec::with_capacity(op.slices.len());
        let mut remote = Vec::with_capacity(op.slices.len());
        for s in op.slices.iter() {
            let missing = PostError::NoTarget { region: s.region };
            let (addr, rkey) = peer.target(s).ok_or(missing)?;
            for i in 0..s.rows {
                let (src, dst) = s.row(i);
                let missing = PostError::NoTarget { region: s.region };
                local.push(node.local(s.region, src, s.len).ok_or(missing)?);
                remote.push((addr + (dst - s.dst_offset), rkey));
            }
        }
        if wrong_rkey {
            if let Some((_, rkey)) = remote.first_mut() {
                // Inverting the key's index bits names a memory region far past any registered.
                *rkey = !*rkey;
            }
        }
        let mut qp = lock(&self.qp);
        if qp.state() != QpState::Rts {
            return Err(PostError::NotConnected);
        }
        qp.post_write(op.id, &local, &remote)
            .map_err(PostError::Verbs)
    }

    /// The core's fence: the QP goes to the error state; its completion task reports what
    /// flushes, and [`RdmaLink::is_drained`] says when nothing of it can land any more.
    pub fn fence(&mut self) -> Result<(), RdmaError> {
        lock(&self.qp).fence()
    }

    /// Whether the fence is complete.
    pub fn is_drained(&self) -> bool {
        lock(&self.qp).is_drained()
    }

    /// After a completed fence: a new QP in INIT, the peer forgotten until its next hello;
    /// returns the hello to send.
    pub fn renew(&mut self, node: &RdmaNode, psn: u32) -> Result<Vec<u8>, RdmaError> {
        let qp = RcQueuePair::new(&node.device, node.port, node.depth, psn)?;
        let hello = node.hello(&qp)?;
        self.qp = Arc::new(Mutex::new(qp));
        self.peer = None;
        Ok(hello)
    }
}

/// Drains `qp`'s completion channel: every finished operation with its outcome, once.
pub fn completions(
    qp: &Mutex<RcQueuePair>,
) -> Result<Vec<(TransferId, TransferOutcome)>, RdmaError> {
    lock(qp).completions()
}
