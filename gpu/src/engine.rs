//! The CUDA copy engine of the staged data plane, and the check of what a registered pointer
//! really is. Thin on purpose: the pipeline around it (ordering, overlap, the bounded pool,
//! faults mid-copy) is `kvferry-tcp`'s and runs in CI over `kvferry_memory::HostCopyEngine`.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, CudaStream};
use kvferry_core::Region;
use kvferry_memory::{
    CopyDirection, CopyDone, CopyEngine, CopyError, CopyJob, DmaBuf, HostBuffer, MemoryKind,
    MemoryMap,
};

use crate::cuda::probe;
use crate::GpuError;

fn check(r: CUresult, what: &str) -> Result<(), CopyError> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CopyError(format!("{what}: {r:?}")))
    }
}

/// Makes `ctx` current on this thread until dropped, then restores what was current: the
/// engine runs on the embedder's threads (a Python thread that also runs torch) and must not
/// change the device they work on.
struct Current;

impl Current {
    fn push(ctx: &CudaContext) -> Result<Current, CopyError> {
        // SAFETY: pushes a live context (held by the engine) on this thread's stack.
        check(
            unsafe { sys::cuCtxPushCurrent_v2(ctx.cu_ctx()) },
            "cuCtxPushCurrent",
        )?;
        Ok(Current)
    }
}

impl Drop for Current {
    fn drop(&mut self) {
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context `push` pushed on this thread.
        let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
    }
}

/// One device's context and the stream its staging copies run on (in order).
struct DeviceCopies {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

/// Copies between device memory and staging buffers with `cuMemcpy*Async` on one copy
/// stream per device; a batch's completion is a host function queued behind its copies, so
/// no thread waits on the GPU.
pub struct CudaCopyEngine {
    devices: BTreeMap<u32, DeviceCopies>,
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
        probe()?;
        let mut map = BTreeMap::new();
        for &d in devices {
            let ctx =
                CudaContext::new(d as usize).map_err(|e| GpuError::Driver(format!("{e:?}")))?;
            let stream = ctx
                .new_stream()
                .map_err(|e| GpuError::Driver(format!("{e:?}")))?;
            map.insert(d, DeviceCopies { ctx, stream });
        }
        Ok(Arc::new(CudaCopyEngine { devices: map }))
    }

    /// An engine for every device `memory`'s regions live on.
    pub fn for_memory(memory: &MemoryMap) -> Result<Arc<Self>, GpuError> {
        let mut devices: Vec<u32> = memory
            .device_regions()
            .filter_map(|(_, k)| match k {
                MemoryKind::Cuda { device } => Some(device),
                MemoryKind::Host => None,
            })
            .collect();
        devices.sort_unstable();
        devices.dedup();
        Self::open(&devices)
    }

    fn any(&self) -> Option<&DeviceCopies> {
        self.devices.values().next()
    }
}

/// What a batch's stream callback receives.
struct Completion {
    done: CopyDone,
    result: Result<(), CopyError>,
}

/// A stream callback (not a host function: the driver skips host functions once the context
/// has an error, and the batch would never end; a callback runs with the error instead).
/// Makes no CUDA call.
unsafe extern "C" fn complete(_stream: sys::CUstream, status: CUresult, user: *mut c_void) {
    // SAFETY: `user` is the Box<Completion> leaked by `start` for exactly this one call.
    let c = unsafe { Box::from_raw(user.cast::<Completion>()) };
    let result = c.result.and(check(status, "copy stream"));
    (c.done)(result);
}

impl CopyEngine for CudaCopyEngine {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn start(&self, device: u32, direction: CopyDirection, jobs: Vec<CopyJob>, done: CopyDone) {
        let Some(dev) = self.devices.get(&device) else {
            done(Err(CopyError(format!(
                "no copy stream for CUDA device {device}"
            ))));
            return;
        };
        let current = match Current::push(&dev.ctx) {
            Ok(c) => c,
            Err(e) => {
                done(Err(e));
                return;
            }
        };
        let stream = dev.stream.cu_stream();
        let mut result = Ok(());
        for j in &jobs {
            // SAFETY: the staged paths pass ranges of registered device memory (bounds-checked
            // by MemoryMap) and of staging buffers they hold until `done` runs.
            let r = unsafe {
                match direction {
                    CopyDirection::DeviceToHost => sys::cuMemcpyDtoHAsync_v2(
                        j.dst as *mut c_void,
                        j.src as sys::CUdeviceptr,
                        j.len,
                        stream,
                    ),
                    CopyDirection::HostToDevice => sys::cuMemcpyHtoDAsync_v2(
                        j.dst as sys::CUdeviceptr,
                        j.src as *const c_void,
                        j.len,
                        stream,
                    ),
                }
            };
            if let Err(e) = check(r, "cuMemcpyAsync") {
                result = Err(e);
                break;
            }
        }
        let user = Box::into_raw(Box::new(Completion { done, result }));
        // SAFETY: `complete` takes the box back exactly once, after every copy queued above.
        let r = unsafe { sys::cuStreamAddCallback(stream, Some(complete), user.cast(), 0) };
        if r != CUresult::CUDA_SUCCESS {
            // SAFETY: the callback was not queued, so the box is still ours.
            let c = unsafe { Box::from_raw(user) };
            let waited = dev
                .stream
                .synchronize()
                .map_err(|e| CopyError(format!("{e:?}")));
            let result = c.result.and(waited).and(check(r, "cuStreamAddCallback"));
            (c.done)(result);
        }
        drop(current);
    }

