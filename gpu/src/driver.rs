//! The CUDA driver calls kvferry makes, as a table of function pointers resolved once from
//! `libcuda` (never through cudarc's loader, which panics on a symbol an older driver lacks),
//! and the device contexts built on it: every call made for a node pushes the context it needs
//! and pops it, so the caller's current context is the same before and after.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::OnceLock;

use cudarc::driver::sys::{
    CUcontext, CUdevice, CUdevice_attribute, CUdeviceptr, CUevent, CUflushGPUDirectRDMAWritesScope,
    CUflushGPUDirectRDMAWritesTarget, CUipcMemHandle, CUmemAccessDesc, CUmemAllocationHandleType,
    CUmemGenericAllocationHandle, CUmemRangeHandleType, CUmemcpyAttributes, CUpointer_attribute,
    CUresult, CUstream, CUDA_MEMCPY2D,
};

use crate::GpuError;

/// Every CUDA driver entry point kvferry uses. Required ones are resolved at load (a driver
/// without one is refused with its name); optional ones are `None` on drivers too old for
/// them, and what needs them falls back (staging instead of dma-buf).
#[allow(non_snake_case, missing_docs)]
#[derive(Clone, Copy)]
pub(crate) struct CudaApi {
    pub cuInit: unsafe extern "C" fn(c_uint) -> CUresult,
    pub cuDeviceGetCount: unsafe extern "C" fn(*mut c_int) -> CUresult,
    pub cuDeviceGet: unsafe extern "C" fn(*mut CUdevice, c_int) -> CUresult,
    pub cuDeviceGetAttribute:
        unsafe extern "C" fn(*mut c_int, CUdevice_attribute, CUdevice) -> CUresult,
    pub cuDeviceGetName: unsafe extern "C" fn(*mut c_char, c_int, CUdevice) -> CUresult,
    pub cuDeviceGetPCIBusId: unsafe extern "C" fn(*mut c_char, c_int, CUdevice) -> CUresult,
    pub cuDevicePrimaryCtxRetain: unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult,
    pub cuDevicePrimaryCtxRelease: unsafe extern "C" fn(CUdevice) -> CUresult,
    pub cuDevicePrimaryCtxGetState:
        unsafe extern "C" fn(CUdevice, *mut c_uint, *mut c_int) -> CUresult,
    pub cuCtxPushCurrent: unsafe extern "C" fn(CUcontext) -> CUresult,
    pub cuCtxPopCurrent: unsafe extern "C" fn(*mut CUcontext) -> CUresult,
    pub cuStreamCreate: unsafe extern "C" fn(*mut CUstream, c_uint) -> CUresult,
    pub cuStreamDestroy: unsafe extern "C" fn(CUstream) -> CUresult,
    pub cuStreamSynchronize: unsafe extern "C" fn(CUstream) -> CUresult,
    pub cuEventCreate: unsafe extern "C" fn(*mut CUevent, c_uint) -> CUresult,
    pub cuEventRecord: unsafe extern "C" fn(CUevent, CUstream) -> CUresult,
    pub cuEventQuery: unsafe extern "C" fn(CUevent) -> CUresult,
    pub cuEventDestroy: unsafe extern "C" fn(CUevent) -> CUresult,
    pub cuMemcpyDtoHAsync:
        unsafe extern "C" fn(*mut c_void, CUdeviceptr, usize, CUstream) -> CUresult,
    pub cuMemcpyHtoDAsync:
        unsafe extern "C" fn(CUdeviceptr, *const c_void, usize, CUstream) -> CUresult,
    pub cuMemcpy2DAsync: unsafe extern "C" fn(*const CUDA_MEMCPY2D, CUstream) -> CUresult,
    pub cuMemHostRegister: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CUresult,
    pub cuMemHostUnregister: unsafe extern "C" fn(*mut c_void) -> CUresult,
    pub cuPointerGetAttribute:
        unsafe extern "C" fn(*mut c_void, CUpointer_attribute, CUdeviceptr) -> CUresult,
    pub cuMemGetAddressRange:
        unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, CUdeviceptr) -> CUresult,
    /// R515+: exports device memory as a dma-buf for a NIC.
    pub cuMemGetHandleForAddressRange: Option<
        unsafe extern "C" fn(
            *mut c_void,
            CUdeviceptr,
            usize,
            CUmemRangeHandleType,
            c_ulonglong,
        ) -> CUresult,
    >,
    /// CUDA 12.8+ (this signature, kept as `cuMemcpyBatchAsync` by later drivers): many
    /// pointer-to-pointer copies in one call.
    pub cuMemcpyBatchAsync: Option<
        unsafe extern "C" fn(
            *mut CUdeviceptr,
            *mut CUdeviceptr,
            *mut usize,
            usize,
            *mut CUmemcpyAttributes,
            *mut usize,
            usize,
            *mut usize,
            CUstream,
        ) -> CUresult,
    >,
    /// Exports an allocation for another process of this host (legacy `cuMemAlloc`
    /// allocations; VMM ones refuse).
    pub cuIpcGetMemHandle:
        Option<unsafe extern "C" fn(*mut CUipcMemHandle, CUdeviceptr) -> CUresult>,
    /// Maps another process's exported allocation into the current context.
    pub cuIpcOpenMemHandle:
        Option<unsafe extern "C" fn(*mut CUdeviceptr, CUipcMemHandle, c_uint) -> CUresult>,
    /// Unmaps what `cuIpcOpenMemHandle` mapped.
    pub cuIpcCloseMemHandle: Option<unsafe extern "C" fn(CUdeviceptr) -> CUresult>,
    /// The VMM API's handle of the physical allocation mapped at an address (fails for
    /// memory the VMM API did not map).
    pub cuMemRetainAllocationHandle:
        Option<unsafe extern "C" fn(*mut CUmemGenericAllocationHandle, *mut c_void) -> CUresult>,
    /// Drops a VMM handle reference (retained, created or imported).
    pub cuMemRelease: Option<unsafe extern "C" fn(CUmemGenericAllocationHandle) -> CUresult>,
    /// Exports a VMM allocation as an OS handle (a file descriptor here).
    pub cuMemExportToShareableHandle: Option<
        unsafe extern "C" fn(
            *mut c_void,
            CUmemGenericAllocationHandle,
            CUmemAllocationHandleType,
            c_ulonglong,
        ) -> CUresult,
    >,
    /// Imports another process's exported VMM allocation from its OS handle.
    pub cuMemImportFromShareableHandle: Option<
        unsafe extern "C" fn(
            *mut CUmemGenericAllocationHandle,
            *mut c_void,
            CUmemAllocationHandleType,
        ) -> CUresult,
    >,
    /// Reserves a virtual address range to map allocations into.
    pub cuMemAddressReserve: Option<
        unsafe extern "C" fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, c_ulonglong) -> CUresult,
    >,
    /// Frees a reservation.
    pub cuMemAddressFree: Option<unsafe extern "C" fn(CUdeviceptr, usize) -> CUresult>,
    /// Maps a VMM allocation into a reservation.
    pub cuMemMap: Option<
        unsafe extern "C" fn(
            CUdeviceptr,
            usize,
            usize,
            CUmemGenericAllocationHandle,
            c_ulonglong,
        ) -> CUresult,
    >,
    /// Unmaps what `cuMemMap` mapped.
    pub cuMemUnmap: Option<unsafe extern "C" fn(CUdeviceptr, usize) -> CUresult>,
    /// Lets devices read and write a mapped range.
    pub cuMemSetAccess:
        Option<unsafe extern "C" fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize) -> CUresult>,
    /// One device-to-device copy (either side may be a mapped peer allocation).
    pub cuMemcpyDtoDAsync:
        Option<unsafe extern "C" fn(CUdeviceptr, CUdeviceptr, usize, CUstream) -> CUresult>,
    /// CUDA 11.3+: makes a NIC's earlier writes visible to the device's own work.
    pub cuFlushGPUDirectRDMAWrites: Option<
        unsafe extern "C" fn(
            CUflushGPUDirectRDMAWritesTarget,
            CUflushGPUDirectRDMAWritesScope,
        ) -> CUresult,
    >,
}

