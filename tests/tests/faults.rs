//! Real nodes, real sockets, injected faults: connection resets on the data path and decode
//! aborts, reproducible per seed. Nothing may be lost or corrupted.
//!
//! The soak and the retried resets run on both drivers. The scenarios of the faults issue
//! that need no hand-driven peer live in `drivers.rs` and run on every driver; the three at the
//! end of this file stay on the tokio driver, each saying why.
#![allow(clippy::unwrap_used)] // tests may panic

use kvferry_testkit::{run_demo, DemoFaults, Shape};
use kvferry_tests::{fast_core, small_shape, Runtime, GLOMMIO};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_with_resets_and_aborts_loses_no_room_and_corrupts_no_page_on_tokio() {
    soak(Runtime::Tokio).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_with_resets_and_aborts_loses_no_room_and_corrupts_no_page_on_glommio() {
    soak(GLOMMIO).await;
}

/// The CI-sized soak of the demo's fault plan: 2,000 rooms, 5 % resets, 5 % aborts.
async fn soak(runtime: Runtime) {
    let shape = Shape {
        concurrency: 16,
        ..small_shape()
    };
    let faults = DemoFaults {
        fault_rate: 0.05,
        abort_rate: 0.05,
        seed: 7,
    };
    let report = run_demo(
        shape,
        fast_core(),
        2000,
        faults,
        None,
        runtime,
        Default::default(),
    )
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

// ---------------------------------------------------------------------------------------
// One test per failure of the faults issue, over real sockets.

use std::time::{Duration, Instant};

use kvferry_core::{Config, FailureReason, Grant, KvPoll, Role, RoomId};
use kvferry_testkit::{run_decode, DecodeRun};
use kvferry_tests::proxy::FaultProxy;
use kvferry_tests::{prefill, start};

fn rooms(n: u64, first: u64) -> DecodeRun {
    DecodeRun {
        rooms: n,
        shape: small_shape(),
        first_room: first,
        progress: None,
        deadline: Duration::from_secs(30),
        abort_rate: 0.0,
        seed: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f01_transient_failures_are_retried_and_rooms_succeed_on_tokio() {
    f01(Runtime::Tokio).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f01_transient_failures_are_retried_and_rooms_succeed_on_glommio() {
    f01(GLOMMIO).await;
}

async fn f01(runtime: Runtime) {
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
    let report = run_demo(
        small_shape(),
        core,
        200,
        faults,
        None,
        runtime,
        Default::default(),
    )
    .await
    .expect("demo runs");
    kvferry_tests::assert_all_clean(&report, 200);
    assert!(report.retries > 0);
}

/// Three prefill PP stages feed one decode room and disagree: one never gets input (it would
/// time out), one aborts, one is slow. The leader's consensus verdict is applied exactly once
/// on every rank, nothing panics, and decode fails softly with a reason.
///
/// Tokio only: the test plays the embedder's consensus by hand through the tokio node's
/// synchronous calls (`room_state`, `fail_room`) and one decode room fed by three sessions;
/// what it checks is the core's consensus, which no driver touches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f05_skewed_prefill_ranks_reach_one_verdict_and_decode_fails_softly() {
    use kvferry_core::consensus::ConsensusLog;
    let shape = small_shape();
    let mut ranks = Vec::new();
    for (rank, layers) in [(0u16, 0u16..1u16), (1, 1..3), (2, 3..4)] {
        let mut cfg = kvferry_testkit::node_config(
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
        let node = kvferry_tokio::start(
            cfg,
            std::sync::Arc::new(kvferry_memory::MemoryMap::allocate(shape.layout())),
        )
        .unwrap();
        let addr = node.listen("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let ann = node.room_announcements();
        ranks.push((node, addr, ann));
    }
    let d = start(Role::Decode, &shape, fast_core(), 130);
    let mut sources = Vec::new();
    for (_, addr, _) in &ranks {
        sources.push(d.connect(addr.clone()).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    let room = RoomId(42);
    let pages: Vec<u32> = (0..8).collect();
    let mut h = d
        .open_receiver(
            room,
            0,
            sources.clone(),
            Some(Grant {
                extras: Vec::new(),
                pages: pages.clone(),
                aux_slot: Some(1),
                state_slot: None,
                receivers: 1,
                skip_pages: 0,
                idle_sources: 0,
                prompt: None,
            }),
        )
        .await
        .unwrap();
    for (node, _, ann) in ranks.iter_mut() {
        let a = ann.recv().await.unwrap();
        node.open_sender(a.room, a.generation, None).await.unwrap();
    }
    // Rank 2 is slow: it sends after a while. Rank 0 never gets input. Rank 1 aborts.
    let slow = ranks[2].0.clone();
    let slow_pages = pages.clone();
    let slow_task = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let _ = slow
            .send_chunk(
                room,
                kvferry_core::Chunk {
                    extras: Vec::new(),
                    pages: slow_pages,
                    last: true,
                    aux_slot: Some(1),
                    state_slot: None,
                    layerwise: false,
                },
            )
            .await;
    });
    ranks[1].0.abort(room).await.unwrap();
    // The leader (rank 0) combines what it sees right now: skewed views, no assertion.
    let mut polls: Vec<KvPoll> = Vec::new();
    for (n, _, _) in &ranks {
        polls.push(n.room_state(room).await.unwrap_or(KvPoll::Bootstrapping));
    }
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
        node.fail_room(room, reason).await;
        assert!(
            !node.fail_room(room, reason).await,
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
        assert!(matches!(
            node.room_state(room).await,
            Some(KvPoll::Failed(_))
        ));
    }
    slow_task.abort();
}

/// Garbage on a control connection and a truncated control frame disconnect the offender; a
/// healthy decode on the same prefill sees no error.
///
/// Tokio only: it counts strikes of single control connections written by hand; the
/// runtime-independent part (garbage, oversized frames, wrong token refused on every shard
/// while a healthy decode works) is `drivers.rs`'s hostile-sockets scenario.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f10_truncated_frames_and_repeated_garbage_disconnect_only_the_offender() {
    use tokio::io::AsyncWriteExt;
    let shape = small_shape();
    let (p, addr, _server) = prefill(&shape, fast_core(), 141).await;
    let healthy = start(Role::Decode, &shape, fast_core(), 142);
    let s = healthy.connect(vec![addr]).await.unwrap();
    // A control connection whose frames have sane lengths but unknown types: before the
    // handshake nothing is skipped, so the first one closes it (with an error frame).
    let mut bad = tokio::net::TcpStream::connect(addr).await.unwrap();
    bad.write_all(b"KVF1\x01").await.unwrap();
    for _ in 0..3 {
        // The first one already closes it: a later write may meet the closed socket.
        let _ = bad
            .write_all(&[2, 0, 0, 0, kvferry_core::codec::PROTOCOL_VERSION, 200])
            .await;
    }
    let closed = kvferry_tests::closed_by_peer(&mut bad, Duration::from_secs(3)).await;
    assert!(closed, "the offender is disconnected");
    // A truncated frame through the proxy ends that connection; nothing leaks to other peers.
    let proxy = FaultProxy::start(addr, 3).await.unwrap();
    let victim = start(Role::Decode, &shape, fast_core(), 143);
    let _ = victim.connect(vec![proxy.addr]).await;
    proxy.set(|f| f.truncate_next = Some(3));
    assert!(p.counters().await.protocol_errors >= 1);
    let report = run_decode(&healthy, s, rooms(20, 500)).await;
    kvferry_tests::assert_all_clean(&report, 20);
}

/// A rogue prefill that passes the handshake then writes outside the pages the room was
/// granted: the write is refused and counted, nothing lands, the room fails with a protocol
/// error, and the decode keeps running.
///
/// Tokio only: the rogue is a single hand-driven endpoint that accepts exactly one control
/// connection; a sharded decode opens one per shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f10_a_write_outside_the_rooms_pages_is_refused_and_nothing_lands() {
    use kvferry_core::{
        Endpoint, EndpointInfo, Incarnation, NodeId, Region, Slice, TransferId, TransferOp,
        TransferOutcome,
    };
    use kvferry_memory::MemoryMap;
    use kvferry_tcp::{answer_data, challenge_data, read_preamble, DataSender, Preamble};
    use std::sync::{Arc, Mutex};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let shape = small_shape();
    let layout = shape.layout();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let d = start(Role::Decode, &shape, fast_core(), 151);
    let connect = tokio::spawn({
        let d = d.clone();
        async move { d.connect(vec![addr]).await }
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
    let sid = rogue.accept_session(now);
    // Challenges, then hellos: the rogue knows the token, so the handshake completes.
    let mut inbox = Vec::new();
    while rogue.session_state(sid) != Some(kvferry_core::SessionState::Established) {
        let mut buf = vec![0u8; 4096];
        let n = control.read(&mut buf).await.unwrap();
        assert!(n > 0, "the decode hung up during the handshake");
        inbox.extend_from_slice(&buf[..n]);
        let used = rogue.handle_input(std::time::Instant::now(), sid, &inbox);
        inbox.drain(..used);
        let mut out = Vec::new();
        while rogue.poll_transmit(&mut out).is_some() {}
        control.write_all(&out).await.unwrap();
    }
    let session = connect.await.unwrap().expect("handshake with the rogue");
    let pages: Vec<u32> = (0..4).collect();
    let mut h = d
        .open_receiver(
            RoomId(1),
            0,
            vec![session],
            Some(Grant {
                extras: Vec::new(),
                pages,
                aux_slot: None,
                state_slot: None,
                receivers: 1,
                skip_pages: 0,
                idle_sources: 0,
                prompt: None,
            }),
        )
        .await
        .unwrap();
    // Read the decode's room request.
    let mut buf = vec![0u8; 4096];
    let n = control.read(&mut buf).await.unwrap();
    inbox.extend_from_slice(&buf[..n]);
    rogue.handle_input(std::time::Instant::now(), sid, &inbox);
    // A data connection arrives from the decode; the rogue writes page 50 (registered, not granted).
    let (mut data, _) = listener.accept().await.unwrap();
    assert!(matches!(
        read_preamble(&mut data).await.unwrap(),
        Preamble::Data
    ));
    let challenge = rogue.data_challenge();
    let hello = challenge_data(&mut data, &challenge).await.unwrap();
    assert_eq!(
        rogue.admit_data(&challenge, &hello.tag, &hello.proof),
        Ok(sid)
    );
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
        std::time::Duration::ZERO,
    );
    let slice = Slice::run(
        Region::Kv { layer: 0, plane: 0 },
        50 * 4096,
        50 * 4096,
        4096,
    );
    let op = TransferOp {
        checksum: false,
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
    assert!(d.counters().await.writes_refused >= 1);
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

/// A decode (or anything between) that acknowledges an operation the prefill never sent on
/// a data connection broke the protocol there: the prefill closes that connection at once,
/// the decode sees it end and opens another, and the rooms whose operations were on it are
/// retried there and succeed, none waiting for its deadline. With one data connection per
/// session, a connection left open stalled every room until its operations timed out and
/// the session was fenced.
///
/// Tokio only: the forged acknowledgement comes from the tokio fault proxy in front of a
/// single-shard prefill; the closing itself is the shared data plane's (`kvferry-tcp`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f10_a_forged_acknowledgement_closes_the_data_connection_and_rooms_still_succeed() {
    let shape = small_shape();
    let (p, addr, _server) = prefill(&shape, fast_core(), 161).await;
    let proxy = FaultProxy::start(addr, 5).await.unwrap();
    let mut cfg =
        kvferry_testkit::node_config(Role::Decode, &shape, fast_core(), b"test-token", 162);
    cfg.data_connections = 1;
    let d = kvferry_tokio::start(
        cfg,
        std::sync::Arc::new(kvferry_memory::MemoryMap::allocate(shape.layout())),
    )
    .unwrap();
    let forged = kvferry_tcp::encode_ack(
        kvferry_core::TransferId(u64::MAX - 1),
        kvferry_tcp::AckStatus::Applied,
    );
    proxy.set(|f| f.forge_data_ack = Some(forged.to_vec()));
    let s = d.connect(vec![proxy.addr]).await.unwrap();
    let started = Instant::now();
    let run = DecodeRun {
        deadline: Duration::from_secs(20),
        ..rooms(20, 700)
    };
    let report = run_decode(&d, s, run).await;
    let mut forged_sent = false;
    proxy.set(|f| forged_sent = f.forge_data_ack.is_none());
    assert!(
        forged_sent,
        "the proxy slipped the forged acknowledgement in"
    );
    kvferry_tests::assert_all_clean(&report, 20);
    // Well within the rooms' 20 s: the connection was replaced, not waited out, and not by
    // fencing the whole session (what a connection left open needed: its operations timed
    // out until the session was fenced).
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(p.counters().await.fences, 0);
}

/// One bit flipped in one page on its way from prefill to decode (a proxy between them).
/// `checksum`: both nodes run with the end-to-end checksum; `device`: both nodes' KV is
/// device memory (staged through the host copy engine). Returns the decode's report.
async fn one_flipped_bit(checksum: bool, device: bool, seed: u64) -> kvferry_testkit::Report {
    let shape = small_shape();
    let core = Config {
        checksum,
        ..kvferry_tests::staged_core()
    };
    let memory = || {
        if device {
            kvferry_tests::device_memory(
                kvferry_memory::HostCopyEngine::new(Duration::ZERO),
                4,
                8192,
            )
        } else {
            std::sync::Arc::new(kvferry_memory::MemoryMap::allocate(shape.layout()))
        }
    };
    let cfg =
        |role, seed| kvferry_testkit::node_config(role, &shape, core.clone(), b"test-token", seed);
    let p = kvferry_tokio::start(cfg(Role::Prefill, seed), memory()).unwrap();
    let addr = p.listen("127.0.0.1:0".parse().unwrap()).await.unwrap()[0];
    let _server = tokio::spawn(kvferry_testkit::serve_prefill(p.clone(), shape.clone()));
    let proxy = FaultProxy::start(addr, seed).await.unwrap();
    // Well inside the first write batch's payload (its header and table are under 1 KiB).
    proxy.set(|f| f.flip_data_byte = Some(4096 + 123));
    let d = kvferry_tokio::start(cfg(Role::Decode, seed + 1), memory()).unwrap();
    let s = d.connect(vec![proxy.addr]).await.unwrap();
    let report = run_decode(&d, s, rooms(20, 800)).await;
    let mut flipped = false;
    proxy.set(|f| flipped = f.flip_data_byte.is_none());
    assert!(flipped, "the proxy flipped its bit");
    report
}

/// With the checksum on, the room whose page was corrupted in flight fails with
/// `checksum_mismatch` (it never reports Success over garbage), and every other room
/// succeeds with every page verified: from host memory, and from device memory staged
/// through host buffers.
///
/// Tokio only: the bit is flipped by the tokio fault proxy; the checksum is the shared data
/// plane's (`kvferry-tcp`), the same on every runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f12_a_bit_flipped_in_flight_fails_its_room_with_checksum_mismatch() {
    for device in [false, true] {
        let report = one_flipped_bit(true, device, 171).await;
        assert_eq!(
            report.failed_by_reason.get("checksum_mismatch"),
            Some(&1),
            "device {device}: {report:?}"
        );
        assert_eq!(report.rooms_succeeded, 19, "device {device}: {report:?}");
        assert_eq!(report.pages_corrupted, 0, "device {device}: {report:?}");
    }
}

/// The same flip without the checksum: the room reports Success and its page is garbage,
/// found only by the demo's own pattern check. What the option exists for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f12_without_the_checksum_the_same_flip_lands_as_a_corrupted_page() {
    let report = one_flipped_bit(false, false, 181).await;
    assert_eq!(report.rooms_succeeded, 20, "{report:?}");
    assert_eq!(report.pages_corrupted, 1, "{report:?}");
}
