//! The CUDA copy engine of the staged data plane, and the check of what a registered pointer
//! really is. Thin on purpose: the pipeline around it (ordering, overlap, the bounded pool,
//! faults mid-copy) is `kvferry-tcp`'s and runs in CI over `kvferry_memory::HostCopyEngine`.
//!
//! Every driver call goes through the [`crate::driver`] table inside the device's primary
//! context, pushed for the call and popped after it: the caller's current context (torch's,
//! on the embedder's thread) is the same before and after, and no device the node does not
//! use is ever touched.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{
    CUdevice_attribute, CUevent, CUflushGPUDirectRDMAWritesScope, CUflushGPUDirectRDMAWritesTarget,
    CUipcMemHandle, CUmemAccessDesc, CUmemAccess_flags, CUmemAllocationHandleType,
    CUmemGenericAllocationHandle, CUmemLocation, CUmemLocationType, CUmemRangeHandleType,
    CUmemcpyAttributes, CUmemcpySrcAccessOrder, CUmemorytype, CUpointer_attribute, CUresult,
    CUstream, CUDA_MEMCPY2D,
};
use kvferry_core::Region;
use kvferry_memory::{
    plan_copies, CopyCall, CopyCounts, CopyDirection, CopyDone, CopyEngine, CopyError, CopyJob,
    DmaBuf, HostBuffer, IpcExport, IpcHandleType, IpcMapping, MemoryKind, MemoryMap,
};

use crate::driver::{self, api, CudaApi, DeviceContext};
pub use crate::driver::{held, Held};
use crate::GpuError;

mod ipc;
mod kinds;
mod queue;
use ipc::*;
pub use kinds::*;
use queue::*;

fn copy_error(e: GpuError) -> CopyError {
    CopyError(e.to_string())
}

/// How long a batch of copies may take before its device is given up (a lost batch: an Xid,
/// a driver torn down): the batch fails, and so does every later one of that device.
pub const DEFAULT_COPY_TIMEOUT: Duration = Duration::from_secs(10);

/// `CU_EVENT_DISABLE_TIMING`: an event only for completion, the cheapest to record and query.
const EVENT_DISABLE_TIMING: u32 = 2;

/// `CU_MEMHOSTREGISTER_PORTABLE`: pinned for every context, so any device's copies see it.
const HOST_REGISTER_PORTABLE: u32 = 1;

