//! The RDMA data plane, written once for every runtime (feature `rdma`): per session one RC
//! queue pair from `kvferry-rdma`, its hello carried in the core's `Transport` frames,
//! operations posted as chained RDMA WRITEs, completions awaited on the completion channel's
//! descriptor (however the runtime waits on one: [`Runtime::readable`], [`Runtime::wait`]),
//! and the fence as "QP to the error state, wait for the flush". Every outcome reaches the
//! core through `handle_transfer_result`, as over TCP. The driver holds the node's
//! [`RdmaPlane`] (set by the runtime when it opened the device) and hands it sessions
//! ([`establish`]), the peer's hellos ([`on_hello`]), operations ([`post`]), fences
//! ([`fence`]) and closes ([`SessionRdma::close`]); a runtime lends only the descriptor wait
//! and spawns [`watch`] as it spawns any [`Job`].

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvferry_core::{Region, SessionId, TransferOp, TransferOutcome};
use kvferry_memory::{MemoryKind, MemoryMap, SliceSide};
use kvferry_rdma::device::RdmaError;
pub use kvferry_rdma::link::RdmaNode;
use kvferry_rdma::link::{completions, HelloOutcome, RdmaLink, RegionMemory};
use kvferry_rdma::topology::{self, MemoryPlace};
use kvferry_rdma::verbs::RcQueuePair;
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use crate::{
    DataBackend, DataPath, Driver, FaultKind, Host, Job, NodeError, Runtime, START_TARGET, TCP_PATH,
};

/// A queue pair shared by its session and the task awaiting its completions.
pub type SharedQp = Arc<Mutex<RcQueuePair>>;

/// A node's RDMA data plane as its driver holds it: the device with the node's memory
/// registered, and that memory (sources are hashed from it, faults injected in it).
#[derive(Clone)]
pub struct RdmaPlane {
    node: Arc<RdmaNode>,
    memory: Arc<MemoryMap>,
}

impl RdmaPlane {
    /// The plane of `node`, which registered `memory` ([`open`]).
    pub fn new(node: Arc<RdmaNode>, memory: Arc<MemoryMap>) -> Self {
        RdmaPlane { node, memory }
    }

    /// The node's memory.
    pub fn memory(&self) -> &Arc<MemoryMap> {
        &self.memory
    }

    /// Whether the device registered device memory (dma-buf) as well as host memory.
    pub fn registers_device_memory(&self) -> bool {
        self.node.registers_device_memory()
    }
}

/// A completion channel's descriptor, kept open by the queue pair it belongs to.
pub struct CompletionFd {
    /// Keeps the channel (and so the descriptor) open.
    _qp: SharedQp,
    fd: RawFd,
}

impl AsRawFd for CompletionFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd
    }
}

impl AsFd for CompletionFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the descriptor belongs to the completion channel of the QP this value
        // keeps alive (an `Arc`), so it stays open for as long as the borrow.
        unsafe { BorrowedFd::borrow_raw(self.fd) }
    }
}

/// A session's RDMA side: its link and the task that awaits the current QP's completions.
pub struct SessionRdma {
    link: RdmaLink,
    /// The QP the core's fence moved to the error state, until its writes have flushed.
    fencing: Option<SharedQp>,
    /// Dropping it tells the completion task to report what is left and let go of its QP.
    _watcher: oneshot::Sender<()>,
}

impl SessionRdma {
    /// The session ends: its QP goes to the error state (nothing more lands) and its
    /// completion task reports what flushes before letting go of it.
    pub fn close(mut self) {
        let _ = self.link.fence();
    }
}

