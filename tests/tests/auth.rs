//! Authentication over real sockets: what a listener sends before a connector proved the
//! cluster token holds no secret, and bytes recorded from a real decode (its control
//! handshake, its data connections' hellos) replayed to the same prefill get nothing.
#![allow(clippy::unwrap_used)] // tests may panic

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvferry_core::codec::{ErrorCode, Message};
use kvferry_core::Role;
use kvferry_testkit::run_decode;
use kvferry_tests::{fast_core, prefill_on, rooms, small_shape, start_on, Runtime};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The token every test node uses (`kvferry_tests::start_on`).
const TOKEN: &[u8] = b"test-token";

/// Everything the peer sends until it closes or is quiet for 500 ms.
async fn read_all(s: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf)).await {
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    got
}

fn frames(mut bytes: &[u8]) -> Vec<Message> {
    let mut out = Vec::new();
    while let Ok(Some((m, n))) = Message::decode(bytes, 1 << 20) {
        out.push(m);
        bytes = &bytes[n..];
    }
    out
}

async fn prefill(runtime: Runtime) -> (kvferry_tests::Node, SocketAddr) {
    let (node, addrs, server) = prefill_on(
        runtime,
        &small_shape(),
        fast_core(),
        61,
        "127.0.0.1:0".parse().unwrap(),
    )
    .await;
    drop(server); // detached: it serves until the node shuts down
    (node, addrs[0])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_reads_a_challenge_and_a_refusal_and_never_the_token() {
    for runtime in [
        Runtime::Tokio,
        Runtime::Glommio {
            shards: 1,
            pin: false,
        },
    ] {
        let (_prefill, addr) = prefill(runtime).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"KVF1\x01").await.unwrap();
        let mut challenge = Vec::new();
        Message::Challenge { nonce: [1; 32] }.encode(&mut challenge);
        s.write_all(&challenge).await.unwrap();
        let mut captured = read_all(&mut s).await;
        let got = frames(&captured);
        assert!(
            matches!(got.as_slice(), [Message::Challenge { .. }]),
            "{runtime:?}: only a challenge before the connector proved anything: {got:?}"
        );
        // A hello with a made-up proof: refused, and still nothing about the listener.
        let mut hello = Vec::new();
        Message::Hello(kvferry_core::codec::Hello {
            checksum: false,
            extras: Vec::new(),
            role: Role::Decode,
            rank: 0,
            node: kvferry_core::NodeId(5),
            incarnation: kvferry_core::Incarnation(5),
            layout: small_shape().layout(),
            layer_start: 0,
            layer_end: small_shape().layout().layers,
            writes_aux: true,
            heads: kvferry_core::Heads::whole(&small_shape().layout()),
            heartbeat_interval_ms: 500,
            heartbeat_misses: 30,
            proof: [7; 32],
        })
        .encode(&mut hello);
        s.write_all(&hello).await.unwrap();
        let rest = read_all(&mut s).await;
        assert!(
            matches!(
                frames(&rest).as_slice(),
                [Message::Error {
                    code: ErrorCode::BadToken,
                    ..
                }]
            ),
            "{runtime:?}: {:?}",
            frames(&rest)
        );
        captured.extend_from_slice(&rest);
        assert!(
            !captured.windows(TOKEN.len()).any(|w| w == TOKEN),
            "{runtime:?}: the token is in what a stranger read"
        );
    }
}

