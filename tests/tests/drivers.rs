//! The integration suite, generic over the driver: every scenario runs on tokio, on glommio
//! (two shards) and on a mixed pair (tokio prefill, glommio decode), through the one embedder
//! API both drivers implement (`kvferry_driver::Node`). Real sockets, real bytes, every page verified.
#![allow(clippy::unwrap_used)] // tests may panic

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvferry_core::{
    Capacity, Chunk, Config, FailureReason, Grant, KvPoll, Role, RoomId, SessionState,
};
use kvferry_testkit::overlap::{run_host_overlap, Batch};
use kvferry_testkit::{run_decode, run_pair, DecodeRun, Shape};
use kvferry_tests::proxy::FaultProxy;
use kvferry_tests::{
    assert_all_clean, fast_core, free_ports, on_every_driver, peer_loss_core, prefill_on, rooms,
    small_shape, start_on, Runtime,
};
use kvferry_tokio::{FaultKind, FaultPlan};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// Starts both sides and moves `run` end to end.
async fn pair(p: Runtime, d: Runtime, core: Config, run: DecodeRun) -> kvferry_testkit::Report {
    let prefill = start_on(p, Role::Prefill, &run.shape, core.clone(), 1);
    let decode = start_on(d, Role::Decode, &run.shape, core, 2);
    run_pair(&prefill, &decode, run).await.expect("pair runs")
}

async fn many_concurrent_rooms_succeed_with_every_byte_verified(p: Runtime, d: Runtime) {
    let report = pair(p, d, fast_core(), rooms(300, 1)).await;
    assert_all_clean(&report, 300);
    assert_eq!(report.pages_verified, 300 * 8 * 4 * 2);
}

/// Rooms whose first three pages the decode already holds (`skip_pages = 3`): the prefill
/// computes the whole room and sends room pages 3.., every granted page lands and holds the
/// pattern of its room page (3 + i), and nothing else is written.
async fn a_prefix_room_moves_every_granted_page_with_every_byte_verified(p: Runtime, d: Runtime) {
    let mut run = rooms(40, 1);
    run.shape.prefix_pages = 3;
    let report = pair(p, d, fast_core(), run).await;
    assert_all_clean(&report, 40);
    assert_eq!(report.pages_verified, 40 * 8 * 4 * 2);
}

/// A prefill whose last chunk leaves granted pages unwritten (the grant skips two pages
/// and asks for four: the room has six pages, prefill sends four) fails the room on both
/// sides with `grant_mismatch`, never a success with pages missing.
async fn a_prefill_that_sends_less_than_its_grant_fails_the_room_on_both_sides(
    p: Runtime,
    d: Runtime,
) {
    let shape = small_shape();
    let prefill = start_on(p, Role::Prefill, &shape, fast_core(), 51);
    let addrs = prefill.listen(any_port()).await.unwrap();
    let decode = start_on(d, Role::Decode, &shape, fast_core(), 52);
    let peer = decode.connect(addrs).await.unwrap();
    let room = RoomId(5);
    let grant = Grant {
        skip_pages: 2,
        ..Grant::new((10..14).collect(), Some(0), None)
    };
    let mut arriving = decode
        .open_receiver(room, 0, vec![peer], Some(grant))
        .await
        .unwrap();
    let mut leaving = prefill.open_sender(room, 0, None).await.unwrap();
    let chunk = Chunk {
        extras: Vec::new(),
        pages: (0..4).collect(),
        last: true,
        aux_slot: Some(0),
        state_slot: None,
        layerwise: false,
    };
    prefill.send_chunk(room, chunk).await.unwrap();
    let within = Duration::from_secs(5);
    let failed = KvPoll::Failed(FailureReason::GrantMismatch);
    let ends = tokio::time::timeout(within, async {
        (leaving.terminal().await, arriving.terminal().await)
    });
    assert_eq!(ends.await.expect("no hang"), (failed, failed));
    decode.shutdown().await;
    prefill.shutdown().await;
}

/// A batch of 4 rooms x 4 layers, and a prefill and a decode node registered for it.
fn batch_pair(p: Runtime, d: Runtime) -> (Batch, kvferry_tests::Node, kvferry_tests::Node) {
    let batch = Batch {
        shape: Shape {
            layers: 4,
            ..small_shape()
        },
        rooms: 4,
        first_room: 1,
    };
    let shape = batch.shape_for_layout();
    let prefill = start_on(p, Role::Prefill, &shape, fast_core(), 1);
    let decode = start_on(d, Role::Decode, &shape, fast_core(), 2);
    (batch, prefill, decode)
}

