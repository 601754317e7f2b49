//! Memory the CPU cannot touch (a GPU's), and how the data plane reaches it: a copy engine
//! that moves bytes between device memory and host staging buffers, and the bounded pool of
//! those buffers.
//!
//! The data plane never dereferences a device address. It copies the pages of an operation
//! into staging buffers on the engine (prefill) or from them (decode), one buffer at a time,
//! so the wire works on one buffer while the engine fills the next. The pool is bounded: a
//! sender or receiver that finds it empty waits for a buffer, it never allocates more.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::region::HostBuffer;

/// What kind of memory a registered region is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Host memory the CPU reads and writes.
    Host,
    /// Memory of CUDA device `device`: reached only through a [`CopyEngine`] (or RDMA that
    /// can register it).
    Cuda {
        /// The device ordinal.
        device: u32,
    },
}

impl std::fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemoryKind::Host => write!(f, "host memory"),
            MemoryKind::Cuda { device } => write!(f, "CUDA device {device} memory"),
        }
    }
}

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyDirection {
    /// From device memory into a staging buffer (prefill, before the wire).
    DeviceToHost,
    /// From a staging buffer into device memory (decode, before the acknowledgement).
    HostToDevice,
}

/// One contiguous copy: `len` bytes from address `src` to address `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyJob {
    /// Destination address.
    pub dst: usize,
    /// Source address.
    pub src: usize,
    /// Bytes.
    pub len: usize,
}

/// A copy the engine could not carry out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyError(pub String);

impl std::fmt::Display for CopyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "copy failed: {}", self.0)
    }
}

impl std::error::Error for CopyError {}

/// Device memory exported for a NIC to register directly: the dma-buf, and where the
/// exported range starts inside it.
#[derive(Debug)]
pub struct DmaBuf {
    /// The dma-buf's file descriptor (closed on drop; a registration keeps its own reference).
    pub fd: std::os::fd::OwnedFd,
    /// The offset of the asked-for address inside the dma-buf.
    pub offset: u64,
}

/// How an importer reaches one exported piece of device memory ([`IpcExport::handle`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IpcHandleType {
    /// The importer is the exporting process: the address is used as it is (no handle).
    InPlace,
    /// `cuIpcGetMemHandle`'s 64 bytes of the whole allocation (`cuMemAlloc` memory).
    CudaIpc,
    /// A file descriptor in the exporting process for one physical allocation of the VMM API
    /// (`cuMemExportToShareableHandle`): bytes 0..4 the descriptor, 8..16 the allocation's
    /// size. The importer takes its own copy of the descriptor (`pidfd_getfd`).
    PosixFd,
}

impl IpcHandleType {
    /// Its code on the wire.
    pub fn code(self) -> u32 {
        match self {
            IpcHandleType::InPlace => 0,
            IpcHandleType::CudaIpc => 1,
            IpcHandleType::PosixFd => 2,
        }
    }

    /// The type a wire code names, if any.
    pub fn from_code(code: u32) -> Option<Self> {
        match code {
            0 => Some(IpcHandleType::InPlace),
            1 => Some(IpcHandleType::CudaIpc),
            2 => Some(IpcHandleType::PosixFd),
            _ => None,
        }
    }
}

/// One piece of device memory exported for another process on this host to map: where it
/// is in the exporter, how to reach it, and where it starts inside its allocation. A region
/// is exported as one piece per allocation it spans (the VMM API maps several into one
/// range; `cuMemAlloc` memory is one).
#[derive(Clone)]
pub struct IpcExport {
    /// How the importer reaches it.
    pub handle_type: IpcHandleType,
    /// The handle's bytes (see [`IpcHandleType`]).
    pub handle: [u8; 64],
    /// Where the piece starts in the exporter's address space.
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
    /// The offset of `addr` inside its allocation.
    pub offset: u64,
    /// What keeps the export valid in the exporter (its file descriptor), held as long as
    /// an importer may take it; `None` where nothing was opened.
    pub keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl std::fmt::Debug for IpcExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcExport")
            .field("handle_type", &self.handle_type)
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("offset", &self.offset)
            .finish()
    }
}

/// Another process's exported device memory as this process reaches it: the address the
/// exported range starts at here. The mapping lasts as long as this value (and its clones).
#[derive(Clone)]
pub struct IpcMapping {
    /// Where the exported range starts in this process's (unified) address space.
    pub addr: u64,
    /// What keeps the mapping open (closed when the last clone is dropped); `None` where
    /// nothing was opened (an export of this very process).
    pub keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl std::fmt::Debug for IpcMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcMapping")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("opened", &self.keep.is_some())
            .finish()
    }
}

