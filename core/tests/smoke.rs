//! The simplest end-to-end runs: rooms between healthy nodes all succeed.

mod common;

use kvferry_core::sim::Workload;

#[test]
fn rooms_succeed_between_one_prefill_and_one_decode() {
    let (mut sim, p, d) = common::pair(1, common::config());
    common::run_workload(
        &mut sim,
        Workload::new(vec![d], vec![vec![p]], 200),
        1_000_000,
    );
    assert_eq!(
        sim.workload_outcomes().get("success"),
        Some(&200),
        "{:?}",
        sim.workload_outcomes()
    );
    assert!(sim.quiescent());
}

#[test]
fn rooms_succeed_across_two_pp_stages_and_two_decodes() {
    let (mut sim, ps, ds) = common::cluster(2, common::config(), Default::default());
    common::run_workload(&mut sim, Workload::new(ds, vec![ps], 200), 1_000_000);
    assert_eq!(
        sim.workload_outcomes().get("success"),
        Some(&200),
        "{:?}",
        sim.workload_outcomes()
    );
    assert!(sim.quiescent());
}
