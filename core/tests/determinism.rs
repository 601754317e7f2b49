//! The same inputs in the same order give the same outputs: two runs of one seeded world
//! produce identical event streams, at identical simulated times.

mod common;

use std::time::Duration;

use kvferry_core::sim::{Faults, Sim, Workload};

fn run(seed: u64) -> Vec<String> {
    let faults = Faults {
        op_transient: 0.1,
        op_hang: 0.01,
        msg_duplicate: 0.05,
        link_reset: 0.001,
        reconnect_after: Some(Duration::from_millis(20)),
        ..Faults::default()
    };
    let (mut sim, ps, ds): (Sim, _, _) = common::cluster(seed, common::config(), faults);
    let mut w = Workload::new(ds, vec![ps], 300);
    w.decode_abort = 0.1;
    w.layerwise = 0.5;
    common::run_workload(&mut sim, w, 5_000_000);
    let start = sim.start;
    sim.nodes
        .iter()
        .enumerate()
        .flat_map(|(i, n)| {
            n.events
                .iter()
                .map(move |(t, e)| format!("{i} {:?} {e:?}", *t - start))
        })
        .collect()
}

#[test]
fn equal_seeds_give_equal_event_streams() {
    let a = run(99);
    let b = run(99);
    assert!(a.len() > 1000);
    assert_eq!(a, b);
}