/// Called once when a batch of copies landed (or the first of them failed).
pub type CopyDone = Box<dyn FnOnce(Result<(), CopyError>) + Send>;

/// Moves bytes between device memory and host staging buffers, off the caller's thread.
pub trait CopyEngine: Send + Sync + 'static {
    /// The engine's name, for logs and metrics (`cuda`, `host`).
    fn name(&self) -> &'static str;

    /// Starts `jobs` in order on the engine's copy stream of `device`, and calls `done` once
    /// every byte of them is at its destination. Must not block on the copies.
    fn start(&self, device: u32, direction: CopyDirection, jobs: Vec<CopyJob>, done: CopyDone);

    /// Prepares a staging buffer for full-speed copies (page-locks it for DMA); called once
    /// per buffer before first use.
    fn pin(&self, _buffer: &mut HostBuffer) -> Result<(), CopyError> {
        Ok(())
    }

    /// Undoes [`CopyEngine::pin`] before the buffer is freed.
    fn unpin(&self, _buffer: &mut HostBuffer) {}

    /// A dma-buf file descriptor for `len` bytes of `device`'s memory at `addr`, for an RDMA
    /// NIC to register directly (GPUDirect); `Err` says why not. By default an engine
    /// cannot, and the node moves such memory staged through host buffers instead.
    fn export_dma_buf(&self, _device: u32, _addr: u64, _len: usize) -> Result<DmaBuf, CopyError> {
        Err(CopyError(format!(
            "the {} copy engine cannot export device memory as a dma-buf",
            self.name()
        )))
    }

    /// Whether a NIC's writes into `device`'s memory may be seen out of order by the device's
    /// own work until [`CopyEngine::flush_remote_writes`] (CUDA: GPUDirect RDMA write ordering
    /// weaker than the owner's).
    fn remote_writes_need_flush(&self, _device: u32) -> bool {
        false
    }

    /// Makes every write a NIC completed into `device`'s memory so far visible to the
    /// device's own work: called before a room those writes filled is reported `Success`.
    fn flush_remote_writes(&self, _device: u32) -> Result<(), CopyError> {
        Ok(())
    }

    /// Exports `len` bytes of `device`'s memory at `addr` for process `importer` of this host
    /// to map ([`CopyEngine::import_ipc`]): one piece per allocation the range spans, in
    /// address order, together covering it; `Err` says why not. By default an engine cannot,
    /// and same-host peers move such memory over the network path.
    fn export_ipc(
        &self,
        _device: u32,
        _addr: u64,
        _len: u64,
        _importer: u32,
    ) -> Result<Vec<IpcExport>, CopyError> {
        Err(CopyError(format!(
            "the {} copy engine cannot export device memory to another process",
            self.name()
        )))
    }

    /// Maps `export`, a piece made by process `owner`, for copies from `device`
    /// ([`CopyEngine::copy_to_peer`]); `Err` says why not. An [`IpcHandleType::InPlace`]
    /// piece is taken only from this very process.
    fn import_ipc(
        &self,
        _device: u32,
        _owner: u32,
        _export: &IpcExport,
    ) -> Result<IpcMapping, CopyError> {
        Err(CopyError(format!(
            "the {} copy engine cannot map another process's device memory",
            self.name()
        )))
    }

    /// Copies `jobs` on `device`'s copy stream, each destination inside a mapping of
    /// [`CopyEngine::import_ipc`] and each source this process's memory, and returns once
    /// every byte landed (the caller's thread waits on the copy's completion only).
    fn copy_to_peer(&self, _device: u32, _jobs: &[CopyJob]) -> Result<(), CopyError> {
        Err(CopyError(format!(
            "the {} copy engine cannot copy into another process's device memory",
            self.name()
        )))
    }

    /// The device whose copies this engine's staging buffers serve first: the pool is placed
    /// on that device's NUMA node. `None`: no preference.
    fn home_device(&self) -> Option<u32> {
        None
    }

    /// Where `device` sits on the PCIe tree: its bus id as sysfs names it
    /// (`0000:3b:00.0`), so the node can pick the RDMA NIC nearest it; `None` if unknown.
    fn pci_bus_id(&self, _device: u32) -> Option<String> {
        None
    }
}