impl std::fmt::Debug for CudaApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaApi")
            .field(
                "dma_buf_export",
                &self.cuMemGetHandleForAddressRange.is_some(),
            )
            .field("rdma_flush", &self.cuFlushGPUDirectRDMAWrites.is_some())
            .field("batched_copies", &self.cuMemcpyBatchAsync.is_some())
            .field("ipc", &self.cuIpcOpenMemHandle.is_some())
            .field("vmm_ipc", &self.cuMemImportFromShareableHandle.is_some())
            .finish()
    }
}

/// `Ok` for `CUDA_SUCCESS`, else a typed error naming the call.
pub(crate) fn ok(r: CUresult, call: &str) -> Result<(), GpuError> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Driver(format!("{call}: {r:?}")))
    }
}

/// Resolves the table from `libcuda`, then `cuInit(0)`: once per process. A missing library
/// is [`GpuError::NoLibcuda`]; a missing required symbol names it.
pub(crate) fn api() -> Result<&'static CudaApi, GpuError> {
    static API: OnceLock<Result<CudaApi, GpuError>> = OnceLock::new();
    API.get_or_init(|| {
        // SAFETY: only tries to load the driver library; no driver call is made.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(GpuError::NoLibcuda);
        }
        // SAFETY: present (checked above), so this does not panic; the library stays loaded
        // for the process (a static), as the resolved pointers need.
        let lib = unsafe { cudarc::driver::sys::culib() };
        let api = resolve(lib)?;
        // SAFETY: the documented first call; flags must be 0.
        match unsafe { (api.cuInit)(0) } {
            CUresult::CUDA_SUCCESS => Ok(api),
            // A driver with every device hidden (CUDA_VISIBLE_DEVICES="") or none present.
            CUresult::CUDA_ERROR_NO_DEVICE => Err(GpuError::NoDevice),
            // The toolkit's stub library, not a driver.
            CUresult::CUDA_ERROR_STUB_LIBRARY => Err(GpuError::NoLibcuda),
            r => Err(GpuError::Driver(format!("cuInit: {r:?}"))),
        }
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Looks each entry point up by its exported (versioned) name.
fn resolve(lib: &'static libloading::Library) -> Result<CudaApi, GpuError> {
    macro_rules! required {
        ($name:literal) => {{
            // SAFETY: the symbol's C type is the field's type, as the CUDA headers declare it
            // for this exported (versioned) name.
            match unsafe { lib.get(concat!($name, "\0").as_bytes()) } {
                Ok(sym) => *sym,
                Err(_) => {
                    return Err(GpuError::Driver(format!(
                        "the CUDA driver lacks {} (too old a driver: kvferry needs R450 or newer)",
                        $name
                    )))
                }
            }
        }};
    }
    macro_rules! optional {
        ($name:literal) => {{
            // SAFETY: as above; absent on older drivers.
            unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                .ok()
                .map(|sym| *sym)
        }};
    }
    Ok(CudaApi {
        cuInit: required!("cuInit"),
        cuDeviceGetCount: required!("cuDeviceGetCount"),
        cuDeviceGet: required!("cuDeviceGet"),
        cuDeviceGetAttribute: required!("cuDeviceGetAttribute"),
        cuDeviceGetName: required!("cuDeviceGetName"),
        cuDeviceGetPCIBusId: required!("cuDeviceGetPCIBusId"),
        cuDevicePrimaryCtxRetain: required!("cuDevicePrimaryCtxRetain"),
        cuDevicePrimaryCtxRelease: required!("cuDevicePrimaryCtxRelease_v2"),
        cuDevicePrimaryCtxGetState: required!("cuDevicePrimaryCtxGetState"),
        cuCtxPushCurrent: required!("cuCtxPushCurrent_v2"),
        cuCtxPopCurrent: required!("cuCtxPopCurrent_v2"),
        cuStreamCreate: required!("cuStreamCreate"),
        cuStreamDestroy: required!("cuStreamDestroy_v2"),
        cuStreamSynchronize: required!("cuStreamSynchronize"),
        cuEventCreate: required!("cuEventCreate"),
        cuEventRecord: required!("cuEventRecord"),
        cuEventQuery: required!("cuEventQuery"),
        cuEventDestroy: required!("cuEventDestroy_v2"),
        cuMemcpyDtoHAsync: required!("cuMemcpyDtoHAsync_v2"),
        cuMemcpyHtoDAsync: required!("cuMemcpyHtoDAsync_v2"),
        cuMemcpy2DAsync: required!("cuMemcpy2DAsync_v2"),
        cuMemHostRegister: required!("cuMemHostRegister_v2"),
        cuMemHostUnregister: required!("cuMemHostUnregister"),
        cuPointerGetAttribute: required!("cuPointerGetAttribute"),
        cuMemGetAddressRange: required!("cuMemGetAddressRange_v2"),
        cuMemGetHandleForAddressRange: optional!("cuMemGetHandleForAddressRange"),
        cuMemcpyBatchAsync: optional!("cuMemcpyBatchAsync"),
        cuFlushGPUDirectRDMAWrites: optional!("cuFlushGPUDirectRDMAWrites"),
        cuIpcGetMemHandle: optional!("cuIpcGetMemHandle"),
        cuIpcOpenMemHandle: optional!("cuIpcOpenMemHandle_v2"),
        cuIpcCloseMemHandle: optional!("cuIpcCloseMemHandle"),
        cuMemRetainAllocationHandle: optional!("cuMemRetainAllocationHandle"),
        cuMemRelease: optional!("cuMemRelease"),
        cuMemExportToShareableHandle: optional!("cuMemExportToShareableHandle"),
        cuMemImportFromShareableHandle: optional!("cuMemImportFromShareableHandle"),
        cuMemAddressReserve: optional!("cuMemAddressReserve"),
        cuMemAddressFree: optional!("cuMemAddressFree"),
        cuMemMap: optional!("cuMemMap"),
        cuMemUnmap: optional!("cuMemUnmap"),
        cuMemSetAccess: optional!("cuMemSetAccess"),
        cuMemcpyDtoDAsync: optional!("cuMemcpyDtoDAsync_v2"),
    })
}

/// What kvferry holds of the driver right now, process-wide (the GPU check's fault run
/// counts it before and after).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// Primary contexts retained.
    pub contexts: i64,
    /// Host buffers page-locked.
    pub pinned: i64,
    /// Copy streams.
    pub streams: i64,
}

