use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};

use super::*;

/// Completes each batch only when the test says so, from another thread.
struct Gate(flume::Receiver<()>, Arc<AtomicBool>);

impl CopyEngine for Gate {
    fn name(&self) -> &'static str {
        "gate"
    }

    fn start(&self, _: u32, _: CopyDirection, _: Vec<CopyJob>, done: CopyDone) {
        let (open, landed) = (self.0.clone(), self.1.clone());
        std::thread::spawn(move || {
            let _ = open.recv();
            landed.store(true, Ordering::SeqCst);
            done(Ok(()));
        });
    }
}

/// A pool of one buffer over `gate`, copies given up after `timeout`.
fn gated(gate: Gate, timeout: Duration) -> Arc<Staging> {
    Staging::new(
        Arc::new(gate),
        StagingConfig {
            buffers: 1,
            buffer_bytes: 64,
            copy_timeout: timeout,
        },
    )
    .unwrap()
}

/// Copies in flight over the pool's one buffer, their wait polled once and cancelled.
fn cancelled_mid_copy(staging: &Staging) -> InFlightCopies {
    let mut copies = InFlightCopies::default();
    copies.start(staging, 0, CopyDirection::HostToDevice, vec![]);
    copies.hold(staging.try_acquire().unwrap());
    {
        let mut wait = std::pin::pin!(copies.next());
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        assert!(wait.as_mut().poll(&mut cx).is_pending());
    }
    copies
}

#[test]
fn dropping_copies_in_flight_returns_at_once_and_their_buffer_comes_back_once_they_land() {
    let (open, gate) = flume::unbounded();
    let landed = Arc::new(AtomicBool::new(false));
    let staging = gated(Gate(gate, landed.clone()), Duration::from_secs(30));
    let copies = cancelled_mid_copy(&staging);
    let t0 = Instant::now();
    drop(copies);
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "the drop blocked on the copy"
    );
    assert!(!landed.load(Ordering::SeqCst));
    assert_eq!(
        staging.free(),
        0,
        "the buffer is out while the copy may write it"
    );
    let _ = open.send(());
    let t0 = Instant::now();
    while staging.free() == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the buffer never came back"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        landed.load(Ordering::SeqCst),
        "back only after the copy landed"
    );
}

#[test]
fn copies_that_never_land_are_given_up_after_the_timeout_and_their_buffer_is_never_reused() {
    let (_open, gate) = flume::unbounded();
    let staging = gated(
        Gate(gate, Arc::new(AtomicBool::new(false))),
        Duration::from_millis(50),
    );
    let before = abandoned_copies();
    drop(cancelled_mid_copy(&staging));
    let t0 = Instant::now();
    while abandoned_copies() == before {
        assert!(t0.elapsed() < Duration::from_secs(10), "never given up");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        staging.free(),
        0,
        "a buffer an engine may still write is never lent"
    );
}

#[test]
fn a_blocking_wait_for_copies_that_never_land_ends_at_the_timeout_with_an_error() {
    let (_open, gate) = flume::unbounded();
    let staging = gated(
        Gate(gate, Arc::new(AtomicBool::new(false))),
        Duration::from_millis(50),
    );
    let mut copies = InFlightCopies::default();
    copies.start(&staging, 0, CopyDirection::DeviceToHost, vec![]);
    let err = copies.wait_blocking().unwrap_err();
    assert!(err.0.contains("did not land"), "{err}");
}

/// Counts pins and unpins; refuses to pin once `pin_limit` buffers are pinned.
#[derive(Default)]
struct Pins {
    pinned: std::sync::atomic::AtomicUsize,
    unpinned: std::sync::atomic::AtomicUsize,
    pin_limit: usize,
}