/// One batch whose host forward pass takes 10 ms per layer, moved layerwise and then as a
/// whole batch: every byte verifies, each layer reaches decode after its compute and in
/// layer order, and the whole batch leaves only after the last layer.
async fn a_layerwise_batch_delivers_each_layer_after_its_compute(p: Runtime, d: Runtime) {
    let (batch, prefill, decode) = batch_pair(p, d);
    let report = run_host_overlap(&prefill, &decode, &batch, Duration::from_millis(10))
        .await
        .unwrap();
    assert!(report.clean(), "{}", report.text());
    let pages = u64::from(batch.rooms) * 4 * 2 * u64::from(batch.shape.pages_per_room);
    let [layerwise, whole] = report.runs.as_slice() else {
        panic!("two runs");
    };
    assert_eq!(
        (layerwise.pages_verified, whole.pages_verified),
        (pages, pages)
    );
    let mut previous = Duration::ZERO;
    for l in &layerwise.timeline.layers {
        let t = l.transfer.expect("layerwise runs time each layer");
        assert!(
            t.end >= l.compute.end,
            "layer {} reached decode before it was computed",
            l.layer
        );
        assert!(
            t.end >= previous,
            "layer {} delivered out of order",
            l.layer
        );
        previous = t.end;
    }
    let b = whole
        .timeline
        .batch
        .expect("the whole batch is one transfer");
    assert_eq!(b.start, whole.timeline.layers[3].compute.end);
    assert!(b.end > b.start && whole.timeline.layers.iter().all(|l| l.transfer.is_none()));
    decode.shutdown().await;
    prefill.shutdown().await;
}

