//! A fake CUDA driver for tests on machines without a GPU: the same table of entry points,
//! over host memory, recording what the node asked of it. Each thread has its own context
//! stack, as with the real driver, and the table has no way to set a context current for
//! good: what a test sees on its thread is what the node left there.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::{Mutex, MutexGuard};

use cudarc::driver::sys::{
    CUcontext, CUdevice, CUdevice_attribute, CUdeviceptr, CUevent, CUflushGPUDirectRDMAWritesScope,
    CUflushGPUDirectRDMAWritesTarget, CUipcMemHandle, CUmemAccessDesc, CUmemAccess_flags,
    CUmemAllocationHandleType, CUmemGenericAllocationHandle, CUmemRangeHandleType,
    CUmemcpyAttributes, CUmemcpySrcAccessOrder, CUmemorytype, CUpointer_attribute, CUresult,
    CUstream, CUDA_MEMCPY2D,
};

use crate::driver::CudaApi;

mod ipc;
use ipc::*;

/// What the fake driver was asked, and what it answers.
#[derive(Debug, Default)]
pub(crate) struct FakeState {
    /// Devices it reports.
    pub devices: u32,
    /// Per device: `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`.
    pub ordering: Vec<i32>,
    /// Per device: `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
    pub dma_buf: Vec<i32>,
    /// Per device: whether someone made its primary context before the node.
    pub active: Vec<bool>,
    /// Per device: retains minus releases of its primary context.
    pub retained: Vec<i32>,
    /// Devices whose primary context was ever retained.
    pub touched: Vec<u32>,
    /// Fake device allocations: `(base, len, device)`.
    pub allocations: Vec<(u64, usize, u32)>,
    /// Pointer queries fail with `INVALID_CONTEXT` on a thread with no context current.
    pub pointers_need_context: bool,
    /// Events never complete (a lost batch).
    pub hang: bool,
    /// Linear copy calls.
    pub copies: u64,
    /// 2D copy calls (and rows in them).
    pub copies_2d: u64,
    /// Rows moved by 2D copies.
    pub rows: u64,
    /// Calls made with no context current (each is a bug: the real driver fails them).
    pub without_context: Vec<&'static str>,
    /// Streams and events alive.
    pub streams: i64,
    /// Events alive.
    pub events: i64,
    /// Host buffers registered and not unregistered.
    pub pinned: i64,
    /// `cuFlushGPUDirectRDMAWrites` calls.
    pub flushes: u64,
    /// `cuMemcpyBatchAsync` calls, and the copies in them.
    pub batches: u64,
    /// Copies made by batched calls.
    pub batched: u64,
    /// Allocations exported for IPC (their bases).
    pub exported: Vec<u64>,
    /// `cuIpcOpenMemHandle` calls, and mappings not closed yet.
    pub ipc_opens: u64,
    /// Mappings open (opens minus closes).
    pub ipc_open: i64,
    /// `cuIpcOpenMemHandle` fails with this (no peer access).
    pub ipc_refused: bool,
    /// Device-to-device copy calls.
    pub copies_dtod: u64,
    /// Bases of the allocations the VMM API made (no legacy IPC handle; a file descriptor).
    pub vmm: Vec<u64>,
    /// VMM handle references taken (retained or imported) and not released.
    pub vmm_refs: i64,
    /// VMM allocations exported as file descriptors, and imported from them.
    pub vmm_exports: u64,
    /// VMM imports.
    pub vmm_imports: u64,
    /// Reservations mapped over an imported allocation: `(address, size, allocation base)`.
    pub vmm_maps: Vec<(u64, usize, u64)>,
    /// Reservations made and not freed.
    pub reserved: i64,
    /// The next reservation's address.
    pub next_reservation: u64,
}

/// Where an address of a reservation mapped over an allocation reaches that allocation (the
/// fake's memory is host memory at the allocation's own address).
fn resolve(addr: u64) -> u64 {
    state(|s| {
        s.vmm_maps
            .iter()
            .find(|(va, size, _)| addr >= *va && addr < *va + *size as u64)
            .map_or(addr, |(va, _, base)| base + (addr - va))
    })
}

