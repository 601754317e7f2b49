//! Putting planned copies on a device's stream: one batched call for the contiguous runs
//! where the driver has it, a 2D copy per stride, one call for anything else.

use super::*;

/// Queues `calls` on `stream`: the contiguous runs in one batched call where the driver has
/// it and there are several (their destinations never overlap, so their order inside the
/// batch does not matter), each strided copy as one 2D copy, anything else one call each.
///
/// # Safety
///
/// As for [`queue`], for every call.
pub(super) unsafe fn queue_all(
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
pub(super) const MIN_2D_ROWS_BESIDE_A_BATCH: usize = 16;

/// The batched copy's entry point.
pub(super) type BatchFn = unsafe extern "C" fn(
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
pub(super) unsafe fn queue_batch(batch: BatchFn, stream: CUstream, runs: &[CopyJob]) -> CUresult {
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
pub(super) unsafe fn queue(
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