/// A copy engine for machines without a GPU: a worker thread that copies with the CPU after
/// a fixed delay per batch, so the staged pipeline (ordering, overlap, the bounded pool,
/// faults mid-copy) runs in CI over memory registered as device memory but living on the
/// host.
#[derive(Debug)]
pub struct HostCopyEngine {
    jobs: flume::Sender<(CopyDirection, Vec<CopyJob>, CopyDone)>,
    counts: Arc<CopyCounts>,
    /// Batches of the failing direction so far, and which direction fails after how many.
    failing: Arc<AtomicU64>,
    fail: Option<(CopyDirection, u64)>,
    /// Exports end a piece at every multiple of this many bytes of address.
    export_piece: Option<u64>,
}

/// What a copy engine was asked to do, and the calls it made for it.
#[derive(Debug, Default)]
pub struct CopyCounts {
    /// Batches started.
    pub batches: AtomicU64,
    /// Jobs (pieces) in them.
    pub jobs: AtomicU64,
    /// Copy calls made for them after planning ([`crate::plan_copies`]).
    pub calls: AtomicU64,
    /// Bytes moved.
    pub bytes: AtomicU64,
}

impl CopyCounts {
    /// Counts one batch and the calls planned for it.
    pub fn count(&self, jobs: usize, calls: &[crate::CopyCall]) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.jobs.fetch_add(jobs as u64, Ordering::Relaxed);
        self.calls.fetch_add(calls.len() as u64, Ordering::Relaxed);
        let bytes: usize = calls.iter().map(crate::CopyCall::bytes).sum();
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// `(batches, jobs, calls, bytes)` so far.
    pub fn snapshot(&self) -> (u64, u64, u64, u64) {
        (
            self.batches.load(Ordering::Relaxed),
            self.jobs.load(Ordering::Relaxed),
            self.calls.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed),
        )
    }
}

impl HostCopyEngine {
    /// An engine whose every batch takes at least `delay`.
    pub fn new(delay: Duration) -> Arc<Self> {
        Self::failing(delay, None)
    }

    /// An engine that fails every batch of `fail.0`'s direction after the first `fail.1` of
    /// them (fault tests). Copies into a peer ([`CopyEngine::copy_to_peer`]) count as the
    /// prefill's outgoing batches (`DeviceToHost`), one per job (a staged operation is many
    /// batches, a peer copy one call).
    pub fn failing(delay: Duration, fail: Option<(CopyDirection, u64)>) -> Arc<Self> {
        Self::with(delay, fail, None)
    }

    fn with(
        delay: Duration,
        fail: Option<(CopyDirection, u64)>,
        export_piece: Option<u64>,
    ) -> Arc<Self> {
        let (tx, rx) = flume::unbounded::<(CopyDirection, Vec<CopyJob>, CopyDone)>();
        let counts = Arc::new(CopyCounts::default());
        let counted = counts.clone();
        let failing = Arc::new(AtomicU64::new(0));
        let seen = failing.clone();
        std::thread::Builder::new()
            .name("kvferry-host-copy".to_owned())
            .spawn(move || {
                while let Ok((direction, jobs, done)) = rx.recv() {
                    if !delay.is_zero() {
                        std::thread::sleep(delay);
                    }
                    if let Some((failing, ok)) = fail {
                        if failing == direction && seen.fetch_add(1, Ordering::SeqCst) + 1 > ok {
                            done(Err(CopyError("injected copy failure".to_owned())));
                            continue;
                        }
                    }
                    let calls = crate::plan_copies(&jobs);
                    counted.count(jobs.len(), &calls);
                    for call in &calls {
                        // SAFETY: the staged paths hand only ranges of registered memory
                        // (bounds-checked by MemoryMap) and of staging buffers they hold until
                        // `done` runs; "device" memory of this engine is host memory.
                        unsafe { crate::copy_with_cpu(call) };
                    }
                    done(Ok(()));
                }
            })
            .map(|_| ())
            .unwrap_or_else(|e| panic!("cannot start the host copy thread: {e}"));
        Arc::new(HostCopyEngine {
            jobs: tx,
            counts,
            failing,
            fail,
            export_piece,
        })
    }

    /// An engine whose exports ([`CopyEngine::export_ipc`]) end a piece at every multiple of
    /// `piece` bytes of address, as a region over several allocations of the VMM API is
    /// exported: pages that cross a piece's end are copied in two.
    pub fn exporting_in_pieces(piece: u64) -> Arc<Self> {
        Self::with(Duration::ZERO, None, Some(piece.max(1)))
    }

    /// What it was asked to do and the calls it made (the copy benchmark's counts).
    pub fn counts(&self) -> &CopyCounts {
        &self.counts
    }
}

