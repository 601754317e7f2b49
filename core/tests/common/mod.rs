//! Shared set-ups for the simulation tests.
#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use kvferry_core::sim::{fast_config, small_layout, Faults, Sim, Workload};
use kvferry_core::Config;

/// One prefill and one decode, connected and past the handshake.
pub fn pair(seed: u64, config: Config) -> (Sim, usize, usize) {
    let mut sim = Sim::new(seed, Faults::default());
    let layout = small_layout(4096);
    let p = sim.add_prefill(config.clone(), layout, 0, 0..layout.layers);
    let d = sim.add_decode(config, layout, 0);
    sim.connect(d, p);
    sim.run_for(Duration::from_millis(5), 10_000).expect("handshake");
    (sim, p, d)
}

/// Two prefill ranks (PP stages splitting the layers) and two decode ranks, fully connected.
pub fn cluster(seed: u64, config: Config, faults: Faults) -> (Sim, Vec<usize>, Vec<usize>) {
    let mut sim = Sim::new(seed, faults);
    let layout = small_layout(2048);
    let p0 = sim.add_prefill(config.clone(), layout, 0, 0..2);
    let p1 = sim.add_prefill(config.clone(), layout, 1, 2..4);
    let d0 = sim.add_decode(config.clone(), layout, 0);
    let d1 = sim.add_decode(config, layout, 1);
    for d in [d0, d1] {
        for p in [p0, p1] {
            sim.connect(d, p);
        }
    }
    sim.run_for(Duration::from_millis(5), 10_000).expect("handshake");
    (sim, vec![p0, p1], vec![d0, d1])
}

/// Runs a workload to completion and asserts the universal invariants.
pub fn run_workload(sim: &mut Sim, w: Workload, max_steps: u64) {
    sim.start_workload(w);
    let r = sim.run_until(max_steps, |s| s.workload_done());
    assert_eq!(r, Ok(()), "outcomes so far: {:?}", sim.workload_outcomes());
    assert_invariants(sim);
}

/// No violation, counters agree with events, nothing left behind.
pub fn assert_invariants(sim: &Sim) {
    assert!(sim.violations.is_empty(), "violations: {:#?}", &sim.violations[..sim.violations.len().min(20)]);
    let mismatches = sim.counter_mismatches();
    assert!(mismatches.is_empty(), "counter mismatches: {mismatches:#?}");
}

/// The default fast configuration.
pub fn config() -> Config {
    fast_config()
}
