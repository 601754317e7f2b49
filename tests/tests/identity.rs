//! Over real sockets: `Success` means the bytes are there, and a peer that is gone is known.
//! A decode re-run (or a second decode) reusing room ids gets `room_id_reused`, never a
//! success for pages nobody wrote; a restarted prefill serves the same ids fresh; a decode
//! whose prefill is killed or stopped ends every room within the unreachable window.
#![allow(clippy::unwrap_used)] // tests may panic

use std::time::{Duration, Instant};

use kvferry_core::{Config, Role};
use kvferry_testkit::{run_decode, Report};
use kvferry_tests::{free_ports, peer_loss_core, prefill_on, rooms, start_on, Runtime};

fn core() -> Config {
    peer_loss_core()
}

async fn decode_run(at: Vec<std::net::SocketAddr>, n: u64, first: u64, seed: u64) -> Report {
    let decode = start_on(
        Runtime::Tokio,
        Role::Decode,
        &rooms(n, first).shape,
        core(),
        seed,
    );
    let peer = decode.connect_persistent(at).await.unwrap();
    let report = run_decode(&decode, peer, rooms(n, first)).await;
    decode.shutdown().await;
    report
}

fn assert_honest(report: &Report) {
    assert!(!report.corrupted(), "{report:?}");
    assert!(
        report.pages_corrupted <= report.pages_verified,
        "{report:?}"
    );
    assert_eq!(report.rooms_unfinished, 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_run_twice_with_the_same_room_ids_is_refused_not_given_success() {
    let shape = rooms(1, 1).shape;
    let (prefill, addrs, _server) = prefill_on(
        Runtime::Tokio,
        &shape,
        core(),
        1,
        "127.0.0.1:0".parse().unwrap(),
    )
    .await;
    let first = decode_run(addrs.clone(), 20, 100, 2).await;
    assert_eq!(first.rooms_succeeded, 20, "{first:?}");
    assert_eq!(
        first.bytes_transferred,
        20 * shape.room_bytes(),
        "every byte landed and was verified"
    );
    assert_honest(&first);
    // The same decode command again: a new incarnation with the same room ids.
    let again = decode_run(addrs.clone(), 20, 100, 3).await;
    assert_eq!(again.rooms_succeeded, 0, "{again:?}");
    assert_eq!(again.failed_by_reason.get("room_id_reused"), Some(&20));
    assert_eq!(again.bytes_transferred, 0, "no byte moved");
    assert_honest(&again);
    // Fresh ids are served as usual.
    let fresh = decode_run(addrs, 20, 1_000, 4).await;
    assert_eq!(fresh.rooms_succeeded, 20, "{fresh:?}");
    assert_honest(&fresh);
    prefill.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_decodes_with_overlapping_room_ids_never_both_succeed_for_one_id() {
    let shape = rooms(1, 1).shape;
    let (prefill, addrs, _server) = prefill_on(
        Runtime::Tokio,
        &shape,
        core(),
        11,
        "127.0.0.1:0".parse().unwrap(),
    )
    .await;
    let (a, b) = tokio::join!(
        decode_run(addrs.clone(), 30, 500, 12),
        decode_run(addrs.clone(), 30, 515, 13)
    );
    for r in [&a, &b] {
        assert_honest(r);
        let reused = r
            .failed_by_reason
            .get("room_id_reused")
            .copied()
            .unwrap_or(0);
        assert_eq!(r.rooms_succeeded + reused, 30, "{r:?}");
    }
    // Ids 515..530 were asked by both: each one served exactly once.
    let reused = |r: &Report| {
        r.failed_by_reason
            .get("room_id_reused")
            .copied()
            .unwrap_or(0)
    };
    assert_eq!(reused(&a) + reused(&b), 15, "{a:?} {b:?}");
    prefill.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_prefill_serves_the_same_room_ids_fresh() {
    let shape = rooms(1, 1).shape;
    let at = free_ports(1);
    let (prefill, addrs, server) = prefill_on(Runtime::Tokio, &shape, core(), 21, at).await;
    let first = decode_run(addrs.clone(), 10, 1, 22).await;
    assert_eq!(first.rooms_succeeded, 10, "{first:?}");
    prefill.shutdown().await;
    server.abort();
    drop(prefill);
    let (prefill, addrs, _server) = prefill_on(Runtime::Tokio, &shape, core(), 23, at).await;
    let again = decode_run(addrs, 10, 1, 24).await;
    assert_eq!(again.rooms_succeeded, 10, "{again:?}");
    assert_honest(&again);
    prefill.shutdown().await;
}

/// Decode against a prefill that goes away mid-run (`graceful`: it shuts down and says so;
/// else it just vanishes). Every room ends, counted under a reason, within about the
/// unreachable window of its open (or of the loss), and none is corrupted.
async fn prefill_lost_mid_run(graceful: bool) -> (Report, Duration) {
    let shape = rooms(1, 1).shape;
    let (prefill, addrs, server) = prefill_on(
        Runtime::Tokio,
        &shape,
        core(),
        31,
        "127.0.0.1:0".parse().unwrap(),
    )
    .await;
    let decode = start_on(Runtime::Tokio, Role::Decode, &shape, core(), 32);
    let peer = decode.connect_persistent(addrs).await.unwrap();
    let run = tokio::spawn({
        let decode = decode.clone();
        async move { run_decode(&decode, peer, rooms(3_000, 1)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let lost = Instant::now();
    if graceful {
        prefill.shutdown().await;
    }
    server.abort();
    drop(prefill);
    let report = tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("decode ends")
        .unwrap();
    let took = lost.elapsed();
    decode.shutdown().await;
    assert_honest(&report);
    assert_eq!(
        report.rooms_succeeded + report.rooms_failed,
        3_000,
        "{report:?}"
    );
    let by_reason: u64 = report.failed_by_reason.values().sum();
    assert_eq!(by_reason, report.rooms_failed);
    (report, took)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_that_stops_fails_decode_rooms_with_peer_shutdown_then_connection_refused() {
    let (report, took) = prefill_lost_mid_run(true).await;
    assert_reasons(&report, &["peer_shutdown", "connection_refused"]);
    assert!(
        report.failed_by_reason.contains_key("connection_refused"),
        "rooms still waiting learn that nothing listens any more: {report:?}"
    );
    assert_each_room_ended_within_the_window(&report, took);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_that_vanishes_fails_decode_rooms_with_connection_lost_then_connection_refused() {
    let (report, took) = prefill_lost_mid_run(false).await;
    assert_reasons(&report, &["connection_lost", "connection_refused"]);
    assert_each_room_ended_within_the_window(&report, took);
}

/// No room waited much longer than the unreachable window (1 s): the longest one, from its
/// open to its end, took at most the window and a margin for a loaded machine. The whole run
/// takes longer where the CPU is shared (the rooms opened after the loss fail one by one), so
/// its own time is only bounded by the test's timeout.
fn assert_each_room_ended_within_the_window(report: &Report, took: Duration) {
    let longest = Duration::from_secs_f64(report.latency_ms.2 / 1e3);
    assert!(
        longest < Duration::from_secs(5),
        "a room took {longest:?}; the run ended {took:?} after the loss: {report:?}"
    );
}

fn assert_reasons(report: &Report, allowed: &[&str]) {
    assert!(
        report
            .failed_by_reason
            .keys()
            .all(|k| allowed.contains(&k.as_str())),
        "{report:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_stopped_mid_run_opens_no_more_rooms_and_reports_every_one() {
    let shape = rooms(1, 1).shape;
    let (prefill, addrs, _server) = prefill_on(
        Runtime::Tokio,
        &shape,
        core(),
        41,
        "127.0.0.1:0".parse().unwrap(),
    )
    .await;
    let decode = start_on(Runtime::Tokio, Role::Decode, &shape, core(), 42);
    let peer = decode.connect_persistent(addrs).await.unwrap();
    let total = 1_000_000;
    let run = tokio::spawn({
        let decode = decode.clone();
        async move { run_decode(&decode, peer, rooms(total, 1)).await }
    });
    // Shut down mid-run, once rooms are flowing.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while decode.counters().await.rooms_succeeded == 0 && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // What SIGINT or SIGTERM does in `kvferry decode`.
    decode.shutdown().await;
    let report = tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("the run ends once its node is shut down, not after a million refusals")
        .unwrap();
    assert_honest(&report);
    assert!(report.rooms_succeeded > 0, "{report:?}");
    assert!(report.rooms_not_opened > 0, "{report:?}");
    let refused: u64 = report.refused_by_error.values().sum();
    assert!(
        refused <= 8,
        "at most the rooms already opening (concurrency 8): {report:?}"
    );
    assert_eq!(
        report.rooms_succeeded + report.rooms_failed + refused + report.rooms_not_opened,
        total,
        "every room is accounted for: {report:?}"
    );
    prefill.shutdown().await;
}

/// What `kvferry decode` does on SIGINT: its signal task shuts the node down, and the run
/// shuts it down again when it ends. Both calls return, on both drivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_shut_down_twice_returns_both_times() {
    for runtime in [
        Runtime::Tokio,
        Runtime::Glommio {
            shards: 1,
            pin: false,
        },
    ] {
        let shape = rooms(1, 1).shape;
        let (prefill, addrs, _server) =
            prefill_on(runtime, &shape, core(), 51, "127.0.0.1:0".parse().unwrap()).await;
        let decode = start_on(runtime, Role::Decode, &shape, core(), 52);
        decode.connect(addrs).await.unwrap();
        for call in ["first", "second"] {
            tokio::time::timeout(Duration::from_secs(10), decode.shutdown())
                .await
                .unwrap_or_else(|_| panic!("{runtime:?}: the {call} shutdown hangs"));
        }
        prefill.shutdown().await;
    }
}

/// A node that has shut down answers every later call at once, however soon after the
/// shutdown it comes: its counters with its final figures, the rest with `ShutDown`. On
/// glommio a call queued to a shard that was stopping was kept by its command channel and
/// never answered (a second shutdown hung this way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_to_a_node_that_has_shut_down_are_answered_at_once() {
    use kvferry_tokio::NodeError;
    for runtime in [Runtime::Tokio, kvferry_tests::GLOMMIO] {
        let shape = rooms(1, 1).shape;
        let (prefill, addrs, _server) =
            prefill_on(runtime, &shape, core(), 61, "127.0.0.1:0".parse().unwrap()).await;
        let decode = start_on(runtime, Role::Decode, &shape, core(), 62);
        let peer = decode.connect(addrs.clone()).await.unwrap();
        let report = run_decode(&decode, peer, rooms(2, 1)).await;
        kvferry_tests::assert_all_clean(&report, 2);
        let kept = decode.connect_persistent(addrs.clone()).await.unwrap();
        decode.reach(kept).await.unwrap();
        prefill.shutdown().await;
        decode.shutdown().await;
        let soon = Duration::from_secs(5);
        let opened = tokio::time::timeout(
            soon,
            decode.open_receiver(kvferry_core::RoomId(1), 0, vec![peer], None),
        )
        .await
        .unwrap_or_else(|_| panic!("{runtime:?}: open_receiver after shutdown hangs"));
        assert!(
            matches!(opened, Err(NodeError::ShutDown)),
            "{runtime:?}: {opened:?}"
        );
        let dialed = tokio::time::timeout(soon, decode.connect(addrs))
            .await
            .unwrap_or_else(|_| panic!("{runtime:?}: connect after shutdown hangs"));
        assert!(
            matches!(dialed, Err(NodeError::ShutDown)),
            "{runtime:?}: {dialed:?}"
        );
        let reached = tokio::time::timeout(soon, decode.reach(kept))
            .await
            .unwrap_or_else(|_| panic!("{runtime:?}: reach after shutdown hangs"));
        assert!(
            matches!(reached, Err(NodeError::ShutDown)),
            "{runtime:?}: {reached:?}"
        );
        let asked = decode.unreachable(kept).await;
        assert!(
            matches!(asked, Err(NodeError::ShutDown)),
            "{runtime:?}: {asked:?}"
        );
        let listened = decode.listen("127.0.0.1:0".parse().unwrap()).await;
        assert!(
            matches!(listened, Err(NodeError::ShutDown)),
            "{runtime:?}: {listened:?}"
        );
        tokio::time::timeout(soon, prefill.shutdown())
            .await
            .unwrap_or_else(|_| panic!("{runtime:?}: a second shutdown hangs"));
        // Its final figures stay readable, however many calls came before.
        assert_eq!(decode.counters().await.rooms_succeeded, 2, "{runtime:?}");
    }
}

/// A caller waiting for a kept peer that is not there hears `ShutDown` when the node shuts
/// down, instead of waiting for a peer the node will not dial again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_a_kept_peer_ends_when_the_node_shuts_down() {
    use kvferry_tokio::NodeError;
    for runtime in [Runtime::Tokio, kvferry_tests::GLOMMIO] {
        let shape = rooms(1, 1).shape;
        let long = Config {
            unreachable_timeout: Duration::from_secs(60),
            ..core()
        };
        let decode = start_on(runtime, Role::Decode, &shape, long, 71);
        // Nothing listens there: the decode dials on and on.
        let kept = decode
            .connect_persistent(vec![free_ports(1)])
            .await
            .unwrap();
        let waiting = tokio::spawn({
            let decode = decode.clone();
            async move { decode.reach(kept).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        decode.shutdown().await;
        let reached = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .unwrap_or_else(|_| panic!("{runtime:?}: the wait outlives the node"))
            .unwrap();
        assert!(
            matches!(reached, Err(NodeError::ShutDown)),
            "{runtime:?}: {reached:?}"
        );
    }
}

/// A shutdown whose caller stops waiting (a timeout around it) still completes: before,
/// dropping the call after the listeners closed left a node that listened no more and
/// was not shut down either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_whose_caller_stops_waiting_still_completes() {
    use kvferry_tokio::NodeError;
    for runtime in [Runtime::Tokio, kvferry_tests::GLOMMIO] {
        let shape = rooms(1, 1).shape;
        let (prefill, addrs, server) =
            prefill_on(runtime, &shape, core(), 81, "127.0.0.1:0".parse().unwrap()).await;
        server.abort();
        let decode = start_on(runtime, Role::Decode, &shape, core(), 82);
        decode.connect(addrs).await.unwrap();
        // Polled once, then dropped (unless it is done by then).
        tokio::select! {
            biased;
            () = prefill.shutdown() => {}
            () = std::future::ready(()) => {}
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut room = 1;
        loop {
            match prefill
                .open_sender(kvferry_core::RoomId(room), 0, None)
                .await
            {
                Err(NodeError::ShutDown) => break,
                other => assert!(
                    Instant::now() < deadline,
                    "{runtime:?}: still open 5 s after its shutdown began: {other:?}"
                ),
            }
            room += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