/// The forward pass fails after two of four layers: the batch reports the failure, and every
/// room on both sides still ends (Failed) and releases its pages; nothing waits forever.
async fn a_forward_pass_that_fails_mid_batch_fails_every_room(p: Runtime, d: Runtime) {
    use kvferry_testkit::overlap::{run_batch, BatchMode, LayerSignal};
    let (batch, prefill, decode) = batch_pair(p, d);
    let addrs = prefill.listen(any_port()).await.unwrap();
    let peer = decode.connect(addrs).await.unwrap();
    let forward = || {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for layer in 0..2 {
            let at = Instant::now();
            let _ = tx.send(LayerSignal::Computed { layer, at });
            let _ = tx.send(LayerSignal::Staged { layer, at });
        }
        let _ = tx.send(LayerSignal::Failed("kernel 2 faulted".to_owned()));
        rx
    };
    let mode = BatchMode {
        layerwise: true,
        deadline: Duration::from_secs(10),
    };
    let result = run_batch(&prefill, &decode, peer, &batch, mode, forward, None).await;
    assert_eq!(result.unwrap_err(), "kernel 2 faulted");
    let t0 = Instant::now();
    loop {
        let (pc, dc) = (prefill.counters().await, decode.counters().await);
        if pc.rooms_failed_total() == 4
            && dc.rooms_failed_total() == 4
            && pc.rooms_released == 4
            && dc.rooms_released == 4
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "rooms did not end: prefill {pc:?} decode {dc:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    decode.shutdown().await;
    prefill.shutdown().await;
}

async fn chunked_rooms_succeed(p: Runtime, d: Runtime) {
    let shape = Shape {
        chunks: 3,
        ..small_shape()
    };
    let report = pair(
        p,
        d,
        fast_core(),
        DecodeRun {
            shape,
            ..rooms(60, 1)
        },
    )
    .await;
    assert_all_clean(&report, 60);
}

async fn layerwise_rooms_succeed(p: Runtime, d: Runtime) {
    let shape = Shape {
        layerwise: true,
        layer_compute: Duration::from_micros(300),
        chunks: 2,
        ..small_shape()
    };
    let report = pair(
        p,
        d,
        fast_core(),
        DecodeRun {
            shape,
            ..rooms(40, 1)
        },
    )
    .await;
    assert_all_clean(&report, 40);
}

/// Aborts (every room) race real transfers: pages stay quarantined until no write can land, so the
/// free-pattern check before every reuse finds no stray write.
async fn aborted_rooms_give_their_pages_back_clean(p: Runtime, d: Runtime) {
    // Rooms of 1 MiB, each aborted 0-3 ms after it opens: a room may finish in a fraction
    // of a millisecond, so only the early aborts catch it in flight; enough must.
    let shape = Shape {
        pages_per_room: 32,
        ..small_shape()
    };
    let run = DecodeRun {
        abort_rate: 1.0,
        seed: 3,
        shape,
        ..rooms(300, 1)
    };
    let report = pair(p, d, fast_core(), run).await;
    let aborted = report
        .failed_by_reason
        .get("aborted_locally")
        .copied()
        .unwrap_or(0);
    // How many aborts catch their room still in flight depends on the machine; enough must,
    // for the race to count.
    assert!(aborted > 5, "{report:?}");
    assert_eq!(
        (report.pages_corrupted, report.rooms_unfinished),
        (0, 0),
        "{report:?}"
    );
}

async fn two_decodes_share_one_prefill(p: Runtime, d: Runtime) {
    let shape = small_shape();
    let (prefill, addrs, _server) = prefill_on(p, &shape, fast_core(), 11, any_port()).await;
    let d1 = start_on(d, Role::Decode, &shape, fast_core(), 12);
    let d2 = start_on(d, Role::Decode, &shape, fast_core(), 13);
    let p1 = d1.connect(addrs.clone()).await.expect("connect");
    let p2 = d2.connect(addrs).await.expect("connect");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let (a, b) = tokio::join!(
        run_decode(&d1, p1, rooms(50, 1)),
        run_decode(&d2, p2, rooms(50, 1000))
    );
    assert_all_clean(&a, 50);
    assert_all_clean(&b, 50);
    prefill.shutdown().await;
}

/// A prefill node that disappears mid-transfer: decode's rooms fail with a reason within
/// their deadlines instead of hanging, and their pages come back.
async fn a_prefill_dropped_mid_transfer_fails_decode_rooms_with_a_reason(p: Runtime, d: Runtime) {
    let shape = small_shape();
    let prefill = start_on(p, Role::Prefill, &shape, fast_core(), 31);
    let addrs = prefill.listen(any_port()).await.unwrap();
    let decode = start_on(d, Role::Decode, &shape, fast_core(), 32);
    let peer = decode.connect(addrs).await.unwrap();
    let mut handles = Vec::new();
    for r in 0..4u32 {
        let grant = Grant {
            extras: Vec::new(),
            pages: (r * 8..r * 8 + 8).collect(),
            aux_slot: Some(r),
            state_slot: None,
            receivers: 1,
            skip_pages: 0,
            idle_sources: 0,
            prompt: None,
        };
        let room = RoomId(u64::from(r) + 1);
        handles.push(
            decode
                .open_receiver(room, 0, vec![peer], Some(grant))
                .await
                .unwrap(),
        );
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let t0 = Instant::now();
    prefill.shutdown().await;
    drop(prefill);
    for mut h in handles {
        let state = tokio::time::timeout(Duration::from_secs(5), h.terminal())
            .await
            .expect("no hang");
        assert_eq!(
            state,
            KvPoll::Failed(FailureReason::PeerShutdown),
            "a prefill that shuts down says so, and decode files its rooms under it"
        );
        tokio::time::timeout(Duration::from_secs(5), h.releasable())
            .await
            .expect("released");
    }
    assert!(t0.elapsed() < Duration::from_secs(3));
    decode.shutdown().await;
}

/// Garbage, an oversized length and a data connection without a session key are refused; a
/// healthy decode keeps working.
async fn hostile_sockets_are_refused_while_other_peers_keep_working(p: Runtime, d: Runtime) {
    let shape = small_shape();
    let (prefill, addrs, _server) = prefill_on(p, &shape, fast_core(), 41, any_port()).await;
    for &addr in &addrs {
        // 1: not a kvferry connection at all.
        let mut junk = TcpStream::connect(addr).await.unwrap();
        junk.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        // 2: a control connection announcing a 4 GiB frame.
        let mut huge = TcpStream::connect(addr).await.unwrap();
        huge.write_all(b"KVF1\x01").await.unwrap();
        huge.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
        // 3: a data connection that does not hold a session key: it reads the challenge and
        // answers with a made-up tag and proof.
        let mut forged = TcpStream::connect(addr).await.unwrap();
        forged.write_all(b"KVF1\x02").await.unwrap();
        let mut challenge = [0u8; kvferry_tcp::DATA_CHALLENGE_LEN];
        forged.read_exact(&mut challenge).await.unwrap();
        let hello = kvferry_tcp::DataHello {
            tag: [9; 16],
            proof: challenge,
        };
        forged.write_all(&hello.encode()).await.unwrap();
        let mut answer = [0u8; 1];
        let refused = forged
            .read_exact(&mut answer)
            .await
            .map(|_| answer[0] != 0)
            .unwrap_or(true);
        assert!(
            refused,
            "a connection without the session key gets no data connection"
        );
        for s in [&mut junk, &mut huge] {
            assert!(kvferry_tests::closed_by_peer(s, Duration::from_secs(3)).await);
        }
    }
    assert!(
        prefill.counters().await.protocol_errors >= 1,
        "the oversized frame was counted"
    );
    let decode = start_on(d, Role::Decode, &shape, fast_core(), 42);
    let peer = decode.connect(addrs).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_all_clean(&run_decode(&decode, peer, rooms(20, 1)).await, 20);
}

/// A decode with another cluster token or another layout gets a typed error that says what to
/// check, not a hang.
async fn a_mismatched_peer_gets_a_typed_error_at_connect(p: Runtime, d: Runtime) {
    let shape = small_shape();
    let (_prefill, addrs, _server) = prefill_on(p, &shape, fast_core(), 51, any_port()).await;
    let mut cfg = kvferry_testkit::node_config(Role::Decode, &shape, fast_core(), b"other", 52);
    cfg.info.token = b"other-token".to_vec();
    let stranger = d
        .start(
            cfg,
            std::sync::Arc::new(kvferry_memory::MemoryMap::allocate(shape.layout())),
        )
        .unwrap();
    let err = stranger.connect(addrs.clone()).await.unwrap_err();
    assert!(err.to_string().contains("token"), "{err}");
    let other = Shape {
        page_bytes: 8192,
        ..small_shape()
    };
    let decode = start_on(d, Role::Decode, &other, fast_core(), 53);
    let err = decode.connect(addrs.clone()).await.unwrap_err();
    assert!(err.to_string().contains("page_bytes"), "{err}");
    // A kept peer refused before anyone waits for it: a later wait still hears what the
    // peer said, both values included.
    let kept = decode
        .connect_persistent(addrs)
        .await
        .expect("a kept peer is named at once");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let err = decode.reach(kept).await.unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("page_bytes") && text.contains("8192"),
        "{text}"
    );
}

/// Every write batch resets its connection: the threshold blacklists the session and new rooms
/// fail fast; once the link heals a probe recovers the session and rooms succeed again.
async fn a_failing_session_is_blacklisted_then_recovered_by_a_probe(p: Runtime, d: Runtime) {
    let core = Config {
        session_failure_threshold: 3,
        transfer_retries: 2,
        probe_interval: Duration::from_millis(200),
        ..fast_core()
    };
    let shape = small_shape();
    let (prefill, addrs, _server) = prefill_on(p, &shape, core.clone(), 61, any_port()).await;
    let decode = start_on(d, Role::Decode, &shape, core, 62);
    let peer = decode.connect(addrs).await.expect("connect");
    tokio::time::sleep(Duration::from_millis(20)).await;
    decode
        .set_faults(Some(FaultPlan {
            rate: 1.0,
            seed: 1,
            kind: FaultKind::Break,
        }))
        .await;
    let serial = Shape {
        concurrency: 1,
        ..small_shape()
    };
    let report = run_decode(
        &decode,
        peer,
        DecodeRun {
            shape: serial,
            ..rooms(8, 1)
        },
    )
    .await;
    assert_eq!(report.rooms_succeeded, 0, "{report:?}");
    assert!(
        report.failed_by_reason.contains_key("session_blacklisted"),
        "{report:?}"
    );
    assert!(prefill.counters().await.sessions_blacklisted >= 1);
    // A new room toward the blacklisted session fails at bootstrap, fast (room 2 uses the same
    // shard and peer address as rooms 2, 4, ... above).
    let t0 = Instant::now();
    let grant = Grant {
        extras: Vec::new(),
        pages: vec![0],
        aux_slot: None,
        state_slot: None,
        receivers: 1,
        skip_pages: 0,
        idle_sources: 0,
        prompt: None,
    };
    let mut h = decode
        .open_receiver(RoomId(98), 0, vec![peer], Some(grant))
        .await
        .unwrap();
    assert_eq!(
        h.terminal().await,
        KvPoll::Failed(FailureReason::SessionBlacklisted)
    );
    // At once, not at the 2 s bootstrap deadline (the bound leaves room for a loaded machine).
    assert!(t0.elapsed() < Duration::from_secs(1));
    // The link heals: probes recover every blacklisted session (one per shard pair; each
    // probes on its own timer).
    decode.set_faults(None).await;
    let until = Instant::now() + Duration::from_secs(5);
    let recovered = |c: &kvferry_core::Counters| c.sessions_recovered >= c.sessions_blacklisted;
    while !recovered(&prefill.counters().await) && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let c = prefill.counters().await;
    assert!(recovered(&c), "probes recover every session: {c:?}");
    let report = run_decode(&decode, peer, rooms(20, 100)).await;
    assert_all_clean(&report, 20);
}

/// A decode that has no pages for a room keeps prefill waiting only until prefill's deadline,
/// which then fails the room as `DecodeSaturated` on both sides.
async fn a_saturated_decode_fails_rooms_with_decode_saturated_at_the_deadline(
    p: Runtime,
    d: Runtime,
) {
    let shape = small_shape();
    let (prefill, addrs, _server) = prefill_on(p, &shape, fast_core(), 71, any_port()).await;
    let slow_bootstrap = Config {
        bootstrap_timeout: Duration::from_secs(10),
        ..fast_core()
    };
    let decode = start_on(d, Role::Decode, &shape, slow_bootstrap, 72);
    let peer = decode.connect(addrs).await.expect("connect");
    decode
        .set_capacity(Capacity {
            free_pages: 0,
            queued_rooms: 5,
        })
        .await;
    // Before the open: prefill's deadline cannot start before decode's request.
    let t0 = Instant::now();
    let mut h = decode
        .open_receiver(RoomId(1), 0, vec![peer], None)
        .await
        .unwrap();
    decode.set_queue_position(RoomId(1), 5).await.unwrap();
    let state = tokio::time::timeout(Duration::from_secs(6), h.terminal())
        .await
        .expect("no hang");
    assert_eq!(state, KvPoll::Failed(FailureReason::DecodeSaturated));
    assert!(
        t0.elapsed() >= Duration::from_millis(1900),
        "waited for the bootstrap deadline"
    );
    let c = prefill.counters().await;
    assert_eq!(c.failed(FailureReason::DecodeSaturated), 1, "{c:?}");
}

#[path = "drivers/lifecycle.rs"]
mod lifecycle;
use lifecycle::*;

/// The node API is one type whatever runtime started it: a decode's subscribers hear each of
/// its rooms succeed, `room_state` answers from the shard owning the room, and a verdict
/// applied to a room that already ended changes nothing.
async fn a_nodes_subscribers_and_room_queries_follow_its_rooms(p: Runtime, d: Runtime) {
    let shape = small_shape();
    let (prefill, addrs, server) = prefill_on(p, &shape, fast_core(), 161, any_port()).await;
    let decode = start_on(d, Role::Decode, &shape, fast_core(), 162);
    let mut events = decode.subscribe();
    let peer = decode.connect(addrs).await.unwrap();
    let report = run_decode(&decode, peer, rooms(6, 70)).await;
    assert_all_clean(&report, 6);
    let mut succeeded = std::collections::BTreeSet::new();
    while let Ok(event) = events.try_recv() {
        if let kvferry_core::Event::RoomState {
            room,
            state: KvPoll::Success,
            ..
        } = event
        {
            succeeded.insert(room.0);
        }
    }
    assert_eq!(succeeded, (70..76).collect(), "{:?}", decode.runtime());
    for room in 70..76 {
        let room = RoomId(room);
        assert_eq!(decode.room_state(room).await, Some(KvPoll::Success));
        assert!(!decode.fail_room(room, FailureReason::AbortedLocally).await);
        assert_eq!(decode.room_state(room).await, Some(KvPoll::Success));
    }
    assert_eq!(decode.room_state(RoomId(9999)).await, None);
    decode.shutdown().await;
    prefill.shutdown().await;
    server.abort();
}

on_every_driver!(
    a_decode_abort_mid_transfer_releases_pages_on_the_drain_ack,
    a_lost_abort_keeps_pages_quarantined_until_the_fence,
    many_concurrent_rooms_succeed_with_every_byte_verified,
    a_prefix_room_moves_every_granted_page_with_every_byte_verified,
    a_prefill_that_sends_less_than_its_grant_fails_the_room_on_both_sides,
    chunked_rooms_succeed,
    layerwise_rooms_succeed,
    a_layerwise_batch_delivers_each_layer_after_its_compute,
    a_forward_pass_that_fails_mid_batch_fails_every_room,
    aborted_rooms_give_their_pages_back_clean,
    two_decodes_share_one_prefill,
    a_prefill_dropped_mid_transfer_fails_decode_rooms_with_a_reason,
    hostile_sockets_are_refused_while_other_peers_keep_working,
    a_mismatched_peer_gets_a_typed_error_at_connect,
    a_failing_session_is_blacklisted_then_recovered_by_a_probe,
    a_saturated_decode_fails_rooms_with_decode_saturated_at_the_deadline,
    a_prefill_abort_reaches_decode_at_once,
    a_room_asked_for_before_the_prefill_subscribes_is_announced_when_it_does,
    a_restarted_prefill_is_reconnected_and_used_again,
    a_persistent_peer_down_past_its_window_is_reported_unreachable,
    a_peer_connected_twice_serves_rooms_on_both_handles,
    a_stalled_decode_does_not_delay_rooms_toward_another_decode,
    a_disconnected_persistent_peer_is_closed_and_dialed_no_more,
    a_connect_that_fails_part_way_leaves_no_session_behind,
    a_wait_for_a_kept_peer_ends_when_it_is_disconnected,
    rooms_move_over_a_link_slower_than_the_connect_timeout,
    a_clean_rooms_writes_are_admitted_without_the_drivers_lock,
    a_nodes_subscribers_and_room_queries_follow_its_rooms,
);

/// A node that begins its shutdown closes its listeners before it tells any peer: a peer
/// that dials again as soon as it hears the goodbye is refused (and dials on until the next
/// incarnation listens), instead of being let in by a node about to go and left waiting out
/// its handshake timeout (10 s) for an answer that never comes. The peer here is a decode
/// core driven by hand over a socket, so nothing stands between hearing and dialing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_dials_on_hearing_the_goodbye_is_refused() {
    for runtime in [Runtime::Tokio, kvferry_tests::GLOMMIO] {
        let shape = small_shape();
        let (prefill, addrs, server) =
            prefill_on(runtime, &shape, fast_core(), 141, any_port()).await;
        let mut peer = HandDecode::connect(addrs[0], &shape, 142).await;
        peer.until(|e, s| e.session_state(s) == Some(SessionState::Established))
            .await;
        let shutdown = tokio::spawn({
            let prefill = prefill.clone();
            async move { prefill.shutdown().await }
        });
        // Heard: the prefill said it is closing the session (its goodbye, nothing else).
        peer.until(|e, s| e.session_state(s) != Some(SessionState::Established))
            .await;
        assert!(
            peer.heard.iter().any(|ev| matches!(
                ev,
                kvferry_core::Event::PeerError {
                    code: kvferry_core::codec::ErrorCode::Shutdown,
                    ..
                }
            )),
            "{runtime:?}: the session ended otherwise: {:?}",
            peer.heard
        );
        for &addr in &addrs {
            let dialed = TcpStream::connect(addr).await;
            assert!(
                dialed.is_err(),
                "{runtime:?}: {addr} let a peer in after its goodbye"
            );
        }
        shutdown.await.unwrap();
        server.abort();
    }
}

