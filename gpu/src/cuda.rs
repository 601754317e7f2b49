//! CUDA through `cudarc` (feature `gpu`, driver loaded at run time): the probe that turns "no
//! GPU here" into a typed error before any driver call (cudarc panics on a driver call when
//! `libcuda` is absent), and, for the embedder's own side of a demo or test, device regions,
//! streams, and events as [`LayerEvent`]s. [`Gpu::open`] makes the device's context current
//! on the calling thread, as the CUDA runtime does for its user; the node's own calls
//! ([`crate::engine`]) never change the caller's current context.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError,
    PinnedHostSlice,
};

use crate::{GpuError, LayerEvent};

/// The `cudarc` this crate was built with, for kernels the embedder compiles and launches.
pub use cudarc;

fn driver(e: DriverError) -> GpuError {
    GpuError::Driver(format!("{e:?}"))
}

/// What the probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// Devices the driver reports.
    pub devices: usize,
    /// The first device's name.
    pub name: String,
}

/// Loads the driver and counts its devices: `cuInit` and `cuDeviceGetCount`, the first
/// device's name, and nothing else. No context is made or made current, no device memory is
/// touched, and a missing driver or symbol is a typed error, never a panic.
pub fn probe() -> Result<GpuInfo, GpuError> {
    probe_with(crate::driver::api()?)
}

/// [`probe`] through a given driver table.
pub(crate) fn probe_with(api: &crate::driver::CudaApi) -> Result<GpuInfo, GpuError> {
    let n = crate::driver::device_count(api)?;
    if n == 0 {
        return Err(GpuError::NoDevice);
    }
    let device = crate::driver::device(api, 0)?;
    // SAFETY: the driver writes at most the given length, NUL-terminated; no context needed.
    let name = crate::driver::driver_string::<256>("cuDeviceGetName", |buf, len| unsafe {
        (api.cuDeviceGetName)(buf, len, device)
    })?;
    Ok(GpuInfo {
        devices: n as usize,
        name,
    })
}

/// One GPU with a compute stream (the forward pass) and a copy stream (staging), so copies of
/// one layer overlap the next layer's compute.
#[derive(Debug)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
}

impl Gpu {
    /// Opens device `ordinal` after [`probe`] said there is one.
    pub fn open(ordinal: usize) -> Result<Gpu, GpuError> {
        probe()?;
        let ctx = CudaContext::new(ordinal).map_err(driver)?;
        let compute = ctx.new_stream().map_err(driver)?;
        let copy = ctx.new_stream().map_err(driver)?;
        Ok(Gpu { ctx, compute, copy })
    }

    /// The stream the embedder runs its forward pass on.
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// The stream staging copies run on.
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    /// An owned device region of `bytes` bytes, zeroed (tests and the CLI's GPU demo).
    pub fn alloc(&self, bytes: usize) -> Result<DeviceRegion, GpuError> {
        let buf = self.compute.alloc_zeros::<u8>(bytes).map_err(driver)?;
        Ok(DeviceRegion { buf })
    }

    /// Records an event on `stream` after everything queued on it so far.
    pub fn record(&self, stream: &Arc<CudaStream>) -> Result<GpuEvent, GpuError> {
        stream.record_event(None).map(GpuEvent).map_err(driver)
    }

    /// Another stream on this GPU (decode's copies into device memory use their own).
    pub fn new_stream(&self) -> Result<Arc<CudaStream>, GpuError> {
        self.ctx.new_stream().map_err(driver)
    }

    /// A zeroed device region whose uses the caller orders with events ([`Gpu::wait_for`])
    /// instead of cudarc's per-slice tracking. Tracking would make the next layer's kernel
    /// wait for the previous layer's copy out of the same region and undo the overlap.
    pub fn alloc_ordered(&self, bytes: usize) -> Result<DeviceRegion, GpuError> {
        // SAFETY: the region created while tracking is off is used only through this crate's
        // copies and the embedder's kernels, which order themselves with recorded events and
        // stream waits; the allocation is complete before it is returned (synchronize below).
        unsafe { self.ctx.disable_event_tracking() };
        let buf = self.compute.alloc_zeros::<u8>(bytes);
        // SAFETY: restores the default for every later allocation.
        unsafe { self.ctx.enable_event_tracking() };
        let buf = buf.map_err(driver)?;
        self.compute.synchronize().map_err(driver)?;
        Ok(DeviceRegion { buf })
    }

