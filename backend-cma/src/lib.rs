//! `kvferry-cma`: kvferry's same-host data plane over cross-memory attach.
//!
//! Owns what moving bytes between two processes of one host without the network stack
//! takes: who counts as "the same host" ([`HostIdentity`]: boot id and PID namespace, so two
//! hosts or two containers never match by accident), the messages two peers exchange over
//! the control channel to open, fence and refuse the path ([`CmaMessage`], laid out in
//! `docs/PROTOCOL.md`, "Same-host path"), the ptrace permission a receiver grants its writer
//! ([`PtracePolicy`]), and the copies themselves: `process_vm_writev` from this process's
//! memory straight into the peer's registered regions, scatter-gather and batched to the
//! kernel's iovec limit, never outside what the peer announced ([`CmaTarget`]). Device
//! memory on the same host is announced here too ([`DeviceRegion`]: a CUDA IPC export); its
//! copies are the copy engine's (`kvferry_memory::CopyEngine::copy_to_peer`).
//!
//! Like every backend it moves bytes; it never decides a retry, a timeout or a room's fate:
//! each copy's error says what happened ([`CmaError`]) and the driver hands the core the
//! outcome.

mod copy;
mod host;
mod message;

pub use copy::{pins_every_row, CmaError, CmaTarget, COPY_THREADS, IOV_MAX, ROW_PIN_MIN};
pub use host::{HostIdentity, PtracePolicy, PtraceScope};
pub use message::{CmaMessage, CmaRegion, Decline, DeviceRegion, MessageError, Offer, Open, TAG};
