//! `kvferry-memory`: registered memory and the admission of writes into it.
//!
//! It owns the regions peers read from and write into ([`MemoryMap`], [`HostBuffer`]), what
//! memory each is (host, or a GPU's: [`MemoryKind`]), how device memory is reached (a
//! [`CopyEngine`] and its bounded pool of [`Staging`] buffers), and the question every data
//! plane asks before it lands bytes there ([`WriteCheck`]). Every backend
//! (TCP, RDMA, GPU) and every driver may depend on it; it depends on nothing but the core. It
//! never moves bytes over a wire and never decides a room's fate.

mod admission;
mod checksum;
mod copy_plan;
mod numa;
mod region;
mod staging;

pub use admission::WriteCheck;
pub use checksum::{Checksum, SliceSide};
pub use copy_plan::{copy_with_cpu, plan_copies, CopyCall, MAX_PITCH};
pub use numa::cpus_near;
pub use region::{page_size, AccessError, ExternalRegion, HostBuffer, MemoryMap, OutOfBounds};
pub use staging::{
    abandoned_copies, CopyCounts, CopyDirection, CopyDone, CopyEngine, CopyError, CopyJob, DmaBuf,
    HostCopyEngine, InFlightCopies, IpcExport, IpcHandleType, IpcMapping, MemoryKind, Staging,
    StagingBuffer, StagingConfig,
};
