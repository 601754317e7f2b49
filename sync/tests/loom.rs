//! loom models of every structure kvferry shares between threads or tasks.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p kvferry-sync --release --test loom`.
//! Without `--cfg loom` this file is empty.
#![cfg(loom)]
#![allow(clippy::unwrap_used)] // models may panic: a panic is a found bug

use std::time::Instant;

use kvferry_core::codec::Message;
use kvferry_core::sim::{fast_config, small_layout};
use kvferry_core::{
    ApiError, Chunk, Endpoint, EndpointInfo, Event, Grant, Incarnation, KvPoll, NodeId, Role,
    RoomId, SessionId, Slice, TransferId, TransferOp, WritePermit,
};
use kvferry_sync::{Acked, ConnSet, EndWrite, Landing, OpLedger, Start};
use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::sync::{Arc, Mutex};
use loom::thread;

// ------------------------------------------------------------------ completion hand-off

/// Invariant: every operation handed to a data connection is reported to the core exactly
/// once, whichever of the writer, the acknowledgement reader and a concurrent close gets to
/// it first (the report is what settles the operation in the core; twice would double-count,
/// never would leave the room waiting until its deadline).
#[test]
fn every_operation_of_a_data_connection_is_reported_exactly_once() {
    loom::model(|| {
        let ledger = Arc::new(OpLedger::new());
        let reports: Arc<[AtomicUsize; 2]> = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
        let ids = [TransferId(0), TransferId(1)];
        for id in ids {
            assert!(ledger.enqueue(id));
        }
        // The wire: how many operations the writer put on it (acks follow in order).
        let written = Arc::new(AtomicUsize::new(0));
        let report = |r: &[AtomicUsize; 2], id: TransferId| {
            r[id.0 as usize].fetch_add(1, Ordering::SeqCst);
        };

        let writer = {
            let (ledger, reports, written) = (ledger.clone(), reports.clone(), written.clone());
            thread::spawn(move || {
                for id in ids {
                    match ledger.start(id, false) {
                        Start::Write => {
                            written.fetch_add(1, Ordering::SeqCst);
                        }
                        Start::Closed => report(&reports, id),
                        Start::Gone => {}
                    }
                }
            })
        };
        let acker = {
            let (ledger, reports, written) = (ledger.clone(), reports.clone(), written.clone());
            thread::spawn(move || {
                // The peer acknowledges the first operation if it was written.
                if written.load(Ordering::SeqCst) >= 1 {
                    match ledger.acked(ids[0]) {
                        Acked::InOrder => report(&reports, ids[0]),
                        Acked::OutOfOrder(Some(e)) => report(&reports, e),
                        Acked::OutOfOrder(None) => {}
                    }
                }
            })
        };
        // A fence closes the connection concurrently.
        for id in ledger.close() {
            report(&reports, id);
        }
        writer.join().unwrap();
        acker.join().unwrap();
        // Nothing is left behind once every party is done.
        for id in ledger.close() {
            report(&reports, id);
        }
        for id in ids {
            assert_eq!(
                reports[id.0 as usize].load(Ordering::SeqCst),
                1,
                "{id} reports"
            );
        }
        assert!(
            !ledger.enqueue(TransferId(9)),
            "a closed connection takes no operation"
        );
    });
}

// ------------------------------------------------------- receive path vs abort and release

/// A decode endpoint holding room 1 (two granted pages) fed by one prefill session.
struct Decode {
    endpoint: Endpoint,
    session: SessionId,
    op: TransferOp,
}