impl CopyEngine for HostCopyEngine {
    fn name(&self) -> &'static str {
        "host"
    }

    fn start(&self, _device: u32, direction: CopyDirection, jobs: Vec<CopyJob>, done: CopyDone) {
        if let Err(flume::SendError((_, _, done))) = self.jobs.send((direction, jobs, done)) {
            done(Err(CopyError("the host copy thread is gone".to_owned())));
        }
    }

    /// Its "device" memory is this process's host memory: only this process maps it (two
    /// nodes of one test process), in place.
    fn export_ipc(
        &self,
        _device: u32,
        addr: u64,
        len: u64,
        _importer: u32,
    ) -> Result<Vec<IpcExport>, CopyError> {
        let piece = self.export_piece.unwrap_or(u64::MAX);
        let end = addr.saturating_add(len);
        let mut pieces = Vec::new();
        let mut at = addr;
        while at < end {
            let next = end.min((at / piece).saturating_add(1).saturating_mul(piece));
            pieces.push(IpcExport {
                handle_type: IpcHandleType::InPlace,
                handle: [0; 64],
                addr: at,
                len: next - at,
                offset: 0,
                keep: None,
            });
            at = next;
        }
        Ok(pieces)
    }

    fn import_ipc(
        &self,
        _device: u32,
        owner: u32,
        export: &IpcExport,
    ) -> Result<IpcMapping, CopyError> {
        let mine = std::process::id();
        if export.handle_type != IpcHandleType::InPlace || owner != mine {
            return Err(CopyError(format!(
                "the host copy engine maps only its own process's memory (process {owner}'s {:?} export, this is {mine})",
                export.handle_type
            )));
        }
        Ok(IpcMapping {
            addr: export.addr,
            keep: None,
        })
    }

    fn copy_to_peer(&self, _device: u32, jobs: &[CopyJob]) -> Result<(), CopyError> {
        if let Some((CopyDirection::DeviceToHost, ok)) = self.fail {
            let n = jobs.len().max(1) as u64;
            if self.failing.fetch_add(n, Ordering::SeqCst) + n > ok {
                return Err(CopyError("injected copy failure".to_owned()));
            }
        }
        if let Some(piece) = self.export_piece {
            // Pieces of different allocations are not contiguous where they are mapped: a
            // copy that crosses a piece's end would land outside it.
            if let Some(job) = jobs
                .iter()
                .find(|j| j.len > 0 && j.dst as u64 / piece != (j.dst + j.len - 1) as u64 / piece)
            {
                return Err(CopyError(format!(
                    "a copy of {} bytes to {:#x} crosses the end of an exported piece",
                    job.len, job.dst
                )));
            }
        }
        let calls = crate::plan_copies(jobs);
        self.counts.count(jobs.len(), &calls);
        for call in &calls {
            // SAFETY: sources are registered memory of this process (bounds-checked by
            // MemoryMap) and destinations lie inside a mapping of `import_ipc`, which is this
            // process's own registered memory, bounds-checked by the caller against the
            // exported region's length.
            unsafe { crate::copy_with_cpu(call) };
        }
        Ok(())
    }
}

/// How much host memory a node stages device bytes through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingConfig {
    /// Buffers in the pool (default 16).
    pub buffers: usize,
    /// Bytes per buffer (default 1 MiB): the unit the engine copies and the wire sends.
    pub buffer_bytes: usize,
    /// How long a batch of copies may take before it is given up as lost (default 10 s): its
    /// buffers are then never reused, and the failure is logged and counted.
    pub copy_timeout: Duration,
}

impl Default for StagingConfig {
    fn default() -> Self {
        StagingConfig {
            buffers: 16,
            buffer_bytes: 1 << 20,
            copy_timeout: Duration::from_secs(10),
        }
    }
}

/// A buffer pinned by a copy engine, unpinned when it ends, wherever that happens: in the pool,
/// in a staged operation that outlived its pool, or in the channel between them.
struct PinnedBuffer {
    buffer: HostBuffer,
    engine: Arc<dyn CopyEngine>,
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("len", &self.buffer.len())
            .field("engine", &self.engine.name())
            .finish()
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        self.engine.unpin(&mut self.buffer);
    }
}

/// A copy engine and the bounded pool of staging buffers it copies through.
pub struct Staging {
    engine: Arc<dyn CopyEngine>,
    free: flume::Receiver<PinnedBuffer>,
    home: flume::Sender<PinnedBuffer>,
    config: StagingConfig,
    taken: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staging")
            .field("engine", &self.engine.name())
            .field("config", &self.config)
            .field("free", &self.free.len())
            .finish()
    }
}