/// The routing rule is the only thing shards of two nodes must agree on (they share no
/// state): with different shard counts on each side, and a single-shard tokio node against a
/// three-shard glommio prefill, every room still meets its peer and every byte arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rooms_meet_their_peer_whatever_the_shard_counts() {
    let three = Runtime::Glommio {
        shards: 3,
        pin: false,
    };
    let two = Runtime::Glommio {
        shards: 2,
        pin: false,
    };
    for (p, d) in [(three, two), (two, three), (three, Runtime::Tokio)] {
        let report = pair(p, d, fast_core(), rooms(60, 1)).await;
        assert_all_clean(&report, 60);
    }
}

/// A second node cannot take an address another node listens on (a glommio listener must
/// not share its port through SO_REUSEPORT and steal connections).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_listener_on_a_taken_address_is_refused() {
    for runtime in [Runtime::Tokio, kvferry_tests::GLOMMIO] {
        let shape = small_shape();
        let at = free_ports(2);
        let (_first, addrs, _server) = prefill_on(runtime, &shape, fast_core(), 1, at).await;
        let second = start_on(runtime, Role::Prefill, &shape, fast_core(), 2);
        let taken = second.listen(addrs[0]).await;
        assert!(taken.is_err(), "{runtime:?}: {taken:?}");
    }
}

