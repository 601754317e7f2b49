//! The same-host data plane, written once for every runtime: when a prefill and a decode
//! run on one host (same boot, same PID namespace), the prefill copies each operation
//! straight into the decode's registered memory with cross-memory attach
//! (`process_vm_writev`, [`kvferry_cma`]). Chosen per session over the control channel
//! (`Offer`, `Open` with the proof cell, `Accept`, or `Decline` with why, both sides logging
//! it); the TCP path is set up as always and carries whatever went before the choice, and a
//! session whose copies start failing falls back to it, saying why.
//!
//! Device memory on both sides moves the same way over CUDA IPC: the decode exports its
//! device regions in its `Open` ([`DeviceRegion`]), the prefill maps them once per session
//! through its copy engine and copies GPU to GPU on its copy stream
//! ([`CopyEngine::copy_to_peer`]), waiting for the copy's event before it reports the
//! operation; host regions of the same session (metadata) still go by cross-memory attach.
//!
//! A copy runs inline on the driver, so once the core settles an operation nothing of it is
//! still landing: the prefill's fences need nothing more than TCP's, and a decode's fence
//! is the prefill's word that it wrote nothing since ([`CmaMessage::Fence`], `Fenced`),
//! then the TCP data connections closed as usual.

use std::sync::Arc;
use std::time::Instant;

use kvferry_cma::{
    CmaError, CmaMessage, CmaRegion, CmaTarget, Decline, DeviceRegion, HostIdentity, Offer, Open,
    PtracePolicy,
};
use kvferry_core::{Role, SessionId, Slice, TransferOp, TransferOutcome};
use kvferry_memory::{
    CopyEngine, CopyError, CopyJob, IpcExport, IpcHandleType, IpcMapping, MemoryKind, MemoryMap,
    SliceSide,
};
use tracing::{debug, info, warn};

use crate::faults::flip_first_source_bit;
use crate::{DataPath, Driver, FaultKind, Host, START_TARGET};

mod target;
pub use target::SameHostTarget;
use target::{CopyFailure, DeviceTarget};

/// Whether a node moves sessions with peers on its own host over the same-host path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SameHost {
    /// Never: every session takes TCP or RDMA (`transport="tcp"` or `"rdma"`).
    #[default]
    Off,
    /// Where the peer shares this host and both sides can (`transport="auto"`).
    Auto,
    /// Always: a node that cannot does not start, and a session whose peer cannot take the
    /// path is refused, its rooms failing `IncompatiblePeer` with why
    /// (`transport="same-host"`).
    Required,
}

impl SameHost {
    /// Whether sessions with peers on this host may take the path.
    fn wanted(self) -> bool {
        matches!(self, SameHost::Auto | SameHost::Required)
    }
}

/// A node whose configuration requires the same-host path (`SameHost::Required`) and cannot
/// take it over `memory` does not start: the error says why.
pub fn check_same_host(mode: SameHost, memory: &MemoryMap) -> Result<(), crate::NodeError> {
    if mode != SameHost::Required {
        return Ok(());
    }
    let usable = if memory.device_regions().next().is_some() && memory.staging().is_none() {
        Err(Decline::DeviceMemory)
    } else {
        HostIdentity::current().map(drop)
    };
    usable.map_err(|why| {
        crate::NodeError::Unsupported(crate::Unsupported::SameHostUnavailable(why.as_str()))
    })
}

/// A node's same-host plane: its memory, who it is, and the permission it grants writers.
pub struct SameHostPlane {
    mode: SameHost,
    memory: Arc<MemoryMap>,
    /// Who this process is, or why this node never takes the path.
    usable: Result<HostIdentity, Decline>,
    /// The proof cell: a writer reads it before its first copy.
    nonce: Box<[u8; 16]>,
}