impl Staging {
    /// Allocates and pins `config.buffers` buffers of `config.buffer_bytes` for `engine`, on
    /// the NUMA node of the engine's home device where sysfs names one.
    pub fn new(engine: Arc<dyn CopyEngine>, config: StagingConfig) -> Result<Arc<Self>, CopyError> {
        Self::placed(engine, config, std::path::Path::new("/sys"))
    }

    /// [`Staging::new`] reading the device's NUMA node from `sysfs`.
    pub(crate) fn placed(
        engine: Arc<dyn CopyEngine>,
        config: StagingConfig,
        sysfs: &std::path::Path,
    ) -> Result<Arc<Self>, CopyError> {
        if config.buffers == 0 || config.buffer_bytes == 0 {
            return Err(CopyError(format!(
                "a staging pool needs at least one buffer of at least one byte (got {} of {})",
                config.buffers, config.buffer_bytes
            )));
        }
        let (home, free) = flume::bounded(config.buffers);
        let fill = || -> Result<(), CopyError> {
            let page = crate::page_size();
            for _ in 0..config.buffers {
                let mut buffer = HostBuffer::new(config.buffer_bytes);
                // First touch, here: the page lands on this thread's node.
                for b in buffer.as_mut_slice().iter_mut().step_by(page) {
                    *b = 0;
                }
                // Those pinned already are unpinned as the channel drops them.
                engine.pin(&mut buffer)?;
                let _ = home.send(PinnedBuffer {
                    buffer,
                    engine: engine.clone(),
                });
            }
            Ok(())
        };
        let near = engine
            .home_device()
            .and_then(|d| engine.pci_bus_id(d))
            .and_then(|id| crate::numa::cpus_near(sysfs, &id));
        match near {
            Some(cpus) => crate::numa::on_cpus(&cpus, fill)?,
            None => fill()?,
        }
        Ok(Arc::new(Staging {
            engine,
            free,
            home,
            config,
            taken: std::sync::atomic::AtomicU64::new(0),
        }))
    }

    /// The engine that copies through this pool.
    pub fn engine(&self) -> &Arc<dyn CopyEngine> {
        &self.engine
    }

    /// The pool's size.
    pub fn config(&self) -> StagingConfig {
        self.config
    }

    /// Buffers free right now.
    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// Buffers taken from the pool so far (each staged piece of an operation takes one).
    pub fn taken(&self) -> u64 {
        self.taken.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A free buffer; waits while every buffer is in use.
    pub async fn acquire(&self) -> StagingBuffer {
        // The pool holds a sender itself, so the channel never disconnects.
        let buffer = self.free.recv_async().await.ok();
        self.taken
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        StagingBuffer {
            buffer,
            home: self.home.clone(),
        }
    }

    /// A free buffer if one is free now.
    pub fn try_acquire(&self) -> Option<StagingBuffer> {
        let buffer = self.free.try_recv().ok()?;
        self.taken
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(StagingBuffer {
            buffer: Some(buffer),
            home: self.home.clone(),
        })
    }
}

/// A staging buffer taken from a [`Staging`] pool; goes back to it when dropped.
#[derive(Debug)]
pub struct StagingBuffer {
    buffer: Option<PinnedBuffer>,
    home: flume::Sender<PinnedBuffer>,
}

impl StagingBuffer {
    /// Address of the buffer's first byte.
    pub fn addr(&self) -> usize {
        self.buffer
            .as_ref()
            .map_or(0, |b| b.buffer.as_slice().as_ptr() as usize)
    }

    /// The buffer's length.
    pub fn len(&self) -> usize {
        self.buffer.as_ref().map_or(0, |b| b.buffer.len())
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer's bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.buffer.as_ref().map_or(&[], |b| b.buffer.as_slice())
    }

    /// Moves the buffer out, leaving this one empty (a stage's copies keep it while they run).
    pub fn take(&mut self) -> StagingBuffer {
        StagingBuffer {
            buffer: self.buffer.take(),
            home: self.home.clone(),
        }
    }

    /// The buffer's bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.buffer
            .as_mut()
            .map_or(&mut [], |b| b.buffer.as_mut_slice())
    }
}

impl Drop for StagingBuffer {
    fn drop(&mut self) {
        if let Some(b) = self.buffer.take() {
            // Where the pool is gone the send fails and the buffer ends here, unpinned.
            let _ = self.home.send(b);
        }
    }
}