/// A decode node's config that asks for RDMA, and its memory.
#[cfg(not(feature = "rdma"))]
fn rdma_decode_config() -> (
    kvferry_tokio::NodeConfig,
    std::sync::Arc<kvferry_memory::MemoryMap>,
) {
    let shape = small_shape();
    let cfg = kvferry_tests::rdma_config(Role::Decode, &shape, fast_core(), 1);
    let memory = std::sync::Arc::new(kvferry_memory::MemoryMap::allocate(shape.layout()));
    (cfg, memory)
}

/// A node built without the `rdma` feature, asked for RDMA, says how to get it (on either
/// runtime).
#[cfg(not(feature = "rdma"))]
#[tokio::test]
async fn a_node_without_rdma_built_in_refuses_the_rdma_backend() {
    for runtime in [Runtime::Tokio, kvferry_tests::GLOMMIO] {
        let (cfg, memory) = rdma_decode_config();
        match runtime.start(cfg, memory) {
            Err(
                e @ kvferry_tokio::NodeError::Unsupported(kvferry_tokio::Unsupported::RdmaNotBuilt),
            ) => {
                let why = e.to_string();
                assert!(
                    why.contains("rdma") && why.contains("--backend tcp"),
                    "{why}"
                )
            }
            Err(e) => panic!("another error: {e}"),
            Ok(_) => panic!("started without RDMA support"),
        }
    }
}

