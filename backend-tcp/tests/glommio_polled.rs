//! A glommio socket read as `Polled`: straight `recv` calls, a spin, and glommio's ring
//! around them keep the byte stream whole and in order.
#![cfg(feature = "glommio")]
#![allow(clippy::unwrap_used)] // test helpers may panic

use std::io::Write;
use std::time::Duration;

use futures_lite::AsyncReadExt;
use glommio::net::TcpListener;
use glommio::{LocalExecutorBuilder, Placement};
use kvferry_tcp::glommio::Polled;

/// Message `i`: its length (1..=9000 bytes), then bytes derived from `i`.
fn message(i: u32) -> Vec<u8> {
    let len = 1 + (i.wrapping_mul(2_654_435_761) % 9000) as usize;
    let mut m = (len as u32).to_le_bytes().to_vec();
    m.extend((0..len).map(|k| (i as usize * 31 + k) as u8));
    m
}

fn read_all_in_order(spin: Duration) {
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let reader = LocalExecutorBuilder::new(Placement::Unbound)
        .io_memory(1 << 20)
        .spawn(move || async move {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            addr_tx.send(listener.local_addr().unwrap()).unwrap();
            let stream = listener.accept().await.unwrap();
            let mut conn = Polled::new(stream, spin);
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
        })
        .unwrap();
    let addr = addr_rx.recv().unwrap();
    let mut writer = std::net::TcpStream::connect(addr).unwrap();
    writer.set_nodelay(true).unwrap();
    for i in 0..3000u32 {
        writer.write_all(&message(i)).unwrap();
        // Pauses shorter and longer than the spin: reads meet bytes at once, bytes a few
        // microseconds later, and an empty socket they wait on glommio's ring for.
        match i % 100 {
            0 => std::thread::sleep(Duration::from_millis(3)),
            n if n % 10 == 0 => std::thread::sleep(Duration::from_micros(20)),
            _ => {}
        }
    }
    drop(writer);
    assert_eq!(reader.join().unwrap(), 3000);
}

#[test]
fn a_polled_glommio_socket_reads_every_byte_in_order_with_a_spin() {
    read_all_in_order(Duration::from_micros(50));
}

#[test]
fn a_polled_glommio_socket_reads_every_byte_in_order_without_a_spin() {
    read_all_in_order(Duration::ZERO);
}
