//! Tests that need a GPU (feature `gpu`); each says clearly when it skips.
#![cfg(feature = "gpu")]
#![allow(clippy::unwrap_used)] // tests may panic

use std::time::Duration;

use kvferry_gpu::cuda::{probe, Gpu};
use kvferry_gpu::{GpuError, LayerEvent};

fn gpu() -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("SKIPPED: no usable GPU here ({e})");
            None
        }
    }
}

#[test]
fn no_gpu_is_a_typed_error_and_never_a_panic() {
    match probe() {
        Ok(info) => eprintln!("GPU present: {} device(s), {}", info.devices, info.name),
        Err(e) => assert!(
            matches!(
                e,
                GpuError::NoLibcuda | GpuError::NoDevice | GpuError::Driver(_)
            ),
            "{e:?}"
        ),
    }
}

#[test]
fn a_device_region_round_trips_through_the_copy_stream() {
    let Some(g) = gpu() else { return };
    let host: Vec<u8> = (0..(1 << 20)).map(|i| (i * 7 + 3) as u8).collect();
    let mut region = g.alloc(host.len()).unwrap();
    g.upload(&host, &mut region).unwrap();
    let mut back = vec![0u8; host.len()];
    g.download(&region, &mut back).unwrap();
    assert_eq!(back, host);
}

#[test]
fn an_event_completes_after_the_work_recorded_before_it() {
    let Some(g) = gpu() else { return };
    let _region = g.alloc(64 << 20).unwrap();
    let mut ev = g.record(g.compute_stream()).unwrap();
    let t0 = std::time::Instant::now();
    while !ev.poll_complete().unwrap() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "event never completed"
        );
        std::thread::sleep(Duration::from_micros(50));
    }
}