fn decode_with_room() -> Decode {
    let now = Instant::now();
    let layout = small_layout(16);
    let mut p = Endpoint::new(
        fast_config(),
        EndpointInfo::new(Role::Prefill, NodeId(1), Incarnation(1), layout),
        1,
        now,
    )
    .unwrap();
    let mut d = Endpoint::new(
        fast_config(),
        EndpointInfo::new(Role::Decode, NodeId(2), Incarnation(2), layout),
        2,
        now,
    )
    .unwrap();
    let sp = p.open_session(now);
    let sd = d.accept_session(now);
    let pump = |p: &mut Endpoint, d: &mut Endpoint| loop {
        let mut buf = Vec::new();
        let mut moved = false;
        while p.poll_transmit(&mut buf).is_some() {
            moved = true;
        }
        d.handle_input(now, sd, &buf);
        buf.clear();
        while d.poll_transmit(&mut buf).is_some() {
            moved = true;
        }
        p.handle_input(now, sp, &buf);
        if !moved {
            break;
        }
    };
    pump(&mut p, &mut d);
    let room = RoomId(1);
    let grant = Grant {
        pages: vec![1, 2],
        aux_slot: None,
        state_slot: None,
        receivers: 1,
        skip_pages: 0,
        idle_sources: 0,
        extras: Vec::new(),
        prompt: None,
    };
    d.open_receiver(now, room, 0, &[sd], Some(grant)).unwrap();
    p.open_sender(now, room, 0, None).unwrap();
    pump(&mut p, &mut d);
    let chunk = Chunk {
        pages: vec![3, 4],
        last: true,
        aux_slot: None,
        state_slot: None,
        layerwise: false,
        extras: Vec::new(),
    };
    p.send_chunk(now, room, chunk).unwrap();
    let op = p.poll_transfer(now).unwrap();
    while d.poll_event().is_some() {}
    Decode {
        endpoint: d,
        session: sd,
        op,
    }
}

fn releasable(d: &mut Endpoint) -> bool {
    std::iter::from_fn(|| d.poll_event()).any(|e| matches!(e, Event::Releasable { .. }))
}

/// The driver's lock around the core, as the tokio driver holds it.
#[derive(Clone)]
struct Core(Arc<Mutex<Endpoint>>);

impl Core {
    /// As the drivers' receive paths admit a write: the core's grant table without the
    /// driver's lock, the core under it for whatever the table does not admit.
    fn begin(&self, session: SessionId, slices: &[Slice]) -> Option<Landing<Ending>> {
        let table = self.0.lock().unwrap().grant_table();
        let permit = match table.begin(session, RoomId(1), 0, slices) {
            Some(p) => p,
            None => {
                let now = Instant::now();
                let mut e = self.0.lock().unwrap();
                e.begin_write(now, session, RoomId(1), 0, slices).ok()?
            }
        };
        Some(Landing::new(permit, Ending(self.clone(), slices.to_vec())))
    }
}

/// Hands a write's permit back to the core under its lock, with the write's slices.
struct Ending(Core, Vec<Slice>);

impl EndWrite for Ending {
    fn end_write(&self, permit: WritePermit) {
        let mut e = self.0 .0.lock().unwrap();
        e.end_write(Instant::now(), permit, &self.1);
    }
}

/// How the modelled receive path authorizes a write.
#[derive(Clone, Copy, PartialEq)]
enum ReceivePath {
    /// As the drivers do: `begin_write`, then the payload, then the permit goes back.
    WithPermit,
    /// Deliberately broken: validates with `check_write` only and holds nothing while the
    /// payload lands. The models must catch it.
    CheckOnly,
}

