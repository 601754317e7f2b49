//! Simulation soak: 10,000 rooms over 2 prefill PP stages and 2 decode ranks with 5 %
//! transient data-path faults and 5 % aborts. Every room must conclude and be released on
//! every node, no write may land on a page that is not its room's, and counters must agree.

mod common;

use std::time::{Duration, Instant};

use kvferry_core::sim::{Faults, Workload};

#[test]
fn soak_10k_rooms_with_transient_faults_and_aborts_loses_nothing() {
    let started = Instant::now();
    let faults = Faults {
        op_transient: 0.05,
        ..Faults::default()
    };
    let mut config = common::config();
    config.transfer_retries = 4;
    let (mut sim, ps, ds) = common::cluster(0x50A4, config, faults);
    let mut w = Workload::new(ds, vec![ps], 10_000);
    w.interarrival = Duration::from_micros(100);
    w.decode_abort = 0.04;
    w.prefill_abort = 0.01;
    common::run_workload(&mut sim, w, 20_000_000);
    let outcomes = sim.workload_outcomes();
    let succeeded = outcomes.get("success").copied().unwrap_or(0);
    let aborted = outcomes.get("aborted_locally").copied().unwrap_or(0)
        + outcomes.get("aborted_by_peer").copied().unwrap_or(0);
    assert_eq!(outcomes.values().sum::<usize>(), 10_000);
    assert!(succeeded >= 9_000, "{outcomes:?}");
    assert!(aborted >= 200, "{outcomes:?}");
    assert!(sim.late_rooms(Duration::from_secs(10)).is_empty());
    assert!(sim.quiescent());
    let retries: u64 = sim
        .nodes
        .iter()
        .map(|n| n.endpoint.counters().retries)
        .sum();
    assert!(retries > 0);
    eprintln!(
        "soak: 10000 rooms, outcomes {outcomes:?}, {retries} retries, {} ops, {} steps, {:?} simulated, {:?} wall",
        sim.ops_emitted,
        sim.steps,
        sim.now - sim.start,
        started.elapsed()
    );
}
