//! Memory of another process on this host: exported by the decode (cudaIpc handles, VMM
//! allocations as file descriptors), mapped by the prefill, unmapped with the last region.

use super::*;

/// Another process's allocation mapped into one device's context; unmapped on drop.
pub(super) struct Imported {
    pub(super) shared: Arc<DeviceShared>,
    /// Where the allocation starts here.
    pub(super) base: u64,
    /// How it was mapped.
    pub(super) how: Mapped,
}

/// How an [`Imported`] allocation was mapped, and so how it is unmapped.
pub(super) enum Mapped {
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
pub(super) fn descriptor_of(pid: u32, fd: i32) -> Result<std::os::fd::OwnedFd, CopyError> {
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

/// The VMM API's handle of the allocation mapped at `addr` (retained: the caller releases
/// it), or `None` for memory the VMM API did not map. The device's context must be entered.
pub(super) fn vmm_handle(api: &CudaApi, addr: u64) -> Option<CUmemGenericAllocationHandle> {
    let retain = api.cuMemRetainAllocationHandle?;
    let mut handle: CUmemGenericAllocationHandle = 0;
    // SAFETY: asks which VMM allocation is mapped at `addr`; the driver writes the handle.
    let r = unsafe { retain(&mut handle, addr as *mut c_void) };
    (r == CUresult::CUDA_SUCCESS).then_some(handle)
}

/// Drops one reference of a VMM handle. The device's context must be entered.
pub(super) fn release_vmm(api: &CudaApi, handle: CUmemGenericAllocationHandle) {
    if let Some(release) = api.cuMemRelease {
        // SAFETY: the handle holds a reference the caller took.
        let _ = unsafe { release(handle) };
    }
}

/// `len` bytes at `addr` of VMM-mapped memory, exported as one file descriptor per physical
/// allocation they span (each the whole allocation, mapped at its base). The device's
/// context must be entered.
pub(super) fn export_vmm(api: &CudaApi, addr: u64, len: u64) -> Result<Vec<IpcExport>, CopyError> {
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
pub(super) fn import_legacy(
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
pub(super) fn import_vmm(
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
pub(super) fn allocation_holding(
    api: &CudaApi,
    addr: u64,
    len: u64,
) -> Result<(u64, usize), CopyError> {
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

/// A `cuMemAlloc` allocation exported as a legacy cudaIpc handle, one piece.
pub(super) fn export_legacy(
    api: &CudaApi,
    addr: u64,
    len: u64,
) -> Result<Vec<IpcExport>, CopyError> {
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

impl CudaCopyEngine {
    /// Maps another process's exported piece into `device`'s context, sharing the mapping
    /// with every region of the same allocation.
    pub(super) fn import_from(
        &self,
        device: u32,
        owner: u32,
        export: &IpcExport,
    ) -> Result<IpcMapping, CopyError> {
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
}