pub(crate) static CONTEXTS: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);
pub(crate) static PINNED: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);
pub(crate) static STREAMS: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

/// What kvferry holds of the driver right now.
pub fn held() -> Held {
    use std::sync::atomic::Ordering::SeqCst;
    Held {
        contexts: CONTEXTS.load(SeqCst),
        pinned: PINNED.load(SeqCst),
        streams: STREAMS.load(SeqCst),
    }
}

/// A device's primary context, retained (never made current for good): the one CUDA
/// context torch and every other runtime API user of that device shares. Released on drop.
#[derive(Debug)]
pub(crate) struct DeviceContext {
    api: &'static CudaApi,
    ordinal: u32,
    device: CUdevice,
    ctx: CUcontext,
}

// SAFETY: a primary context may be pushed on any thread; the handle is only an address the
// driver hands back, and every use goes through the driver.
unsafe impl Send for DeviceContext {}
// SAFETY: as above.
unsafe impl Sync for DeviceContext {}

impl DeviceContext {
    /// Retains device `ordinal`'s primary context without making it current anywhere.
    pub(crate) fn retain(api: &'static CudaApi, ordinal: u32) -> Result<Self, GpuError> {
        let device = device(api, ordinal)?;
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle; does not change this thread's current context.
        ok(
            unsafe { (api.cuDevicePrimaryCtxRetain)(&mut ctx, device) },
            "cuDevicePrimaryCtxRetain",
        )?;
        CONTEXTS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(DeviceContext {
            api,
            ordinal,
            device,
            ctx,
        })
    }