/// Opens the data plane `backend` asks for: `None` for TCP. `Rdma` fails when the device
/// cannot be opened; `Auto` then moves every session over TCP and says why (so does it when
/// the checksum must hash device memory, which only the TCP path does).
pub fn open_backend(
    backend: &DataBackend,
    memory: &MemoryMap,
    remote_write: bool,
    checksum: bool,
) -> Result<Option<Arc<RdmaNode>>, NodeError> {
    match backend {
        DataBackend::Tcp => Ok(None),
        DataBackend::Rdma { device, port } => open(memory, remote_write, device.as_deref(), *port),
        DataBackend::Auto { device, port } => {
            if checksum && memory.device_regions().next().is_some() {
                info!(target: START_TARGET, "checksum of device memory: every session moves over TCP");
                return Ok(None);
            }
            open(memory, remote_write, device.as_deref(), *port).or_else(|e| {
                info!(target: START_TARGET, why = %e, "RDMA unavailable on this node: every session moves over TCP");
                Ok(None)
            })
        }
    }
}

/// The device to open: `named`, the only one, or the one nearest the node's memory on the
/// PCIe tree (the first GPU region's device, else the NUMA node of this thread's CPU).
fn choose_device(memory: &MemoryMap, named: Option<&str>) -> Result<String, RdmaError> {
    if let Some(name) = named {
        return Ok(name.to_owned());
    }
    let devices = kvferry_rdma::device::list_devices()?;
    if devices.len() == 1 {
        return Ok(devices[0].clone());
    }
    let sysfs = std::path::Path::new("/sys");
    let gpu = memory.device_regions().find_map(|(_, kind)| match kind {
        MemoryKind::Cuda { device } => memory.staging()?.engine().pci_bus_id(device),
        _ => None,
    });
    let place = match gpu {
        Some(pci_bus_id) => MemoryPlace::Gpu { pci_bus_id },
        None => MemoryPlace::Host {
            numa_node: topology::current_numa_node(sysfs),
        },
    };
    let choice = topology::nearest(sysfs, &devices, &place).ok_or(RdmaError::NoDevice)?;
    info!(target: START_TARGET, device = %choice.device, nearness = choice.nearness.as_str(), memory = ?place, of = ?devices, "RDMA device nearest the KV");
    Ok(choice.device)
}

/// Opens the device and registers every region of `memory` (remote write on decode): host
/// memory as it is, device memory through the dma-buf its copy engine exports. `None`: some
/// device region cannot be registered (the engine cannot export it, or the NIC cannot
/// register dma-bufs), so every session of the node moves over TCP, staged through host
/// buffers; the log says why.
pub fn open(
    memory: &MemoryMap,
    remote_write: bool,
    device: Option<&str>,
    port: u8,
) -> Result<Option<Arc<RdmaNode>>, NodeError> {
    let Exports {
        host,
        exported,
        refused,
    } = export_regions(memory);
    if !refused.is_empty() {
        // Each region that cannot be given to the NIC says why (one allocation of many may
        // be the one that spans two segments).
        for (region, why) in &refused {
            warn!(
                ?region,
                why, "device memory region cannot be registered for RDMA"
            );
        }
        return Ok(staged(refused.len(), &refused[0].1));
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
    let device =
        choose_device(memory, device).map_err(|e| NodeError::Backend(e.to_string().into()))?;
    // SAFETY: the ranges belong to `memory`, which the node keeps for as long as it keeps the
    // `RdmaNode` that registered them (its driver's `RdmaPlane` holds an `Arc` of each).
    let node = match unsafe { RdmaNode::open(Some(&device), port, &regions, remote_write) } {
        Ok(node) => node,
        Err(
            e @ RdmaError::Verbs {
                call: "ibv_reg_dmabuf_mr",
                ..
            },
        ) => {
            return Ok(staged(exported.len(), &e.to_string()));
        }
        Err(e) => return Err(NodeError::Backend(e.to_string().into())),
    };
    info!(
        target: START_TARGET,
        device = node.device_name(),
        port,
        remote_write,
        device_memory = node.registers_device_memory(),
        "RDMA data plane ready"
    );
    Ok(Some(Arc::new(node)))
}

/// Each region of a node's memory as its NIC will register it.
struct Exports {
    /// Host memory: `(region, address, length)`.
    host: Vec<(Region, *mut u8, usize)>,
    /// Device memory exported as a dma-buf: `(region, dma-buf, address, length)`.
    exported: Vec<(Region, kvferry_memory::DmaBuf, u64, usize)>,
    /// Device memory that cannot be exported, and why.
    refused: Vec<(Region, String)>,
}

/// Asks the copy engine for a dma-buf of every device region (each refusal kept with its
/// reason, so each is reported); host regions as they are.
fn export_regions(memory: &MemoryMap) -> Exports {
    let mut out = Exports {
        host: Vec::new(),
        exported: Vec::new(),
        refused: Vec::new(),
    };
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
                    Ok(buf) => out.exported.push((region, buf, ptr as u64, len as usize)),
                    Err(e) => out.refused.push((region, e.to_string())),
                }
            }
            _ => out.host.push((region, ptr, len as usize)),
        }
    }
    out
}

