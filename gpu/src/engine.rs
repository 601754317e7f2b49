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

/// Another process's allocation mapped into one device's context; unmapped on drop.
struct Imported {
    shared: Arc<DeviceShared>,
    /// Where the allocation starts here.
    base: u64,
    /// How it was mapped.
    how: Mapped,
}

/// How an [`Imported`] allocation was mapped, and so how it is unmapped.
enum Mapped {
    /// `cuIpcOpenMemHandle`.
    Ipc,
    /// The VMM API: the imported handle mapped over a reservation of `size` bytes.
    Vmm {
        handle: CUmemGenericAllocationHandle,
        size: usize,
    },
}

impl Drop for Imported {
    fn drop(&mut self) {
        let api = self.shared.api();
        let Ok(_in) = self.shared.ctx.enter() else {
            return;
        };
        // A failed unmap leaves nothing to do: the mapping ends with the process.
        match self.how {
            Mapped::Ipc => {
                if let Some(close) = api.cuIpcCloseMemHandle {
                    // SAFETY: `base` was mapped by cuIpcOpenMemHandle in this context, and no
                    // copy into it is queued any more (every copy waits for its event before
                    // it returns, and the session's target holding this mapping is gone).
                    let _ = unsafe { close(self.base) };
                }
            }
            Mapped::Vmm { handle, size } => {
                // SAFETY: as above, for the range this import reserved and mapped; the handle
                // is the import's own reference.
                unsafe {
                    if let Some(unmap) = api.cuMemUnmap {
                        let _ = unmap(self.base, size);
                    }
                    if let Some(free) = api.cuMemAddressFree {
                        let _ = free(self.base, size);
                    }
                    if let Some(release) = api.cuMemRelease {
                        let _ = release(handle);
                    }
                }
            }
        }
    }
}