impl CopyEngine for Pins {
    fn name(&self) -> &'static str {
        "pins"
    }

    fn start(&self, _: u32, _: CopyDirection, _: Vec<CopyJob>, done: CopyDone) {
        done(Ok(()));
    }

    fn pin(&self, _: &mut HostBuffer) -> Result<(), CopyError> {
        if self.pinned.load(Ordering::SeqCst) == self.pin_limit {
            return Err(CopyError("no more pinned memory".to_owned()));
        }
        self.pinned.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn unpin(&self, buffer: &mut HostBuffer) {
        // Still allocated: the bytes are there to read.
        assert_eq!(buffer.as_slice().len(), buffer.len());
        self.unpinned.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn a_buffer_that_outlives_its_pool_is_unpinned_when_it_ends() {
    let pins = Arc::new(Pins {
        pin_limit: usize::MAX,
        ..Pins::default()
    });
    let config = StagingConfig {
        buffers: 2,
        buffer_bytes: 64,
        ..StagingConfig::default()
    };
    let staging = Staging::new(pins.clone(), config).unwrap();
    let held = staging.try_acquire().unwrap();
    drop(staging);
    assert_eq!(pins.pinned.load(Ordering::SeqCst), 2);
    drop(held);
    assert_eq!(
        pins.unpinned.load(Ordering::SeqCst),
        2,
        "every pinned buffer is unpinned once, the one held past its pool too"
    );
}

#[test]
fn a_pool_that_cannot_pin_every_buffer_unpins_those_it_pinned() {
    let pins = Arc::new(Pins {
        pin_limit: 2,
        ..Pins::default()
    });
    let config = StagingConfig {
        buffers: 3,
        buffer_bytes: 64,
        ..StagingConfig::default()
    };
    assert!(Staging::new(pins.clone(), config).is_err());
    assert_eq!(pins.unpinned.load(Ordering::SeqCst), 2);
}

/// A GPU at `0000:3b:00.0`; records the CPUs each pin ran on.
#[derive(Default)]
struct Placed(std::sync::Mutex<Vec<Vec<usize>>>);

impl CopyEngine for Placed {
    fn name(&self) -> &'static str {
        "placed"
    }

    fn start(&self, _: u32, _: CopyDirection, _: Vec<CopyJob>, done: CopyDone) {
        done(Ok(()));
    }

    fn pin(&self, _: &mut HostBuffer) -> Result<(), CopyError> {
        let set = rustix::process::sched_getaffinity(None).unwrap();
        let cpus = (0..rustix::process::CpuSet::MAX_CPU)
            .filter(|&c| set.is_set(c))
            .collect();
        self.0.lock().unwrap().push(cpus);
        Ok(())
    }

    fn home_device(&self) -> Option<u32> {
        Some(0)
    }

    fn pci_bus_id(&self, _: u32) -> Option<String> {
        Some("0000:3b:00.0".to_owned())
    }
}

#[test]
fn a_pool_is_allocated_and_pinned_on_its_devices_numa_node() {
    let sysfs = crate::numa::test_sysfs::sysfs("1", "0");
    let engine = Arc::new(Placed::default());
    let config = StagingConfig {
        buffers: 3,
        buffer_bytes: 64,
        ..StagingConfig::default()
    };
    let _pool = Staging::placed(engine.clone(), config, sysfs.path()).unwrap();
    assert_eq!(*engine.0.lock().unwrap(), vec![vec![0]; 3]);
}

#[test]
fn a_pool_lends_each_buffer_once_and_takes_it_back_on_drop() {
    let staging = Staging::new(
        HostCopyEngine::new(Duration::ZERO),
        StagingConfig {
            buffers: 2,
            buffer_bytes: 64,
            ..StagingConfig::default()
        },
    )
    .unwrap();
    let a = staging.try_acquire().unwrap();
    let b = staging.try_acquire().unwrap();
    assert!(
        staging.try_acquire().is_none(),
        "bounded: a third buffer is never made"
    );
    assert_ne!(a.addr(), b.addr());
    drop(a);
    assert_eq!(staging.free(), 1);
    drop(b);
    assert_eq!((staging.free(), staging.taken()), (2, 2));
}
