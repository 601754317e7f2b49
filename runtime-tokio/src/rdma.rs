//! The RDMA data plane on tokio (feature `rdma`): per session one RC queue pair from
//! `kvferry-rdma`, its hello carried in the core's `Transport` frames, operations posted as
//! chained RDMA WRITEs, completions awaited on the completion channel's descriptor with
//! `AsyncFd` (no spinning), and the fence as "QP to the error state, wait for the flush".
//! Every outcome reaches the core through `handle_transfer_result`, as over TCP.

use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use kvferry_core::{Region, SessionId, TransferOp, TransferOutcome};
use kvferry_memory::{MemoryKind, MemoryMap, SliceSide};
use kvferry_rdma::device::RdmaError;
use kvferry_rdma::link::{completions, HelloOutcome, RdmaLink, RdmaNode, RegionMemory};
use kvferry_rdma::verbs::RcQueuePair;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use kvferry_driver::{DataPath, Driver, FaultKind, TCP_PATH};

use crate::{NodeError, Shared, TokioHost};

/// A session's RDMA side: its link and the task that awaits the current QP's completions.
pub struct SessionRdma {
    link: RdmaLink,
    /// The QP the core's fence moved to the error state, until its writes have flushed.
    fencing: Option<Arc<Mutex<RcQueuePair>>>,
    /// Dropping it tells the completion task to report what is left and let go of its QP.
    _watcher: oneshot::Sender<()>,
}

impl SessionRdma {
    /// The session ends: its QP goes to the error state (nothing more lands) and its
    /// completion task reports what flushes before letting go of it.
    pub(crate) fn close(mut self) {
        let _ = self.link.fence();
    }
}

