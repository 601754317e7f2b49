//! Peers that leave are let go: a decode keeps every prefill a router ever sent it to
//! (`connect_persistent`), and prefills are scaled up and down; each one unused for
//! `peer_idle_timeout`, gone or still up, is dialed no more, its session and sockets close,
//! and its id is unknown. On both runtimes.
#![allow(clippy::unwrap_used)] // tests may panic

use std::time::{Duration, Instant};

use kvferry_core::{Config, Role};
use kvferry_testkit::{run_decode, Runtime};
use kvferry_tests::{
    assert_all_clean, fast_core, prefill_on, rooms, small_shape, start_on, RUNTIMES,
};
use kvferry_tokio::NodeError;

const PREFILLS: u64 = 50;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

async fn fifty_prefills_coming_and_going_leave_the_decode_flat(rt: Runtime) {
    let shape = small_shape();
    let idle = Duration::from_millis(300);
    let core = Config {
        peer_idle_timeout: idle,
        ..fast_core()
    };
    let decode = start_on(rt, Role::Decode, &shape, core, 700);
    let fds_before = open_fds();
    let mut peers = Vec::new();
    let mut staying = Vec::new();
    for i in 0..PREFILLS {
        let any = "127.0.0.1:0".parse().unwrap();
        let (prefill, addrs, server) =
            prefill_on(Runtime::Tokio, &shape, fast_core(), 701 + i, any).await;
        let peer = decode.connect_persistent(addrs).await.unwrap();
        assert_all_clean(&run_decode(&decode, peer, rooms(2, 1 + 10 * i)).await, 2);
        peers.push(peer);
        if i % 5 == 0 {
            // Still up, but the router sends it nothing any more.
            staying.push((prefill, server));
        } else {
            prefill.shutdown().await;
            server.abort();
        }
    }
    let deadline = Instant::now() + idle * 20;
    while decode.counters().await.peers_let_go < PREFILLS {
        assert!(
            Instant::now() < deadline,
            "{} rt: let go {} of {PREFILLS}",
            rt.name(),
            decode.counters().await.peers_let_go
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for &peer in &peers {
        assert!(!decode.knows_peer(peer).await, "{}: {peer:?}", rt.name());
    }
    let err = decode
        .open_receiver(kvferry_core::RoomId(9_999), 0, vec![peers[0]], None)
        .await
        .unwrap_err();
    assert!(
        matches!(err, NodeError::UnknownPeer(p) if p == peers[0]),
        "{err}"
    );
    assert!(
        decode.data_paths().await.is_empty(),
        "{}: no session left",
        rt.name()
    );
    for (prefill, server) in staying {
        prefill.shutdown().await;
        server.abort();
    }
    // A closed socket can take a moment to leave the table after its task ends.
    let deadline = Instant::now() + Duration::from_secs(5);
    while open_fds() > fds_before + 2 {
        assert!(
            Instant::now() < deadline,
            "{}: {} descriptors open, {fds_before} before the prefills came",
            rt.name(),
            open_fds()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    decode.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_prefills_coming_and_going_leave_no_session_socket_or_peer_behind() {
    for rt in RUNTIMES {
        fifty_prefills_coming_and_going_leave_the_decode_flat(rt).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_in_use_is_kept_and_one_let_go_can_be_connected_again() {
    let shape = small_shape();
    let idle = Duration::from_millis(300);
    let core = Config {
        peer_idle_timeout: idle,
        ..fast_core()
    };
    for rt in RUNTIMES {
        let decode = start_on(rt, Role::Decode, &shape, core.clone(), 800);
        let any = "127.0.0.1:0".parse().unwrap();
        let (prefill, addrs, server) =
            prefill_on(Runtime::Tokio, &shape, fast_core(), 801, any).await;
        let peer = decode.connect_persistent(addrs.clone()).await.unwrap();
        // Rooms every 100 ms for 10 idle timeouts: the peer is never idle that long.
        for i in 0..30 {
            assert_all_clean(&run_decode(&decode, peer, rooms(1, 1 + i)).await, 1);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(decode.knows_peer(peer).await, "{}", rt.name());
        assert_eq!(decode.counters().await.peers_let_go, 0);
        tokio::time::sleep(idle * 4).await;
        assert!(!decode.knows_peer(peer).await, "{}", rt.name());
        let again = decode.connect_persistent(addrs).await.unwrap();
        assert_all_clean(&run_decode(&decode, again, rooms(3, 100)).await, 3);
        prefill.shutdown().await;
        server.abort();
        decode.shutdown().await;
    }
}
