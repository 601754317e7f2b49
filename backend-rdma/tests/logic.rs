//! Everything of the RDMA backend that needs no device: the completion table, the queue-pair
//! lifecycle and its fence, and the handshake fields.
#![allow(clippy::unwrap_used)] // tests may panic

use kvferry_core::{Region, Slice, TransferId, TransferOutcome};
use kvferry_rdma::{
    classify, HandshakeError, QpError, QpLifecycle, QpState, RdmaHello, RemoteRegion, WcStatus,
};

fn hello() -> RdmaHello {
    RdmaHello {
        qpn: 0x12_3456,
        psn: 0xAB_CDEF,
        lid: 7,
        port: 1,
        gid: [0xFE; 16],
        mtu: 5,
        regions: vec![
            RemoteRegion {
                region: Region::Kv { layer: 0, plane: 1 }.code(),
                addr: 0x7000_0000,
                len: 1 << 20,
                rkey: 0x55,
            },
            RemoteRegion {
                region: Region::Aux.code(),
                addr: 0x9000_0000,
                len: 4096,
                rkey: 0x66,
            },
        ],
    }
}

#[test]
fn completion_statuses_map_to_the_documented_outcomes() {
    use TransferOutcome::*;
    let expect = |s: WcStatus| match s {
        WcStatus::Success => Done,
        WcStatus::RetryExcErr
        | WcStatus::RnrRetryExcErr
        | WcStatus::RespTimeoutErr
        | WcStatus::RemAbortErr => Transient,
        WcStatus::WrFlushErr => Flushed,
        WcStatus::RemAccessErr => Refused,
        _ => Fatal,
    };
    for s in WcStatus::ALL {
        assert_eq!(classify(Some(s)), expect(s), "{s:?}");
        assert_eq!(WcStatus::from_raw(s as u32), Some(s));
    }
    assert_eq!(WcStatus::from_raw(24), None);
    assert_eq!(classify(None), Fatal, "an unknown status is fatal");
}

#[test]
fn a_queue_pair_goes_through_init_rtr_rts_in_order_only() {
    let mut qp = QpLifecycle::new();
    assert_eq!(
        qp.post(TransferId(1)),
        Err(QpError::NotReady(QpState::Reset))
    );
    assert!(matches!(qp.to_rts(), Err(QpError::Transition { .. })));
    qp.to_init().unwrap();
    let mut no_peer = hello();
    no_peer.qpn = 0;
    assert_eq!(qp.to_rtr(&no_peer), Err(QpError::BadPeer));
    qp.to_rtr(&hello()).unwrap();
    assert_eq!(qp.post(TransferId(1)), Err(QpError::NotReady(QpState::Rtr)));
    qp.to_rts().unwrap();
    assert_eq!(qp.state(), QpState::Rts);
    assert!(qp.post(TransferId(1)).is_ok());
}

fn ready() -> QpLifecycle {
    let mut qp = QpLifecycle::new();
    qp.to_init().unwrap();
    qp.to_rtr(&hello()).unwrap();
    qp.to_rts().unwrap();
    qp
}

#[test]
fn every_posted_operation_completes_exactly_once() {
    let mut qp = ready();
    let a = qp.post(TransferId(10)).unwrap();
    let b = qp.post(TransferId(11)).unwrap();
    assert_ne!(a, b);
    assert_eq!(
        qp.complete(b, Some(WcStatus::Success)),
        Some((TransferId(11), TransferOutcome::Done))
    );
    assert_eq!(
        qp.complete(b, Some(WcStatus::Success)),
        None,
        "a repeat yields nothing"
    );
    assert_eq!(
        qp.complete(999, Some(WcStatus::Success)),
        None,
        "unknown wr_id"
    );
    assert_eq!(
        qp.complete(a, Some(WcStatus::Success)),
        Some((TransferId(10), TransferOutcome::Done))
    );
    assert_eq!(qp.outstanding(), 0);
}

#[test]
fn the_fence_is_complete_only_once_every_outstanding_write_was_flushed() {
    let mut qp = ready();
    let wrs: Vec<u64> = (0..3).map(|i| qp.post(TransferId(i)).unwrap()).collect();
    qp.fence();
    assert_eq!(qp.state(), QpState::Error);
    assert!(!qp.is_drained(), "writes may still land");
    assert!(
        qp.post(TransferId(9)).is_err(),
        "nothing new after the fence"
    );
    for (i, wr) in wrs.iter().enumerate() {
        assert!(!qp.is_drained());
        assert_eq!(
            qp.complete(*wr, Some(WcStatus::WrFlushErr)),
            Some((TransferId(i as u64), TransferOutcome::Flushed))
        );
    }
    assert!(qp.is_drained());
    qp.reset().unwrap();
    assert_eq!(qp.state(), QpState::Reset);
}

