//! The end-to-end checksum option in the core: peers must agree on it, and a write whose
//! bytes landed but failed their checksum fails the room with `checksum_mismatch`.

mod common;

use std::time::Duration;

use common::*;
use kvferry_core::sim::{small_layout, Faults, Sim};
use kvferry_core::{Config, Event, FailureReason, KvPoll, Region, RejectReason, RoomId, Slice};

fn checked() -> Config {
    Config {
        checksum: true,
        ..config()
    }
}

#[test]
fn a_write_that_failed_its_checksum_fails_the_room_with_checksum_mismatch() {
    let (mut sim, p, d) = pair(31, checked());
    let dst = open_room(&mut sim, d, &[p], 1, 2);
    run_ms(&mut sim, 5);
    let session = sim.session(d, p).expect("session");
    let page = u64::from(small_layout(1).page_bytes);
    let slice = [Slice::run(
        Region::Kv { layer: 0, plane: 0 },
        0,
        u64::from(dst[0]) * page,
        page,
    )];
    let now = sim.now;
    let permit = sim.nodes[d]
        .endpoint
        .begin_write(now, session, RoomId(1), 0, &slice)
        .expect("admitted");
    sim.nodes[d]
        .endpoint
        .end_write(now, permit.corrupt(), &slice);
    sim.drain(d);
    assert_eq!(state(&sim, d, 1), failed(FailureReason::ChecksumMismatch));
    run_ms(&mut sim, 50);
    // The prefill hears that decode gave up; the pages stay quarantined until released.
    assert!(matches!(state(&sim, p, 1), Some(KvPoll::Failed(_))));
    assert!(released_at(&sim, d, 1).is_some());
}

#[test]
fn peers_that_disagree_on_the_checksum_are_refused_naming_both_settings() {
    let mut sim = Sim::new(32, Faults::default());
    let layout = small_layout(64);
    let p = sim.add_prefill(checked(), layout, 0, 0..layout.layers);
    let d = sim.add_decode(config(), layout, 0);
    sim.connect(d, p);
    sim.run_for(Duration::from_millis(5), 10_000)
        .expect("handshake");
    let named = |n: usize| {
        sim.nodes[n].count_events(|e| {
            matches!(e, Event::SessionRejected { reason: RejectReason::IncompatibleLayout(m), .. }
                if m.field == "checksum" && m.ours + m.theirs == 1)
        })
    };
    assert!(named(p) + named(d) >= 1);
    assert_eq!(sim.session(d, p), None);
}