/// A copy, in this process, of file descriptor `fd` of process `pid` (`pidfd_getfd`: the
/// same permission as `process_vm_writev`, which the same-host path was granted).
fn descriptor_of(pid: u32, fd: i32) -> Result<std::os::fd::OwnedFd, CopyError> {
    use std::os::fd::FromRawFd;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd < 0 {
        return Err(CopyError(format!(
            "pidfd_open({pid}): {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: the kernel just gave this descriptor to us.
    let pidfd = unsafe { std::os::fd::OwnedFd::from_raw_fd(pidfd as i32) };
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number in that process and flags, and
    // returns a new descriptor here or -1.
    let got = unsafe {
        libc::syscall(
            libc::SYS_pidfd_getfd,
            std::os::fd::AsRawFd::as_raw_fd(&pidfd),
            fd,
            0,
        )
    };
    if got < 0 {
        return Err(CopyError(format!(
            "pidfd_getfd of process {pid}'s descriptor {fd}: {} (the kernel's ptrace rules, or the exporter is gone)",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: as above.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(got as i32) })
}

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

/// Queues `calls` on `stream`: the contiguous runs in one batched call where the driver has
/// it and there are several (their destinations never overlap, so their order inside the
/// batch does not matter), each strided copy as one 2D copy, anything else one call each.
///
/// # Safety
///
/// As for [`queue`], for every call.
unsafe fn queue_all(
    api: &CudaApi,
    stream: CUstream,
    direction: CopyDirection,
    calls: &[CopyCall],
) -> Result<(), CopyError> {
    // With a batched copy, a few rows that happened to line up are cheaper inside the
    // batch than as a 2D copy of their own; many rows stay one 2D copy.
    let in_batch = |c: &CopyCall| match c {
        CopyCall::Run(_) => true,
        CopyCall::Rows { rows, .. } => *rows < MIN_2D_ROWS_BESIDE_A_BATCH,
    };
    let batched = match api.cuMemcpyBatchAsync {
        Some(batch) => {
            let runs: Vec<CopyJob> = calls
                .iter()
                .filter(|c| in_batch(c))
                .flat_map(CopyCall::pieces)
                .collect();
            runs.len() >= 2 && {
                // SAFETY: the caller's contract, for each run.
                let r = unsafe { queue_batch(batch, stream, &runs) };
                driver::ok(r, "cuMemcpyBatchAsync").map_err(copy_error)?;
                true
            }
        }
        None => false,
    };
    for call in calls {
        if batched && in_batch(call) {
            continue;
        }
        // SAFETY: the caller's contract.
        let r = unsafe { queue(api, stream, direction, call) };
        driver::ok(r, "cuMemcpyAsync").map_err(copy_error)?;
    }
    Ok(())
}

/// Rows of one stride, fewer than this, go into a batched copy (where the driver has one)
/// rather than a 2D copy of their own.
const MIN_2D_ROWS_BESIDE_A_BATCH: usize = 16;

/// The batched copy's entry point.
type BatchFn = unsafe extern "C" fn(
    *mut u64,
    *mut u64,
    *mut usize,
    usize,
    *mut CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    CUstream,
) -> CUresult;

/// Queues `runs` as one batched copy (pointer to pointer: unified addresses on both sides).
///
/// # Safety
///
/// As for [`queue`], for every run.
unsafe fn queue_batch(batch: BatchFn, stream: CUstream, runs: &[CopyJob]) -> CUresult {
    let mut dsts: Vec<u64> = runs.iter().map(|j| j.dst as u64).collect();
    let mut srcs: Vec<u64> = runs.iter().map(|j| j.src as u64).collect();
    let mut sizes: Vec<usize> = runs.iter().map(|j| j.len).collect();
    let nowhere = CUmemLocation {
        type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID,
        id: 0,
    };
    // One attribute for every copy: the source is read in stream order (after the work
    // queued before it), no location hint (staging buffers are not managed memory).
    let mut attrs = [CUmemcpyAttributes {
        srcAccessOrder: CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: nowhere,
        dstLocHint: nowhere,
        flags: 0,
    }];
    let mut attr_index = [0usize];
    let mut failed = usize::MAX;
    // SAFETY: the arrays hold `runs.len()` entries each and live across the call (the driver
    // reads them before returning); the caller's contract for the bytes.
    unsafe {
        batch(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            runs.len(),
            attrs.as_mut_ptr(),
            attr_index.as_mut_ptr(),
            1,
            &mut failed,
            stream,
        )
    }
}

/// Queues one planned call on `stream`.
///
/// # Safety
///
/// The call's ranges are valid device memory (device side) and page-locked or pageable host
/// memory (host side) that stay valid until the batch's event completes; the device's
/// context is current.
unsafe fn queue(
    api: &CudaApi,
    stream: CUstream,
    direction: CopyDirection,
    call: &CopyCall,
) -> CUresult {
    match (*call, direction) {
        (CopyCall::Run(j), CopyDirection::DeviceToHost) => {
            // SAFETY: the caller's contract.
            unsafe { (api.cuMemcpyDtoHAsync)(j.dst as *mut c_void, j.src as u64, j.len, stream) }
        }
        (CopyCall::Run(j), CopyDirection::HostToDevice) => {
            // SAFETY: the caller's contract.
            unsafe { (api.cuMemcpyHtoDAsync)(j.dst as u64, j.src as *const c_void, j.len, stream) }
        }
        (
            CopyCall::Rows {
                dst,
                src,
                width,
                rows,
                dst_pitch,
                src_pitch,
            },
            direction,
        ) => {
            let (device, host) = (
                CUmemorytype::CU_MEMORYTYPE_DEVICE,
                CUmemorytype::CU_MEMORYTYPE_HOST,
            );
            let to_host = direction == CopyDirection::DeviceToHost;
            let p = CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: if to_host { device } else { host },
                srcHost: src as *const c_void,
                srcDevice: src as u64,
                srcArray: std::ptr::null_mut(),
                srcPitch: src_pitch,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: if to_host { host } else { device },
                dstHost: dst as *mut c_void,
                dstDevice: dst as u64,
                dstArray: std::ptr::null_mut(),
                dstPitch: dst_pitch,
                WidthInBytes: width,
                Height: rows,
            };
            // SAFETY: the caller's contract; `p` lives across the call (the driver reads it
            // before returning).
            unsafe { (api.cuMemcpy2DAsync)(&p, stream) }
        }
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
        let get = api
            .cuIpcGetMemHandle
            .ok_or_else(|| CopyError("the CUDA driver lacks cuIpcGetMemHandle".to_owned()))?;
        let (base, _) = allocation_holding(api, addr, len)?;
        // SAFETY: a zeroed handle is a valid value of this plain byte array.
        let mut handle: CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: exports a live allocation of the entered context; the driver writes the
        // handle.
        let r = unsafe { get(&mut handle, base) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(CopyError(format!(
                "cuIpcGetMemHandle: {r:?} (only cuMemAlloc allocations export this way, and the VMM API's as file descriptors: not a memory pool's (cuMemAllocAsync))"
            )));
        }
        let mut bytes = [0u8; 64];
        for (b, c) in bytes.iter_mut().zip(handle.reserved.iter()) {
            *b = *c as u8;
        }
        Ok(vec![IpcExport {
            handle_type: IpcHandleType::CudaIpc,
            handle: bytes,
            addr,
            len,
            offset: addr - base,
            keep: None,
        }])
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
        let dev = self.device(device)?;
        let api = dev.shared.api();
        if api.cuMemcpyDtoDAsync.is_none() {
            return Err(CopyError(
                "the CUDA driver lacks cuMemcpyDtoDAsync_v2".to_owned(),
            ));
        }
        let key = (export.handle_type, export.handle, owner, device);
        let mut imports = self
            .imports
            .lock()
            .map_err(|_| CopyError("the engine's import table is poisoned".to_owned()))?;
        imports.retain(|(_, weak)| weak.strong_count() > 0);
        let found = imports
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, weak)| weak.upgrade());
        let imported = match found {
            Some(i) => i,
            None => {
                let imported = Arc::new(match export.handle_type {
                    IpcHandleType::PosixFd => import_vmm(&dev.shared, device, owner, export)?,
                    _ => import_legacy(&dev.shared, device, export)?,
                });
                imports.push((key, Arc::downgrade(&imported)));
                imported
            }
        };
        Ok(IpcMapping {
            addr: imported.base + export.offset,
            keep: Some(imported),
        })
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

/// The VMM API's handle of the allocation mapped at `addr` (retained: the caller releases
/// it), or `None` for memory the VMM API did not map. The device's context must be entered.
fn vmm_handle(api: &CudaApi, addr: u64) -> Option<CUmemGenericAllocationHandle> {
    let retain = api.cuMemRetainAllocationHandle?;
    let mut handle: CUmemGenericAllocationHandle = 0;
    // SAFETY: asks which VMM allocation is mapped at `addr`; the driver writes the handle.
    let r = unsafe { retain(&mut handle, addr as *mut c_void) };
    (r == CUresult::CUDA_SUCCESS).then_some(handle)
}

/// Drops one reference of a VMM handle. The device's context must be entered.
fn release_vmm(api: &CudaApi, handle: CUmemGenericAllocationHandle) {
    if let Some(release) = api.cuMemRelease {
        // SAFETY: the handle holds a reference the caller took.
        let _ = unsafe { release(handle) };
    }
}

/// `len` bytes at `addr` of VMM-mapped memory, exported as one file descriptor per physical
/// allocation they span (each the whole allocation, mapped at its base). The device's
/// context must be entered.
fn export_vmm(api: &CudaApi, addr: u64, len: u64) -> Result<Vec<IpcExport>, CopyError> {
    let export = api.cuMemExportToShareableHandle.ok_or_else(|| {
        CopyError("the CUDA driver lacks cuMemExportToShareableHandle".to_owned())
    })?;
    let end = addr
        .checked_add(len)
        .ok_or_else(|| CopyError(format!("{len} bytes at {addr:#x} overflow")))?;
    let mut pieces = Vec::new();
    let mut at = addr;
    while at < end {
        let (base, size) = allocation_holding(api, at, 1)?;
        let handle = vmm_handle(api, at).ok_or_else(|| {
            CopyError(format!(
                "{len} bytes at {addr:#x}: the memory at {at:#x} is not the VMM API's while the start is"
            ))
        })?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: exports a live VMM allocation of the entered context; the driver writes one
        // descriptor (an int for this handle type).
        let r = unsafe {
            export(
                (&mut fd as *mut std::ffi::c_int).cast(),
                handle,
                CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        };
        release_vmm(api, handle);
        if r != CUresult::CUDA_SUCCESS || fd < 0 {
            return Err(CopyError(format!(
                "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR) of the VMM allocation at {base:#x}: {r:?} (it must be created with that handle type requested)"
            )));
        }
        // SAFETY: the driver handed this descriptor to us; nothing else owns it.
        let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        let piece_end = end.min(base + size as u64);
        let mut handle_bytes = [0u8; 64];
        handle_bytes[..4].copy_from_slice(&std::os::fd::AsRawFd::as_raw_fd(&fd).to_le_bytes());
        handle_bytes[8..16].copy_from_slice(&(size as u64).to_le_bytes());
        pieces.push(IpcExport {
            handle_type: IpcHandleType::PosixFd,
            handle: handle_bytes,
            addr: at,
            len: piece_end - at,
            offset: at - base,
            keep: Some(Arc::new(fd)),
        });
        at = piece_end;
    }
    Ok(pieces)
}

/// Maps a `cuIpcGetMemHandle` export into `device`'s context.
fn import_legacy(
    shared: &Arc<DeviceShared>,
    device: u32,
    export: &IpcExport,
) -> Result<Imported, CopyError> {
    let api = shared.api();
    let (Some(open), Some(_)) = (api.cuIpcOpenMemHandle, api.cuIpcCloseMemHandle) else {
        return Err(CopyError(
            "the CUDA driver lacks cuIpcOpenMemHandle or cuIpcCloseMemHandle".to_owned(),
        ));
    };
    // SAFETY: a zeroed handle is a valid value of this plain byte array.
    let mut handle: CUipcMemHandle = unsafe { std::mem::zeroed() };
    for (c, b) in handle.reserved.iter_mut().zip(export.handle.iter()) {
        *c = *b as _;
    }
    let _in = shared.ctx.enter().map_err(copy_error)?;
    let mut base = 0u64;
    // SAFETY: maps the exported allocation into the entered context; the driver writes its
    // address here. Closed by `Imported::drop`.
    let r = unsafe { open(&mut base, handle, IPC_LAZY_ENABLE_PEER_ACCESS) };
    if r != CUresult::CUDA_SUCCESS {
        return Err(CopyError(format!(
            "cuIpcOpenMemHandle on CUDA device {device}: {r:?} (no peer access between the two GPUs, or the exporter is gone)"
        )));
    }
    Ok(Imported {
        shared: shared.clone(),
        base,
        how: Mapped::Ipc,
    })
}

/// Maps a VMM allocation process `owner` exported as a file descriptor into `device`'s
/// context: the descriptor taken from the owner, imported, mapped over a reservation of its
/// size, readable and writable by `device`.
fn import_vmm(
    shared: &Arc<DeviceShared>,
    device: u32,
    owner: u32,
    export: &IpcExport,
) -> Result<Imported, CopyError> {
    let api = shared.api();
    let (Some(import), Some(reserve), Some(free), Some(map), Some(unmap), Some(access), Some(_)) = (
        api.cuMemImportFromShareableHandle,
        api.cuMemAddressReserve,
        api.cuMemAddressFree,
        api.cuMemMap,
        api.cuMemUnmap,
        api.cuMemSetAccess,
        api.cuMemRelease,
    ) else {
        return Err(CopyError(
            "the CUDA driver lacks the VMM API's import calls (cuMemImportFromShareableHandle, cuMemMap, ...)"
                .to_owned(),
        ));
    };
    let fd = i32::from_le_bytes([
        export.handle[0],
        export.handle[1],
        export.handle[2],
        export.handle[3],
    ]);
    let mut size = [0u8; 8];
    size.copy_from_slice(&export.handle[8..16]);
    let size = usize::try_from(u64::from_le_bytes(size))
        .map_err(|_| CopyError("a VMM allocation larger than the address space".to_owned()))?;
    if export
        .offset
        .checked_add(export.len)
        .map_or(true, |end| end > size as u64)
    {
        return Err(CopyError(format!(
            "a VMM piece of {} bytes at offset {} runs past its allocation of {size} bytes",
            export.len, export.offset
        )));
    }
    let local = descriptor_of(owner, fd)?;
    let _in = shared.ctx.enter().map_err(copy_error)?;
    let mut handle: CUmemGenericAllocationHandle = 0;
    let raw = std::os::fd::AsRawFd::as_raw_fd(&local);
    // SAFETY: imports the allocation behind a descriptor this process owns (the handle type's
    // OS handle is the descriptor's value cast to a pointer); the driver writes the handle and
    // keeps its own reference to the memory, so the descriptor is closed after.
    let r = unsafe {
        import(
            &mut handle,
            raw as isize as *mut c_void,
            CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    };
    drop(local);
    driver::ok(r, "cuMemImportFromShareableHandle").map_err(copy_error)?;
    let mut base = 0u64;
    // SAFETY: reserves `size` bytes of address space; the driver writes where.
    let r = unsafe { reserve(&mut base, size, 0, 0, 0) };
    if let Err(e) = driver::ok(r, "cuMemAddressReserve") {
        release_vmm(api, handle);
        return Err(copy_error(e));
    }
    // SAFETY: maps the whole imported allocation over the whole reservation just made.
    let r = unsafe { map(base, size, 0, handle, 0) };
    if let Err(e) = driver::ok(r, "cuMemMap") {
        // SAFETY: the reservation just made, with nothing mapped.
        unsafe {
            let _ = free(base, size);
        }
        release_vmm(api, handle);
        return Err(copy_error(e));
    }
    let desc = CUmemAccessDesc {
        location: CUmemLocation {
            type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device as i32,
        },
        flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: the range just mapped, one access descriptor.
    let r = unsafe { access(base, size, &desc, 1) };
    if let Err(e) = driver::ok(r, "cuMemSetAccess") {
        // SAFETY: undoes the mapping and reservation just made.
        unsafe {
            let _ = unmap(base, size);
            let _ = free(base, size);
        }
        release_vmm(api, handle);
        return Err(CopyError(format!(
            "{e} on CUDA device {device} (no peer access between the two GPUs?)"
        )));
    }
    Ok(Imported {
        shared: shared.clone(),
        base,
        how: Mapped::Vmm { handle, size },
    })
}

/// The CUDA allocation holding `len` bytes at `addr`: its base and size; an error if the
/// range runs past it. The device's context must be entered.
fn allocation_holding(api: &CudaApi, addr: u64, len: u64) -> Result<(u64, usize), CopyError> {
    let mut base = 0u64;
    let mut size: usize = 0;
    // SAFETY: asks the driver which allocation holds `addr`; it writes the two values.
    driver::ok(
        unsafe { (api.cuMemGetAddressRange)(&mut base, &mut size, addr) },
        "cuMemGetAddressRange",
    )
    .map_err(copy_error)?;
    if addr < base || addr - base + len > size as u64 {
        return Err(CopyError(format!(
            "{len} bytes at {addr:#x} span more than one CUDA allocation (the one holding its start ends at {:#x}); a caching allocator's expandable segments do this",
            base + size as u64
        )));
    }
    Ok((base, size))
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

/// What the driver says the memory at `ptr` is: host memory it does not know, or a device's.
pub fn pointer_kind(ptr: *const u8) -> Result<MemoryKind, GpuError> {
    kind_of(api()?, ptr)
}

/// One attribute of `ptr` as the driver reports it (`T` is the attribute's C type: `u32`
/// for the memory type, `i32` for the device ordinal).
fn attribute<T: Default>(
    api: &CudaApi,
    ptr: *const u8,
    which: CUpointer_attribute,
) -> (CUresult, T) {
    let mut value = T::default();
    // SAFETY: asks the driver about an address; it writes one value of the attribute's type,
    // which the callers name as `T`.
    let r =
        unsafe { (api.cuPointerGetAttribute)((&mut value as *mut T).cast(), which, ptr as u64) };
    (r, value)
}

/// [`pointer_kind`] through a given driver table. Asked first on this thread as it is (torch's
/// context current, or none); a driver that needs a context is asked again inside each device
/// context some user of this process already made (a pointer to device memory exists only in
/// a context someone made), never creating one.
pub(crate) fn kind_of(api: &'static CudaApi, ptr: *const u8) -> Result<MemoryKind, GpuError> {
    match kind_here(api, ptr) {
        Err(CUresult::CUDA_ERROR_INVALID_CONTEXT) => {}
        Err(r) => return Err(GpuError::Driver(format!("what memory {ptr:?} is: {r:?}"))),
        Ok(kind) => return Ok(kind),
    }
    for ordinal in 0..driver::device_count(api)? {
        if !driver::primary_context_active(api, ordinal)? {
            continue;
        }
        let ctx = DeviceContext::retain(api, ordinal)?;
        let _in = ctx.enter()?;
        match kind_here(api, ptr) {
            Err(CUresult::CUDA_ERROR_INVALID_CONTEXT) => {}
            Err(r) => return Err(GpuError::Driver(format!("what memory {ptr:?} is: {r:?}"))),
            Ok(kind) => return Ok(kind),
        }
    }
    // No device context exists in this process: no device memory does either.
    Ok(MemoryKind::Host)
}

/// The kind of `ptr` in the context current on this thread; `Err`: the driver's answer.
fn kind_here(api: &CudaApi, ptr: *const u8) -> Result<MemoryKind, CUresult> {
    let (r, memory_type) = attribute::<u32>(
        api,
        ptr,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    );
    if r == CUresult::CUDA_ERROR_INVALID_VALUE {
        // Memory the driver never saw (plain malloc) is host memory.
        return Ok(MemoryKind::Host);
    }
    if r != CUresult::CUDA_SUCCESS {
        // Any other answer says nothing about the pointer: do not call it host memory.
        return Err(r);
    }
    if memory_type != CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return Ok(MemoryKind::Host);
    }
    let (r, ordinal) = attribute::<i32>(
        api,
        ptr,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    );
    // Device memory whose ordinal the driver does not give is still device memory: call it
    // device 0 rather than host, so it is never read by the CPU.
    Ok(MemoryKind::Cuda {
        device: if r == CUresult::CUDA_SUCCESS {
            ordinal as u32
        } else {
            0
        },
    })
}

/// A region registered as one kind of memory that the driver says is another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KindMismatch {
    /// The region.
    pub region: Region,
    /// What it was registered as.
    pub registered: MemoryKind,
    /// What the driver says it is.
    pub actual: MemoryKind,
}

/// Why registered memory was refused by [`verify_kinds`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KindError {
    /// The driver says a region is another kind of memory than it was registered as.
    Mismatch(KindMismatch),
    /// The driver could not say what a region is.
    Unknown {
        /// The region.
        region: Region,
        /// What it was registered as.
        registered: MemoryKind,
        /// Why.
        why: GpuError,
    },
}

impl std::fmt::Display for KindError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KindError::Mismatch(m) => write!(
                f,
                "{:?} was registered as {} but the CUDA driver says it is {}",
                m.region, m.registered, m.actual
            ),
            KindError::Unknown {
                region,
                registered,
                why,
            } => write!(
                f,
                "{region:?} was registered as {registered}, and the CUDA driver cannot say what it is, so it is not used: {why}"
            ),
        }
    }
}

impl std::error::Error for KindError {}

/// Asks the driver what every region of `memory` is and names the first registered as the
/// wrong kind (a device pointer registered as host would be read by the CPU).
pub fn check_kinds(memory: &MemoryMap) -> Result<Option<KindMismatch>, GpuError> {
    match verify_kinds(memory) {
        Ok(()) => Ok(None),
        Err(KindError::Mismatch(m)) => Ok(Some(m)),
        Err(KindError::Unknown { why, .. }) => Err(why),
    }
}

/// Checks that every region of `memory` is the kind of memory it was registered as. Host
/// memory on a host with no CUDA driver or no GPU needs no driver to say so; anything else
/// the driver cannot answer is an error naming the region.
pub fn verify_kinds(memory: &MemoryMap) -> Result<(), KindError> {
    verify_kinds_with(api(), memory)
}

/// [`verify_kinds`] through a given driver table (or the reason there is none).
pub(crate) fn verify_kinds_with(
    api: Result<&'static CudaApi, GpuError>,
    memory: &MemoryMap,
) -> Result<(), KindError> {
    let first = memory.kinds().next();
    let device_region = memory.kinds().find(|(_, k)| *k != MemoryKind::Host);
    let api = match api.and_then(|api| match driver::device_count(api)? {
        0 => Err(GpuError::NoDevice),
        _ => Ok(api),
    }) {
        Ok(api) => api,
        // Where the driver cannot start in this process, no one in it can have made device
        // memory (torch included): host regions are host.
        Err(_) if device_region.is_none() => return Ok(()),
        Err(why) => {
            let (region, registered) = device_region
                .or(first)
                .unwrap_or((Region::Scratch, MemoryKind::Host));
            return Err(KindError::Unknown {
                region,
                registered,
                why,
            });
        }
    };
    for (region, registered) in memory.kinds() {
        let unknown = |why| KindError::Unknown {
            region,
            registered,
            why,
        };
        let ptr = memory
            .range(region, 0, 0)
            .map_err(|e| unknown(GpuError::Driver(e.to_string())))?;
        let actual = kind_of(api, ptr).map_err(unknown)?;
        if actual != registered {
            return Err(KindError::Mismatch(KindMismatch {
                region,
                registered,
                actual,
            }));
        }
    }
    Ok(())
}