    /// Makes the context current on this thread until the guard drops, which restores what
    /// was current before.
    pub(crate) fn enter(&self) -> Result<Entered<'_>, GpuError> {
        // SAFETY: pushes a retained (live) context on this thread's stack; `Entered` pops it.
        ok(
            unsafe { (self.api.cuCtxPushCurrent)(self.ctx) },
            "cuCtxPushCurrent",
        )?;
        Ok(Entered {
            api: self.api,
            _ctx: self,
        })
    }

    /// One integer attribute of the device (no context needed).
    pub(crate) fn attribute(&self, which: CUdevice_attribute) -> Result<i32, GpuError> {
        let mut value: c_int = 0;
        // SAFETY: writes one int.
        ok(
            unsafe { (self.api.cuDeviceGetAttribute)(&mut value, which, self.device) },
            "cuDeviceGetAttribute",
        )?;
        Ok(value)
    }

    /// The device ordinal.
    pub(crate) fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The driver's table this context was made with.
    pub(crate) fn api(&self) -> &'static CudaApi {
        self.api
    }

    /// The device handle.
    pub(crate) fn device(&self) -> CUdevice {
        self.device
    }
}

impl Drop for DeviceContext {
    fn drop(&mut self) {
        // SAFETY: releases the one retain `retain` made.
        let _ = unsafe { (self.api.cuDevicePrimaryCtxRelease)(self.device) };
        CONTEXTS.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A context pushed by [`DeviceContext::enter`]; popped on drop.
#[derive(Debug)]
pub(crate) struct Entered<'a> {
    api: &'static CudaApi,
    _ctx: &'a DeviceContext,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        let mut popped: CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context `enter` pushed on this thread.
        let _ = unsafe { (self.api.cuCtxPopCurrent)(&mut popped) };
    }
}