impl SameHostPlane {
    /// The plane of a node over `memory` as `mode` asks: one that declines every session
    /// (and says why) where the node cannot or must not take the path.
    pub fn open(mode: SameHost, memory: Arc<MemoryMap>) -> Arc<SameHostPlane> {
        let device = memory.device_regions().next().is_some();
        let usable = match mode {
            SameHost::Off => Err(Decline::Forbidden),
            _ if device && memory.staging().is_none() => Err(Decline::DeviceMemory),
            SameHost::Auto | SameHost::Required => HostIdentity::current(),
        };
        if mode.wanted() {
            match &usable {
                Ok(_) if device => {
                    info!(target: START_TARGET, "same-host path ready: peers on this host move over CUDA IPC (device memory) and cross-memory attach (host memory)")
                }
                Ok(_) => {
                    info!(target: START_TARGET, "same-host path ready: peers on this host move over cross-memory attach")
                }
                Err(why) => {
                    info!(target: START_TARGET, why = why.as_str(), "no same-host path: peers on this host move over the network path")
                }
            }
        }
        Arc::new(SameHostPlane {
            mode,
            memory,
            usable,
            nonce: Box::new(nonce()),
        })
    }

    /// The node's memory.
    pub fn memory(&self) -> &Arc<MemoryMap> {
        &self.memory
    }

    /// The copy engine device memory is reached through, if any.
    fn engine(&self) -> Option<Arc<dyn CopyEngine>> {
        self.memory.staging().map(|s| s.engine().clone())
    }

    /// The host-memory regions a writer may write.
    fn regions(&self) -> Vec<CmaRegion> {
        self.memory
            .region_lens()
            .filter(|(region, _)| region.written_by_peers())
            .filter(|(region, _)| matches!(self.memory.kind(*region), Some(MemoryKind::Host)))
            .filter_map(|(region, len)| {
                let addr = self.memory.range(region, 0, len).ok()? as u64;
                Some(CmaRegion {
                    region: region.code(),
                    addr,
                    len,
                })
            })
            .collect()
    }
}

impl SameHostPlane {
    /// The device-memory regions a writer may write, each exported for another process to
    /// map (one piece per allocation a region spans), and what keeps the exports valid;
    /// `Err` names the region the engine could not export and why.
    fn device_regions(&self, importer: u32) -> Result<(Vec<DeviceRegion>, Vec<Keep>), String> {
        let mut out = Vec::new();
        let mut keep = Vec::new();
        for (region, len) in self.memory.region_lens() {
            let Some(MemoryKind::Cuda { device }) = self.memory.kind(region) else {
                continue;
            };
            if !region.written_by_peers() {
                continue;
            }
            let engine = self
                .engine()
                .ok_or_else(|| "device memory without a copy engine".to_owned())?;
            let addr = self
                .memory
                .range(region, 0, len)
                .map_err(|e| e.to_string())? as u64;
            let pieces = engine
                .export_ipc(device, addr, len, importer)
                .map_err(|e| format!("{region:?} on CUDA device {device}: {e}"))?;
            if !covers(&pieces, addr, len) {
                return Err(format!(
                    "{region:?} on CUDA device {device}: the {} copy engine's export does not cover the region",
                    engine.name()
                ));
            }
            for piece in pieces {
                out.push(DeviceRegion {
                    region: region.code(),
                    handle_type: piece.handle_type.code(),
                    addr: piece.addr,
                    len: piece.len,
                    offset: piece.offset,
                    handle: piece.handle,
                });
                keep.extend(piece.keep);
            }
        }
        Ok((out, keep))
    }

