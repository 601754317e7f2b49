//! `demo --gpu` end to end (feature `gpu`): on a host with an NVIDIA GPU, one batch with its
//! KV in GPU memory, a CUDA kernel per layer, staged layerwise and as a whole batch, every
//! byte checked after copying decode's device memory back. Without a GPU it must answer with
//! a typed reason, never a panic.
#![cfg(feature = "gpu")]
#![allow(clippy::unwrap_used)] // tests may panic

use std::time::Duration;

use kvferry_testkit::overlap::Batch;
use kvferry_testkit::{gpu_overlap_demo, Runtime, Shape};

fn batch() -> Batch {
    Batch {
        shape: Shape {
            layers: 4,
            page_bytes: 16 * 1024,
            pages_per_room: 16,
            ..Shape::default()
        },
        rooms: 4,
        first_room: 1,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gpu_overlap_demo_verifies_every_byte_or_says_why_it_cannot_run() {
    let fast = kvferry_core::Config::default();
    let batch = batch();
    let demo = gpu_overlap_demo(
        &batch,
        fast,
        Runtime::Tokio,
        Default::default(),
        Duration::from_millis(5),
    );
    match demo.await {
        Ok(report) => {
            eprintln!("{}", report.text());
            assert!(report.clean(), "{}", report.text());
            let pages = 4 * 4 * 2 * 16;
            assert!(report.runs.iter().all(|r| r.pages_verified == pages));
            assert!(report.staging_gbps.is_some_and(|(a, b)| a > 0.0 && b > 0.0));
        }
        Err(why) => {
            eprintln!("SKIPPED (no usable GPU here): {why}");
            assert!(
                why.contains("libcuda") || why.contains("GPU") || why.contains("NVRTC"),
                "a reason that names what is missing: {why}"
            );
        }
    }
}