/// Copies started on an engine and not yet known to have landed, and what they use (staging
/// buffers handed to [`InFlightCopies::hold`]). Dropping it never blocks: where copies are
/// still pending (a task cancelled mid-copy by a fence or a closed connection), they and what
/// they use go to the reaper thread, which lets go of the buffers once the copies landed, so
/// no engine writes into a buffer someone else holds. Copies that do not land within the
/// pool's `copy_timeout` are given up: their buffers are never reused (leaked), and
/// [`abandoned_copies`] counts them.
#[derive(Debug, Default)]
pub struct InFlightCopies {
    pending: Vec<flume::Receiver<Result<(), CopyError>>>,
    held: Vec<Held>,
    timeout: Option<Duration>,
}

/// Something the copies in flight use, let go only after they landed.
struct Held(#[allow(dead_code)] Box<dyn Send>);

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Held")
    }
}

/// Batches of copies abandoned since the process started: they had not landed `copy_timeout`
/// after their wait was given up (a GPU fault, a driver torn down).
pub fn abandoned_copies() -> u64 {
    ABANDONED.load(Ordering::Relaxed)
}

static ABANDONED: AtomicU64 = AtomicU64::new(0);

/// Copies whose owner went away before they landed, and what they use.
struct Reap {
    pending: Vec<flume::Receiver<Result<(), CopyError>>>,
    held: Vec<Held>,
    deadline: Instant,
}

/// The reaper: one thread per process, started at the first drop with copies pending.
fn reaper() -> Option<&'static flume::Sender<Reap>> {
    static REAPER: OnceLock<Option<flume::Sender<Reap>>> = OnceLock::new();
    REAPER
        .get_or_init(|| {
            let (tx, rx) = flume::unbounded::<Reap>();
            std::thread::Builder::new()
                .name("kvferry-copy-reaper".to_owned())
                .spawn(move || {
                    while let Ok(reap) = rx.recv() {
                        let landed = reap.pending.iter().all(|p| {
                            matches!(
                                p.recv_deadline(reap.deadline),
                                Ok(_) | Err(flume::RecvTimeoutError::Disconnected)
                            )
                        });
                        if landed {
                            drop(reap.held);
                        } else {
                            ABANDONED.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(
                                buffers = reap.held.len(),
                                "copies did not land within the staging pool's copy_timeout: \
                                 their buffers are never reused"
                            );
                            std::mem::forget(reap.held);
                        }
                    }
                })
                .ok()
                .map(|_| tx)
        })
        .as_ref()
}

impl InFlightCopies {
    /// Starts `jobs` on `staging`'s engine and tracks them.
    pub fn start(
        &mut self,
        staging: &Staging,
        device: u32,
        direction: CopyDirection,
        jobs: Vec<CopyJob>,
    ) {
        let (tx, rx) = flume::bounded(1);
        self.pending.push(rx);
        let timeout = staging.config.copy_timeout;
        self.timeout = Some(self.timeout.map_or(timeout, |t| t.max(timeout)));
        staging.engine.start(
            device,
            direction,
            jobs,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
    }

    /// Keeps `item` (a staging buffer the copies use) until every copy tracked here landed.
    pub fn hold<T: Send + 'static>(&mut self, item: T) {
        self.held.push(Held(Box::new(item)));
    }

    /// Waits for the oldest batch; `None` if none is pending.
    pub async fn next(&mut self) -> Option<Result<(), CopyError>> {
        if self.pending.is_empty() {
            return None;
        }
        // The batch stays tracked while this waits: a caller cancelled here still leaves it
        // to the reaper.
        let r = self.pending[0]
            .recv_async()
            .await
            .unwrap_or_else(|_| Err(CopyError("the copy engine dropped a batch".to_owned())));
        self.pending.remove(0);
        Some(r)
    }

