//! `kvferry-memory`: registered memory and the admission of writes into it.
//!
//! It owns the regions peers read from and write into ([`MemoryMap`], [`HostBuffer`]) and the
//! question every data plane asks before it lands bytes there ([`WriteCheck`]). Every backend
//! (TCP, RDMA, GPU) and every driver may depend on it; it depends on nothing but the core. It
//! never moves bytes over a wire and never decides a room's fate.

mod admission;
mod region;

pub use admission::WriteCheck;
pub use region::{HostBuffer, MemoryMap, OutOfBounds, PAGE_ALIGN};