/// The node cannot give its NIC `regions` of its device memory: it moves every session
/// over TCP, staged.
fn staged(regions: usize, why: &str) -> Option<Arc<RdmaNode>> {
    warn!(
        regions,
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

/// Starts the task that awaits `qp`'s completions ([`Job::WatchCompletions`]); dropping what
/// it returns stops it.
fn start_watch<H: Host>(driver: &Driver<H>, sid: SessionId, qp: SharedQp) -> oneshot::Sender<()> {
    let (stop_tx, stop) = oneshot::channel();
    driver.host().start(Job::WatchCompletions {
        session: sid,
        qp,
        stop,
    });
    stop_tx
}

/// Awaits the completions of `sid`'s current QP in place of the task that awaited its
/// previous one (dropping that task's stop lets it report what the old QP still flushes).
fn rewatch<H: Host>(driver: &mut Driver<H>, sid: SessionId) {
    let Some(qp) = session_rdma(driver, sid).map(|r| r.link.queue_pair()) else {
        return;
    };
    let watcher = start_watch(driver, sid, qp);
    if let Some(r) = session_rdma(driver, sid) {
        r._watcher = watcher;
    }
}

/// `sid`'s RDMA side, if it has one.
fn session_rdma<H: Host>(driver: &mut Driver<H>, sid: SessionId) -> Option<&mut SessionRdma> {
    driver.session_io(sid).and_then(|io| io.rdma.as_mut())
}

/// The node's RDMA device, when its data moves over RDMA.
fn plane<H: Host>(driver: &Driver<H>) -> Option<RdmaPlane> {
    driver.rdma_plane().cloned()
}

/// The session is established: create its QP, send the hello, watch completions. `false`
/// when the node moves data over TCP.
pub fn establish<H: Host>(driver: &mut Driver<H>, sid: SessionId) -> bool {
    let Some(RdmaPlane { node, .. }) = plane(driver) else {
        return false;
    };
    let (link, hello) = match node.link(psn(sid)) {
        Ok(x) => x,
        Err(e) => {
            warn!(session = %sid, error = %e, "no RDMA queue pair for the session");
            return true;
        }
    };
    let watcher = start_watch(driver, sid, link.queue_pair());
    if let Some(io) = driver.session_io(sid) {
        io.rdma = Some(SessionRdma {
            link,
            fencing: None,
            _watcher: watcher,
        });
    }
    send_hello(driver, sid, &hello);
    true
}

fn send_hello<H: Host>(driver: &mut Driver<H>, sid: SessionId, hello: &[u8]) {
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
pub fn on_hello<H: Host>(driver: &mut Driver<H>, sid: SessionId, payload: &[u8]) {
    let Some(plane) = plane(driver) else {
        return;
    };
    if payload == TCP_PATH {
        if let Some(r) = driver.session_io(sid).and_then(|io| io.rdma.take()) {
            r.close();
        }
        driver.use_tcp_path(sid, "the peer has no RDMA data plane");
        return;
    }
    let Some(r) = session_rdma(driver, sid) else {
        debug!(session = %sid, "RDMA hello for a session without a queue pair");
        return;
    };
    match r.link.on_hello(&plane.node, payload, psn(sid)) {
        Ok(HelloOutcome::Connected) => info!(session = %sid, "RDMA queue pair connected"),
        Ok(HelloOutcome::Replaced { hello }) => {
            info!(session = %sid, "the peer started over: RDMA queue pair replaced");
            rewatch(driver, sid);
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
    if plane.node.registers_device_memory() && plane.memory().remote_writes_need_flush() {
        driver.endpoint_mut().flush_landed_writes(sid);
    }
    if plane.node.registers_device_memory() && plane.memory().remote_writes_need_flush() {
        driver.endpoint_mut().flush_landed_writes(sid);
    }
    let path = if plane.node.registers_device_memory() {
        DataPath::RdmaDmaBuf
    } else {
        DataPath::Rdma
    };
    driver.set_path(sid, path, "both sides move data over RDMA");
    let parked = driver
        .session_io(sid)
        .map(|io| io.take_parked())
        .unwrap_or_default();
    for op in parked {
        post_on(driver, &plane, op);
    }
}

/// Posts `op` over RDMA when the node moves data that way; gives it back for TCP otherwise.
pub fn post<H: Host>(driver: &mut Driver<H>, op: TransferOp) -> Option<TransferOp> {
    let Some(plane) = plane(driver) else {
        return Some(op);
    };
    if on_tcp(driver, op.session) {
        return Some(op);
    }
    post_on(driver, &plane, op);
    None
}

/// Whether the peer moves `sid` over TCP (it said so with [`TCP_PATH`]).
fn on_tcp<H: Host>(driver: &Driver<H>, sid: SessionId) -> bool {
    driver.session_path(sid).is_some_and(DataPath::is_tcp)
}

/// Posts `op` on its session's QP; holds it if the QP is not connected yet, or reports the
/// outcome at once if no post can succeed.
fn post_on<H: Host>(driver: &mut Driver<H>, plane: &RdmaPlane, op: TransferOp) {
    let faults = driver.faults();
    let (node, memory) = (&plane.node, &plane.memory);
    // With the checksum option the decode verifies what landed against the source's hash,
    // taken now: the room holds these source pages until the operation is settled.
    let checksum = if op.checksum && op.room.is_some() {
        match memory.checksum(&op.slices, SliceSide::Source) {
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
    let Some(io) = driver.session_io(op.session) else {
        driver.endpoint_mut().handle_transfer_result(
            Instant::now(),
            op.id,
            TransferOutcome::Transient,
        );
        return;
    };
    let Some(r) = io.rdma.as_mut() else {
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
    let flip = |memory: &MemoryMap| crate::faults::flip_first_source_bit(memory, &op.slices);
    let flipped = hit.is_some_and(|f| f.kind == FaultKind::FlipBit) && flip(memory);
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
                    flip(memory);
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
    // checksum in the batch); its completion reaches the core through the driver, which is
    // in use here, so the hash is known first.
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
/// `false` when the session's TCP data connections carry out the fence: the node moves
/// data over TCP, or the session has no queue pair (a same-host session, whose TCP data
/// connections carry the rows that copy badly, and whatever went before its path was chosen).
pub fn fence<H: Host>(driver: &mut Driver<H>, sid: SessionId) -> bool {
    let Some(RdmaPlane { node, .. }) = plane(driver) else {
        return false;
    };
    if on_tcp(driver, sid) {
        return false;
    }
    let Some(r) = session_rdma(driver, sid) else {
        return false;
    };
    if let Err(e) = r.link.fence() {
        warn!(session = %sid, error = %e, "could not move the queue pair to the error state");
    }
    // The fence is about this QP: a hello may replace it meanwhile, and the new one is not
    // what has to drain.
    let fenced = r.link.queue_pair();
    r.fencing = Some(fenced.clone());
    // Nothing outstanding: the fence is complete now.
    finish_fence(driver, &node, sid, &fenced);
    true
}

/// Completes `sid`'s fence if `qp` is the QP it fenced and every write of it has flushed:
/// the core hears it, and if `qp` is still the session's, a new QP replaces it.
fn finish_fence<H: Host>(driver: &mut Driver<H>, node: &RdmaNode, sid: SessionId, qp: &SharedQp) {
    let Some(r) = session_rdma(driver, sid) else {
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
                rewatch(driver, sid);
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

/// A session's completion task: awaits `qp`'s completion channel and reports every finished
/// operation to the core. When told to stop (`stop` ends: its QP was replaced), it reports
/// what the old QP still flushes, then lets go of its descriptor before the QP, so the
/// descriptor is never reused under it.
pub async fn watch<H: Runtime>(
    host: H,
    sid: SessionId,
    qp: SharedQp,
    mut stop: oneshot::Receiver<()>,
) {
    let fd = qp.lock().map(|q| q.completion_fd()).unwrap_or(-1);
    let mut ready = match host.readable(CompletionFd {
        _qp: qp.clone(),
        fd,
    }) {
        Ok(r) => r,
        Err(e) => {
            warn!(session = %sid, error = %e, "cannot await the completion channel");
            return;
        }
    };
    // Once replaced, the old QP is in the error state: its outstanding writes flush as
    // completions, collected until it is drained or the core says to stop (its operation
    // timeout: the core has timed those operations out by then).
    let mut drain = None;
    loop {
        let woke = if let Some((_, done)) = drain.as_mut() {
            if qp.lock().map_or(true, |q| q.is_drained()) {
                break;
            }
            futures_lite::future::or(async { Some(H::wait(&mut ready).await) }, async {
                let _ = done.await;
                None
            })
            .await
        } else {
            futures_lite::future::or(async { Some(H::wait(&mut ready).await) }, async {
                let _ = (&mut stop).await;
                drain = host.drive(|d| d.drain_started());
                // What flushed before the replacement may already be in the queue.
                drain.as_ref().map(|_| Ok(()))
            })
            .await
        };
        match woke {
            Some(Ok(())) => {}
            Some(Err(_)) | None => break,
        }
        if !report(&host, sid, &qp) {
            return;
        }
        after_completions(&host, sid, &qp);
    }
    if let Some((id, _)) = drain {
        host.drive(|d| d.drain_settled(id));
    }
    drop(ready);
}

/// Reports every completion `qp` has to the core; `false` once the node is gone.
fn report<H: Runtime>(host: &H, sid: SessionId, qp: &Mutex<RcQueuePair>) -> bool {
    let done = match completions(qp) {
        Ok(d) => d,
        Err(e) => {
            warn!(session = %sid, error = %e, "polling completions failed");
            Vec::new()
        }
    };
    host.drive(|d| {
        if !done.is_empty() {
            d.with(|e, now| {
                for (id, outcome) in done {
                    e.handle_transfer_result(now, id, outcome);
                }
            });
        }
    })
    .is_some()
}

/// After `qp`'s completions reached the core: a fence of `qp` whose last write flushed is
/// complete ([`finish_fence`]); a current QP that went to the error state by itself (a failed
/// work request, not a fence) carries nothing more, and once drained a new one replaces it
/// and the peer gets its hello (and replaces its own), as a broken TCP data connection is
/// re-opened. The core still decides about the operations that failed: they were reported.
fn after_completions<H: Runtime>(host: &H, sid: SessionId, qp: &SharedQp) {
    host.drive(|driver| {
        let Some(RdmaPlane { node, .. }) = plane(driver) else {
            return;
        };
        finish_fence(driver, &node, sid, qp);
        let Some(r) = session_rdma(driver, sid) else {
            driver.drain();
            return;
        };
        let broken = r.fencing.is_none() && r.link.is_current(qp) && r.link.is_drained();
        if broken {
            match r.link.renew(&node, psn(sid)) {
                Ok(hello) => {
                    warn!(session = %sid, "RDMA queue pair failed; replacing it");
                    // Replacing the watcher ends the task that called us once it returns.
                    rewatch(driver, sid);
                    send_hello(driver, sid, &hello);
                }
                Err(e) => warn!(session = %sid, error = %e, "no new queue pair after a failure"),
            }
        }
        driver.drain();
    });
}

/// A pipe every [`PolledFd`] of a node also watches: dropping the write end (the second)
/// ends their threads even if their tasks are never polled again (a runtime that stopped
/// with them pending). Both ends close on exec.
pub fn poller_stop() -> io::Result<(Arc<OwnedFd>, OwnedFd)> {
    let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    Ok((Arc::new(read), write))
}

/// A descriptor wait for runtimes that cannot wait on an arbitrary descriptor themselves
/// (glommio 0.9 keeps its readiness polls private): a thread blocks in `poll(2)` on the
/// descriptor and wakes the runtime's task through a channel, then waits until that task
/// has consumed what was there before it polls again.
pub struct PolledFd {
    ready: tokio::sync::mpsc::Receiver<()>,
    /// Tells the thread the last readiness was consumed.
    go: Option<std::sync::mpsc::SyncSender<()>>,
    /// A readiness was handed out and its consumption not yet confirmed.
    taken: bool,
    /// Closing it (on drop) makes the thread's poll return and the thread end.
    stop: Option<OwnedFd>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Keeps the descriptor open until the thread has ended.
    _fd: CompletionFd,
}

impl PolledFd {
    /// Starts the thread polling `fd`; it also ends when `node_stop` hangs up
    /// ([`poller_stop`]).
    pub fn new(fd: CompletionFd, node_stop: Arc<OwnedFd>) -> io::Result<PolledFd> {
        let (stop_read, stop) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
        let (ready_tx, ready) = tokio::sync::mpsc::channel(1);
        let (go, go_rx) = std::sync::mpsc::sync_channel(1);
        let raw = fd.as_raw_fd();
        let thread = std::thread::Builder::new()
            .name("kvferry-cq-poll".into())
            .spawn(move || {
                // SAFETY: `PolledFd` keeps the descriptor open (its `CompletionFd`) until
                // this thread has been joined.
                let cq = unsafe { BorrowedFd::borrow_raw(raw) };
                poll_loop(cq, [&stop_read, &node_stop], &ready_tx, &go_rx);
            })?;
        Ok(PolledFd {
            ready,
            go: Some(go),
            taken: false,
            stop: Some(stop),
            thread: Some(thread),
            _fd: fd,
        })
    }
}

/// The polling thread: hands out each readiness of `cq` and waits for its consumption;
/// ends when either `stop` pipe hangs up, either channel closes, or the descriptor reports
/// an error or hang-up (a device gone: nothing more can be consumed from it, and a level
/// triggered poll would hand the same condition out for ever).
fn poll_loop(
    cq: BorrowedFd<'_>,
    stop: [&OwnedFd; 2],
    ready: &tokio::sync::mpsc::Sender<()>,
    go: &std::sync::mpsc::Receiver<()>,
) {
    use rustix::event::{poll, PollFd, PollFlags};
    loop {
        let mut fds = [
            PollFd::new(&cq, PollFlags::IN),
            PollFd::new(stop[0], PollFlags::IN),
            PollFd::new(stop[1], PollFlags::IN),
        ];
        match poll(&mut fds, -1) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => return,
        }
        let broken = PollFlags::ERR | PollFlags::HUP | PollFlags::NVAL;
        let cq_events = fds[0].revents();
        if !fds[1].revents().is_empty()
            || !fds[2].revents().is_empty()
            || cq_events.intersects(broken)
            || !cq_events.contains(PollFlags::IN)
        {
            return;
        }
        if ready.blocking_send(()).is_err() || go.recv().is_err() {
            return;
        }
    }
}

impl PolledFd {
    /// Waits for the descriptor's next readiness ([`Runtime::wait`]).
    pub async fn wait(&mut self) -> io::Result<()> {
        if std::mem::take(&mut self.taken) {
            let sent = self.go.as_ref().is_some_and(|go| go.send(()).is_ok());
            if !sent {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
        }
        match self.ready.recv().await {
            Some(()) => {
                self.taken = true;
                Ok(())
            }
            None => Err(io::ErrorKind::BrokenPipe.into()),
        }
    }
}

impl Drop for PolledFd {
    fn drop(&mut self) {
        // Hang up on the thread whichever wait it is in, then wait for it to end: only
        // then may the descriptor close.
        self.stop = None;
        self.go = None;
        self.ready.close();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests;