#[test]
fn an_error_completion_puts_the_queue_pair_in_error() {
    let mut qp = ready();
    let a = qp.post(TransferId(1)).unwrap();
    let b = qp.post(TransferId(2)).unwrap();
    assert_eq!(
        qp.complete(a, Some(WcStatus::RemAccessErr)),
        Some((TransferId(1), TransferOutcome::Refused))
    );
    assert_eq!(qp.state(), QpState::Error);
    assert!(qp.post(TransferId(3)).is_err());
    assert!(qp.reset().is_err(), "not drained yet");
    assert_eq!(
        qp.complete(b, Some(WcStatus::WrFlushErr)),
        Some((TransferId(2), TransferOutcome::Flushed))
    );
    assert!(qp.is_drained());
}

#[test]
fn a_post_the_device_refused_leaves_the_queue_pair_usable() {
    let mut qp = ready();
    let a = qp.post(TransferId(1)).unwrap();
    // ibv_post_send failed (a full send queue): nothing was queued.
    assert_eq!(qp.cancel(a), Some(TransferId(1)));
    assert_eq!(qp.cancel(a), None, "forgotten once");
    assert_eq!(qp.state(), QpState::Rts);
    assert_eq!(qp.outstanding(), 0);
    let b = qp.post(TransferId(2)).unwrap();
    assert_eq!(
        qp.complete(b, Some(WcStatus::Success)),
        Some((TransferId(2), TransferOutcome::Done))
    );
}

#[test]
fn the_rdma_hello_round_trips_and_refuses_what_cannot_connect() {
    let h = hello();
    let mut b = Vec::new();
    h.encode(&mut b);
    assert_eq!(RdmaHello::decode(&b), Ok(h.clone()));
    assert_eq!(
        RdmaHello::decode(&b[..b.len() - 1]),
        Err(HandshakeError::Truncated)
    );
    let mut longer = b.clone();
    longer.push(0);
    assert_eq!(
        RdmaHello::decode(&longer),
        Err(HandshakeError::TrailingBytes)
    );
    let mut wide = h.clone();
    wide.psn = 0x100_0000;
    let mut w = Vec::new();
    wide.encode(&mut w);
    assert_eq!(RdmaHello::decode(&w), Err(HandshakeError::BadQueuePair));
    let mut bad_mtu = b.clone();
    bad_mtu[28] = 9;
    assert_eq!(RdmaHello::decode(&bad_mtu), Err(HandshakeError::BadMtu(9)));
    let mut overflow = h;
    overflow.regions[0].addr = u64::MAX - 10;
    let mut o = Vec::new();
    overflow.encode(&mut o);
    assert!(matches!(
        RdmaHello::decode(&o),
        Err(HandshakeError::BadRegion(_))
    ));
}

#[test]
fn the_rdma_hello_decoder_is_total() {
    // Every prefix and many corruptions of a valid hello decode or fail with a typed error.
    let mut b = Vec::new();
    hello().encode(&mut b);
    for n in 0..b.len() {
        let _ = RdmaHello::decode(&b[..n]);
    }
    let mut x = 0x9E37_79B9_u64;
    for _ in 0..20_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let mut c = b.clone();
        let i = (x as usize) % c.len();
        c[i] = (x >> 32) as u8;
        let _ = RdmaHello::decode(&c);
    }
}

#[test]
fn a_write_target_never_leaves_the_region_the_peer_registered() {
    let h = hello();
    let kv = Region::Kv { layer: 0, plane: 1 };
    let slice = |region, off, len| Slice::run(region, 0, off, len);
    assert_eq!(h.target(&slice(kv, 4096, 4096)), Some((0x7000_1000, 0x55)));
    assert_eq!(
        h.target(&slice(kv, (1 << 20) - 4096, 4096)),
        Some((0x700F_F000, 0x55))
    );
    assert_eq!(
        h.target(&slice(kv, (1 << 20) - 4095, 4096)),
        None,
        "past the end"
    );
    assert_eq!(h.target(&slice(kv, u64::MAX, 2)), None, "overflow");
    assert_eq!(h.target(&slice(kv, 0, 0)), None, "empty");
    assert_eq!(
        h.target(&slice(Region::Kv { layer: 3, plane: 0 }, 0, 64)),
        None,
        "not announced"
    );
    assert_eq!(h.target(&slice(Region::Scratch, 0, 64)), None);
    assert!(kvferry_rdma::writable(Region::Scratch), "probes write it");
    assert!(kvferry_rdma::writable(Region::Aux));
}
