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

mod host_engine;
pub use host_engine::{CopyCounts, HostCopyEngine};

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
mod tests;
