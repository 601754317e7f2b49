//! What a registered pointer really is (host memory, or which device's), checked against
//! what the embedder declared.

use super::*;

/// What the driver says the memory at `ptr` is: host memory it does not know, or a device's.
pub fn pointer_kind(ptr: *const u8) -> Result<MemoryKind, GpuError> {
    kind_of(api()?, ptr)
}

/// One attribute of `ptr` as the driver reports it (`T` is the attribute's C type: `u32`
/// for the memory type, `i32` for the device ordinal).
pub(super) fn attribute<T: Default>(
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
pub(super) fn kind_here(api: &CudaApi, ptr: *const u8) -> Result<MemoryKind, CUresult> {
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
