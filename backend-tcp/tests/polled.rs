//! A socket read as `Polled`: straight `recv` calls, a spin, and the runtime's own wait
//! around them keep the byte stream whole and in order, on tokio and on glommio.
#![allow(clippy::unwrap_used)] // test helpers may panic

use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use futures_io::AsyncRead;
use futures_lite::AsyncReadExt;
use kvferry_tcp::polled::Polled;

/// Message `i`: its length (1..=9000 bytes), then bytes derived from `i`.
fn message(i: u32) -> Vec<u8> {
    let len = 1 + (i.wrapping_mul(2_654_435_761) % 9000) as usize;
    let mut m = (len as u32).to_le_bytes().to_vec();
    m.extend((0..len).map(|k| (i as usize * 31 + k) as u8));
    m
}

/// Reads messages until the writer closes, checking each; returns how many came.
async fn read_messages(mut conn: impl AsyncRead + Unpin) -> u32 {
    let mut got = 0u32;
    let mut len = [0u8; 4];
    loop {
        match conn.read_exact(&mut len).await {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => panic!("{e}"),
        }
        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
        conn.read_exact(&mut body).await.unwrap();
        assert_eq!(message(got)[4..], body[..], "message {got}");
        got += 1;
    }
    got
}

/// Writes 3000 messages to `addr` from a plain thread, then closes.
fn write_messages(addr: SocketAddr) {
    let mut writer = std::net::TcpStream::connect(addr).unwrap();
    writer.set_nodelay(true).unwrap();
    for i in 0..3000u32 {
        writer.write_all(&message(i)).unwrap();
        // Pauses shorter and longer than the spin: reads meet bytes at once, bytes a few
        // microseconds later, and an empty socket they wait on their runtime for.
        match i % 100 {
            0 => std::thread::sleep(Duration::from_millis(3)),
            n if n % 10 == 0 => std::thread::sleep(Duration::from_micros(20)),
            _ => {}
        }
    }
}

#[cfg(feature = "glommio")]
fn glommio_reads_all_in_order(spin: Duration) {
    use glommio::net::TcpListener;
    use glommio::{LocalExecutorBuilder, Placement};

    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let reader = LocalExecutorBuilder::new(Placement::Unbound)
        .io_memory(1 << 20)
        .spawn(move || async move {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            addr_tx.send(listener.local_addr().unwrap()).unwrap();
            let stream = listener.accept().await.unwrap();
            read_messages(Polled::new(stream, spin)).await
        })
        .unwrap();
    write_messages(addr_rx.recv().unwrap());
    assert_eq!(reader.join().unwrap(), 3000);
}

#[cfg(feature = "glommio")]
#[test]
fn a_polled_glommio_socket_reads_every_byte_in_order_with_a_spin() {
    glommio_reads_all_in_order(Duration::from_micros(50));
}

#[cfg(feature = "glommio")]
#[test]
fn a_polled_glommio_socket_reads_every_byte_in_order_without_a_spin() {
    glommio_reads_all_in_order(Duration::ZERO);
}

#[cfg(feature = "tokio")]
async fn tokio_reads_all_in_order(spin: Duration) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let writer = std::thread::spawn(move || write_messages(addr));
    let (stream, _) = listener.accept().await.unwrap();
    let got = read_messages(Polled::new(kvferry_tcp::TokioIo(stream), spin)).await;
    writer.join().unwrap();
    assert_eq!(got, 3000);
}

#[cfg(feature = "tokio")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polled_tokio_socket_reads_every_byte_in_order_with_a_spin() {
    tokio_reads_all_in_order(Duration::from_micros(50)).await;
}

#[cfg(feature = "tokio")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polled_tokio_socket_reads_every_byte_in_order_without_a_spin() {
    tokio_reads_all_in_order(Duration::ZERO).await;
}

/// A connection whose bytes are all there yields to the executor's other tasks every
/// `READY_RUN` reads, as the runtime's own reads would once their task's budget ran out: on
/// one thread, tasks queued behind it run while it reads 64 KiB (well within any socket's
/// buffers) in 16-byte reads.
#[cfg(feature = "tokio")]
#[tokio::test(flavor = "current_thread")]
async fn a_connection_that_always_has_bytes_still_lets_other_tasks_run() {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    const TOTAL: usize = 64 << 10;
    const OTHERS: u32 = 100;
    let mut writer = std::net::TcpStream::connect(addr).unwrap();
    let (stream, _) = listener.accept().await.unwrap();
    // Every byte is in the receiver's socket before the first read.
    writer.write_all(&vec![7u8; TOTAL]).unwrap();
    let ran = Arc::new(AtomicU32::new(0));
    // The reader runs first (spawned first); the others are queued behind it.
    let reader = {
        let ran = ran.clone();
        tokio::spawn(async move {
            let mut conn = Polled::new(kvferry_tcp::TokioIo(stream), Duration::from_micros(50));
            let mut piece = [0u8; 16];
            let mut got = 0;
            while got < TOTAL {
                let n = conn.read(&mut piece).await.unwrap();
                assert!(n > 0 && piece[..n].iter().all(|&b| b == 7));
                got += n;
            }
            (got, ran.load(Ordering::Relaxed))
        })
    };
    for _ in 0..OTHERS {
        let ran = ran.clone();
        tokio::spawn(async move {
            ran.fetch_add(1, Ordering::Relaxed);
        });
    }
    let (got, ran_meanwhile) = reader.await.unwrap();
    assert_eq!(got, TOTAL);
    assert_eq!(
        ran_meanwhile,
        OTHERS,
        "every task queued behind the reader ran before it finished its {} reads",
        TOTAL / 16
    );
}
