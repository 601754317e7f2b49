//! The GPU pieces that need no GPU: the layer waiter (driven by host-side events that stand in
//! for CUDA events, completed by another thread as a stream would), and the overlap timeline.
#![allow(clippy::unwrap_used)] // tests may panic

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use kvferry_core::RoomId;
use kvferry_gpu::{
    GpuError, LayerEvent, LayerTimes, LayerWaiter, PollPolicy, Readiness, Span, Timeline,
};

/// 0 = pending, 1 = complete, 2 = failed.
struct HostEvent(Arc<AtomicU8>);

impl LayerEvent for HostEvent {
    fn poll_complete(&mut self) -> Result<bool, GpuError> {
        match self.0.load(Ordering::Acquire) {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(GpuError::Driver("kernel failed".into())),
        }
    }
}

fn waiter() -> (LayerWaiter, mpsc::Receiver<Readiness>) {
    let (tx, rx) = mpsc::channel();
    let w = LayerWaiter::spawn(PollPolicy::default(), move |r| {
        let _ = tx.send(r);
    });
    (w, rx)
}

#[test]
fn a_layer_is_reported_ready_only_after_its_event_completes() {
    let (w, rx) = waiter();
    let flag = Arc::new(AtomicU8::new(0));
    w.watch(
        vec![RoomId(1), RoomId(2)],
        3,
        Box::new(HostEvent(flag.clone())),
    )
    .unwrap();
    assert!(
        rx.recv_timeout(Duration::from_millis(50)).is_err(),
        "not before the event"
    );
    flag.store(1, Ordering::Release);
    match rx.recv_timeout(Duration::from_secs(2)).unwrap() {
        Readiness::Ready { rooms, layer, .. } => {
            assert_eq!((rooms, layer), (vec![RoomId(1), RoomId(2)], 3));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn layers_completing_in_order_are_delivered_in_order_and_once() {
    let (w, rx) = waiter();
    let flags: Vec<Arc<AtomicU8>> = (0..8).map(|_| Arc::new(AtomicU8::new(0))).collect();
    for (l, f) in flags.iter().enumerate() {
        w.watch(vec![RoomId(7)], l as u16, Box::new(HostEvent(f.clone())))
            .unwrap();
    }
    // A stream completes its layers in order.
    let completer = std::thread::spawn(move || {
        for f in flags {
            std::thread::sleep(Duration::from_millis(2));
            f.store(1, Ordering::Release);
        }
    });
    let mut seen = Vec::new();
    while seen.len() < 8 {
        if let Readiness::Ready { layer, .. } = rx.recv_timeout(Duration::from_secs(2)).unwrap() {
            seen.push(layer);
        }
    }
    completer.join().unwrap();
    assert_eq!(seen, (0..8).collect::<Vec<u16>>());
    assert!(
        rx.recv_timeout(Duration::from_millis(50)).is_err(),
        "nothing twice"
    );
}

#[test]
fn a_failed_event_is_reported_as_a_failure_for_its_rooms() {
    let (w, rx) = waiter();
    let flag = Arc::new(AtomicU8::new(2));
    w.watch(vec![RoomId(9)], 0, Box::new(HostEvent(flag)))
        .unwrap();
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(2)).unwrap(),
        Readiness::Failed {
            rooms: vec![RoomId(9)],
            layer: 0,
            error: GpuError::Driver("kernel failed".into())
        }
    );
}

#[test]
fn dropping_the_waiter_stops_its_thread_without_hanging() {
    let (w, _rx) = waiter();
    let never = Arc::new(AtomicU8::new(0));
    w.watch(vec![RoomId(1)], 0, Box::new(HostEvent(never)))
        .unwrap();
    drop(w); // joins the thread
}

fn ms(a: u64, b: u64) -> Span {
    Span {
        start: Duration::from_millis(a),
        end: Duration::from_millis(b),
    }
}

fn layerwise() -> Timeline {
    // 4 layers of 10 ms compute; each layer's transfer (4 ms) starts when its compute ends.
    Timeline {
        label: "layerwise".into(),
        layers: (0..4)
            .map(|l| LayerTimes {
                layer: l,
                compute: ms(10 * u64::from(l), 10 * u64::from(l) + 10),
                transfer: Some(ms(10 * u64::from(l) + 10, 10 * u64::from(l) + 14)),
            })
            .collect(),
        batch: None,
        held: None,
        layer_transfer: None,
    }
}

#[test]
fn perfect_overlap_is_exactly_the_ideal() {
    let t = layerwise();
    assert_eq!(t.complete_at(), Duration::from_millis(44));
    assert_eq!(t.ideal(), Duration::from_millis(44));
    assert!((t.vs_ideal() - 1.0).abs() < 1e-9);
}

#[test]
fn a_whole_batch_transfer_is_measured_against_the_same_ideal() {
    let mut t = layerwise();
    for l in t.layers.iter_mut() {
        l.transfer = None;
    }
    t.batch = Some(ms(40, 56));
    t.label = "whole batch".into();
    assert_eq!(t.complete_at(), Duration::from_millis(56));
    assert_eq!(
        t.ideal(),
        Duration::from_millis(44),
        "40 ms compute + a quarter of the batch"
    );
    assert!(t.vs_ideal() > 1.25);
}

#[test]
fn a_separately_measured_layer_transfer_replaces_the_queued_ones_in_the_ideal() {
    let mut t = layerwise();
    // Transfer-bound: layer transfers queue up and the last one ends late.
    t.layers[3].transfer = Some(ms(40, 60));
    assert_eq!(t.ideal(), Duration::from_millis(60), "longest measured");
    t.layer_transfer = Some(Duration::from_millis(4));
    assert_eq!(t.ideal(), Duration::from_millis(44));
    assert!((t.vs_ideal() - 60.0 / 44.0).abs() < 1e-9);
}

#[test]
fn a_copy_into_gpu_memory_after_the_last_transfer_counts_toward_completion() {
    let mut t = layerwise();
    t.held = Some(Duration::from_millis(47));
    assert_eq!(t.complete_at(), Duration::from_millis(47));
    t.held = Some(Duration::from_millis(30));
    assert_eq!(t.complete_at(), Duration::from_millis(44), "never earlier");
}

#[test]
fn the_timeline_picture_shows_every_layer_on_one_axis() {
    let a = layerwise();
    let mut b = layerwise();
    b.label = "whole <batch>".into();
    let svg = Timeline::svg(&[&a, &b]);
    assert!(svg.starts_with("<svg"));
    assert!(svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("compute</title>").count(), 8);
    assert_eq!(svg.matches("transfer</title>").count(), 8);
    assert!(svg.contains("whole &lt;batch&gt;"), "labels are escaped");
    assert!(svg.contains("(1.00x ideal)"));
}