    /// Page-locked host memory of `bytes` bytes, zeroed, that the CPU reads at full speed
    /// (not write-combined): staging memory the network sends from and receives into.
    pub fn alloc_pinned(&self, bytes: usize) -> Result<PinnedBuffer, GpuError> {
        // SAFETY: flag 0 is plain page-locked memory; it is zeroed below before any use.
        let mut buf =
            unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes.max(1), 0) }.map_err(driver)?;
        let ptr = buf.as_mut_ptr().map_err(driver)?;
        // SAFETY: `ptr` is valid for `bytes.max(1)` bytes, just allocated and not shared.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes.max(1)) };
        Ok(PinnedBuffer {
            buf,
            ptr,
            len: bytes,
        })
    }

    /// Makes `stream` wait (on the GPU, not the host) for everything before `event`.
    pub fn wait_for(&self, stream: &Arc<CudaStream>, event: &GpuEvent) -> Result<(), GpuError> {
        stream.wait(&event.0).map_err(driver)
    }

    /// Queues a copy of `len` bytes at `offset` of `src` to `dst` on `stream`.
    ///
    /// # Safety
    ///
    /// `dst` must stay valid for `len` bytes, and untouched by anyone else, until an event
    /// recorded on `stream` after this call has completed; page-locked memory makes the copy
    /// asynchronous.
    pub unsafe fn copy_to_host_async(
        &self,
        stream: &Arc<CudaStream>,
        src: &DeviceRegion,
        offset: usize,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), GpuError> {
        src.check(offset, len)?;
        // Raw driver calls need the context current on this thread (copies run on the
        // demo's forward and landing threads).
        self.ctx.bind_to_thread().map_err(driver)?;
        let (base, _guard) = src.buf.device_ptr(stream);
        // SAFETY: the range is inside `src` (checked); the caller keeps `dst` valid until the
        // copy is known complete.
        unsafe {
            cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                dst.cast(),
                base + offset as u64,
                len,
                stream.cu_stream(),
            )
        }
        .result()
        .map_err(driver)
    }

    /// Queues a copy of `len` bytes from `src` into `dst` at `offset` on `stream`.
    ///
    /// # Safety
    ///
    /// `src` must stay valid and unchanged for `len` bytes until an event recorded on `stream`
    /// after this call has completed.
    pub unsafe fn copy_to_device_async(
        &self,
        stream: &Arc<CudaStream>,
        dst: &DeviceRegion,
        offset: usize,
        src: *const u8,
        len: usize,
    ) -> Result<(), GpuError> {
        dst.check(offset, len)?;
        self.ctx.bind_to_thread().map_err(driver)?;
        let (base, _guard) = dst.buf.device_ptr(stream);
        // SAFETY: the range is inside `dst` (checked); the caller keeps `src` valid until the
        // copy is known complete; nothing else writes `dst` there (the caller's ordering).
        unsafe {
            cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
                base + offset as u64,
                src.cast(),
                len,
                stream.cu_stream(),
            )
        }
        .result()
        .map_err(driver)
    }

    /// Compiles CUDA C `source` with NVRTC and loads `function` from it.
    pub fn compile(&self, source: &str, function: &str) -> Result<CudaFunction, GpuError> {
        // SAFETY: only tries to load the NVRTC library; no NVRTC call is made.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(GpuError::NoNvrtc);
        }
        let ptx =
            cudarc::nvrtc::compile_ptx(source).map_err(|e| GpuError::Compile(format!("{e:?}")))?;
        let module = self.ctx.load_module(ptx).map_err(driver)?;
        module.load_function(function).map_err(driver)
    }

    /// Copies host bytes into a device region (waits for the copy).
    pub fn upload(&self, host: &[u8], dst: &mut DeviceRegion) -> Result<(), GpuError> {
        self.copy.memcpy_htod(host, &mut dst.buf).map_err(driver)?;
        self.copy.synchronize().map_err(driver)
    }

    /// Copies a device region into host bytes (waits for the copy).
    pub fn download(&self, src: &DeviceRegion, host: &mut [u8]) -> Result<(), GpuError> {
        self.copy.memcpy_dtoh(&src.buf, host).map_err(driver)?;
        self.copy.synchronize().map_err(driver)
    }

    /// The context (for kernels the embedder compiles).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

/// GPU memory kvferry moves KV from or into.
#[derive(Debug)]
pub struct DeviceRegion {
    buf: CudaSlice<u8>,
}

impl DeviceRegion {
    /// The region's device address, to register it with kvferry as device memory
    /// (`kvferry_memory::MemoryKind::Cuda`).
    pub fn device_addr(&self, gpu: &Gpu) -> u64 {
        let (ptr, _sync) = self.buf.device_ptr(gpu.compute_stream());
        ptr
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), GpuError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.buf.len() => Ok(()),
            _ => Err(GpuError::OutOfRange {
                offset,
                len,
                size: self.buf.len(),
            }),
        }
    }

    /// The device memory, to pass to a kernel.
    pub fn slice(&self) -> &CudaSlice<u8> {
        &self.buf
    }

    /// The device memory, to pass to a kernel that writes it.
    pub fn slice_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.buf
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.buf.len() == 0
    }
}

/// Page-locked host memory (staging between GPU memory and the network).
#[derive(Debug)]
pub struct PinnedBuffer {
    buf: PinnedHostSlice<u8>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer owns its allocation (freed on drop through its context); `ptr` is only an
// address into it, and who touches which bytes when is the holder's contract, as for any
// registered memory.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Its base address (valid while the buffer lives).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its context (the buffer must not outlive uses queued on it).
    pub fn context(&self) -> &Arc<CudaContext> {
        self.buf.context()
    }
}

/// A CUDA event as a layer's readiness signal.
#[derive(Debug)]
pub struct GpuEvent(CudaEvent);

impl LayerEvent for GpuEvent {
    fn poll_complete(&mut self) -> Result<bool, GpuError> {
        self.0.try_is_complete().map_err(driver)
    }
}
