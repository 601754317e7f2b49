//! `kvferry-rdma`: kvferry's RDMA verbs backend.
//!
//! Owns what RDMA adds to the data plane: how a work completion's status maps to the core's
//! transfer outcomes ([`classify`], documented table in `docs/PROTOCOL.md`), the queue-pair
//! lifecycle in which the core's fence is "move the session's QPs to the error state and
//! drain them" ([`QpLifecycle`]), the fields both sides exchange over the control channel to
//! connect RC queue pairs and to write into each other's registered regions
//! ([`RdmaHello`]), and, behind the `rdma` feature, device discovery through `rdma-sys` with a
//! typed error when there is no device, no kernel support or no `libibverbs`
//! ([`device`]). Like every backend it moves bytes; it never decides a retry, a timeout or a
//! room's fate.
//!
//! Nothing here links a native library: with the `rdma` feature libibverbs is loaded at run
//! time (the first device lookup), so every build starts on machines without rdma-core and
//! a node that asks for RDMA there gets [`device::RdmaError::NoLibrary`].

mod handshake;
mod qp;
pub mod topology;
mod wc;

#[cfg(feature = "rdma")]
pub mod device;
#[cfg(feature = "rdma")]
mod ffi;
#[cfg(feature = "rdma")]
pub mod link;
#[cfg(feature = "rdma")]
pub mod verbs;

pub use handshake::{writable, HandshakeError, RdmaHello, RemoteRegion, PSN_MASK};
pub use qp::{QpError, QpLifecycle, QpState};
pub use wc::{classify, WcStatus};