    fn pin(&self, buffer: &mut HostBuffer) -> Result<(), CopyError> {
        let Some(dev) = self.any() else {
            return Ok(());
        };
        let _current = Current::push(&dev.ctx)?;
        let slice = buffer.as_mut_slice();
        // SAFETY: page-locks the buffer's own allocation, for every context (portable: copies
        // of any device see it pinned); `unpin` undoes it before it is freed.
        let r = unsafe {
            sys::cuMemHostRegister_v2(
                slice.as_mut_ptr().cast(),
                slice.len(),
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        check(r, "cuMemHostRegister")
    }

    fn pci_bus_id(&self, device: u32) -> Option<String> {
        let mut dev: sys::CUdevice = 0;
        // SAFETY: the driver was initialised when the engine opened; writes one handle.
        if unsafe { sys::cuDeviceGet(&mut dev, device as std::ffi::c_int) }
            != CUresult::CUDA_SUCCESS
        {
            return None;
        }
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: `buf` holds 32 bytes, the length passed; the driver NUL-terminates it. No
        // context is needed (nor made current).
        let r = unsafe {
            sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as std::ffi::c_int, dev)
        };
        if r != CUresult::CUDA_SUCCESS {
            return None;
        }
        // SAFETY: NUL-terminated within `buf` on success.
        let id = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
        // The driver writes `0000:3B:00.0`; sysfs names it in lower case.
        Some(id.to_string_lossy().to_lowercase())
    }

    fn export_dma_buf(&self, device: u32, addr: u64, len: usize) -> Result<DmaBuf, CopyError> {
        let Some(dev) = self.devices.get(&device) else {
            return Err(CopyError(format!("no context for CUDA device {device}")));
        };
        let _current = Current::push(&dev.ctx)?;
        // The whole allocation is exported: its base and size are page-aligned, as the export
        // requires, and the asked-for range lies inside it.
        let mut base: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: asks the driver which allocation holds `addr`; it writes the two values.
        check(
            unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) },
            "cuMemGetAddressRange",
        )?;
        if addr < base || addr - base + len as u64 > size as u64 {
            return Err(CopyError(format!(
                "{len} bytes at {addr:#x} do not lie in one CUDA allocation"
            )));
        }
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: exports a live allocation of this context; the driver writes one descriptor.
        let r = unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut std::ffi::c_int).cast(),
                base,
                size,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        check(r, "cuMemGetHandleForAddressRange(DMA_BUF_FD)")?;
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

    fn unpin(&self, buffer: &mut HostBuffer) {
        if let Some(dev) = self.any() {
            if let Ok(_current) = Current::push(&dev.ctx) {
                // SAFETY: the buffer was registered by `pin` and is not in use any more.
                let _ =
                    unsafe { sys::cuMemHostUnregister(buffer.as_mut_slice().as_mut_ptr().cast()) };
            }
        }
    }
}

/// What the driver says the memory at `ptr` is: host memory it does not know, or a device's.
pub fn pointer_kind(ptr: *const u8) -> Result<MemoryKind, GpuError> {
    probe()?;
    kind_of(ptr)
}

/// One attribute of `ptr` as the driver reports it (`T` is the attribute's C type: `u32`
/// for the memory type, `i32` for the device ordinal).
fn attribute<T: Default>(ptr: *const u8, which: sys::CUpointer_attribute) -> (CUresult, T) {
    let mut value = T::default();
    // SAFETY: asks the driver about an address; it writes one value of the attribute's type,
    // which the callers name as `T`.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut value as *mut T).cast(),
            which,
            ptr as sys::CUdeviceptr,
        )
    };
    (r, value)
}

/// [`pointer_kind`] once the driver is known to be loaded and initialised.
fn kind_of(ptr: *const u8) -> Result<MemoryKind, GpuError> {
    let (r, memory_type) = attribute::<u32>(
        ptr,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    );
    if r == CUresult::CUDA_ERROR_INVALID_VALUE {
        // Memory the driver never saw (plain malloc) is host memory.
        return Ok(MemoryKind::Host);
    }
    if r != CUresult::CUDA_SUCCESS {
        // Any other answer says nothing about the pointer: do not call it host memory.
        return Err(GpuError::Driver(format!("what memory {ptr:?} is: {r:?}")));
    }
    if memory_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return Ok(MemoryKind::Host);
    }
    let (r, ordinal) = attribute::<i32>(
        ptr,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
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

/// Asks the driver what every region of `memory` is and names the first registered as the
/// wrong kind (a device pointer registered as host would be read by the CPU).
pub fn check_kinds(memory: &MemoryMap) -> Result<Option<KindMismatch>, GpuError> {
    probe()?;
    for (region, registered) in memory.kinds() {
        let ptr = memory
            .range(region, 0, 0)
            .map_err(|e| GpuError::Driver(e.to_string()))?;
        let actual = kind_of(ptr)?;
        if actual != registered {
            return Ok(Some(KindMismatch {
                region,
                registered,
                actual,
            }));
        }
    }
    Ok(None)
}