    /// Maps the receiver's device regions for copies from this node's regions of the same
    /// codes; `Err` says why the session cannot take the path.
    fn import(&self, open: &Open) -> Result<Vec<DeviceTarget>, (Decline, String)> {
        let kinds: std::collections::HashMap<u32, MemoryKind> = self
            .memory
            .kinds()
            .map(|(region, kind)| (region.code(), kind))
            .collect();
        if let Some(r) = open
            .regions
            .iter()
            .find(|r| matches!(kinds.get(&r.region), Some(MemoryKind::Cuda { .. })))
        {
            return Err((
                Decline::DeviceMemory,
                format!(
                    "region {:#x} is device memory here and host memory in the decode",
                    r.region
                ),
            ));
        }
        let mut out: Vec<DeviceTarget> = Vec::new();
        for d in &open.device {
            let device = match kinds.get(&d.region) {
                Some(MemoryKind::Cuda { device }) => *device,
                Some(MemoryKind::Host) => {
                    return Err((
                        Decline::DeviceMemory,
                        format!(
                            "region {:#x} is host memory here and device memory in the decode",
                            d.region
                        ),
                    ))
                }
                None => continue,
            };
            let engine = self.engine().ok_or_else(|| {
                (
                    Decline::DeviceMemory,
                    "device memory without a copy engine".to_owned(),
                )
            })?;
            let handle_type = IpcHandleType::from_code(d.handle_type).ok_or_else(|| {
                (
                    Decline::IpcUnavailable,
                    format!("device handle type {} is unknown", d.handle_type),
                )
            })?;
            let export = IpcExport {
                handle_type,
                handle: d.handle,
                addr: d.addr,
                len: d.len,
                offset: d.offset,
                keep: None,
            };
            let mapping = engine
                .import_ipc(device, open.pid, &export)
                .map_err(|e| (Decline::IpcUnavailable, e.to_string()))?;
            // The decoder holds a region's pieces next to each other and contiguous: a piece
            // starts in the region where the previous one of its code ended.
            let start = match out.last() {
                Some(prev) if prev.region == d.region => prev.start + prev.len,
                _ => 0,
            };
            out.push(DeviceTarget {
                region: d.region,
                start,
                len: d.len,
                device,
                mapping,
            });
        }
        out.sort_by_key(|d| (d.region, d.start));
        Ok(out)
    }
}

/// Whether `pieces` cover `len` bytes at `addr`, one after another.
fn covers(pieces: &[IpcExport], addr: u64, len: u64) -> bool {
    let mut at = addr;
    for piece in pieces {
        if piece.addr != at || piece.len == 0 {
            return false;
        }
        at += piece.len;
    }
    at == addr + len
}

/// What keeps an export valid in the exporting process while its importer may take it.
type Keep = Arc<dyn std::any::Any + Send + Sync>;

/// A fresh 16-byte nonce per node (no two nodes' proof cells agree by chance).
fn nonce() -> [u8; 16] {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut z = t ^ (u64::from(std::process::id()) << 32) ^ 0x9E37_79B9_7F4A_7C15;
    let mut out = [0u8; 16];
    for half in out.chunks_mut(8) {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut x = z;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        half.copy_from_slice(&(x ^ (x >> 31)).to_le_bytes());
    }
    out
}

/// A receiver's permission for one writer process, given back when the session ends.
pub struct Grant {
    writer: u32,
}

impl Drop for Grant {
    fn drop(&mut self) {
        PtracePolicy::process().release(self.writer);
    }
}

/// The session is closing: a writer copies nothing more from now on (a receiver keeps its
/// state until the session is gone: its writer's pid decides how long its pages wait).
pub(crate) fn stop_writing<H: Host>(io: &mut crate::SessionIo<H>) {
    if matches!(io.cma, Some(SessionCma::Writing(_))) {
        io.cma = None;
    }
}

/// Receiver: the writer of `io`'s session, if it was let copy into this process.
pub(crate) fn writer_of<H: Host>(io: &crate::SessionIo<H>) -> Option<u32> {
    match &io.cma {
        Some(SessionCma::Opened { grant, .. }) => Some(grant.writer),
        _ => None,
    }
}

/// Whether process `pid` can no longer write: gone, a zombie, or past releasing its memory
/// (its exit closes its sockets after that, so a peer that hears them close may find it so).
pub(crate) fn exited(pid: u32) -> bool {
    if pid == std::process::id() {
        return false;
    }
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return true;
    };
    // After the command's closing parenthesis: state, then fields 4.. (vsize is field 23).
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return false;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first().copied().unwrap_or("");
    let vsize = fields.get(20).and_then(|v| v.parse::<u64>().ok());
    matches!(state, "Z" | "X" | "x") || vsize == Some(0)
}