/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`: an allocation of another GPU is mapped with peer
/// access enabled as needed (NVLink or PCIe peer to peer).
const IPC_LAZY_ENABLE_PEER_ACCESS: u32 = 1;

/// Whether a NIC's writes into a device need a flush before the device's work sees them.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Flush {
    /// The device orders them for its owner already.
    NotNeeded,
    /// `cuFlushGPUDirectRDMAWrites` before a room is reported landed.
    Needed,
    /// Needed, and the driver lacks the call: no dma-buf for this device.
    Unavailable,
}

/// A CUDA handle that lives as long as its owner (a stream, an event): only an address the
/// driver hands back.
#[derive(Clone, Copy, Debug)]
struct Handle<T>(T);

// SAFETY: stream and event handles may be used from any thread that has their context current;
// every use below enters it.
unsafe impl<T> Send for Handle<T> {}
// SAFETY: as above; the driver serializes what needs it.
unsafe impl<T> Sync for Handle<T> {}

/// What a device's copies share with its completion thread.
struct DeviceShared {
    ctx: DeviceContext,
    stream: Handle<CUstream>,
    events: Mutex<Vec<Handle<CUevent>>>,
    stalled: AtomicBool,
}

impl DeviceShared {
    fn api(&self) -> &'static CudaApi {
        self.ctx.api()
    }

    /// A free completion event, or a new one (the context entered).
    fn event(&self) -> Result<Handle<CUevent>, GpuError> {
        if let Some(e) = self.events.lock().ok().and_then(|mut free| free.pop()) {
            return Ok(e);
        }
        let mut event: CUevent = std::ptr::null_mut();
        // SAFETY: writes one event handle of the current (entered) context.
        driver::ok(
            unsafe { (self.api().cuEventCreate)(&mut event, EVENT_DISABLE_TIMING) },
            "cuEventCreate",
        )?;
        Ok(Handle(event))
    }
}

impl Drop for DeviceShared {
    fn drop(&mut self) {
        let api = self.api();
        if let Ok(_in) = self.ctx.enter() {
            // SAFETY: the completion thread has ended (it held the last reference); nothing is
            // queued on the stream that anyone waits for, and each handle is destroyed once.
            unsafe {
                let _ = (api.cuStreamSynchronize)(self.stream.0);
                for e in self
                    .events
                    .get_mut()
                    .map(std::mem::take)
                    .unwrap_or_default()
                {
                    let _ = (api.cuEventDestroy)(e.0);
                }
                let _ = (api.cuStreamDestroy)(self.stream.0);
            }
            driver::STREAMS.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// A batch's completion, as the completion thread receives it.
struct Batch {
    event: Handle<CUevent>,
    done: CopyDone,
    queued: Result<(), CopyError>,
    deadline: Instant,
}

/// One device's copy stream, its completion thread and what the device can do.
struct DeviceCopies {
    shared: Arc<DeviceShared>,
    batches: std::sync::mpsc::Sender<Batch>,
    flush: Flush,
    /// `Err`: why the device's memory cannot be exported as a dma-buf.
    dma_buf: Result<(), String>,
}

/// Copies between device memory and staging buffers on one copy stream per device: a batch's
/// pieces become as few calls as they can ([`plan_copies`]: runs merged, strided rows as one
/// 2D copy), and its completion is an event the device's completion thread polls, so no
/// runtime thread waits on the GPU and nothing stalls the stream.
pub struct CudaCopyEngine {
    devices: BTreeMap<u32, DeviceCopies>,
    counts: CopyCounts,
    timeout: Duration,
    /// Other processes' allocations mapped here, by handle and device: the driver maps one
    /// allocation once per context, so every region of it shares the mapping.
    imports: Mutex<Vec<(ImportKey, std::sync::Weak<Imported>)>>,
}

/// An exported allocation (its handle type, handle and owner) and the device it is mapped
/// for.
type ImportKey = (IpcHandleType, [u8; 64], u32, u32);

impl std::fmt::Debug for CudaCopyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCopyEngine")
            .field("devices", &self.devices.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl CudaCopyEngine {
    /// An engine for `devices` (ordinals); a typed error where there is no GPU or driver.
    pub fn open(devices: &[u32]) -> Result<Arc<Self>, GpuError> {
        Self::open_with(api()?, devices, DEFAULT_COPY_TIMEOUT)
    }

    /// An engine for every device `memory`'s regions live on.
    pub fn for_memory(memory: &MemoryMap) -> Result<Arc<Self>, GpuError> {
        Self::open(&memory.devices().collect::<Vec<_>>())
    }

    /// [`CudaCopyEngine::open`] over a given driver table, batches given up after `timeout`.
    pub(crate) fn open_with(
        api: &'static CudaApi,
        devices: &[u32],
        timeout: Duration,
    ) -> Result<Arc<Self>, GpuError> {
        let mut map = BTreeMap::new();
        for &d in devices {
            map.insert(d, open_device(api, d)?);
        }
        Ok(Arc::new(CudaCopyEngine {
            devices: map,
            counts: CopyCounts::default(),
            timeout,
            imports: Mutex::new(Vec::new()),
        }))
    }

    /// What it was asked to do and the calls it made (the copy benchmark's counts).
    pub fn counts(&self) -> &CopyCounts {
        &self.counts
    }

    fn any(&self) -> Option<&DeviceCopies> {
        self.devices.values().next()
    }

    fn device(&self, device: u32) -> Result<&DeviceCopies, CopyError> {
        self.devices
            .get(&device)
            .ok_or_else(|| CopyError(format!("no copy stream for CUDA device {device}")))
    }
}

/// Retains `ordinal`'s primary context, makes its copy stream and completion thread, and
/// reads what it can do for a NIC.
fn open_device(api: &'static CudaApi, ordinal: u32) -> Result<DeviceCopies, GpuError> {
    let ctx = DeviceContext::retain(api, ordinal)?;
    let stream = {
        let _in = ctx.enter()?;
        let mut stream: CUstream = std::ptr::null_mut();
        // SAFETY: writes one stream handle of the entered context; flag 1 = non-blocking
        // (no implicit order with the legacy default stream torch may use).
        driver::ok(
            unsafe { (api.cuStreamCreate)(&mut stream, 1) },
            "cuStreamCreate",
        )?;
        driver::STREAMS.fetch_add(1, Ordering::SeqCst);
        Handle(stream)
    };
    let ordering = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING)
        .unwrap_or(0);
    let flush = if ordering >= 100 {
        Flush::NotNeeded
    } else if api.cuFlushGPUDirectRDMAWrites.is_some() {
        Flush::Needed
    } else {
        Flush::Unavailable
    };
    let dma_buf = dma_buf_support(api, &ctx, &flush);
    let shared = Arc::new(DeviceShared {
        ctx,
        stream,
        events: Mutex::new(Vec::new()),
        stalled: AtomicBool::new(false),
    });
    let (batches, rx) = std::sync::mpsc::channel();
    let polled = shared.clone();
    std::thread::Builder::new()
        .name(format!("kvferry-cuda-copy-{ordinal}"))
        .spawn(move || complete_batches(polled, rx))
        .map_err(|e| GpuError::Driver(format!("cannot start a copy completion thread: {e}")))?;
    Ok(DeviceCopies {
        shared,
        batches,
        flush,
        dma_buf,
    })
}

/// Whether the driver and the device can export memory as a dma-buf a NIC registers.
fn dma_buf_support(api: &CudaApi, ctx: &DeviceContext, flush: &Flush) -> Result<(), String> {
    if api.cuMemGetHandleForAddressRange.is_none() {
        return Err(
            "the CUDA driver lacks cuMemGetHandleForAddressRange (dma-buf export needs R515 or newer)"
                .to_owned(),
        );
    }
    let supported = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
        .unwrap_or(0);
    if supported != 1 {
        return Err(format!(
            "CUDA device {} does not support dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = {supported})",
            ctx.ordinal()
        ));
    }
    if *flush == Flush::Unavailable {
        return Err(format!(
            "CUDA device {} orders a NIC's writes only with cuFlushGPUDirectRDMAWrites, which the driver lacks",
            ctx.ordinal()
        ));
    }
    Ok(())
}

/// A device's completion thread: waits for each batch's event in order (its stream runs
/// them in order), spinning briefly, then yielding, then sleeping a little, and calls `done`.
fn complete_batches(shared: Arc<DeviceShared>, batches: std::sync::mpsc::Receiver<Batch>) {
    let Ok(_in) = shared.ctx.enter() else {
        for b in batches.iter() {
            (b.done)(Err(CopyError(
                "cannot enter the device's context".to_owned(),
            )));
        }
        return;
    };
    let api = shared.api();
    for batch in batches.iter() {
        let mut polls = 0u32;
        let landed = loop {
            // SAFETY: a live event of the entered context, recorded after the batch's copies.
            match unsafe { (api.cuEventQuery)(batch.event.0) } {
                CUresult::CUDA_SUCCESS => break Ok(()),
                CUresult::CUDA_ERROR_NOT_READY => {}
                r => break Err(CopyError(format!("copy stream: {r:?}"))),
            }
            if Instant::now() >= batch.deadline {
                break Err(CopyError(
                    "copies did not complete within the copy timeout".to_owned(),
                ));
            }
            polls += 1;
            match polls {
                0..64 => std::hint::spin_loop(),
                64..256 => std::thread::yield_now(),
                _ => std::thread::sleep(Duration::from_micros(20)),
            }
        };
        match &landed {
            Ok(()) => {
                if let Ok(mut free) = shared.events.lock() {
                    free.push(batch.event);
                }
            }
            // The stream may still run it: its event is never reused, and no later batch of
            // this device is started.
            Err(_) => shared.stalled.store(true, Ordering::SeqCst),
        }
        (batch.done)(batch.queued.and(landed));
    }
}

impl CopyEngine for CudaCopyEngine {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn start(&self, device: u32, direction: CopyDirection, jobs: Vec<CopyJob>, done: CopyDone) {
        let dev = match self.device(device) {
            Ok(d) => d,
            Err(e) => return done(Err(e)),
        };
        let shared = &dev.shared;
        if shared.stalled.load(Ordering::SeqCst) {
            return done(Err(CopyError(format!(
                "CUDA device {device}'s copies stalled earlier: it takes no more"
            ))));
        }
        let calls = plan_copies(&jobs);
        self.counts.count(jobs.len(), &calls);
        let api = shared.api();
        let entered = match shared.ctx.enter() {
            Ok(e) => e,
            Err(e) => return done(Err(copy_error(e))),
        };
        // SAFETY: the staged paths pass ranges of registered device memory (bounds-checked by
        // MemoryMap) and of staging buffers they hold until `done` runs; the context is
        // entered.
        let queued = unsafe { queue_all(api, shared.stream.0, direction, &calls) };
        let recorded = shared.event().and_then(|event| {
            // SAFETY: an event and the stream of the entered context.
            driver::ok(
                unsafe { (api.cuEventRecord)(event.0, shared.stream.0) },
                "cuEventRecord",
            )
            .map(|()| event)
        });
        drop(entered);
        match recorded {
            Ok(event) => {
                let batch = Batch {
                    event,
                    done,
                    queued,
                    deadline: Instant::now() + self.timeout,
                };
                if let Err(std::sync::mpsc::SendError(b)) = dev.batches.send(batch) {
                    (b.done)(Err(CopyError(
                        "the copy completion thread is gone".to_owned(),
                    )));
                }
            }
            Err(e) => {
                // Nothing tells when what was queued ends: the device takes no more.
                shared.stalled.store(true, Ordering::SeqCst);
                done(queued.and(Err(copy_error(e))));
            }
        }
    }

    fn pin(&self, buffer: &mut HostBuffer) -> Result<(), CopyError> {
        let Some(dev) = self.any() else {
            return Ok(());
        };
        let _in = dev.shared.ctx.enter().map_err(copy_error)?;
        let slice = buffer.as_mut_slice();
        // SAFETY: page-locks the buffer's own allocation, for every context (portable: copies
        // of any device see it pinned); `unpin` undoes it before it is freed.
        let r = unsafe {
            (dev.shared.api().cuMemHostRegister)(
                slice.as_mut_ptr().cast(),
                slice.len(),
                HOST_REGISTER_PORTABLE,
            )
        };
        driver::ok(r, "cuMemHostRegister").map_err(copy_error)?;
        driver::PINNED.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn unpin(&self, buffer: &mut HostBuffer) {
        if let Some(dev) = self.any() {
            if let Ok(_in) = dev.shared.ctx.enter() {
                // SAFETY: the buffer was registered by `pin` and is not in use any more.
                let r = unsafe {
                    (dev.shared.api().cuMemHostUnregister)(
                        buffer.as_mut_slice().as_mut_ptr().cast(),
                    )
                };
                if r == CUresult::CUDA_SUCCESS {
                    driver::PINNED.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }
    }

    fn home_device(&self) -> Option<u32> {
        self.devices.keys().next().copied()
    }

    fn pci_bus_id(&self, device: u32) -> Option<String> {
        let api = self.devices.get(&device)?.shared.api();
        let handle = self.devices.get(&device)?.shared.ctx.device();
        // SAFETY: the driver writes at most the given length, NUL-terminated; no context needed.
        let id = driver::driver_string::<32>("cuDeviceGetPCIBusId", |buf, len| unsafe {
            (api.cuDeviceGetPCIBusId)(buf, len, handle)
        })
        .ok()?;
        // The driver writes `0000:3B:00.0`; sysfs names it in lower case.
        Some(id.to_lowercase())
    }

    fn export_dma_buf(&self, device: u32, addr: u64, len: usize) -> Result<DmaBuf, CopyError> {
        let dev = self.device(device)?;
        dev.dma_buf.clone().map_err(CopyError)?;
        let api = dev.shared.api();
        let export = api.cuMemGetHandleForAddressRange.ok_or_else(|| {
            CopyError("the CUDA driver lacks cuMemGetHandleForAddressRange".to_owned())
        })?;
        let _in = dev.shared.ctx.enter().map_err(copy_error)?;
        // The whole allocation is exported: its base and size are page-aligned, as the export
        // requires, and the asked-for range lies inside it.
        let (base, size) = allocation_holding(api, addr, len as u64)?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: exports a live allocation of this context; the driver writes one descriptor.
        let r = unsafe {
            export(
                (&mut fd as *mut std::ffi::c_int).cast(),
                base,
                size,
                CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        driver::ok(r, "cuMemGetHandleForAddressRange(DMA_BUF_FD)").map_err(copy_error)?;
        if fd < 0 {
            return Err(CopyError(
                "the CUDA driver gave no dma-buf descriptor".to_owned(),
            ));
        }
        // SAFETY: the driver handed this descriptor to us; nothing else owns it.
        let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        Ok(DmaBuf {
            fd,
            offset: addr - base,
        })
    }

    fn export_ipc(
        &self,
        device: u32,
        addr: u64,
        len: u64,
        importer: u32,
    ) -> Result<Vec<IpcExport>, CopyError> {
        let dev = self.device(device)?;
        if importer == std::process::id() {
            // This process maps its own memory in place (`import_ipc`): no handle is needed,
            // and memory no handle exports (a pool's) serves as well.
            return Ok(vec![IpcExport {
                handle_type: IpcHandleType::InPlace,
                handle: [0; 64],
                addr,
                len,
                offset: 0,
                keep: None,
            }]);
        }
        let api = dev.shared.api();
        let _in = dev.shared.ctx.enter().map_err(copy_error)?;
        if let Some(handle) = vmm_handle(api, addr) {
            release_vmm(api, handle);
            return export_vmm(api, addr, len);
        }
        export_legacy(api, addr, len)
    }

    fn import_ipc(
        &self,
        device: u32,
        owner: u32,
        export: &IpcExport,
    ) -> Result<IpcMapping, CopyError> {
        if export.handle_type == IpcHandleType::InPlace {
            if owner != std::process::id() {
                return Err(CopyError(format!(
                    "process {owner} offered its memory in place: only this process's own memory is used so"
                )));
            }
            // The driver refuses to open a process's own handle, and needs not: with unified
            // addressing the exporter's address is valid in every context of this process.
            return Ok(IpcMapping {
                addr: export.addr,
                keep: None,
            });
        }
        self.import_from(device, owner, export)
    }

    fn copy_to_peer(&self, device: u32, jobs: &[CopyJob]) -> Result<(), CopyError> {
        let dev = self.device(device)?;
        let shared = &dev.shared;
        if shared.stalled.load(Ordering::SeqCst) {
            return Err(CopyError(format!(
                "CUDA device {device}'s copies stalled earlier: it takes no more"
            )));
        }
        let api = shared.api();
        let copy = api
            .cuMemcpyDtoDAsync
            .ok_or_else(|| CopyError("the CUDA driver lacks cuMemcpyDtoDAsync_v2".to_owned()))?;
        let runs = merge_runs(jobs);
        let calls: Vec<CopyCall> = runs.iter().map(|j| CopyCall::Run(*j)).collect();
        self.counts.count(jobs.len(), &calls);
        let _in = shared.ctx.enter().map_err(copy_error)?;
        // SAFETY (both branches): every source lies in this node's registered device memory
        // (bounds-checked by MemoryMap) and every destination inside a peer's allocation this
        // engine mapped (bounds-checked by the caller against the exported region), both
        // held until this returns; the stream is the entered context's.
        match api.cuMemcpyBatchAsync {
            Some(batch) if runs.len() >= 2 => {
                let r = unsafe { queue_batch(batch, shared.stream.0, &runs) };
                driver::ok(r, "cuMemcpyBatchAsync").map_err(copy_error)?;
            }
            _ => {
                for run in &runs {
                    let r =
                        unsafe { copy(run.dst as u64, run.src as u64, run.len, shared.stream.0) };
                    driver::ok(r, "cuMemcpyDtoDAsync").map_err(copy_error)?;
                }
            }
        }
        let event = shared.event().map_err(copy_error)?;
        // SAFETY: an event and the stream of the entered context.
        driver::ok(
            unsafe { (api.cuEventRecord)(event.0, shared.stream.0) },
            "cuEventRecord",
        )
        .map_err(copy_error)?;
        let deadline = Instant::now() + self.timeout;
        let mut spins = 0u32;
        let result = loop {
            // SAFETY: queries an event of the entered context.
            match unsafe { (api.cuEventQuery)(event.0) } {
                CUresult::CUDA_SUCCESS => break Ok(()),
                CUresult::CUDA_ERROR_NOT_READY if Instant::now() < deadline => {
                    // A page's copy takes microseconds: spin a little, then sleep briefly.
                    spins += 1;
                    if spins < 64 {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(Duration::from_micros(20));
                    }
                }
                CUresult::CUDA_ERROR_NOT_READY => {
                    shared.stalled.store(true, Ordering::SeqCst);
                    return Err(CopyError(format!(
                        "copies into a peer on CUDA device {device} took over {:?}: the device takes no more",
                        self.timeout
                    )));
                }
                r => break driver::ok(r, "cuEventQuery").map_err(copy_error),
            }
        };
        if let Ok(mut free) = shared.events.lock() {
            free.push(event);
        }
        result
    }

    fn remote_writes_need_flush(&self, device: u32) -> bool {
        self.devices
            .get(&device)
            .is_some_and(|d| d.flush != Flush::NotNeeded)
    }

    fn flush_remote_writes(&self, device: u32) -> Result<(), CopyError> {
        let dev = self.device(device)?;
        if dev.flush == Flush::NotNeeded {
            return Ok(());
        }
        let flush = dev.shared.api().cuFlushGPUDirectRDMAWrites.ok_or_else(|| {
            CopyError("the CUDA driver lacks cuFlushGPUDirectRDMAWrites".to_owned())
        })?;
        let _in = dev.shared.ctx.enter().map_err(copy_error)?;
        // SAFETY: flushes the NIC writes into the entered context's memory; no pointers.
        let r = unsafe {
            flush(
                CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
            )
        };
        driver::ok(r, "cuFlushGPUDirectRDMAWrites").map_err(copy_error)
    }
}

/// `jobs` with each run that continues the previous one on both sides merged into it.
fn merge_runs(jobs: &[CopyJob]) -> Vec<CopyJob> {
    let mut runs: Vec<CopyJob> = Vec::with_capacity(jobs.len());
    for job in jobs {
        if let Some(last) = runs.last_mut() {
            if last.src + last.len == job.src && last.dst + last.len == job.dst {
                last.len += job.len;
                continue;
            }
        }
        runs.push(*job);
    }
    runs
}