/// The driver's handle of device `ordinal`.
pub(crate) fn device(api: &CudaApi, ordinal: u32) -> Result<CUdevice, GpuError> {
    let mut device: CUdevice = 0;
    let ordinal = c_int::try_from(ordinal)
        .map_err(|_| GpuError::Driver(format!("no CUDA device {ordinal}")))?;
    // SAFETY: writes one device handle.
    ok(
        unsafe { (api.cuDeviceGet)(&mut device, ordinal) },
        "cuDeviceGet",
    )?;
    Ok(device)
}

/// Devices the driver reports.
pub(crate) fn device_count(api: &CudaApi) -> Result<u32, GpuError> {
    let mut n: c_int = 0;
    // SAFETY: writes one int.
    ok(
        unsafe { (api.cuDeviceGetCount)(&mut n) },
        "cuDeviceGetCount",
    )?;
    Ok(n.max(0) as u32)
}

/// Whether some user of this process (torch, the embedder) already made device `ordinal`'s
/// primary context: retaining it then costs nothing and creates nothing.
pub(crate) fn primary_context_active(api: &CudaApi, ordinal: u32) -> Result<bool, GpuError> {
    let device = device(api, ordinal)?;
    let (mut flags, mut active): (c_uint, c_int) = (0, 0);
    // SAFETY: writes two ints; creates nothing.
    ok(
        unsafe { (api.cuDevicePrimaryCtxGetState)(device, &mut flags, &mut active) },
        "cuDevicePrimaryCtxGetState",
    )?;
    Ok(active != 0)
}

/// A NUL-terminated string the driver writes into a buffer of `N` bytes.
pub(crate) fn driver_string<const N: usize>(
    call: &str,
    f: impl FnOnce(*mut c_char, c_int) -> CUresult,
) -> Result<String, GpuError> {
    let mut buf = [0 as c_char; N];
    ok(f(buf.as_mut_ptr(), N as c_int), call)?;
    buf[N - 1] = 0;
    // SAFETY: NUL-terminated within `buf` (forced above).
    let s = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Ok(s.to_string_lossy().into_owned())
}