/// A relay between decodes and `upstream` that records what each connection's client sent.
async fn recording_relay(upstream: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<Vec<u8>>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let l = log.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(upstream).await else {
                return;
            };
            let index = {
                let mut log = l.lock().unwrap();
                log.push(Vec::new());
                log.len() - 1
            };
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            let l = l.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = cr.read(&mut buf).await {
                    if n == 0 || sw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                    let mut log = l.lock().unwrap();
                    if log[index].len() < 4096 {
                        log[index].extend_from_slice(&buf[..n]);
                    }
                }
            });
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut sr, &mut cw).await;
            });
        }
    });
    (addr, log)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decodes_recorded_handshake_and_data_hellos_replayed_get_nothing() {
    let (_prefill, addr) = prefill(Runtime::Tokio).await;
    let (relay, log) = recording_relay(addr).await;
    let decode = start_on(
        Runtime::Tokio,
        Role::Decode,
        &small_shape(),
        fast_core(),
        62,
    );
    let peer = decode.connect(vec![relay]).await.unwrap();
    let report = run_decode(&decode, peer, rooms(4, 1)).await;
    assert_eq!(report.rooms_succeeded, 4, "{report:?}");
    let recorded = log.lock().unwrap().clone();
    let control = recorded
        .iter()
        .find(|c| c.starts_with(b"KVF1\x01"))
        .expect("the control connection was recorded")
        .clone();
    let data = recorded
        .iter()
        .find(|c| c.starts_with(b"KVF1\x02"))
        .expect("a data connection was recorded")
        .clone();
    // The control handshake, byte for byte, on a fresh connection.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&control).await.unwrap();
    let answer = frames(&read_all(&mut s).await);
    assert!(
        !answer.iter().any(|m| matches!(m, Message::Hello(_))),
        "a replayed handshake got the listener's hello: {answer:?}"
    );
    assert!(
        answer.iter().any(|m| matches!(
            m,
            Message::Error {
                code: ErrorCode::BadToken,
                ..
            }
        )),
        "{answer:?}"
    );
    // A data connection's preamble and hello, replayed: the listener's challenge is fresh.
    let hello_end = 5 + kvferry_tcp::DATA_HELLO_LEN;
    let mut d = TcpStream::connect(addr).await.unwrap();
    d.write_all(&data[..5]).await.unwrap();
    let mut challenge = [0u8; kvferry_tcp::DATA_CHALLENGE_LEN];
    d.read_exact(&mut challenge).await.unwrap();
    d.write_all(&data[5..hello_end]).await.unwrap();
    let mut verdict = [0u8; 1];
    let refused = d
        .read_exact(&mut verdict)
        .await
        .map(|_| verdict[0] != 0)
        .unwrap_or(true);
    assert!(refused, "a replayed data hello was admitted");
    decode.shutdown().await;
}

/// A serving prefill whose handshake timeout is 300 ms, and its address.
async fn impatient_prefill(runtime: Runtime, seed: u64) -> (kvferry_tests::Node, SocketAddr) {
    let core = kvferry_core::Config {
        handshake_timeout: Duration::from_millis(300),
        ..fast_core()
    };
    let (node, addrs, server) = prefill_on(
        runtime,
        &small_shape(),
        core,
        seed,
        "127.0.0.1:0".parse().unwrap(),
    )
    .await;
    drop(server); // detached: it serves until the node shuts down
    (node, addrs[0])
}

/// Reads until the peer closes; the time it took, or `None` if it was still open after `most`.
/// `started` is taken before the connect: the node's timer cannot start earlier, so a lower
/// bound on the result holds however late this task runs.
async fn closed_within(
    s: &mut TcpStream,
    started: tokio::time::Instant,
    most: Duration,
) -> Option<Duration> {
    let mut buf = [0u8; 256];
    loop {
        match tokio::time::timeout_at(started + most, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Some(started.elapsed()),
            Ok(Ok(_)) => continue,
            Err(_) => return None,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_says_nothing_is_dropped_after_the_handshake_timeout() {
    for runtime in [
        Runtime::Tokio,
        Runtime::Glommio {
            shards: 1,
            pin: false,
        },
    ] {
        let (_prefill, addr) = impatient_prefill(runtime, 62).await;
        let started = tokio::time::Instant::now();
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let took = closed_within(&mut silent, started, Duration::from_secs(3)).await;
        assert!(
            took.is_some_and(|t| t >= Duration::from_millis(250)),
            "{runtime:?}: a silent connection was held {took:?} (handshake timeout 300 ms)"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_connection_that_never_answers_its_challenge_is_dropped_after_the_handshake_timeout()
{
    for runtime in [
        Runtime::Tokio,
        Runtime::Glommio {
            shards: 1,
            pin: false,
        },
    ] {
        let (_prefill, addr) = impatient_prefill(runtime, 63).await;
        let started = tokio::time::Instant::now();
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&kvferry_tcp::MAGIC).await.unwrap();
        s.write_all(&[kvferry_tcp::KIND_DATA]).await.unwrap();
        let mut challenge = [0u8; kvferry_tcp::DATA_CHALLENGE_LEN];
        s.read_exact(&mut challenge).await.unwrap();
        let took = closed_within(&mut s, started, Duration::from_secs(3)).await;
        assert!(
            took.is_some_and(|t| t >= Duration::from_millis(250)),
            "{runtime:?}: an unanswered data challenge held the connection {took:?}"
        );
    }
}
