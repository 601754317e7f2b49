//! TLS on control and data connections: rooms move and verify over it, and a peer without a
//! certificate from the cluster's CA (or without TLS at all) gets no session.
#![allow(clippy::unwrap_used)] // tests may panic

use std::sync::Arc;
use std::time::Duration;

use kvferry_core::Role;
use kvferry_memory::MemoryMap;
use kvferry_tcp::TlsFiles;
use kvferry_testkit::testcert::{self, CertDir};
use kvferry_testkit::{node_config, run_decode, serve_prefill};
use kvferry_tests::{fast_core, rooms, small_shape, Node, Runtime, RUNTIMES};

fn node(runtime: Runtime, role: Role, tls: Option<TlsFiles>, seed: u64) -> Node {
    let shape = small_shape();
    let mut cfg = node_config(role, &shape, fast_core(), b"test-token", seed);
    cfg.tls = tls;
    runtime
        .start(cfg, Arc::new(MemoryMap::allocate(shape.layout())))
        .unwrap()
}

/// A throwaway certificate directory for one test, removed when the test ends.
fn dir(name: &str) -> CertDir {
    CertDir::new(&format!("tls-{name}"))
}

/// A prefill on `p` serving a decode on `d` over TLS: `n` rooms move, every byte verified.
async fn rooms_over_tls(p: Runtime, d: Runtime, tls: &TlsFiles, seed: u64, n: u64) {
    let prefill = node(p, Role::Prefill, Some(tls.clone()), seed);
    let addrs = prefill
        .listen("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    tokio::spawn(serve_prefill(prefill.clone(), small_shape()));
    let decode = node(d, Role::Decode, Some(tls.clone()), seed + 1);
    let peer = decode.connect(addrs).await.unwrap();
    let report = run_decode(&decode, peer, rooms(n, 1)).await;
    kvferry_tests::assert_all_clean(&report, n);
    decode.shutdown().await;
    prefill.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rooms_move_and_verify_over_tls() {
    let ok_dir = dir("ok");
    let tls = testcert::throwaway(&ok_dir, "kvferry").unwrap();
    for runtime in RUNTIMES {
        rooms_over_tls(runtime, runtime, &tls, 71, 40).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokio_node_and_a_glommio_node_move_rooms_over_tls() {
    let mixed_dir = dir("mixed");
    let tls = testcert::throwaway(&mixed_dir, "kvferry").unwrap();
    let [tokio_rt, glommio_rt] = RUNTIMES;
    for (p, d) in [(tokio_rt, glommio_rt), (glommio_rt, tokio_rt)] {
        rooms_over_tls(p, d, &tls, 81, 20).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_the_clusters_tls_gets_no_session() {
    for runtime in RUNTIMES {
        let a_dir = dir("a");
        let tls = testcert::throwaway(&a_dir, "kvferry").unwrap();
        let prefill = node(runtime, Role::Prefill, Some(tls.clone()), 73);
        let addrs = prefill
            .listen("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        tokio::spawn(serve_prefill(prefill.clone(), small_shape()));
        // Plain TCP against a TLS listener.
        let plain = node(runtime, Role::Decode, None, 74);
        let err = tokio::time::timeout(Duration::from_secs(15), plain.connect(addrs.clone()))
            .await
            .expect("a typed error, not a hang");
        assert!(err.is_err(), "a plain connection got a session");
        // TLS with a certificate from another CA (the right token does not help).
        let b_dir = dir("b");
        let stranger = testcert::throwaway(&b_dir, "kvferry").unwrap();
        let other = node(runtime, Role::Decode, Some(stranger), 75);
        let err = tokio::time::timeout(Duration::from_secs(15), other.connect(addrs.clone()))
            .await
            .expect("a typed error, not a hang");
        assert!(err.is_err(), "another CA's certificate got a session");
        // A listener certificate for another name: the connector refuses it.
        let renamed = TlsFiles {
            server_name: "not-kvferry".into(),
            ..tls
        };
        let wrong_name = node(runtime, Role::Decode, Some(renamed), 76);
        let err = tokio::time::timeout(Duration::from_secs(15), wrong_name.connect(addrs))
            .await
            .expect("a typed error, not a hang");
        assert!(err.is_err(), "a listener with another name was trusted");
        prefill.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_tls_files_are_a_typed_error_on_both_runtimes() {
    let shape = small_shape();
    for runtime in RUNTIMES {
        let mut cfg = node_config(Role::Decode, &shape, fast_core(), b"t", 77);
        cfg.tls = Some(TlsFiles {
            cert: "/nonexistent/node.pem".into(),
            key: "/nonexistent/node.key".into(),
            ca: "/nonexistent/ca.pem".into(),
            server_name: "kvferry".into(),
        });
        let Err(err) = runtime.start(cfg, Arc::new(MemoryMap::allocate(shape.layout()))) else {
            panic!("{runtime:?} started without its TLS files")
        };
        assert!(
            matches!(err, kvferry_tokio::NodeError::Tls(_)),
            "{runtime:?}: {err}"
        );
        assert!(err.to_string().contains("/nonexistent/node.pem"), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_starts_its_tls_handshake_is_dropped_after_the_handshake_timeout() {
    use tokio::io::AsyncReadExt;
    let silent_dir = dir("silent");
    let tls = testcert::throwaway(&silent_dir, "kvferry").unwrap();
    for runtime in RUNTIMES {
        let shape = small_shape();
        let core = kvferry_core::Config {
            handshake_timeout: Duration::from_millis(300),
            ..fast_core()
        };
        let mut cfg = node_config(Role::Prefill, &shape, core, b"test-token", 79);
        cfg.tls = Some(tls.clone());
        let prefill = runtime
            .start(cfg, Arc::new(MemoryMap::allocate(shape.layout())))
            .unwrap();
        let addrs = prefill
            .listen("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let started = tokio::time::Instant::now();
        let mut silent = tokio::net::TcpStream::connect(addrs[0]).await.unwrap();
        let mut buf = [0u8; 64];
        let closed = tokio::time::timeout(Duration::from_secs(3), silent.read(&mut buf)).await;
        let took = started.elapsed();
        assert!(
            matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
            "{runtime:?}: a connection without a TLS hello was held: {closed:?}"
        );
        assert!(
            took >= Duration::from_millis(250),
            "{runtime:?}: dropped after {took:?}, before the handshake timeout (300 ms)"
        );
        prefill.shutdown().await;
    }
}
