//! The fake driver's exports and imports between processes: legacy cudaIpc handles, and VMM
//! allocations as file descriptors mapped over reservations.

use super::*;

/// The fake's handle: `"fakeipc"` and the allocation's base.
pub(super) fn fake_handle(base: u64) -> CUipcMemHandle {
    // SAFETY: a zeroed handle is a valid value of this plain byte array.
    let mut h: CUipcMemHandle = unsafe { std::mem::zeroed() };
    for (c, b) in h
        .reserved
        .iter_mut()
        .zip(b"fakeipc\0".iter().chain(base.to_le_bytes().iter()))
    {
        *c = *b as _;
    }
    h
}
#[allow(non_snake_case)]
pub(super) unsafe extern "C" fn cuIpcGetMemHandle(
    out: *mut CUipcMemHandle,
    base: CUdeviceptr,
) -> CUresult {
    let r = in_context("cuIpcGetMemHandle");
    if r != OK {
        return r;
    }
    let known =
        state(|s| s.allocations.iter().any(|(b, _, _)| *b == base) && !s.vmm.contains(&base));
    if !known {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    state(|s| s.exported.push(base));
    // SAFETY: the caller passes a handle to write.
    unsafe { *out = fake_handle(base) };
    OK
}
#[allow(non_snake_case)]
pub(super) unsafe extern "C" fn cuIpcOpenMemHandle(
    out: *mut CUdeviceptr,
    handle: CUipcMemHandle,
    _flags: c_uint,
) -> CUresult {
    let r = in_context("cuIpcOpenMemHandle");
    if r != OK {
        return r;
    }
    if state(|s| s.ipc_refused) {
        return CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED;
    }
    let bytes: Vec<u8> = handle.reserved.iter().map(|c| *c as u8).collect();
    if &bytes[..8] != b"fakeipc\0" {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    let mut base = [0u8; 8];
    base.copy_from_slice(&bytes[8..16]);
    state(|s| {
        s.ipc_opens += 1;
        s.ipc_open += 1;
    });
    // SAFETY: the caller passes an address to write; the fake maps an allocation at its
    // own address (one address space).
    unsafe { *out = u64::from_le_bytes(base) };
    OK
}
#[allow(non_snake_case)]
pub(super) unsafe extern "C" fn cuIpcCloseMemHandle(_: CUdeviceptr) -> CUresult {
    let r = in_context("cuIpcCloseMemHandle");
    if r == OK {
        state(|s| s.ipc_open -= 1);
    }
    r
}
/// The VMM allocation holding `ptr`: its base and length.
pub(super) fn vmm_holding(ptr: u64) -> Option<(u64, usize)> {
    state(|s| {
        s.allocations
            .iter()
            .find(|(b, l, _)| ptr >= *b && ptr < *b + *l as u64 && s.vmm.contains(b))
            .map(|(b, l, _)| (*b, *l))
    })
}
#[allow(non_snake_case)]
pub(super) unsafe extern "C" fn cuMemRetainAllocationHandle(
    out: *mut CUmemGenericAllocationHandle,
    ptr: *mut c_void,
) -> CUresult {
    let r = in_context("cuMemRetainAllocationHandle");
    if r != OK {
        return r;
    }
    let Some((base, _)) = vmm_holding(ptr as u64) else {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    };
    state(|s| s.vmm_refs += 1);
    // SAFETY: the caller passes a handle to write; the fake's handle is the base.
    unsafe { *out = base };
    OK
}
#[allow(non_snake_case)]
pub(super) unsafe extern "C" fn cuMemRelease(_: CUmemGenericAllocationHandle) -> CUresult {
    let r = in_context("cuMemRelease");
    if r == OK {
        state(|s| s.vmm_refs -= 1);
    }
    r
}
#[allow(non_snake_case)]
pub(super) unsafe extern "C" fn cuMemExportToShareableHandle(
    out: *mut c_void,
    handle: CUmemGenericAllocationHandle,
    kind: CUmemAllocationHandleType,
    _: c_ulonglong,
) -> CUresult {
    let r = in_context("cuMemExportToShareableHandle");
    if r != OK {
        return r;
    }
    if kind != CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        || vmm_holding(handle).is_none()
    {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    // The descriptor is a memory file holding the allocation's base: an importer that reads
    // it got the exporter's descriptor, not a number that happens to match.
    // SAFETY: a name and flags; returns a new descriptor or -1.
    let fd = unsafe { libc::memfd_create(c"kvferry-fake-vmm".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return CUresult::CUDA_ERROR_UNKNOWN;
    }
    let bytes = handle.to_le_bytes();
    // SAFETY: writes 8 bytes from a local array to the descriptor just made.
    if unsafe { libc::pwrite(fd, bytes.as_ptr().cast(), 8, 0) } != 8 {
        return CUresult::CUDA_ERROR_UNKNOWN;
    }
    state(|s| s.vmm_exports += 1);
    // SAFETY: the handle's C type is int for this handle type.
    unsafe { *out.cast::<c_int>() = fd };
    OK
}
#[allow(non_snake_case)]
pub(super) unsafe extern "C" fn cuMemImportFromShareableHandle(
    out: *mut CUmemGenericAllocationHandle,
    os_handle: *mut c_void,
    kind: CUmemAllocationHandleType,
) -> CUresult {
    let r = in_context("cuMemImportFromShareableHandle");
    if r != OK {
        return r;
    }
    if kind != CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    let mut bytes = [0u8; 8];
    // SAFETY: reads 8 bytes into a local array from the descriptor the caller owns.
    if unsafe { libc::pread(os_handle as isize as c_int, bytes.as_mut_ptr().cast(), 8, 0) } != 8 {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    let base = u64::from_le_bytes(bytes);
    if vmm_holding(base).is_none() {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    state(|s| {
        s.vmm_refs += 1;
        s.vmm_imports += 1;
    });
    // SAFETY: the caller passes a handle to write.
    unsafe { *out = base };
    OK
}
#[allow(non_snake_case)]
pub(super) unsafe extern "C" fn cuMemAddressReserve(
    out: *mut CUdeviceptr,
    size: usize,
    _: usize,
    _: CUdeviceptr,
    _: c_ulonglong,
) -> CUresult {
    let r = in_context("cuMemAddressReserve");
    if r != OK {
        return r;
    }
    // Reservations lie far from any host allocation: a copy that used one unresolved
    // would fault, not land somewhere plausible.
    let va = state(|s| {
        s.reserved += 1;
        let va = 0x6000_0000_0000 + s.next_reservation;
        s.next_reservation += (size as u64).next_multiple_of(1 << 32);
        va
    });
    // SAFETY: the caller passes an address to write.
    unsafe { *out = va };
    OK
}
#[allow(non_snake_case)]
pub(super) unsafe extern "C" fn cuMemAddressFree(_: CUdeviceptr, _: usize) -> CUresult {
    let r = in_context("cuMemAddressFree");
    if r == OK {
        state(|s| s.reserved -= 1);
    }
    r
}
#[allow(non_snake_case)]
pub(super) unsafe extern "C" fn cuMemMap(
    va: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    _: c_ulonglong,
) -> CUresult {
    let r = in_context("cuMemMap");
    if r != OK {
        return r;
    }
    match vmm_holding(handle) {
        Some((base, len)) if base == handle && len == size && offset == 0 => {
            state(|s| s.vmm_maps.push((va, size, base)));
            OK
        }
        _ => CUresult::CUDA_ERROR_INVALID_VALUE,
    }
}
#[allow(non_snake_case)]
pub(super) unsafe extern "C" fn cuMemUnmap(va: CUdeviceptr, _: usize) -> CUresult {
    let r = in_context("cuMemUnmap");
    if r == OK {
        state(|s| s.vmm_maps.retain(|(v, _, _)| *v != va));
    }
    r
}
#[allow(non_snake_case)]
pub(super) unsafe extern "C" fn cuMemSetAccess(
    va: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    let r = in_context("cuMemSetAccess");
    if r != OK {
        return r;
    }
    // SAFETY: the caller passes `count` descriptors.
    let desc = unsafe { std::slice::from_raw_parts(desc, count) };
    let mapped = state(|s| s.vmm_maps.iter().any(|(v, l, _)| *v == va && *l == size));
    if !mapped
        || desc
            .iter()
            .any(|d| d.flags != CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    OK
}