    /// Waits for every pending batch; the first error, if any.
    pub async fn all(&mut self) -> Result<(), CopyError> {
        let mut first = Ok(());
        while let Some(r) = self.next().await {
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Batches started and not yet waited for.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Waits on this thread for every pending batch, up to the pool's `copy_timeout`; the
    /// first error, if any (a batch still out then is left to the reaper and is an error).
    pub fn wait_blocking(&mut self) -> Result<(), CopyError> {
        let deadline = Instant::now() + self.timeout.unwrap_or_default();
        let mut first = Ok(());
        while let Some(rx) = self.pending.first() {
            let r = match rx.recv_deadline(deadline) {
                Ok(r) => r,
                Err(flume::RecvTimeoutError::Disconnected) => {
                    Err(CopyError("the copy engine dropped a batch".to_owned()))
                }
                Err(flume::RecvTimeoutError::Timeout) => {
                    return first.and(Err(CopyError(format!(
                        "copies did not land within {:?}",
                        self.timeout.unwrap_or_default()
                    ))));
                }
            };
            self.pending.remove(0);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

impl Drop for InFlightCopies {
    fn drop(&mut self) {
        // Batches that landed already need no one to wait for them.
        self.pending
            .retain(|p| p.is_empty() && !p.is_disconnected());
        if self.pending.is_empty() {
            return;
        }
        let reap = Reap {
            pending: std::mem::take(&mut self.pending),
            held: std::mem::take(&mut self.held),
            deadline: Instant::now() + self.timeout.unwrap_or_default(),
        };
        let unreaped = match reaper() {
            Some(r) => r.send(reap).err().map(|flume::SendError(reap)| reap),
            None => Some(reap),
        };
        if let Some(reap) = unreaped {
            // No reaper thread: never free what an engine may still write.
            ABANDONED.fetch_add(1, Ordering::Relaxed);
            std::mem::forget(reap.held);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// Completes each batch only when the test says so, from another thread.
    struct Gate(flume::Receiver<()>, Arc<AtomicBool>);

    impl CopyEngine for Gate {
        fn name(&self) -> &'static str {
            "gate"
        }

        fn start(&self, _: u32, _: CopyDirection, _: Vec<CopyJob>, done: CopyDone) {
            let (open, landed) = (self.0.clone(), self.1.clone());
            std::thread::spawn(move || {
                let _ = open.recv();
                landed.store(true, Ordering::SeqCst);
                done(Ok(()));
            });
        }
    }

    /// A pool of one buffer over `gate`, copies given up after `timeout`.
    fn gated(gate: Gate, timeout: Duration) -> Arc<Staging> {
        Staging::new(
            Arc::new(gate),
            StagingConfig {
                buffers: 1,
                buffer_bytes: 64,
                copy_timeout: timeout,
            },
        )
        .unwrap()
    }

    /// Copies in flight over the pool's one buffer, their wait polled once and cancelled.
    fn cancelled_mid_copy(staging: &Staging) -> InFlightCopies {
        let mut copies = InFlightCopies::default();
        copies.start(staging, 0, CopyDirection::HostToDevice, vec![]);
        copies.hold(staging.try_acquire().unwrap());
        {
            let mut wait = std::pin::pin!(copies.next());
            let waker = std::task::Waker::noop();
            let mut cx = std::task::Context::from_waker(waker);
            assert!(wait.as_mut().poll(&mut cx).is_pending());
        }
        copies
    }

    #[test]
    fn dropping_copies_in_flight_returns_at_once_and_their_buffer_comes_back_once_they_land() {
        let (open, gate) = flume::unbounded();
        let landed = Arc::new(AtomicBool::new(false));
        let staging = gated(Gate(gate, landed.clone()), Duration::from_secs(30));
        let copies = cancelled_mid_copy(&staging);
        let t0 = Instant::now();
        drop(copies);
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "the drop blocked on the copy"
        );
        assert!(!landed.load(Ordering::SeqCst));
        assert_eq!(
            staging.free(),
            0,
            "the buffer is out while the copy may write it"
        );
        let _ = open.send(());
        let t0 = Instant::now();
        while staging.free() == 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the buffer never came back"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            landed.load(Ordering::SeqCst),
            "back only after the copy landed"
        );
    }

    #[test]
    fn copies_that_never_land_are_given_up_after_the_timeout_and_their_buffer_is_never_reused() {
        let (_open, gate) = flume::unbounded();
        let staging = gated(
            Gate(gate, Arc::new(AtomicBool::new(false))),
            Duration::from_millis(50),
        );
        let before = abandoned_copies();
        drop(cancelled_mid_copy(&staging));
        let t0 = Instant::now();
        while abandoned_copies() == before {
            assert!(t0.elapsed() < Duration::from_secs(10), "never given up");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            staging.free(),
            0,
            "a buffer an engine may still write is never lent"
        );
    }

    #[test]
    fn a_blocking_wait_for_copies_that_never_land_ends_at_the_timeout_with_an_error() {
        let (_open, gate) = flume::unbounded();
        let staging = gated(
            Gate(gate, Arc::new(AtomicBool::new(false))),
            Duration::from_millis(50),
        );
        let mut copies = InFlightCopies::default();
        copies.start(&staging, 0, CopyDirection::DeviceToHost, vec![]);
        let err = copies.wait_blocking().unwrap_err();
        assert!(err.0.contains("did not land"), "{err}");
    }

    /// Counts pins and unpins; refuses to pin once `pin_limit` buffers are pinned.
    #[derive(Default)]
    struct Pins {
        pinned: std::sync::atomic::AtomicUsize,
        unpinned: std::sync::atomic::AtomicUsize,
        pin_limit: usize,
    }

    impl CopyEngine for Pins {
        fn name(&self) -> &'static str {
            "pins"
        }

        fn start(&self, _: u32, _: CopyDirection, _: Vec<CopyJob>, done: CopyDone) {
            done(Ok(()));
        }

        fn pin(&self, _: &mut HostBuffer) -> Result<(), CopyError> {
            if self.pinned.load(Ordering::SeqCst) == self.pin_limit {
                return Err(CopyError("no more pinned memory".to_owned()));
            }
            self.pinned.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }

        fn unpin(&self, buffer: &mut HostBuffer) {
            // Still allocated: the bytes are there to read.
            assert_eq!(buffer.as_slice().len(), buffer.len());
            self.unpinned.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_buffer_that_outlives_its_pool_is_unpinned_when_it_ends() {
        let pins = Arc::new(Pins {
            pin_limit: usize::MAX,
            ..Pins::default()
        });
        let config = StagingConfig {
            buffers: 2,
            buffer_bytes: 64,
            ..StagingConfig::default()
        };
        let staging = Staging::new(pins.clone(), config).unwrap();
        let held = staging.try_acquire().unwrap();
        drop(staging);
        assert_eq!(pins.pinned.load(Ordering::SeqCst), 2);
        drop(held);
        assert_eq!(
            pins.unpinned.load(Ordering::SeqCst),
            2,
            "every pinned buffer is unpinned once, the one held past its pool too"
        );
    }

    #[test]
    fn a_pool_that_cannot_pin_every_buffer_unpins_those_it_pinned() {
        let pins = Arc::new(Pins {
            pin_limit: 2,
            ..Pins::default()
        });
        let config = StagingConfig {
            buffers: 3,
            buffer_bytes: 64,
            ..StagingConfig::default()
        };
        assert!(Staging::new(pins.clone(), config).is_err());
        assert_eq!(pins.unpinned.load(Ordering::SeqCst), 2);
    }

    /// A GPU at `0000:3b:00.0`; records the CPUs each pin ran on.
    #[derive(Default)]
    struct Placed(std::sync::Mutex<Vec<Vec<usize>>>);

    impl CopyEngine for Placed {
        fn name(&self) -> &'static str {
            "placed"
        }

        fn start(&self, _: u32, _: CopyDirection, _: Vec<CopyJob>, done: CopyDone) {
            done(Ok(()));
        }

        fn pin(&self, _: &mut HostBuffer) -> Result<(), CopyError> {
            let set = rustix::process::sched_getaffinity(None).unwrap();
            let cpus = (0..rustix::process::CpuSet::MAX_CPU)
                .filter(|&c| set.is_set(c))
                .collect();
            self.0.lock().unwrap().push(cpus);
            Ok(())
        }

        fn home_device(&self) -> Option<u32> {
            Some(0)
        }

        fn pci_bus_id(&self, _: u32) -> Option<String> {
            Some("0000:3b:00.0".to_owned())
        }
    }

    #[test]
    fn a_pool_is_allocated_and_pinned_on_its_devices_numa_node() {
        let sysfs = crate::numa::test_sysfs::sysfs("1", "0");
        let engine = Arc::new(Placed::default());
        let config = StagingConfig {
            buffers: 3,
            buffer_bytes: 64,
            ..StagingConfig::default()
        };
        let _pool = Staging::placed(engine.clone(), config, sysfs.path()).unwrap();
        assert_eq!(*engine.0.lock().unwrap(), vec![vec![0]; 3]);
    }

    #[test]
    fn a_pool_lends_each_buffer_once_and_takes_it_back_on_drop() {
        let staging = Staging::new(
            HostCopyEngine::new(Duration::ZERO),
            StagingConfig {
                buffers: 2,
                buffer_bytes: 64,
                ..StagingConfig::default()
            },
        )
        .unwrap();
        let a = staging.try_acquire().unwrap();
        let b = staging.try_acquire().unwrap();
        assert!(
            staging.try_acquire().is_none(),
            "bounded: a third buffer is never made"
        );
        assert_ne!(a.addr(), b.addr());
        drop(a);
        assert_eq!(staging.free(), 1);
        drop(b);
        assert_eq!((staging.free(), staging.taken()), (2, 2));
    }
}