/// Opens the device and registers every region of `memory` (remote write on decode): host
/// memory as it is, device memory through the dma-buf its copy engine exports. `None`: some
/// device region cannot be registered (the engine cannot export it, or the NIC cannot
/// register dma-bufs), so every session of the node moves over TCP, staged through host
/// buffers; the log says why.
pub(crate) fn open(
    memory: &MemoryMap,
    remote_write: bool,
    device: Option<&str>,
    port: u8,
) -> Result<Option<Arc<RdmaNode>>, NodeError> {
    let mut host = Vec::new();
    let mut exported = Vec::new();
    let wanted: Vec<(Region, u64)> = memory.region_lens().collect();
    for (region, len) in wanted {
        let Ok(ptr) = memory.range(region, 0, len) else {
            continue;
        };
        match (memory.kind(region), memory.staging()) {
            (Some(MemoryKind::Cuda { device }), Some(staging)) => {
                match staging
                    .engine()
                    .export_dma_buf(device, ptr as u64, len as usize)
                {
                    Ok(buf) => exported.push((region, buf, ptr as u64, len as usize)),
                    Err(e) => return Ok(staged(region, &e.to_string())),
                }
            }
            _ => host.push((region, ptr, len as usize)),
        }
    }
    let mut regions: Vec<(Region, RegionMemory<'_>)> = host
        .iter()
        .map(|&(region, ptr, len)| (region, RegionMemory::Host { ptr, len }))
        .collect();
    regions.extend(exported.iter().map(|(region, buf, iova, len)| {
        (
            *region,
            RegionMemory::DmaBuf {
                fd: buf.fd.as_fd(),
                offset: buf.offset,
                iova: *iova,
                len: *len,
            },
        )
    }));
    // SAFETY: the ranges belong to `memory`, which the node keeps (an `Arc` in `Shared`) for
    // as long as it keeps the `RdmaNode` that registered them.
    let node = match unsafe { RdmaNode::open(device, port, &regions, remote_write) } {
        Ok(node) => node,
        Err(
            e @ RdmaError::Verbs {
                call: "ibv_reg_dmabuf_mr",
                ..
            },
        ) => {
            let region = exported.first().map_or(Region::Scratch, |x| x.0);
            return Ok(staged(region, &e.to_string()));
        }
        Err(e) => return Err(NodeError::Backend(e.to_string().into())),
    };
    info!(
        device = node.device_name(),
        remote_write,
        device_memory = node.registers_device_memory(),
        "RDMA data plane ready"
    );
    Ok(Some(Arc::new(node)))
}

/// The node cannot give its NIC `region`: it moves every session over TCP, staged.
fn staged(region: Region, why: &str) -> Option<Arc<RdmaNode>> {
    warn!(
        ?region,
        why,
        "device memory cannot be registered for RDMA: every session moves over TCP, staged through host buffers"
    );
    None
}

/// A fresh initial packet sequence number per queue pair (so a late packet of an old QP is
/// not in the new one's window).
fn psn(sid: SessionId) -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ u64::from(std::process::id());
    let mut z = u64::from(sid.0) ^ t ^ 0x9E37_79B9_7F4A_7C15;
    z = (z ^ (z >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (z >> 20) as u32
}

/// The node's RDMA device and its shared state, when data moves over RDMA.
fn rdma_of(driver: &Driver<TokioHost>) -> Option<(Arc<Shared>, Arc<RdmaNode>)> {
    let shared = driver.host().shared.upgrade()?;
    let node = shared.rdma.clone()?;
    Some((shared, node))
}

/// The session is established: create its QP, send the hello, watch completions. `false`
/// when the node moves data over TCP.
pub(crate) fn establish(driver: &mut Driver<TokioHost>, sid: SessionId) -> bool {
    let Some((shared, node)) = rdma_of(driver) else {
        return false;
    };
    let (link, hello) = match node.link(psn(sid)) {
        Ok(x) => x,
        Err(e) => {
            warn!(session = %sid, error = %e, "no RDMA queue pair for the session");
            return true;
        }
    };
    let watcher = watch(&shared, sid, link.queue_pair());
    if let Some(io) = driver.session_io(sid) {
        io.ext = Some(SessionRdma {
            link,
            fencing: None,
            _watcher: watcher,
        });
    }
    send_hello(driver, sid, &hello);
    true
}

fn send_hello(driver: &mut Driver<TokioHost>, sid: SessionId, hello: &[u8]) {
    if let Err(e) = driver
        .endpoint_mut()
        .send_transport(Instant::now(), sid, hello)
    {
        warn!(session = %sid, error = %e, "could not send the RDMA hello");
    }
}

/// The peer's hello arrived: connect (or start over), then post what waited. A peer that
/// moves this session over TCP says so instead: the session's queue pair goes, and its
/// operations take TCP data connections.
pub(crate) fn on_hello(driver: &mut Driver<TokioHost>, sid: SessionId, payload: &[u8]) {
    let Some((shared, node)) = rdma_of(driver) else {
        return;
    };
    if payload == TCP_PATH {
        if let Some(r) = driver.session_io(sid).and_then(|io| io.ext.take()) {
            r.close();
        }
        driver.use_tcp_path(sid);
        return;
    }
    let Some(r) = driver.session_io(sid).and_then(|io| io.ext.as_mut()) else {
        debug!(session = %sid, "RDMA hello for a session without a queue pair");
        return;
    };
    match r.link.on_hello(&node, payload, psn(sid)) {
        Ok(HelloOutcome::Connected) => info!(session = %sid, "RDMA queue pair connected"),
        Ok(HelloOutcome::Replaced { hello }) => {
            info!(session = %sid, "the peer started over: RDMA queue pair replaced");
            r._watcher = watch(&shared, sid, r.link.queue_pair());
            send_hello(driver, sid, &hello);
        }
        Err(e) => {
            warn!(session = %sid, error = %e, "RDMA hello refused");
            return;
        }
    }
    // Decode sees no write of a one-sided path land: its rooms succeed on the source's word.
    // The source's hello (this one) precedes its first `Done` on the control channel.
    driver.endpoint_mut().set_one_sided(sid);
    let path = if node.registers_device_memory() {
        DataPath::RdmaDmaBuf
    } else {
        DataPath::Rdma
    };
    driver.set_path(sid, path);
    let parked = driver
        .session_io(sid)
        .map(|io| io.take_parked())
        .unwrap_or_default();
    for op in parked {
        post_on(driver, &node, op);
    }
}

/// Posts `op` over RDMA when the node moves data that way; gives it back for TCP otherwise.
pub(crate) fn post(driver: &mut Driver<TokioHost>, op: TransferOp) -> Option<TransferOp> {
    let Some((_, node)) = rdma_of(driver) else {
        return Some(op);
    };
    if on_tcp(driver, op.session) {
        return Some(op);
    }
    post_on(driver, &node, op);
    None
}

/// Whether the peer moves `sid` over TCP (it said so with [`TCP_PATH`]).
fn on_tcp(driver: &Driver<TokioHost>, sid: SessionId) -> bool {
    driver.session_path(sid).is_some_and(DataPath::is_tcp)
}

/// Posts `op` on its session's QP; holds it if the QP is not connected yet, or reports the
/// outcome at once if no post can succeed.
fn post_on(driver: &mut Driver<TokioHost>, node: &RdmaNode, op: TransferOp) {
    let faults = driver.faults();
    // With the checksum option the decode verifies what landed against the source's hash,
    // taken now: the room holds these source pages until the operation is settled.
    let checksum = if op.checksum && op.room.is_some() {
        match driver.host().memory.checksum(&op.slices, SliceSide::Source) {
            Ok(sum) => Some(sum),
            Err(e) => {
                warn!(session = %op.session, error = %e, "cannot hash an operation's source bytes");
                None
            }
        }
    } else {
        None
    };
    let id = op.id;
    let hit = faults.filter(|f| op.room.is_some_and(|room| f.hits(room, op.id)));
    let memory = driver.host().memory.clone();
    let Some(io) = driver.session_io(op.session) else {
        driver.endpoint_mut().handle_transfer_result(
            Instant::now(),
            op.id,
            TransferOutcome::Transient,
        );
        return;
    };
    let Some(r) = io.ext.as_mut() else {
        io.park(op);
        return;
    };
    // Injected faults (demos and tests). Break: the write names a key the peer never
    // registered, so its device refuses it and this QP fails, as it would if the peer's memory
    // went away. FlipBit: one bit of the source flips after it was hashed, so what lands is
    // not what the source held (the flip stays; the room's source pages are refilled by
    // whoever reuses them).
    let poison = hit.is_some_and(|f| f.kind == FaultKind::Break);
    // Flips the first source bit (again, to restore it): the write was hashed before.
    let flip = |memory: &MemoryMap| {
        let Some(first) = op.slices.first() else {
            return false;
        };
        let mut byte = [0u8; 1];
        let read = memory.read(first.region, first.src_offset, &mut byte);
        byte[0] ^= 1;
        read.is_ok() && memory.write(first.region, first.src_offset, &byte).is_ok()
    };
    let flipped = hit.is_some_and(|f| f.kind == FaultKind::FlipBit) && flip(&memory);
    if flipped {
        warn!(session = %op.session, room = ?op.room, "injected fault: one bit of a write flipped");
    }
    let mut posted = false;
    let failed = match r.link.post_as(node, &op, poison) {
        Ok(()) => {
            posted = true;
            None
        }
        Err(e) => match e.outcome() {
            None => {
                // Not posted: the source goes back to what was hashed, so a re-post (or the
                // TCP path) starts from the bytes the prefill holds.
                if flipped {
                    flip(&memory);
                }
                io.park(op);
                None
            }
            Some(outcome) => {
                debug!(session = %op.session, error = ?e, "RDMA post failed");
                Some((op.id, outcome))
            }
        },
    };
    // Only for a write posted on a QP (a parked one may yet go over TCP, which carries its
    // checksum in the batch); its completion waits for the driver's lock, held here.
    if let (true, Some(sum)) = (posted, checksum) {
        driver.endpoint_mut().handle_source_checksum(id, sum);
    }
    if let Some((id, outcome)) = failed {
        driver
            .endpoint_mut()
            .handle_transfer_result(Instant::now(), id, outcome);
    }
}

/// The core's fence: the session's QP goes to the error state, and once every outstanding
/// write has completed flushed (the completion task sees the last one), nothing of it can
/// land: the fence is confirmed and a new QP (with a new hello) replaces it.
/// `false` when the node moves data over TCP.
pub(crate) fn fence(driver: &mut Driver<TokioHost>, sid: SessionId) -> bool {
    let Some((shared, node)) = rdma_of(driver) else {
        return false;
    };
    if on_tcp(driver, sid) {
        return false;
    }
    let Some(r) = driver.session_io(sid).and_then(|io| io.ext.as_mut()) else {
        driver
            .endpoint_mut()
            .handle_fence_complete(Instant::now(), sid);
        return true;
    };
    if let Err(e) = r.link.fence() {
        warn!(session = %sid, error = %e, "could not move the queue pair to the error state");
    }
    // The fence is about this QP: a hello may replace it meanwhile, and the new one is not
    // what has to drain.
    let fenced = r.link.queue_pair();
    r.fencing = Some(fenced.clone());
    // Nothing outstanding: the fence is complete now.
    finish_fence(driver, &shared, &node, sid, &fenced);
    true
}

/// Completes `sid`'s fence if `qp` is the QP it fenced and every write of it has flushed:
/// the core hears it, and if `qp` is still the session's, a new QP replaces it.
fn finish_fence(
    driver: &mut Driver<TokioHost>,
    shared: &Arc<Shared>,
    node: &RdmaNode,
    sid: SessionId,
    qp: &Arc<Mutex<RcQueuePair>>,
) {
    let Some(r) = driver.session_io(sid).and_then(|io| io.ext.as_mut()) else {
        return;
    };
    let fenced = r.fencing.as_ref().is_some_and(|f| Arc::ptr_eq(f, qp));
    if !fenced || !qp.lock().map_or(true, |q| q.is_drained()) {
        return;
    }
    r.fencing = None;
    let hello = if r.link.is_current(qp) {
        match r.link.renew(node, psn(sid)) {
            Ok(hello) => {
                r._watcher = watch(shared, sid, r.link.queue_pair());
                Some(hello)
            }
            Err(e) => {
                warn!(session = %sid, error = %e, "no new queue pair after the fence");
                None
            }
        }
    } else {
        None
    };
    driver
        .endpoint_mut()
        .handle_fence_complete(Instant::now(), sid);
    info!(session = %sid, "session fenced (RDMA queue pair drained)");
    if let Some(hello) = hello {
        send_hello(driver, sid, &hello);
    }
}

/// The completion channel's descriptor, kept open by the QP it belongs to.
struct QpFd {
    qp: Arc<Mutex<RcQueuePair>>,
    fd: RawFd,
}

impl AsRawFd for QpFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd
    }
}

