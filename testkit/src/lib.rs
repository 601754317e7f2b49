//! `kvferry-testkit`: the reference embedder that the `kvferry` command and the integration
//! tests share. A synthetic model shape whose every page carries a pattern derived from
//! (room, layer, plane, page), a prefill half that serves it, a decode half that requests
//! rooms and verifies every byte, the report, the layerwise overlap and GPU demos, the fault
//! proxy and throwaway TLS certificates.
//!
//! It embeds kvferry exactly as a user would, through the driver's API; it never reaches into
//! the core's internals and is never a dependency of a kvferry library crate.

pub mod bench;
mod decode;
mod demo;
mod nodes;
pub mod overlap;
mod pattern;
mod pool;
mod prefill;
pub mod proxy;
mod report;
mod shape;
pub mod testcert;

pub use decode::*;
pub use demo::*;
pub use nodes::*;
pub use pattern::*;
use pool::Pool;
pub use prefill::*;
pub use report::*;
pub use shape::*;

pub use kvferry_tokio::{read_spin_from_vars, DataBackend, Node, SameHost};

#[cfg(feature = "gpu")]
pub mod gpu_demo;
#[cfg(feature = "gpu")]
pub use gpu_demo::gpu_overlap_demo;

/// `demo --gpu`: the overlap demo with KV in GPU memory. Without the `gpu` feature: a typed
/// answer that says how to get one, never a panic.
#[cfg(not(feature = "gpu"))]
pub async fn gpu_overlap_demo(
    _batch: &overlap::Batch,
    _core: kvferry_core::Config,
    _runtime: Runtime,
    _backend: DataBackend,
    _compute: std::time::Duration,
) -> Result<overlap::OverlapReport, String> {
    Err("this kvferry was built without GPU support: rebuild with `cargo build --release -p kvferry-cli --features gpu`, or run without --gpu".to_owned())
}