static STATE: Mutex<Option<FakeState>> = Mutex::new(None);
static SERIAL: Mutex<()> = Mutex::new(());

thread_local! {
    static STACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on the fake's state.
pub(crate) fn state<T>(f: impl FnOnce(&mut FakeState) -> T) -> T {
    let mut s = STATE.lock().unwrap_or_else(|e| e.into_inner());
    f(s.get_or_insert_with(FakeState::default))
}

/// The context current on this thread (0: none).
pub(crate) fn current() -> usize {
    STACK.with(|s| s.borrow().last().copied().unwrap_or(0))
}

/// How deep this thread's context stack is.
pub(crate) fn depth() -> usize {
    STACK.with(|s| s.borrow().len())
}

/// Pushes a context of the test's own (the embedder's, e.g. torch's).
pub(crate) fn push_own(ctx: usize) {
    STACK.with(|s| s.borrow_mut().push(ctx));
}

/// A fresh fake with `devices` devices (ordering: owner; dma-buf: supported), for one test at
/// a time: hold the guard for the test.
pub(crate) fn reset(devices: u32) -> MutexGuard<'static, ()> {
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // The last test's engine lets go of its contexts on its completion threads: wait for it.
    let t0 = std::time::Instant::now();
    while state(|s| s.retained.iter().any(|r| *r != 0))
        && t0.elapsed() < std::time::Duration::from_secs(10)
    {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let n = devices as usize;
    *STATE.lock().unwrap_or_else(|e| e.into_inner()) = Some(FakeState {
        devices,
        ordering: vec![100; n],
        dma_buf: vec![1; n],
        active: vec![false; n],
        retained: vec![0; n],
        ..FakeState::default()
    });
    STACK.with(|s| s.borrow_mut().clear());
    guard
}

/// The fake table of a driver new enough for batched copies (CUDA 12.8+).
pub(crate) fn api_batched() -> &'static CudaApi {
    let mut api = *api(true, true);
    api.cuMemcpyBatchAsync = Some(cuMemcpyBatchAsync);
    Box::leak(Box::new(api))
}

/// The fake table; `export` and `flush` say whether the driver has those optional calls (it
/// has no batched copy).
pub(crate) fn api(export: bool, flush: bool) -> &'static CudaApi {
    Box::leak(Box::new(CudaApi {
        cuInit,
        cuDeviceGetCount,
        cuDeviceGet,
        cuDeviceGetAttribute,
        cuDeviceGetName,
        cuDeviceGetPCIBusId,
        cuDevicePrimaryCtxRetain,
        cuDevicePrimaryCtxRelease,
        cuDevicePrimaryCtxGetState,
        cuCtxPushCurrent,
        cuCtxPopCurrent,
        cuStreamCreate,
        cuStreamDestroy,
        cuStreamSynchronize,
        cuEventCreate,
        cuEventRecord,
        cuEventQuery,
        cuEventDestroy,
        cuMemcpyDtoHAsync,
        cuMemcpyHtoDAsync,
        cuMemcpy2DAsync,
        cuMemHostRegister,
        cuMemHostUnregister,
        cuPointerGetAttribute,
        cuMemGetAddressRange,
        cuMemGetHandleForAddressRange: export.then_some(cuMemGetHandleForAddressRange as _),
        cuMemcpyBatchAsync: None,
        cuFlushGPUDirectRDMAWrites: flush.then_some(cuFlushGPUDirectRDMAWrites as _),
        cuIpcGetMemHandle: Some(cuIpcGetMemHandle),
        cuIpcOpenMemHandle: Some(cuIpcOpenMemHandle),
        cuIpcCloseMemHandle: Some(cuIpcCloseMemHandle),
        cuMemRetainAllocationHandle: Some(cuMemRetainAllocationHandle),
        cuMemRelease: Some(cuMemRelease),
        cuMemExportToShareableHandle: Some(cuMemExportToShareableHandle),
        cuMemImportFromShareableHandle: Some(cuMemImportFromShareableHandle),
        cuMemAddressReserve: Some(cuMemAddressReserve),
        cuMemAddressFree: Some(cuMemAddressFree),
        cuMemMap: Some(cuMemMap),
        cuMemUnmap: Some(cuMemUnmap),
        cuMemSetAccess: Some(cuMemSetAccess),
        cuMemcpyDtoDAsync: Some(cuMemcpyDtoDAsync),
    }))
}