/// A decode core driven by hand over one control connection: what a peer hears and when it
/// dials, with no driver in between.
struct HandDecode {
    endpoint: kvferry_core::Endpoint,
    session: kvferry_core::SessionId,
    stream: TcpStream,
    unread: Vec<u8>,
    /// What the core made of what it heard.
    heard: Vec<kvferry_core::Event>,
}

impl HandDecode {
    /// Dials `to` and starts a handshake as a decode of `shape`.
    async fn connect(to: SocketAddr, shape: &kvferry_testkit::Shape, seed: u64) -> HandDecode {
        let cfg =
            kvferry_testkit::node_config(Role::Decode, shape, fast_core(), b"test-token", seed);
        let mut endpoint =
            kvferry_core::Endpoint::new(cfg.core, cfg.info, seed, Instant::now()).unwrap();
        let mut stream = TcpStream::connect(to).await.unwrap();
        stream.write_all(&kvferry_tcp::MAGIC).await.unwrap();
        stream
            .write_all(&[kvferry_tcp::KIND_CONTROL])
            .await
            .unwrap();
        let session = endpoint.open_session(Instant::now());
        HandDecode {
            endpoint,
            session,
            stream,
            unread: Vec::new(),
            heard: Vec::new(),
        }
    }

    /// Sends what the core has to send, then feeds it what arrives until `done` holds.
    async fn until(
        &mut self,
        done: impl Fn(&kvferry_core::Endpoint, kvferry_core::SessionId) -> bool,
    ) {
        let mut buf = vec![0u8; 64 * 1024];
        while !done(&self.endpoint, self.session) {
            let mut out = Vec::new();
            while self.endpoint.poll_transmit(&mut out).is_some() {}
            self.stream.write_all(&out).await.unwrap();
            let n = tokio::time::timeout(Duration::from_secs(5), self.stream.read(&mut buf))
                .await
                .expect("the prefill says something within 5 s")
                .unwrap();
            assert!(n > 0, "the prefill closed the connection unheard");
            self.unread.extend_from_slice(&buf[..n]);
            let used = self
                .endpoint
                .handle_input(Instant::now(), self.session, &self.unread);
            self.unread.drain(..used);
            self.heard
                .extend(std::iter::from_fn(|| self.endpoint.poll_event()));
        }
    }
}
