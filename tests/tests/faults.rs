//! Real nodes, real sockets, injected faults: connection resets on the data path and decode
//! aborts, reproducible per seed. Nothing may be lost or corrupted.

use kvferry_cli::{run_demo, DemoFaults, Shape};
use kvferry_tests::{fast_core, small_shape};

/// The CI-sized soak of the demo's fault plan: 2,000 rooms, 5 % resets, 5 % aborts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_with_resets_and_aborts_loses_no_room_and_corrupts_no_page() {
    let shape = Shape {
        concurrency: 16,
        ..small_shape()
    };
    let faults = DemoFaults {
        fault_rate: 0.05,
        abort_rate: 0.05,
        seed: 7,
    };
    let report = run_demo(shape, fast_core(), 2000, faults, None)
        .await
        .expect("demo runs");
    assert_eq!(report.rooms_unfinished, 0, "{report:?}");
    assert_eq!(report.pages_corrupted, 0, "{report:?}");
    assert_eq!(report.rooms_succeeded + report.rooms_failed, 2000);
    let by_reason: u64 = report.failed_by_reason.values().sum();
    assert_eq!(
        by_reason, report.rooms_failed,
        "every failed room is counted under a reason"
    );
    assert!(report.retries > 0, "resets were retried");
    assert!(
        report.failed_by_reason.contains_key("aborted_locally"),
        "{report:?}"
    );
    assert!(report.rooms_succeeded > 0, "{report:?}");
    // Every failure is one the fault plan explains (a blacklist after ten consecutive
    // exhausted operations fails new rooms fast until a probe recovers the session).
    let expected = [
        "aborted_locally",
        "transfer_failed",
        "session_blacklisted",
        "waiting_timeout",
    ];
    assert!(
        report
            .failed_by_reason
            .keys()
            .all(|k| expected.contains(&k.as_str())),
        "{report:?}"
    );
}

/// Aborts at a high rate (20 %) race real transfers; every aborted room's pages come back
/// clean (the free-pattern check before reuse finds no stray write).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frequent_decode_aborts_never_leave_a_stray_write() {
    let faults = DemoFaults {
        fault_rate: 0.0,
        abort_rate: 0.2,
        seed: 3,
    };
    let report = run_demo(small_shape(), fast_core(), 300, faults, None)
        .await
        .expect("demo runs");
    assert!(
        report
            .failed_by_reason
            .get("aborted_locally")
            .copied()
            .unwrap_or(0)
            > 10,
        "{report:?}"
    );
    assert_eq!(
        (report.pages_corrupted, report.rooms_unfinished),
        (0, 0),
        "{report:?}"
    );
}