/// Awaits `qp`'s completion channel and reports every finished operation to the core. When
/// told to stop (its QP was replaced), it reports what the old QP still flushes, then drops
/// its registration before the QP, so the descriptor is never reused under it.
fn watch(shared: &Arc<Shared>, sid: SessionId, qp: Arc<Mutex<RcQueuePair>>) -> oneshot::Sender<()> {
    let (stop_tx, mut stop_rx) = oneshot::channel::<()>();
    let weak = Arc::downgrade(shared);
    let fd = qp.lock().map(|q| q.completion_fd()).unwrap_or(-1);
    shared.runtime.spawn(async move {
        // SAFETY: the descriptor belongs to the completion channel of the QP that `QpFd`
        // keeps alive (an `Arc`), so it stays open and the same for the AsyncFd's lifetime;
        // `as_raw_fd` always returns it.
        let registered =
            unsafe { AsyncFd::register_with_interest(QpFd { qp, fd }, Interest::READABLE) };
        let afd = match registered {
            Ok(a) => a,
            Err(e) => {
                warn!(session = %sid, error = %e, "cannot await the completion channel");
                return;
            }
        };
        let report = |qp: &Mutex<RcQueuePair>| -> bool {
            let done = match completions(qp) {
                Ok(d) => d,
                Err(e) => {
                    warn!(session = %sid, error = %e, "polling completions failed");
                    Vec::new()
                }
            };
            let Some(shared) = weak.upgrade() else {
                return false;
            };
            if !done.is_empty() {
                shared.lock().with(|e, now| {
                    for (id, outcome) in done {
                        e.handle_transfer_result(now, id, outcome);
                    }
                });
            }
            true
        };
        // Once replaced, the old QP is in the error state: its outstanding writes flush as
        // completions, collected until it is drained or the core's operation timeout passes
        // (the core has timed those operations out by then).
        let mut replaced = false;
        let linger = weak.upgrade().map_or(Duration::ZERO, |s| {
            s.lock().endpoint().config().operation_timeout
        });
        loop {
            let ready = if replaced {
                if afd.get_ref().qp.lock().map_or(true, |q| q.is_drained()) {
                    break;
                }
                match tokio::time::timeout(linger, afd.readable()).await {
                    Ok(r) => r,
                    Err(_) => break,
                }
            } else {
                tokio::select! {
                    r = afd.readable() => r,
                    _ = &mut stop_rx => {
                        replaced = true;
                        // What flushed before the replacement may already be in the queue.
                        if !report(&afd.get_ref().qp) {
                            return;
                        }
                        after_completions(&weak, sid, &afd.get_ref().qp);
                        continue;
                    }
                }
            };
            let Ok(mut guard) = ready else { break };
            let alive = report(&afd.get_ref().qp);
            guard.clear_ready();
            if !alive {
                return;
            }
            after_completions(&weak, sid, &afd.get_ref().qp);
        }
        drop(afd);
    });
    stop_tx
}