/// One session's same-host state.
pub enum SessionCma {
    /// Writer: offered, waiting for the receiver's `Open` or `Decline`.
    Offered,
    /// Writer: the receiver's memory, where this session's operations go.
    Writing(Arc<SameHostTarget>),
    /// Receiver: opened for the writer (one-sided from then on: it may accept and copy
    /// before this side hears it).
    Opened {
        /// The writer's permission, held while the session lasts.
        grant: Grant,
        /// The fence waiting for the writer's `Fenced`, by epoch.
        fencing: Option<u32>,
        /// The last fence's epoch.
        epoch: u32,
        /// Whether device regions were opened (the path is CUDA IPC).
        device: bool,
        /// What keeps this node's device exports valid while the writer may map them.
        exports: Vec<Keep>,
    },
    /// Not this session, and why.
    Declined(Decline),
}

fn plane<H: Host>(driver: &Driver<H>) -> Option<Arc<SameHostPlane>> {
    driver.same_host_plane().cloned()
}

fn state<H: Host>(driver: &mut Driver<H>, sid: SessionId) -> Option<&mut Option<SessionCma>> {
    driver.session_io(sid).map(|io| &mut io.cma)
}

fn send<H: Host>(driver: &mut Driver<H>, sid: SessionId, msg: &CmaMessage) {
    if let Err(e) = driver
        .endpoint_mut()
        .send_transport(Instant::now(), sid, &msg.encode())
    {
        debug!(session = %sid, error = %e, "could not send a same-host message");
    }
}

/// Logs why `sid` does not take the same-host path: at info where this node asked for it.
/// Where this node requires the path, the session is refused instead.
fn declined<H: Host>(driver: &mut Driver<H>, sid: SessionId, why: Decline, by_peer: bool) {
    if plane(driver).is_some_and(|p| p.mode == SameHost::Required) {
        warn!(target: START_TARGET, session = %sid, why = why.as_str(), by_peer, "same-host path declined, and this node requires it (transport=same-host): the session is refused");
        if let Some(s) = state(driver, sid) {
            *s = Some(SessionCma::Declined(why));
        }
        driver.note_same_host_refusal(sid, why.as_str());
        let detail = format!(
            "the same-host path is required (transport=same-host) and was declined: {}",
            why.as_str()
        );
        driver
            .endpoint_mut()
            .refuse_session(Instant::now(), sid, &detail);
        return;
    }
    let asked = plane(driver).is_some_and(|p| p.usable.is_ok());
    if asked {
        info!(target: START_TARGET, session = %sid, why = why.as_str(), by_peer, "same-host path declined: the session keeps the network path");
    } else {
        debug!(session = %sid, why = why.as_str(), by_peer, "same-host path declined");
    }
    if let Some(s) = state(driver, sid) {
        *s = Some(SessionCma::Declined(why));
    }
}

/// The session is established: a prefill offers the path to its decode (or says at once
/// why it will not take it, where it was asked to).
pub(crate) fn establish<H: Host>(driver: &mut Driver<H>, sid: SessionId) {
    let Some(plane) = plane(driver) else {
        return;
    };
    let writer = driver.endpoint().info().role == Role::Prefill
        && driver
            .endpoint()
            .peer(sid)
            .is_some_and(|p| p.role == Role::Decode);
    if !writer {
        return;
    }
    match plane.usable {
        Ok(host) => {
            if let Some(s) = state(driver, sid) {
                *s = Some(SessionCma::Offered);
            }
            let offer = CmaMessage::Offer(Offer {
                host,
                pid: std::process::id(),
            });
            send(driver, sid, &offer);
        }
        Err(Decline::Forbidden) => {
            // Said, so that a decode that requires the path hears it will not come.
            send(driver, sid, &CmaMessage::Decline(Decline::Forbidden));
            declined(driver, sid, Decline::Forbidden, false);
        }
        Err(why) => {
            send(driver, sid, &CmaMessage::Decline(why));
            declined(driver, sid, why, false);
        }
    }
}

