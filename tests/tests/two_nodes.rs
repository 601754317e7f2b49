//! Two or more real nodes over loopback sockets: real bytes, verified; aborts, dropped nodes
//! and hostile sockets.
#![allow(clippy::unwrap_used)] // tests may panic

use std::time::{Duration, Instant};

use kvferry_cli::{run_decode, run_demo, DecodeRun};
use kvferry_core::{Chunk, Event, FailureReason, Grant, KvPoll, Role, RoomId};
use kvferry_tests::{fast_core, prefill, small_shape, start};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn run(rooms: u64) -> DecodeRun {
    DecodeRun {
        rooms,
        shape: small_shape(),
        first_room: 1,
        progress: None,
        deadline: Duration::from_secs(30),
        abort_rate: 0.0,
        seed: 0,
        target: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_rooms_succeed_with_every_byte_verified() {
    let report = run_demo(small_shape(), fast_core(), 300, Default::default(), None)
        .await
        .expect("demo runs");
    assert_eq!(report.rooms_succeeded, 300, "{report:?}");
    assert_eq!(report.pages_corrupted, 0);
    assert_eq!(report.pages_verified, 300 * 8 * 4 * 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_rooms_succeed() {
    let shape = kvferry_cli::Shape {
        chunks: 3,
        ..small_shape()
    };
    let report = run_demo(shape, fast_core(), 60, Default::default(), None)
        .await
        .expect("demo runs");
    kvferry_tests::assert_all_clean(&report, 60);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layerwise_rooms_succeed() {
    let shape = kvferry_cli::Shape {
        layerwise: true,
        layer_compute: Duration::from_micros(300),
        chunks: 2,
        ..small_shape()
    };
    let report = run_demo(shape, fast_core(), 40, Default::default(), None)
        .await
        .expect("demo runs");
    kvferry_tests::assert_all_clean(&report, 40);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_decodes_share_one_prefill() {
    let shape = small_shape();
    let (p, addr, _server) = prefill(&shape, fast_core(), 11).await;
    let d1 = start(Role::Decode, &shape, fast_core(), 12);
    let d2 = start(Role::Decode, &shape, fast_core(), 13);
    let s1 = d1.connect(addr).await.expect("connect");
    let s2 = d2.connect(addr).await.expect("connect");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let r2 = DecodeRun {
        first_room: 1000,
        ..run(50)
    };
    let (a, b) = tokio::join!(run_decode(&d1, s1, run(50)), run_decode(&d2, s2, r2));
    assert_eq!((a.rooms_succeeded, b.rooms_succeeded), (50, 50));
    assert_eq!(a.pages_corrupted + b.pages_corrupted, 0);
    drop(p);
}

/// Decode aborts a room while its writes are in flight: the room's pages become releasable
/// only after prefill acknowledged the drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_abort_mid_transfer_releases_pages_only_after_the_ack() {
    let shape = kvferry_cli::Shape {
        page_bytes: 64 * 1024,
        pages_per_room: 64,
        ..small_shape()
    };
    let p = start(Role::Prefill, &shape, fast_core(), 21);
    let addr = p.listen("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let d = start(Role::Decode, &shape, fast_core(), 22);
    let session = d.connect(addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut prefill_events = p.subscribe();
    let mut decode_events = d.subscribe();
    let room = RoomId(7);
    let pages: Vec<u32> = (0..64).collect();
    let mut handle = d
        .open_receiver(
            room,
            0,
            &[session],
            Some(Grant {
                pages: pages.clone(),
                aux_slot: Some(0),
                state_slot: None,
                receivers: 1,
            }),
        )
        .unwrap();
    // Prefill opens the room when decode's request arrives, and sends 4 layers x 2 x 4 MiB.
    loop {
        if let Ok(Event::RoomAnnounced { room: r, .. }) = prefill_events.recv().await {
            if r == room {
                break;
            }
        }
    }
    p.open_sender(room, 0).unwrap();
    p.send_chunk(
        room,
        Chunk {
            pages,
            last: true,
            aux_slot: Some(0),
            state_slot: None,
            layerwise: false,
        },
    )
    .unwrap();
    tokio::time::sleep(Duration::from_micros(300)).await;
    d.abort(room).unwrap();
    let aborted_at = Instant::now();
    assert_eq!(
        handle.terminal().await,
        KvPoll::Failed(FailureReason::AbortedLocally)
    );
    handle.releasable().await;
    // The release came after the drain acknowledgement (no fence was needed).
    assert_eq!(d.counters().fences, 0);
    let mut saw_release = false;
    while let Ok(e) = decode_events.try_recv() {
        if matches!(e, Event::Releasable { room: r, .. } if r == room) {
            saw_release = true;
        }
    }
    assert!(saw_release);
    assert!(
        aborted_at.elapsed() < Duration::from_millis(500),
        "released on the ack, not on the fence timer"
    );
    let state = p.room_state(room);
    assert_eq!(
        state,
        Some(KvPoll::Failed(FailureReason::AbortedByPeer)),
        "prefill learnt of the abort"
    );
}

/// A prefill node that disappears mid-transfer: decode's rooms fail with a reason within
/// their deadlines instead of hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_dropped_mid_transfer_fails_decode_rooms_with_a_reason() {
    let shape = small_shape();
    let p = start(Role::Prefill, &shape, fast_core(), 31);
    let addr = p.listen("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let d = start(Role::Decode, &shape, fast_core(), 32);
    let session = d.connect(addr).await.unwrap();
    let mut handles = Vec::new();
    for r in 0..4u32 {
        let pages: Vec<u32> = (r * 8..r * 8 + 8).collect();
        let grant = Grant {
            pages,
            aux_slot: Some(r),
            state_slot: None,
            receivers: 1,
        };
        handles.push(
            d.open_receiver(RoomId(u64::from(r) + 1), 0, &[session], Some(grant))
                .unwrap(),
        );
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let t0 = Instant::now();
    p.shutdown().await;
    drop(p);
    for mut h in handles {
        let state = tokio::time::timeout(Duration::from_secs(5), h.terminal())
            .await
            .expect("no hang");
        assert!(
            matches!(
                state,
                KvPoll::Failed(FailureReason::PeerUnreachable | FailureReason::Shutdown)
            ),
            "{state:?}"
        );
        tokio::time::timeout(Duration::from_secs(5), h.releasable())
            .await
            .expect("released");
    }
    assert!(t0.elapsed() < Duration::from_secs(3));
}

/// Garbage, an oversized length and a wrong token are refused; a healthy decode keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_sockets_are_refused_while_other_peers_keep_working() {
    let shape = small_shape();
    let (p, addr, _server) = prefill(&shape, fast_core(), 41).await;
    // 1: not a kvferry connection at all.
    let mut junk = TcpStream::connect(addr).await.unwrap();
    junk.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    // 2: a control connection announcing a 4 GiB frame.
    let mut huge = TcpStream::connect(addr).await.unwrap();
    huge.write_all(b"KVF1\x01").await.unwrap();
    huge.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
    // 3: a data connection with a wrong token.
    let mut forged = TcpStream::connect(addr).await.unwrap();
    let hello = kvferry_tcp::DataHello {
        node: kvferry_core::NodeId(9),
        incarnation: kvferry_core::Incarnation(9),
        token: b"wrong".to_vec(),
    };
    forged.write_all(&hello.encode()).await.unwrap();
    let mut answer = [0u8; 1];
    let refused = forged
        .read_exact(&mut answer)
        .await
        .map(|_| answer[0] != 0)
        .unwrap_or(true);
    assert!(refused, "a wrong token gets no data connection");
    // Every hostile connection gets closed by the prefill.
    for s in [&mut junk, &mut huge] {
        let closed = kvferry_tests::closed_by_peer(s, Duration::from_secs(3)).await;
        assert!(closed);
    }
    assert!(
        p.counters().protocol_errors >= 1,
        "the oversized frame was counted"
    );
    // A healthy decode is unaffected.
    let d = start(Role::Decode, &shape, fast_core(), 42);
    let s = d.connect(addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let report = run_decode(&d, s, run(20)).await;
    assert_eq!((report.rooms_succeeded, report.pages_corrupted), (20, 0));
}

/// A decode with another cluster token or another layout gets a typed error that says what to
/// check, not a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mismatched_peer_gets_a_typed_error_at_connect() {
    let shape = small_shape();
    let (_p, addr, _server) = prefill(&shape, fast_core(), 51).await;
    let mut cfg = kvferry_cli::node_config(Role::Decode, &shape, fast_core(), b"other-token", 52);
    cfg.info.token = b"other-token".to_vec();
    let stranger = kvferry_tokio::Node::start(
        cfg,
        std::sync::Arc::new(kvferry_tcp::MemoryMap::allocate(shape.layout())),
    )
    .unwrap();
    let err = stranger.connect(addr).await.unwrap_err();
    assert!(err.to_string().contains("token"), "{err}");
    let other = kvferry_cli::Shape {
        page_bytes: 8192,
        ..small_shape()
    };
    let d = start(Role::Decode, &other, fast_core(), 53);
    let err = d.connect(addr).await.unwrap_err();
    assert!(err.to_string().contains("page_bytes"), "{err}");
}