/// One receive task (authorize, apply the payload into the page, hand the permit back)
/// racing the embedder's abort of the room, which reuses the page as soon as the core says
/// the room is releasable.
///
/// Invariant (no write after release): the page is written by the receive path and by its
/// next owner in a happens-before order, never concurrently; loom's `UnsafeCell` reports any
/// unordered pair of accesses. Together with the core's rule that a permit holds the pages,
/// this is what makes a released page safe to hand to another request.
fn receive_races_abort(path: ReceivePath) {
    loom::model(move || {
        let Decode {
            endpoint,
            session,
            op,
        } = decode_with_room();
        let core = Core(Arc::new(Mutex::new(endpoint)));
        let page = Arc::new(UnsafeCell::new(0u64));

        let receiver = {
            let (core, page, op) = (core.clone(), page.clone(), op.clone());
            thread::spawn(move || {
                let now = Instant::now();
                let landing = match path {
                    ReceivePath::WithPermit => match core.begin(session, &op.slices) {
                        Some(l) => Some(l),
                        None => return,
                    },
                    ReceivePath::CheckOnly => {
                        let mut e = core.0.lock().unwrap();
                        for s in op.slices.iter() {
                            if e.check_write(now, session, RoomId(1), 0, s).is_err() {
                                return;
                            }
                        }
                        None
                    }
                };
                page.with_mut(|p| unsafe { *p = 1 });
                if let Some(l) = landing {
                    l.applied();
                }
            })
        };

        // The embedder aborts, and prefill acknowledges the drain at once: its attempt was
        // on a connection that broke on its side, while this receive task still applies the
        // bytes that had reached it (the orphaned write).
        let free = {
            let mut e = core.0.lock().unwrap();
            let now = Instant::now();
            // Over TCP the room may already have succeeded on its landed bytes: the abort is
            // refused then, and the release rule must hold all the same.
            if let Err(err) = e.abort(now, RoomId(1)) {
                assert!(
                    matches!(err, ApiError::RoomConcluded(_, KvPoll::Success)),
                    "{err:?}"
                );
            }
            let mut ack = Vec::new();
            Message::AbortAck {
                room: RoomId(1),
                generation: 0,
            }
            .encode(&mut ack);
            e.handle_input(now, session, &ack);
            releasable(&mut e)
        };
        if free {
            page.with_mut(|p| unsafe { *p = 2 });
        }
        receiver.join().unwrap();
        // After the receive path finished, the room must be releasable (nothing leaks).
        let mut e = core.0.lock().unwrap();
        let late = releasable(&mut e);
        drop(e);
        if !free && late {
            page.with_mut(|p| unsafe { *p = 2 });
        }
    });
}

#[test]
fn no_write_lands_after_a_room_is_released() {
    receive_races_abort(ReceivePath::WithPermit);
}

/// Runs the deliberately broken model `name` in a child process (a failing loom model aborts
/// its process while unwinding) and checks that loom reported the race.
fn expect_model_failure(name: &str) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            name,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success(),
        "the broken model {name} passed:\n{stdout}"
    );
    assert!(
        stderr.contains("Causality violation") || stdout.contains("Causality violation"),
        "the broken model {name} failed for another reason:\n{stdout}\n{stderr}"
    );
}

/// The deliberately broken variant: a receive path that authorizes without a permit lets the
/// embedder reuse a page the payload is still being written into; the model finds it.
#[test]
fn the_model_catches_a_receive_path_that_holds_no_permit() {
    expect_model_failure("broken_receive_path_without_permit");
}

#[test]
#[ignore = "deliberately broken; run by the_model_catches_a_receive_path_that_holds_no_permit"]
fn broken_receive_path_without_permit() {
    receive_races_abort(ReceivePath::CheckOnly);
}