/// A same-host message from the peer of `sid`.
pub(crate) fn on_message<H: Host>(driver: &mut Driver<H>, sid: SessionId, payload: &[u8]) {
    let Some(plane) = plane(driver) else {
        return;
    };
    let msg = match CmaMessage::decode(payload) {
        Ok(m) => m,
        Err(e) => {
            warn!(session = %sid, error = %e, "same-host message refused");
            return;
        }
    };
    match msg {
        CmaMessage::Offer(offer) => on_offer(driver, &plane, sid, offer),
        CmaMessage::Open(open) => on_open(driver, sid, open),
        CmaMessage::Accept => on_accept(driver, sid),
        CmaMessage::Decline(why) => {
            if matches!(state(driver, sid), Some(Some(SessionCma::Opened { .. }))) {
                driver.endpoint_mut().clear_one_sided(sid);
                if matches!(
                    driver.session_path(sid),
                    Some(DataPath::Cma | DataPath::CudaIpc)
                ) {
                    let tcp = driver.tcp_path();
                    driver.set_path(sid, tcp, "the prefill's same-host copies failed");
                }
            }
            declined(driver, sid, why, true);
        }
        CmaMessage::Fence { epoch } => {
            // Every copy runs inline: none issued before this message is still landing,
            // whatever this side's state.
            send(driver, sid, &CmaMessage::Fenced { epoch });
        }
        CmaMessage::Fenced { epoch } => on_fenced(driver, sid, epoch),
    }
}

/// Receiver: the writer shares this host? Grant it the memory and the proof, or decline.
fn on_offer<H: Host>(
    driver: &mut Driver<H>,
    plane: &Arc<SameHostPlane>,
    sid: SessionId,
    offer: Offer,
) {
    let regions = plane.regions();
    let checksum = driver.endpoint().config().checksum;
    let mut device = Vec::new();
    let mut exports = Vec::new();
    let answer = plane
        .usable
        .and_then(|me| me.reaches(&offer.host))
        .and_then(|()| {
            (device, exports) = plane.device_regions(offer.pid).map_err(|e| {
                info!(target: START_TARGET, session = %sid, error = %e, "this node's device memory cannot be exported to the prefill");
                Decline::IpcUnavailable
            })?;
            if checksum && !device.is_empty() {
                return Err(Decline::ChecksumOnDevice);
            }
            if CmaMessage::open_fits(regions.len(), device.len()) {
                Ok(())
            } else {
                Err(Decline::TooManyRegions)
            }
        })
        .and_then(|()| PtracePolicy::process().grant(offer.pid));
    match answer {
        Err(why) => {
            send(driver, sid, &CmaMessage::Decline(why));
            declined(driver, sid, why, false);
        }
        Ok(()) => {
            let grant = Grant { writer: offer.pid };
            // One-sided from now on: the writer's first copies and its word on them may
            // follow its `Accept` in the same read, before this node hears the `Accept`.
            // Writes that still come over TCP are acknowledged before that word, so a room
            // succeeding on it is as true there.
            driver.endpoint_mut().set_one_sided(sid);
            driver.endpoint_mut().set_fenced_by_writer(sid);
            if let Some(s) = state(driver, sid) {
                *s = Some(SessionCma::Opened {
                    grant,
                    fencing: None,
                    epoch: 0,
                    device: !device.is_empty(),
                    exports,
                });
            }
            let open = CmaMessage::Open(Open {
                pid: std::process::id(),
                nonce_addr: plane.nonce.as_ptr() as u64,
                nonce: *plane.nonce,
                regions,
                device,
            });
            send(driver, sid, &open);
        }
    }
}

