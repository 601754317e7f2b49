//! Every reason a decode sees names its cause, end to end over real sockets: one test per
//! cause. (A peer that vanishes: `connection_lost`, and one that stops: `peer_shutdown`, are
//! in `identity.rs`; a write outside the room's pages: `protocol_error`, in `faults.rs`.)
//! And an outage shorter than the liveness window loses no room.
#![allow(clippy::unwrap_used)] // tests may panic

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvferry_core::{Config, Role};
use kvferry_testkit::{run_decode, Report};
use kvferry_tests::proxy::FaultProxy;
use kvferry_tests::{
    free_ports, peer_loss_core, prefill_on, rooms, small_shape, start_on, Runtime,
};

/// Short windows: liveness 6 s (200 ms × 30), unreachable 1 s; a room's own silence
/// deadline (10 s) outlasts the liveness window, as the defaults' 300 s do.
fn core() -> Config {
    Config {
        waiting_timeout: Duration::from_secs(10),
        ..peer_loss_core()
    }
}

/// A decode (token `token`) runs `n` rooms against `at`, through a persistent target.
async fn decode_against(at: Vec<SocketAddr>, token: &[u8], n: u64) -> Report {
    let shape = small_shape();
    let mut cfg = kvferry_testkit::node_config(Role::Decode, &shape, core(), token, 7);
    cfg.info.token = token.to_vec();
    let decode = Runtime::Tokio
        .start(
            cfg,
            std::sync::Arc::new(kvferry_memory::MemoryMap::allocate(shape.layout())),
        )
        .unwrap();
    let peer = decode.connect_persistent(at).await.unwrap();
    let report = tokio::time::timeout(
        Duration::from_secs(20),
        run_decode(&decode, peer, rooms(n, 1)),
    )
    .await
    .expect("every room ends");
    decode.shutdown().await;
    report
}

fn only_reason(report: &Report, reason: &str, n: u64) {
    assert_eq!(report.rooms_failed, n, "{report:?}");
    assert_eq!(report.failed_by_reason.get(reason), Some(&n), "{report:?}");
    assert_eq!(report.rooms_unfinished, 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_cluster_token_fails_rooms_as_unauthorized() {
    let shape = small_shape();
    let (prefill, addrs, _server) = prefill_on(
        Runtime::Tokio,
        &shape,
        core(),
        1,
        "127.0.0.1:0".parse().unwrap(),
    )
    .await;
    let report = decode_against(addrs, b"not-the-cluster-token", 5).await;
    only_reason(&report, "unauthorized", 5);
    assert!(prefill.counters().await.sessions_rejected >= 1);
    prefill.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_where_nothing_listens_fails_rooms_as_connection_refused() {
    let report = decode_against(vec![free_ports(1)], b"test-token", 5).await;
    only_reason(&report, "connection_refused", 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_that_never_answers_fails_rooms_as_peer_unreachable() {
    // A listener whose accept queue is full: Linux drops further SYNs, so a connection
    // attempt gets no answer at all, as through a black-holed link.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(1).unwrap();
    let at = listener.local_addr().unwrap();
    let mut fillers = Vec::new();
    for _ in 0..4 {
        if let Ok(Ok(s)) = tokio::time::timeout(
            Duration::from_millis(300),
            tokio::net::TcpStream::connect(at),
        )
        .await
        {
            fillers.push(s);
        }
    }
    let report = decode_against(vec![at], b"test-token", 5).await;
    only_reason(&report, "peer_unreachable", 5);
    drop((listener, fillers));
}

/// A prefill behind a proxy that goes dark 300 ms in, for `dark`: the decode's rooms over
/// that time, and when the first room succeeded after the link came back. `n` must be
/// enough rooms to outlast the first 300 ms (about 3000 rooms a second here).
async fn run_through_an_outage(dark: Duration, n: u64) -> (Report, Option<Duration>) {
    let shape = small_shape();
    let (prefill, addrs, _server) = prefill_on(
        Runtime::Tokio,
        &shape,
        core(),
        3,
        "127.0.0.1:0".parse().unwrap(),
    )
    .await;
    let proxy = FaultProxy::start(addrs[0], 4).await.unwrap();
    let decode = start_on(Runtime::Tokio, Role::Decode, &shape, core(), 5);
    let peer = decode.connect_persistent(vec![proxy.addr]).await.unwrap();
    let mut run = rooms(n, 1);
    run.deadline = Duration::from_secs(60);
    let task = tokio::spawn({
        let decode = decode.clone();
        async move { run_decode(&decode, peer, run).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let healed = Instant::now() + dark;
    proxy.set(|f| f.blackhole_until = Some(healed));
    tokio::time::sleep(dark).await;
    let before = decode.counters().await.rooms_succeeded;
    let mut first_after = None;
    while first_after.is_none() && healed.elapsed() < Duration::from_secs(20) && !task.is_finished()
    {
        if decode.counters().await.rooms_succeeded > before {
            first_after = Some(healed.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let report = tokio::time::timeout(Duration::from_secs(60), task)
        .await
        .expect("decode ends")
        .unwrap();
    decode.shutdown().await;
    prefill.shutdown().await;
    (report, first_after)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_missed_for_the_liveness_window_fail_rooms_as_peer_silent() {
    // The proxy takes connections but forwards nothing: what a hung prefill looks like.
    let (report, _) = run_through_an_outage(Duration::from_secs(9), 2000).await;
    assert!(report.rooms_failed > 0, "{report:?}");
    assert!(!report.corrupted(), "{report:?}");
    assert!(
        report.failed_by_reason.keys().all(|k| k == "peer_silent"),
        "{report:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_shorter_than_the_liveness_window_loses_no_room() {
    let (report, first_after) = run_through_an_outage(Duration::from_secs(2), 2000).await;
    assert_eq!(report.rooms_succeeded, 2000, "{report:?}");
    assert!(!report.corrupted(), "{report:?}");
    let first_after = first_after.expect("rooms flow again after the heal");
    println!("first room {first_after:?} after the heal");
    assert!(first_after < Duration::from_secs(3), "{first_after:?}");
}