/// A fence racing a receive task: the driver aborts the task (it stops at its next await
/// point, handing its permit back), waits until it is gone, and only then confirms the fence
/// to the core, which then releases the aborted room's pages.
///
/// Invariant: as above, no write to the page after it was released; here the ordering comes
/// from the driver waiting for the task before `handle_fence_complete` (with the permit void
/// after the fence, that wait is the only thing that orders them).
fn receive_races_fence(wait_for_task: bool) {
    loom::model(move || {
        let Decode {
            endpoint,
            session,
            op,
        } = decode_with_room();
        let core = Core(Arc::new(Mutex::new(endpoint)));
        let page = Arc::new(UnsafeCell::new(0u64));
        let stop = Arc::new(AtomicBool::new(false));
        let gone = Arc::new(AtomicBool::new(false));

        let receiver = {
            let (core, page, op) = (core.clone(), page.clone(), op.clone());
            let (stop, gone) = (stop.clone(), gone.clone());
            thread::spawn(move || {
                if let Some(landing) = core.begin(session, &op.slices) {
                    // An await point: an aborted task stops here.
                    if !stop.load(Ordering::Acquire) {
                        page.with_mut(|p| unsafe { *p = 1 });
                    }
                    drop(landing);
                }
                gone.store(true, Ordering::Release);
            })
        };

        let later = {
            // The embedder aborts; no drain acknowledgement comes in time, so the core asks
            // for a fence of the session.
            let mut e = core.0.lock().unwrap();
            let now = Instant::now();
            e.abort(now, RoomId(1)).unwrap();
            let later = now + e.config().abort_ack_timeout * 2;
            e.handle_timeout(later);
            let fence = std::iter::from_fn(|| e.poll_action())
                .any(|a| a == kvferry_core::Action::FenceSession(session));
            assert!(fence, "the core asks for a fence");
            later
        };
        // The fence: abort the receive task and wait until it cannot write any more.
        stop.store(true, Ordering::Release);
        if wait_for_task {
            while !gone.load(Ordering::Acquire) {
                thread::yield_now();
            }
        }
        let free = {
            let mut e = core.0.lock().unwrap();
            e.handle_fence_complete(later, session);
            releasable(&mut e)
        };
        assert!(free, "a fenced session's aborted room is releasable");
        page.with_mut(|p| unsafe { *p = 2 });
        receiver.join().unwrap();
    });
}

#[test]
fn a_fence_is_confirmed_only_after_the_receive_task_is_gone() {
    receive_races_fence(true);
}

/// The deliberately broken variant: a driver that confirms the fence without waiting for the
/// receive task to stop.
#[test]
fn the_model_catches_a_fence_confirmed_before_the_task_stopped() {
    expect_model_failure("broken_fence_confirmed_early");
}

#[test]
#[ignore = "deliberately broken; run by the_model_catches_a_fence_confirmed_before_the_task_stopped"]
fn broken_fence_confirmed_early() {
    receive_races_fence(false);
}

// --------------------------------------------- connection replacement and shutdown

/// A data connection in the model: counts how often it was closed.
#[derive(Clone)]
struct Conn(Arc<AtomicUsize>);

impl Conn {
    fn close(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A session's data connections while a new one is being attached (a connect task
/// finishing), a fence takes them, and a close (the peer came back with a new incarnation,
/// so the old session is replaced; or the node shuts down) takes them for good.
///
/// Invariant: every connection is closed exactly once (by the fence, by the close, or by the
/// attaching task itself when the session was already closing) and nothing stays attached to
/// a closed session, so no socket of a replaced session or a stopped node lives on.
#[test]
fn connections_are_closed_exactly_once_across_attach_fence_and_close() {
    loom::model(|| {
        let set: Arc<Mutex<ConnSet<Conn>>> = Arc::new(Mutex::new(ConnSet::default()));
        let first = Conn(Arc::new(AtomicUsize::new(0)));
        let late = Conn(Arc::new(AtomicUsize::new(0)));
        set.lock().unwrap().attach(first.clone()).ok().unwrap();

        let attacher = {
            let (set, late) = (set.clone(), late.clone());
            thread::spawn(move || {
                let refused = set.lock().unwrap().attach(late);
                if let Err(c) = refused {
                    c.close();
                }
            })
        };
        let fencer = {
            let set = set.clone();
            thread::spawn(move || {
                let taken = set.lock().unwrap().fence();
                for c in taken {
                    c.close();
                }
            })
        };
        // The replacement (or shutdown) closes the session.
        let taken = set.lock().unwrap().close().unwrap_or_default();
        for c in taken {
            c.close();
        }
        attacher.join().unwrap();
        fencer.join().unwrap();
        let s = set.lock().unwrap();
        assert!(s.is_empty(), "nothing attached to a closed session");
        assert!(s.is_closing());
        for c in [&first, &late] {
            assert_eq!(c.0.load(Ordering::SeqCst), 1, "closed exactly once");
        }
    });
}