/// Writer: the receiver opened its memory. Prove the pid is the receiver, then write there.
fn on_open<H: Host>(driver: &mut Driver<H>, sid: SessionId, open: Open) {
    if !matches!(state(driver, sid), Some(Some(SessionCma::Offered))) {
        debug!(session = %sid, "same-host Open without an offer");
        return;
    }
    let Some(plane) = plane(driver) else {
        return;
    };
    let host = CmaTarget::new(open.pid, open.regions.clone());
    if let Err(e) = host.prove(open.nonce_addr, &open.nonce) {
        let why = match e {
            CmaError::Permission => Decline::PtraceRefused,
            _ => Decline::NotThePeer,
        };
        send(driver, sid, &CmaMessage::Decline(why));
        declined(driver, sid, why, false);
        return;
    }
    let checksum = driver.endpoint().config().checksum;
    let device = plane.import(&open).and_then(|device| {
        if checksum && !device.is_empty() {
            Err((
                Decline::ChecksumOnDevice,
                "this node hashes what it sends".to_owned(),
            ))
        } else {
            Ok(device)
        }
    });
    let device = match device {
        Ok(d) => d,
        Err((why, detail)) => {
            info!(target: START_TARGET, session = %sid, why = why.as_str(), detail, "the decode's device memory cannot be reached from here");
            send(driver, sid, &CmaMessage::Decline(why));
            declined(driver, sid, why, false);
            return;
        }
    };
    let (path, why) = if device.is_empty() {
        (
            DataPath::Cma,
            "same host: cross-memory attach into the decode's memory",
        )
    } else {
        (
            DataPath::CudaIpc,
            "same host: GPU copies into the decode's device memory (CUDA IPC)",
        )
    };
    let target = SameHostTarget {
        host,
        device,
        engine: plane.engine(),
        rows_by_tcp_said: Default::default(),
    };
    if let Some(s) = state(driver, sid) {
        *s = Some(SessionCma::Writing(Arc::new(target)));
    }
    send(driver, sid, &CmaMessage::Accept);
    driver.set_path(sid, path, why);
}

/// Receiver: the writer writes this session's operations into this process from now on.
fn on_accept<H: Host>(driver: &mut Driver<H>, sid: SessionId) {
    let device = match state(driver, sid) {
        Some(Some(SessionCma::Opened { device, .. })) => *device,
        _ => {
            debug!(session = %sid, "same-host Accept without an Open");
            return;
        }
    };
    if device {
        driver.set_path(
            sid,
            DataPath::CudaIpc,
            "same host: the prefill's GPU copies into this device memory (CUDA IPC)",
        );
    } else {
        driver.set_path(
            sid,
            DataPath::Cma,
            "same host: the prefill writes into this memory",
        );
    }
}

/// Where an operation goes once the same-host plane has seen it.
pub(crate) enum Posted {
    /// Copied (or settled) here.
    Done,
    /// Not a same-host session's: the other planes take it.
    Elsewhere(TransferOp),
    /// A same-host session's operation that its TCP data connections carry.
    OverTcp(TransferOp),
}

