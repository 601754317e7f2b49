//! The verbs data path on a real device (feature `rdma`): skipped, with a message, where the
//! host has none. `scripts/rdma-check.sh` runs these on a host that has one.
#![cfg(feature = "rdma")]
#![allow(clippy::unwrap_used)] // tests may panic

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_core::{Region, Slice, TransferId, TransferOutcome};
use kvferry_rdma::device::Device;
use kvferry_rdma::verbs::{LocalPiece, MemoryRegistration, RcQueuePair};

fn device() -> Option<Arc<Device>> {
    match Device::open(None) {
        Ok(d) => Some(Arc::new(d)),
        Err(e) => {
            assert!(
                std::env::var_os("KVFERRY_REQUIRE_RDMA").is_none(),
                "KVFERRY_REQUIRE_RDMA is set and no RDMA device opens: {e}"
            );
            eprintln!("SKIPPED: no RDMA device here ({e})");
            None
        }
    }
}

/// Waits (bounded) for `n` completions.
fn settle(qp: &mut RcQueuePair, n: usize) -> Vec<(TransferId, TransferOutcome)> {
    let mut got = Vec::new();
    let t0 = Instant::now();
    while got.len() < n {
        got.extend(qp.completions().unwrap());
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "completions: {got:?}"
        );
        std::thread::sleep(Duration::from_micros(100));
    }
    got
}

/// Two connected QPs on one device, a registered source and a remotely writable destination.
fn pair(
    dev: &Arc<Device>,
    len: usize,
) -> (
    RcQueuePair,
    RcQueuePair,
    Vec<u8>,
    Vec<u8>,
    MemoryRegistration,
    MemoryRegistration,
) {
    let mut src = vec![0u8; len];
    let mut dst = vec![0u8; len];
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i * 31 + 7) as u8;
    }
    // SAFETY: both vectors outlive their registrations (returned together, dropped after).
    let src_mr = unsafe { MemoryRegistration::new(dev, src.as_mut_ptr(), len, false) }.unwrap();
    // SAFETY: as above.
    let dst_mr = unsafe { MemoryRegistration::new(dev, dst.as_mut_ptr(), len, true) }.unwrap();
    let mut a = RcQueuePair::new(dev, 1, 64, 0x111).unwrap();
    let mut b = RcQueuePair::new(dev, 1, 64, 0x222).unwrap();
    let kv = Region::Kv { layer: 0, plane: 0 }.code();
    let ha = a.hello(vec![]).unwrap();
    let hb = b.hello(vec![dst_mr.announce(kv)]).unwrap();
    a.connect(&hb).unwrap();
    b.connect(&ha).unwrap();
    (a, b, src, dst, src_mr, dst_mr)
}

#[test]
fn a_chained_write_lands_byte_for_byte_and_completes_once() {
    let Some(dev) = device() else { return };
    let len = 1 << 20;
    let (mut a, b, src, dst, src_mr, dst_mr) = pair(&dev, len);
    let kv = Region::Kv { layer: 0, plane: 0 };
    let hello = b.hello(vec![dst_mr.announce(kv.code())]).unwrap();
    // Two pieces: the first and the last 64 KiB, swapped on the far side.
    let pieces = [(0u64, (len - 65536) as u64), ((len - 65536) as u64, 0u64)];
    let mut local = Vec::new();
    let mut remote = Vec::new();
    for (from, to) in pieces {
        let slice = Slice::run(kv, from, to, 65536);
        remote.push(hello.target(&slice).unwrap());
        local.push(LocalPiece {
            addr: src.as_ptr() as u64 + from,
            len: 65536,
            lkey: src_mr.lkey(),
        });
    }
    a.post_write(TransferId(1), &local, &remote).unwrap();
    assert_eq!(
        settle(&mut a, 1),
        vec![(TransferId(1), TransferOutcome::Done)]
    );
    assert_eq!(&dst[len - 65536..], &src[..65536]);
    assert_eq!(&dst[..65536], &src[len - 65536..]);
}

#[test]
fn a_fence_flushes_outstanding_writes_and_then_nothing_lands() {
    let Some(dev) = device() else { return };
    let len = 64 << 20;
    let (mut a, b, src, _dst, src_mr, dst_mr) = pair(&dev, len);
    let kv = Region::Kv { layer: 0, plane: 0 };
    let hello = b.hello(vec![dst_mr.announce(kv.code())]).unwrap();
    for i in 0..16u64 {
        let slice = Slice::run(kv, 0, 0, len as u64);
        let local = [LocalPiece {
            addr: src.as_ptr() as u64,
            len: len as u32,
            lkey: src_mr.lkey(),
        }];
        a.post_write(TransferId(i), &local, &[hello.target(&slice).unwrap()])
            .unwrap();
    }
    a.fence().unwrap();
    let done = settle(&mut a, 16);
    assert!(a.is_drained());
    assert!(done
        .iter()
        .all(|(_, o)| matches!(o, TransferOutcome::Done | TransferOutcome::Flushed)));
}

#[test]
fn a_write_outside_the_announced_region_is_refused_by_the_peer() {
    let Some(dev) = device() else { return };
    let len = 1 << 20;
    let (mut a, _b, src, _dst, src_mr, dst_mr) = pair(&dev, len);
    // A forged target: the right rkey, one byte past the registration.
    let local = [LocalPiece {
        addr: src.as_ptr() as u64,
        len: 4096,
        lkey: src_mr.lkey(),
    }];
    let past = dst_mr.announce(0);
    a.post_write(
        TransferId(1),
        &local,
        &[(past.addr + past.len - 1, past.rkey)],
    )
    .unwrap();
    assert_eq!(
        settle(&mut a, 1),
        vec![(TransferId(1), TransferOutcome::Refused)]
    );
}
