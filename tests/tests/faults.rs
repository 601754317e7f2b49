//! Real nodes, real sockets, injected faults: connection resets on the data path and decode
//! aborts, reproducible per seed. Nothing may be lost or corrupted.
#![allow(clippy::unwrap_used)] // tests may panic

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

// ---------------------------------------------------------------------------------------
// One test per failure of the faults issue, over real sockets.

use std::time::{Duration, Instant};

use kvferry_cli::{run_decode, serve_prefill, DecodeRun};
use kvferry_core::{Config, Event, FailureReason, Grant, KvPoll, Role, RoomId};
use kvferry_tests::proxy::FaultProxy;
use kvferry_tests::{prefill, start};
use kvferry_tokio::FaultPlan;

fn rooms(n: u64, first: u64) -> DecodeRun {
    DecodeRun {
        rooms: n,
        shape: small_shape(),
        first_room: first,
        progress: None,
        deadline: Duration::from_secs(30),
        abort_rate: 0.0,
        seed: 0,
        target: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f01_transient_failures_are_retried_and_rooms_succeed() {
    let core = Config {
        // A reset fails every operation pipelined on its connection (about half of them per
        // attempt at this rate): 16 attempts make exhausting one vanishingly rare.
        transfer_retries: 16,
        ..fast_core()
    };
    let faults = DemoFaults {
        fault_rate: 0.1,
        abort_rate: 0.0,
        seed: 11,
    };
    let report = run_demo(small_shape(), core, 200, faults, None)
        .await
        .expect("demo runs");
    kvferry_tests::assert_all_clean(&report, 200);
    assert!(report.retries > 0);
}

async fn blacklisted_pair() -> (
    kvferry_tokio::Node,
    kvferry_tokio::Node,
    kvferry_core::SessionId,
) {
    let core = Config {
        session_failure_threshold: 3,
        transfer_retries: 2,
        probe_interval: Duration::from_millis(200),
        ..fast_core()
    };
    let (p, addr, _server) = prefill(&small_shape(), core.clone(), 61).await;
    let d = start(Role::Decode, &small_shape(), core, 62);
    let s = d.connect(addr).await.expect("connect");
    tokio::time::sleep(Duration::from_millis(20)).await;
    d.set_faults(Some(FaultPlan { rate: 1.0, seed: 1 }));
    (p, d, s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f02_consecutive_failures_blacklist_the_session_and_new_rooms_fail_fast() {
    let (p, d, s) = blacklisted_pair().await;
    let report = run_decode(
        &d,
        s,
        DecodeRun {
            shape: Shape {
                concurrency: 1,
                ..small_shape()
            },
            ..rooms(8, 1)
        },
    )
    .await;
    assert_eq!(report.rooms_succeeded, 0);
    assert!(
        report
            .failed_by_reason
            .get("transfer_failed")
            .copied()
            .unwrap_or(0)
            >= 3,
        "{report:?}"
    );
    assert!(
        report
            .failed_by_reason
            .get("session_blacklisted")
            .copied()
            .unwrap_or(0)
            >= 1,
        "{report:?}"
    );
    assert!(p.counters().sessions_blacklisted >= 1);
    // A new room toward the blacklisted session fails at bootstrap, fast.
    let t0 = Instant::now();
    let mut h = d
        .open_receiver(
            RoomId(99),
            0,
            &[s],
            Some(Grant {
                pages: vec![0],
                aux_slot: None,
                state_slot: None,
                receivers: 1,
            }),
        )
        .unwrap();
    assert_eq!(
        h.terminal().await,
        KvPoll::Failed(FailureReason::SessionBlacklisted)
    );
    assert!(t0.elapsed() < Duration::from_millis(100));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f03_a_healed_link_is_unblacklisted_by_a_probe_and_new_rooms_succeed() {
    let (p, d, s) = blacklisted_pair().await;
    let mut events = p.subscribe();
    let _ = run_decode(
        &d,
        s,
        DecodeRun {
            shape: Shape {
                concurrency: 1,
                ..small_shape()
            },
            ..rooms(4, 1)
        },
    )
    .await;
    assert!(p.counters().sessions_blacklisted >= 1);
    d.set_faults(None);
    let recovered = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let Ok(Event::SessionRecovered { .. }) = events.recv().await {
                return;
            }
        }
    })
    .await;
    assert!(recovered.is_ok(), "a probe recovers the session");
    assert!(p.counters().sessions_recovered >= 1);
    let report = run_decode(&d, s, rooms(20, 100)).await;
    kvferry_tests::assert_all_clean(&report, 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f04_a_saturated_decode_fails_prefill_rooms_with_decode_saturated_at_the_deadline() {
    let (p, addr, _server) = prefill(&small_shape(), fast_core(), 71).await;
    // Decode would wait longer for pages than prefill waits for decode.
    let d = start(
        Role::Decode,
        &small_shape(),
        Config {
            bootstrap_timeout: Duration::from_secs(10),
            ..fast_core()
        },
        72,
    );
    let s = d.connect(addr).await.expect("connect");
    d.set_capacity(kvferry_core::Capacity {
        free_pages: 0,
        queued_rooms: 5,
    });
    let mut h = d.open_receiver(RoomId(1), 0, &[s], None).unwrap();
    d.set_queue_position(RoomId(1), 5).unwrap();
    let t0 = Instant::now();
    let state = tokio::time::timeout(Duration::from_secs(6), h.terminal())
        .await
        .expect("no hang");
    assert_eq!(state, KvPoll::Failed(FailureReason::DecodeSaturated));
    assert!(
        t0.elapsed() >= Duration::from_millis(1900),
        "waited for the bootstrap deadline"
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        p.room_state(RoomId(1)),
        Some(KvPoll::Failed(FailureReason::DecodeSaturated))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f07_a_lost_abort_keeps_pages_quarantined_until_the_fence() {
    let shape = Shape {
        page_bytes: 64 * 1024,
        pages_per_room: 64,
        ..small_shape()
    };
    // Liveness outlasts the abort-ack timeout here, so the fence is what releases the pages
    // (a session declared dead would be a fence too).
    let core = Config {
        heartbeat_interval: Duration::from_secs(2),
        ..fast_core()
    };
    let (p, addr, _server) = prefill(&shape, core.clone(), 81).await;
    let proxy = FaultProxy::start(addr, 5).await.unwrap();
    let d = start(Role::Decode, &shape, core, 82);
    let s = d.connect(proxy.addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    // 64 KiB chunks 5 ms apart: the room's 32 MiB need far longer than this test waits.
    proxy.set(|f| f.delay = Duration::from_millis(5));
    let pages: Vec<u32> = (0..64).collect();
    let mut h = d
        .open_receiver(
            RoomId(1),
            0,
            &[s],
            Some(Grant {
                pages,
                aux_slot: Some(0),
                state_slot: None,
                receivers: 1,
            }),
        )
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        h.view().state,
        KvPoll::WaitingForInput,
        "writes have not finished"
    );
    // The link goes dark: the abort and any ack are held, as if lost.
    proxy.set(|f| f.blackhole_until = Some(Instant::now() + Duration::from_secs(30)));
    let mut events = d.subscribe();
    let t0 = Instant::now();
    d.abort(RoomId(1)).unwrap();
    assert_eq!(
        h.terminal().await,
        KvPoll::Failed(FailureReason::AbortedLocally)
    );
    tokio::time::timeout(Duration::from_secs(5), h.releasable())
        .await
        .expect("released after the fence");
    let mut seen = Vec::new();
    while let Ok(e) = events.try_recv() {
        seen.push(format!("{e:?}"));
    }
    assert!(
        t0.elapsed() >= Duration::from_millis(450),
        "no release before the abort-ack timeout: {:?} {seen:?} {:?} prefill {:?} {:?}",
        t0.elapsed(),
        d.counters(),
        p.counters(),
        p.room_state(RoomId(1))
    );
    assert!(d.counters().fences >= 1, "the session was fenced");
    drop(p);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f08_a_prefill_abort_reaches_decode_at_once_with_its_reason() {
    let shape = small_shape();
    let p = start(Role::Prefill, &shape, fast_core(), 91);
    let addr = p.listen("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let mut ann = p.room_announcements();
    let d = start(Role::Decode, &shape, fast_core(), 92);
    let s = d.connect(addr).await.expect("connect");
    let mut h = d
        .open_receiver(
            RoomId(5),
            0,
            &[s],
            Some(Grant {
                pages: vec![1, 2],
                aux_slot: None,
                state_slot: None,
                receivers: 1,
            }),
        )
        .unwrap();
    let a = ann.recv().await.unwrap();
    p.open_sender(a.room, a.generation).unwrap();
    let t0 = Instant::now();
    p.abort(RoomId(5)).unwrap();
    assert_eq!(
        h.terminal().await,
        KvPoll::Failed(FailureReason::AbortedByPeer)
    );
    assert!(
        t0.elapsed() < Duration::from_millis(200),
        "not at the waiting deadline"
    );
    h.releasable().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f09_a_prefill_restarted_behind_the_same_address_is_used_again() {
    let shape = small_shape();
    let (p1, addr, server1) = prefill(&shape, fast_core(), 101).await;
    let d = start(Role::Decode, &shape, fast_core(), 102);
    let s1 = d.connect(addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(run_decode(&d, s1, rooms(5, 1)).await.rooms_succeeded, 5);
    p1.shutdown().await;
    server1.abort();
    drop(p1);
    tokio::time::sleep(Duration::from_millis(50)).await;
    // A new process (new incarnation) behind the same address.
    let p2 = start(Role::Prefill, &shape, fast_core(), 103);
    let addr2 = p2.listen(addr).await.unwrap();
    assert_eq!(addr, addr2);
    let _server2 = tokio::spawn(serve_prefill(p2.clone(), shape.clone()));
    let s2 = d.connect(addr).await.unwrap();
    assert_ne!(s1, s2);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let report = run_decode(&d, s2, rooms(10, 100)).await;
    kvferry_tests::assert_all_clean(&report, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f11_a_stalled_decode_does_not_delay_rooms_toward_another_decode() {
    let shape = small_shape();
    let (_p, addr, _server) = prefill(&shape, fast_core(), 111).await;
    let proxy = FaultProxy::start(addr, 9).await.unwrap();
    let slow = start(Role::Decode, &shape, fast_core(), 112);
    let fast = start(Role::Decode, &shape, fast_core(), 113);
    let s_slow = slow.connect(proxy.addr).await.unwrap();
    let s_fast = fast.connect(addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    // The slow decode stops reading entirely; its rooms pile up on the prefill.
    proxy.set(|f| {
        f.stall_up = true;
        f.stall_down = true;
    });
    let stuck = tokio::spawn(async move { run_decode(&slow, s_slow, rooms(8, 1)).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let report = run_decode(&fast, s_fast, rooms(50, 1000)).await;
    kvferry_tests::assert_all_clean(&report, 50);
    assert!(
        report.latency_ms.1 < 500.0,
        "p99 {} ms: no head-of-line blocking",
        report.latency_ms.1
    );
    stuck.abort();
}

/// Three prefill PP stages feed one decode room and disagree: one never gets input (it would
/// time out), one aborts, one is slow. The leader's consensus verdict is applied exactly once
/// on every rank, nothing panics, and decode fails softly with a reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f05_skewed_prefill_ranks_reach_one_verdict_and_decode_fails_softly() {
    use kvferry_core::consensus::ConsensusLog;
    let shape = small_shape();
    let mut ranks = Vec::new();
    for (rank, layers) in [(0u16, 0u16..1u16), (1, 1..3), (2, 3..4)] {
        let mut cfg = kvferry_cli::node_config(
            Role::Prefill,
            &shape,
            fast_core(),
            b"test-token",
            120 + u64::from(rank),
        );
        cfg.info.rank = rank;
        cfg.info.layer_start = layers.start;
        cfg.info.layer_end = layers.end;
        cfg.info.writes_aux = layers.end == shape.layers;
        let node = kvferry_tokio::Node::start(
            cfg,
            std::sync::Arc::new(kvferry_tcp::MemoryMap::allocate(shape.layout())),
        )
        .unwrap();
        let addr = node.listen("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let ann = node.room_announcements();
        ranks.push((node, addr, ann));
    }
    let d = start(Role::Decode, &shape, fast_core(), 130);
    let mut sources = Vec::new();
    for (_, addr, _) in &ranks {
        sources.push(d.connect(*addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    let room = RoomId(42);
    let pages: Vec<u32> = (0..8).collect();
    let mut h = d
        .open_receiver(
            room,
            0,
            &sources,
            Some(Grant {
                pages: pages.clone(),
                aux_slot: Some(1),
                state_slot: None,
                receivers: 1,
            }),
        )
        .unwrap();
    for (node, _, ann) in ranks.iter_mut() {
        let a = ann.recv().await.unwrap();
        node.open_sender(a.room, a.generation).unwrap();
    }
    // Rank 2 is slow: it sends after a while. Rank 0 never gets input. Rank 1 aborts.
    let slow = ranks[2].0.clone();
    let slow_pages = pages.clone();
    let slow_task = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let _ = slow.send_chunk(
            room,
            kvferry_core::Chunk {
                pages: slow_pages,
                last: true,
                aux_slot: Some(1),
                state_slot: None,
                layerwise: false,
            },
        );
    });
    ranks[1].0.abort(room).unwrap();
    // The leader (rank 0) combines what it sees right now: skewed views, no assertion.
    let polls: Vec<KvPoll> = ranks
        .iter()
        .map(|(n, _, _)| n.room_state(room).unwrap_or(KvPoll::Bootstrapping))
        .collect();
    let mut leader = ConsensusLog::new(64);
    let decision = leader
        .decide(room, &polls)
        .expect("a failed rank makes a terminal verdict");
    let reason = kvferry_core::consensus::verdict_failure(decision.verdict).expect("a failure");
    assert!(reason.is_soft());
    // Every rank applies the broadcast decision exactly once, delivered twice.
    for (node, _, _) in &ranks {
        let mut log = ConsensusLog::new(64);
        let mut applied = log.apply(decision);
        applied.extend(log.apply(decision));
        assert_eq!(applied, vec![decision]);
        node.fail_room(room, reason);
        assert!(
            !node.fail_room(room, reason),
            "a verdict applied twice changes nothing"
        );
    }
    let state = tokio::time::timeout(Duration::from_secs(5), h.terminal())
        .await
        .expect("decode concludes");
    assert!(
        matches!(state, KvPoll::Failed(r) if r.is_soft()),
        "{state:?}"
    );
    tokio::time::timeout(Duration::from_secs(5), h.releasable())
        .await
        .expect("decode releases after every drain ack");
    for (node, _, _) in &ranks {
        assert!(matches!(node.room_state(room), Some(KvPoll::Failed(_))));
    }
    slow_task.abort();
}

/// A truncated control frame and repeated garbage earn strikes; the offender is disconnected,
/// a healthy decode on the same prefill sees no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f10_truncated_frames_and_repeated_garbage_disconnect_only_the_offender() {
    use tokio::io::AsyncWriteExt;
    let shape = small_shape();
    let (p, addr, _server) = prefill(&shape, fast_core(), 141).await;
    let healthy = start(Role::Decode, &shape, fast_core(), 142);
    let s = healthy.connect(addr).await.unwrap();
    // A control connection whose frames have sane lengths but unknown types: three strikes.
    let mut bad = tokio::net::TcpStream::connect(addr).await.unwrap();
    bad.write_all(b"KVF1\x01").await.unwrap();
    for _ in 0..3 {
        bad.write_all(&[2, 0, 0, 0, 1, 200]).await.unwrap();
    }
    let closed = kvferry_tests::closed_by_peer(&mut bad, Duration::from_secs(3)).await;
    assert!(
        closed,
        "the offender is disconnected after repeated strikes"
    );
    // A truncated frame through the proxy ends that connection; nothing leaks to other peers.
    let proxy = FaultProxy::start(addr, 3).await.unwrap();
    let victim = start(Role::Decode, &shape, fast_core(), 143);
    let _ = victim.connect(proxy.addr).await;
    proxy.set(|f| f.truncate_next = Some(3));
    assert!(p.counters().protocol_errors >= 3);
    let report = run_decode(&healthy, s, rooms(20, 500)).await;
    kvferry_tests::assert_all_clean(&report, 20);
}

/// A rogue prefill that passes the handshake then writes outside the pages the room was
/// granted: the write is refused and counted, nothing lands, the room fails with a protocol
/// error, and the decode keeps running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f10_a_write_outside_the_rooms_pages_is_refused_and_nothing_lands() {
    use kvferry_core::{
        Endpoint, EndpointInfo, Incarnation, NodeId, Region, Slice, TransferId, TransferOp,
        TransferOutcome,
    };
    use kvferry_tcp::{answer_data, read_preamble, DataSender, MemoryMap, Preamble};
    use std::sync::{Arc, Mutex};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let shape = small_shape();
    let layout = shape.layout();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let d = start(Role::Decode, &shape, fast_core(), 151);
    let connect = tokio::spawn({
        let d = d.clone();
        async move { d.connect(addr).await }
    });
    // The rogue speaks the real control protocol through a real core endpoint.
    let (mut control, _) = listener.accept().await.unwrap();
    assert!(matches!(
        read_preamble(&mut control).await.unwrap(),
        Preamble::Control
    ));
    let mut info = EndpointInfo::new(Role::Prefill, NodeId(666), Incarnation(666), layout);
    info.token = b"test-token".to_vec();
    let now = std::time::Instant::now();
    let mut rogue = Endpoint::new(fast_core(), info, 666, now).unwrap();
    let sid = rogue.open_session(now);
    let mut out = Vec::new();
    while rogue.poll_transmit(&mut out).is_some() {}
    control.write_all(&out).await.unwrap();
    let session = connect.await.unwrap().expect("handshake with the rogue");
    let pages: Vec<u32> = (0..4).collect();
    let mut h = d
        .open_receiver(
            RoomId(1),
            0,
            &[session],
            Some(Grant {
                pages,
                aux_slot: None,
                state_slot: None,
                receivers: 1,
            }),
        )
        .unwrap();
    // Read the decode's hello and room request.
    let mut buf = vec![0u8; 4096];
    let n = control.read(&mut buf).await.unwrap();
    rogue.handle_input(std::time::Instant::now(), sid, &buf[..n]);
    // A data connection arrives from the decode; the rogue writes page 50 (registered, not granted).
    let (mut data, _) = listener.accept().await.unwrap();
    assert!(matches!(
        read_preamble(&mut data).await.unwrap(),
        Preamble::Data(_)
    ));
    answer_data(&mut data, true).await.unwrap();
    let src = Arc::new(MemoryMap::allocate(layout));
    src.write(Region::Kv { layer: 0, plane: 0 }, 50 * 4096, &[0xAB; 4096])
        .unwrap();
    let outcome = Arc::new(Mutex::new(None));
    let o = outcome.clone();
    let sender = DataSender::spawn(
        data,
        src,
        Arc::new(move |_, r| *o.lock().unwrap() = Some(r)),
    );
    let slice = Slice {
        region: Region::Kv { layer: 0, plane: 0 },
        src_offset: 50 * 4096,
        dst_offset: 50 * 4096,
        len: 4096,
    };
    let op = TransferOp {
        id: TransferId(1),
        session: sid,
        room: Some(RoomId(1)),
        generation: 0,
        kind: kvferry_core::OpKind::Kv,
        attempt: 1,
        slices: vec![slice].into(),
        bytes: 4096,
    };
    sender.send(op).unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    while outcome.lock().unwrap().is_none() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(*outcome.lock().unwrap(), Some(TransferOutcome::Refused));
    assert!(d.counters().writes_refused >= 1);
    assert_eq!(
        h.terminal().await,
        KvPoll::Failed(FailureReason::ProtocolError)
    );
    let mut page = vec![0u8; 4096];
    d.memory()
        .read(Region::Kv { layer: 0, plane: 0 }, 50 * 4096, &mut page)
        .unwrap();
    assert!(page.iter().all(|b| *b == 0), "nothing landed");
}

/// The decode keeps a persistent session: when the prefill restarts behind the same address
/// the core reconnects on its own, notices the new incarnation, and rooms keep flowing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f09_a_persistent_decode_reconnects_to_a_restarted_prefill_by_itself() {
    let shape = small_shape();
    let (p1, addr, server1) = prefill(&shape, fast_core(), 161).await;
    let d = start(Role::Decode, &shape, fast_core(), 162);
    let target = d.connect_persistent(addr);
    let persistent = |first| DecodeRun {
        target: Some(target),
        ..rooms(5, first)
    };
    assert_eq!(
        run_decode(&d, kvferry_core::SessionId(0), persistent(1))
            .await
            .rooms_succeeded,
        5
    );
    let before = d.target_session(target).expect("connected");
    p1.shutdown().await;
    server1.abort();
    drop(p1);
    let p2 = start(Role::Prefill, &shape, fast_core(), 163);
    p2.listen(addr).await.unwrap();
    let _server2 = tokio::spawn(serve_prefill(p2.clone(), shape.clone()));
    // No connect call: the core's reconnect backoff brings the session back.
    let report = run_decode(
        &d,
        kvferry_core::SessionId(0),
        DecodeRun {
            rooms: 10,
            ..persistent(100)
        },
    )
    .await;
    kvferry_tests::assert_all_clean(&report, 10);
    assert_ne!(
        d.target_session(target),
        Some(before),
        "a new session to the new incarnation"
    );
}