/// Copies `op` into the receiver when its session takes the same-host path; gives it back
/// otherwise.
pub(crate) fn post<H: Host>(driver: &mut Driver<H>, op: TransferOp) -> Posted {
    let Some(plane) = plane(driver) else {
        return Posted::Elsewhere(op);
    };
    let faults = driver.faults();
    // A session with a queue pair opens no TCP data connection: its copies stay here.
    let (target, has_tcp) = match driver.session_io(op.session) {
        Some(io) => match &io.cma {
            Some(SessionCma::Writing(t)) => (t.clone(), !io.has_queue_pair()),
            _ => return Posted::Elsewhere(op),
        },
        None => return Posted::Elsewhere(op),
    };
    if plane.mode == SameHost::Auto && has_tcp {
        if let Some(slice) = target.slow_rows(&op.slices) {
            // The session's TCP data connections carry it: same bytes, no page pin a row.
            if !target
                .rows_by_tcp_said
                .swap(true, std::sync::atomic::Ordering::Relaxed)
            {
                info!(session = %op.session, row_bytes = slice.len, stride = slice.dst_stride, "rows apart in the decode's memory go over TCP: cross-memory attach would pin a page for every row");
            }
            return Posted::OverTcp(op);
        }
    }
    let memory = plane.memory();
    let checksum = if op.checksum && op.room.is_some() {
        memory.checksum(&op.slices, SliceSide::Source).ok()
    } else {
        None
    };
    let hit = faults
        .filter(|f| op.room.is_some_and(|room| f.hits(room, op.id)))
        .map(|f| f.kind);
    let now = Instant::now();
    if !driver.endpoint().may_write_unseen(op.session, now) {
        // The decode may have given the session up (and its pages with it): no copy now.
        debug!(session = %op.session, room = ?op.room, "same-host copy withheld: the decode has been silent for the liveness window");
        driver
            .endpoint_mut()
            .handle_transfer_result(now, op.id, TransferOutcome::Transient);
        return Posted::Done;
    }
    if hit == Some(FaultKind::Break) {
        // Injected (demos and tests): the copy fails as a broken connection would.
        driver
            .endpoint_mut()
            .handle_transfer_result(now, op.id, TransferOutcome::Transient);
        return Posted::Done;
    }
    let flipped = hit == Some(FaultKind::FlipBit) && flip_first_source_bit(memory, &op.slices);
    if flipped {
        warn!(session = %op.session, room = ?op.room, "injected fault: one bit of a copy flipped");
    }
    let result = target.write(memory, &op.slices);
    if flipped {
        flip_first_source_bit(memory, &op.slices);
    }
    let outcome = match result {
        Ok(_) => {
            if let Some(sum) = checksum {
                driver.endpoint_mut().handle_source_checksum(op.id, sum);
            }
            TransferOutcome::Done
        }
        Err(e @ CopyFailure::Host(CmaError::OutsideRegion { .. } | CmaError::Source(_))) => {
            warn!(session = %op.session, room = ?op.room, error = %e, "same-host copy refused");
            TransferOutcome::Fatal
        }
        Err(e) => {
            // The receiver's memory or permission went away under the session: it moves
            // over its TCP data connections from now on (the receiver hears why), and the
            // operation is retried there.
            warn!(session = %op.session, room = ?op.room, error = %e, "same-host copy failed");
            let why = match e {
                CopyFailure::Host(CmaError::Permission) => Decline::PtraceRefused,
                _ => Decline::CopyFailed,
            };
            send(driver, op.session, &CmaMessage::Decline(why));
            if plane.mode == SameHost::Required {
                declined(driver, op.session, why, false);
            } else {
                if let Some(io) = driver.session_io(op.session) {
                    io.cma = Some(SessionCma::Declined(why));
                }
                let tcp = driver.tcp_path();
                driver.set_path(op.session, tcp, "the same-host copy failed");
            }
            TransferOutcome::Transient
        }
    };
    driver
        .endpoint_mut()
        .handle_transfer_result(now, op.id, outcome);
    Posted::Done
}

/// Receiver: the core's fence of `sid`, whose writer copies into this process: ask the
/// writer to confirm that nothing it issued before is still landing; the TCP side of the
/// fence follows its answer ([`on_fenced`]). `false` when the session's writer was never
/// let copy this way.
pub(crate) fn fence<H: Host>(driver: &mut Driver<H>, sid: SessionId) -> bool {
    let epoch = match state(driver, sid) {
        Some(Some(SessionCma::Opened { fencing, epoch, .. })) => {
            *epoch = epoch.wrapping_add(1);
            *fencing = Some(*epoch);
            *epoch
        }
        _ => return false,
    };
    send(driver, sid, &CmaMessage::Fence { epoch });
    true
}

/// Receiver: the writer confirmed the fence of `epoch`.
fn on_fenced<H: Host>(driver: &mut Driver<H>, sid: SessionId, epoch: u32) {
    match state(driver, sid) {
        Some(Some(SessionCma::Opened { fencing, .. })) if *fencing == Some(epoch) => {
            *fencing = None;
        }
        _ => {
            debug!(session = %sid, epoch, "same-host Fenced for no fence");
            return;
        }
    }
    driver.fence_data_connections(sid);
}