const OK: CUresult = CUresult::CUDA_SUCCESS;

/// The fake context of device `d`.
fn ctx_of(d: CUdevice) -> usize {
    0x1000 * (d as usize + 1)
}

/// `OK` if a context is current, else records `call` as made without one.
fn in_context(call: &'static str) -> CUresult {
    if current() == 0 {
        state(|s| s.without_context.push(call));
        return CUresult::CUDA_ERROR_INVALID_CONTEXT;
    }
    OK
}

#[allow(non_snake_case)]
unsafe extern "C" fn cuInit(_: c_uint) -> CUresult {
    OK
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CUresult {
    // SAFETY: the caller passes a valid pointer (the driver's contract).
    unsafe { *n = state(|s| s.devices) as c_int };
    OK
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuDeviceGet(d: *mut CUdevice, ordinal: c_int) -> CUresult {
    if ordinal < 0 || ordinal as u32 >= state(|s| s.devices) {
        return CUresult::CUDA_ERROR_INVALID_DEVICE;
    }
    // SAFETY: as above.
    unsafe { *d = ordinal };
    OK
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuDeviceGetAttribute(
    v: *mut c_int,
    which: CUdevice_attribute,
    d: CUdevice,
) -> CUresult {
    let value = state(|s| match which {
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING => {
            s.ordering[d as usize]
        }
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED => s.dma_buf[d as usize],
        _ => 0,
    });
    // SAFETY: as above.
    unsafe { *v = value };
    OK
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuDeviceGetName(buf: *mut c_char, len: c_int, d: CUdevice) -> CUresult {
    write_str(buf, len, &format!("Fake GPU {d}"))
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuDeviceGetPCIBusId(buf: *mut c_char, len: c_int, d: CUdevice) -> CUresult {
    write_str(buf, len, &format!("0000:{:02X}:00.0", 0x3B + d))
}
fn write_str(buf: *mut c_char, len: c_int, s: &str) -> CUresult {
    let bytes = s.as_bytes();
    let n = bytes.len().min(len as usize - 1);
    for (i, b) in bytes[..n].iter().enumerate() {
        // SAFETY: within the caller's `len` bytes.
        unsafe { *buf.add(i) = *b as c_char };
    }
    // SAFETY: as above.
    unsafe { *buf.add(n) = 0 };
    OK
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuDevicePrimaryCtxRetain(c: *mut CUcontext, d: CUdevice) -> CUresult {
    state(|s| {
        s.retained[d as usize] += 1;
        if !s.touched.contains(&(d as u32)) {
            s.touched.push(d as u32);
        }
    });
    // SAFETY: as above.
    unsafe { *c = ctx_of(d) as CUcontext };
    OK
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuDevicePrimaryCtxRelease(d: CUdevice) -> CUresult {
    state(|s| {
        if let Some(r) = s.retained.get_mut(d as usize) {
            *r -= 1;
        }
    });
    OK
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    d: CUdevice,
    flags: *mut c_uint,
    active: *mut c_int,
) -> CUresult {
    let a = state(|s| s.active[d as usize]);
    // SAFETY: as above.
    unsafe {
        *flags = 0;
        *active = c_int::from(a);
    }
    OK
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuCtxPushCurrent(c: CUcontext) -> CUresult {
    STACK.with(|s| s.borrow_mut().push(c as usize));
    OK
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuCtxPopCurrent(c: *mut CUcontext) -> CUresult {
    match STACK.with(|s| s.borrow_mut().pop()) {
        Some(top) => {
            // SAFETY: as above.
            unsafe { *c = top as CUcontext };
            OK
        }
        None => CUresult::CUDA_ERROR_INVALID_CONTEXT,
    }
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuStreamCreate(st: *mut CUstream, _: c_uint) -> CUresult {
    let r = in_context("cuStreamCreate");
    if r == OK {
        state(|s| s.streams += 1);
        // SAFETY: as above.
        unsafe { *st = 0x51 as CUstream };
    }
    r
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuStreamDestroy(_: CUstream) -> CUresult {
    state(|s| s.streams -= 1);
    in_context("cuStreamDestroy")
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuStreamSynchronize(_: CUstream) -> CUresult {
    in_context("cuStreamSynchronize")
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuEventCreate(e: *mut CUevent, _: c_uint) -> CUresult {
    let r = in_context("cuEventCreate");
    if r == OK {
        state(|s| s.events += 1);
        // SAFETY: as above.
        unsafe { *e = 0xE0 as CUevent };
    }
    r
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuEventRecord(_: CUevent, _: CUstream) -> CUresult {
    in_context("cuEventRecord")
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuEventQuery(_: CUevent) -> CUresult {
    let r = in_context("cuEventQuery");
    if r != OK {
        return r;
    }
    if state(|s| s.hang) {
        CUresult::CUDA_ERROR_NOT_READY
    } else {
        OK
    }
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuEventDestroy(_: CUevent) -> CUresult {
    state(|s| s.events -= 1);
    in_context("cuEventDestroy")
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuMemcpyDtoHAsync(
    dst: *mut c_void,
    src: CUdeviceptr,
    len: usize,
    _: CUstream,
) -> CUresult {
    let r = in_context("cuMemcpyDtoHAsync");
    if r == OK {
        state(|s| s.copies += 1);
        // SAFETY: fake device memory is host memory the test owns.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.cast::<u8>(), len) };
    }
    r
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuMemcpyHtoDAsync(
    dst: CUdeviceptr,
    src: *const c_void,
    len: usize,
    _: CUstream,
) -> CUresult {
    let r = in_context("cuMemcpyHtoDAsync");
    if r == OK {
        state(|s| s.copies += 1);
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(src.cast::<u8>(), dst as *mut u8, len) };
    }
    r
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuMemcpyDtoDAsync(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    len: usize,
    _: CUstream,
) -> CUresult {
    let r = in_context("cuMemcpyDtoDAsync");
    if r == OK {
        state(|s| s.copies_dtod += 1);
        // SAFETY: fake device memory is host memory the test owns.
        unsafe {
            std::ptr::copy_nonoverlapping(resolve(src) as *const u8, resolve(dst) as *mut u8, len)
        };
    }
    r
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuMemcpy2DAsync(p: *const CUDA_MEMCPY2D, _: CUstream) -> CUresult {
    let r = in_context("cuMemcpy2DAsync");
    if r != OK {
        return r;
    }
    // SAFETY: the caller passes a valid descriptor.
    let p = unsafe { &*p };
    let src = match p.srcMemoryType {
        CUmemorytype::CU_MEMORYTYPE_DEVICE => p.srcDevice as usize,
        _ => p.srcHost as usize,
    };
    let dst = match p.dstMemoryType {
        CUmemorytype::CU_MEMORYTYPE_DEVICE => p.dstDevice as usize,
        _ => p.dstHost as usize,
    };
    if p.WidthInBytes > p.srcPitch
        || p.WidthInBytes > p.dstPitch
        || p.srcMemoryType == p.dstMemoryType
    {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    for r in 0..p.Height {
        // SAFETY: as above, row by row.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (src + r * p.srcPitch) as *const u8,
                (dst + r * p.dstPitch) as *mut u8,
                p.WidthInBytes,
            )
        };
    }
    state(|s| {
        s.copies_2d += 1;
        s.rows += p.Height as u64;
    });
    OK
}
#[allow(non_snake_case, clippy::too_many_arguments)]
unsafe extern "C" fn cuMemcpyBatchAsync(
    dsts: *mut CUdeviceptr,
    srcs: *mut CUdeviceptr,
    sizes: *mut usize,
    count: usize,
    attrs: *mut CUmemcpyAttributes,
    attr_index: *mut usize,
    attrs_len: usize,
    _failed: *mut usize,
    _: CUstream,
) -> CUresult {
    let r = in_context("cuMemcpyBatchAsync");
    if r != OK {
        return r;
    }
    // SAFETY: the caller passes arrays of the lengths it names.
    let (attrs, attr_index) = unsafe {
        (
            std::slice::from_raw_parts(attrs, attrs_len),
            std::slice::from_raw_parts(attr_index, attrs_len),
        )
    };
    if attrs.is_empty()
        || attr_index[0] != 0
        || attrs[0].srcAccessOrder != CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    for i in 0..count {
        // SAFETY: as above; fake device memory is host memory the test owns.
        unsafe {
            std::ptr::copy_nonoverlapping(
                resolve(*srcs.add(i)) as *const u8,
                resolve(*dsts.add(i)) as *mut u8,
                *sizes.add(i),
            )
        };
    }
    state(|s| {
        s.batches += 1;
        s.batched += count as u64;
    });
    OK
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuMemHostRegister(_: *mut c_void, _: usize, _: c_uint) -> CUresult {
    let r = in_context("cuMemHostRegister");
    if r == OK {
        state(|s| s.pinned += 1);
    }
    r
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuMemHostUnregister(_: *mut c_void) -> CUresult {
    let r = in_context("cuMemHostUnregister");
    if r == OK {
        state(|s| s.pinned -= 1);
    }
    r
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuPointerGetAttribute(
    v: *mut c_void,
    which: CUpointer_attribute,
    ptr: CUdeviceptr,
) -> CUresult {
    if current() == 0 && state(|s| s.pointers_need_context) {
        return CUresult::CUDA_ERROR_INVALID_CONTEXT;
    }
    let Some(device) = state(|s| {
        s.allocations
            .iter()
            .find(|(b, l, _)| ptr >= *b && ptr < *b + *l as u64)
            .map(|a| a.2)
    }) else {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    };
    match which {
        // SAFETY: the attribute's C type is unsigned int.
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE => unsafe {
            *v.cast::<u32>() = CUmemorytype::CU_MEMORYTYPE_DEVICE as u32
        },
        // SAFETY: the attribute's C type is int.
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL => unsafe {
            *v.cast::<i32>() = device as i32
        },
        _ => return CUresult::CUDA_ERROR_NOT_SUPPORTED,
    }
    OK
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuMemGetAddressRange(
    base: *mut CUdeviceptr,
    size: *mut usize,
    ptr: CUdeviceptr,
) -> CUresult {
    let r = in_context("cuMemGetAddressRange");
    if r != OK {
        return r;
    }
    let Some((b, l, _)) = state(|s| {
        s.allocations
            .iter()
            .find(|(b, l, _)| ptr >= *b && ptr < *b + *l as u64)
            .copied()
    }) else {
        return CUresult::CUDA_ERROR_NOT_FOUND;
    };
    // SAFETY: as above.
    unsafe {
        *base = b;
        *size = l;
    }
    OK
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuMemGetHandleForAddressRange(
    handle: *mut c_void,
    _: CUdeviceptr,
    _: usize,
    _: CUmemRangeHandleType,
    _: c_ulonglong,
) -> CUresult {
    let r = in_context("cuMemGetHandleForAddressRange");
    if r != OK {
        return r;
    }
    let Ok(file) = std::fs::File::open("/dev/null") else {
        return CUresult::CUDA_ERROR_UNKNOWN;
    };
    // SAFETY: the handle's C type is int (a file descriptor the caller then owns).
    unsafe { *handle.cast::<c_int>() = std::os::fd::IntoRawFd::into_raw_fd(file) };
    OK
}
#[allow(non_snake_case)]
unsafe extern "C" fn cuFlushGPUDirectRDMAWrites(
    _: CUflushGPUDirectRDMAWritesTarget,
    _: CUflushGPUDirectRDMAWritesScope,
) -> CUresult {
    let r = in_context("cuFlushGPUDirectRDMAWrites");
    if r == OK {
        state(|s| s.flushes += 1);
    }
    r
}
