//! `kvferry-gpu`: what GPU-resident KV needs from kvferry.
//!
//! Owns layer readiness from GPU events ([`LayerWaiter`]: a dedicated thread polls each
//! layer's event and hands `(rooms, layer)` to the embedder's callback, which marks the layer
//! ready in the core; no runtime thread ever blocks on the GPU and the core never sees a CUDA
//! type), the overlap timeline of a layerwise transfer and its SVG drawing ([`Timeline`]),
//! and, behind the `gpu` feature, CUDA through `cudarc` with dynamic loading ([`cuda`]):
//! device regions, pinned staging and events, and the data plane's CUDA copy engine
//! ([`engine::CudaCopyEngine`]). Without the feature nothing loads or links
//! CUDA. Like every backend piece it moves bytes and time; decisions stay in the core.

mod error;
mod timeline;
mod waiter;

#[cfg(feature = "gpu")]
pub mod cuda;
#[cfg(feature = "gpu")]
mod driver;
#[cfg(feature = "gpu")]
pub mod engine;
#[cfg(all(test, feature = "gpu"))]
mod engine_tests;
#[cfg(all(test, feature = "gpu"))]
mod fake;

pub use error::GpuError;
pub use timeline::{LayerTimes, Span, Timeline};
pub use waiter::{LayerEvent, LayerWaiter, PollPolicy, Readiness};
