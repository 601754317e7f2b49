//! CUDA through `cudarc` (feature `gpu`, driver loaded at run time): the probe that turns "no
//! GPU here" into a typed error before any driver call (cudarc panics on a driver call when
//! `libcuda` is absent), device regions, streams, and events as [`LayerEvent`]s.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DriverError};

use crate::{GpuError, LayerEvent};

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

/// Checks for `libcuda` first, then asks the driver for devices: never panics.
pub fn probe() -> Result<GpuInfo, GpuError> {
    // SAFETY: only tries to load the driver library; no driver call is made.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(GpuError::NoLibcuda);
    }
    let n = CudaContext::device_count().map_err(driver)?;
    if n <= 0 {
        return Err(GpuError::NoDevice);
    }
    let ctx = CudaContext::new(0).map_err(driver)?;
    Ok(GpuInfo {
        devices: n as usize,
        name: ctx.name().map_err(driver)?,
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
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.buf.len() == 0
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