/// After `qp`'s completions reached the core: a fence of `qp` whose last write flushed is
/// complete ([`finish_fence`]); a current QP that went to the error state by itself (a failed
/// work request, not a fence) carries nothing more, and once drained a new one replaces it
/// and the peer gets its hello (and replaces its own), as a broken TCP data connection is
/// re-opened. The core still decides about the operations that failed: they were reported.
fn after_completions(weak: &Weak<Shared>, sid: SessionId, qp: &Arc<Mutex<RcQueuePair>>) {
    let Some(shared) = weak.upgrade() else { return };
    let Some(node) = shared.rdma.clone() else {
        return;
    };
    let mut driver = shared.lock();
    finish_fence(&mut driver, &shared, &node, sid, qp);
    let Some(r) = driver.session_io(sid).and_then(|io| io.ext.as_mut()) else {
        driver.drain();
        return;
    };
    let broken = r.fencing.is_none() && r.link.is_current(qp) && r.link.is_drained();
    if broken {
        match r.link.renew(&node, psn(sid)) {
            Ok(hello) => {
                warn!(session = %sid, "RDMA queue pair failed; replacing it");
                // Replacing the watcher ends the task that called us once it returns.
                r._watcher = watch(&shared, sid, r.link.queue_pair());
                send_hello(&mut driver, sid, &hello);
            }
            Err(e) => warn!(session = %sid, error = %e, "no new queue pair after a failure"),
        }
    }
    driver.drain();
}
