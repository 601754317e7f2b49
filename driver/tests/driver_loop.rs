//! The driver loop against a recording host: two drivers wired frame by frame, no sockets,
//! no runtime. Each test is one behaviour of `Driver` that every runtime inherits.

#![allow(clippy::unwrap_used)] // tests may panic

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use kvferry_core::{
    Config, EndpointInfo, Event, Generation, Incarnation, Layout, NodeId, Role, RoomId, SessionId,
    TargetId, TransferOp,
};
use kvferry_driver::{
    Announcer, ControlQueue, CoreWait, Dial, Driver, Host, Job, NodeError, OpSink, Release,
    TURN_BUDGET,
};
use tokio::sync::{mpsc, oneshot};

/// What the driver asked of its host, in order.
#[derive(Default)]
struct Log {
    connects: Vec<(TargetId, kvferry_core::DialId)>,
    /// One entry per data connection asked for.
    data_opened: Vec<SessionId>,
    closes: Vec<SessionId>,
    /// The linger of each close, as the host's release would wait on it.
    lingers: Vec<Option<CoreWait>>,
    published: Vec<Event>,
}

/// A host that starts nothing and records every request.
struct Recorder(Rc<RefCell<Log>>);

/// A control connection's queue, and what its writer would send from it.
#[derive(Clone)]
struct Wire {
    queue: ControlQueue,
    frames: Rc<RefCell<mpsc::UnboundedReceiver<Vec<u8>>>>,
}

impl Default for Wire {
    fn default() -> Self {
        let (queue, frames) = mpsc::unbounded_channel();
        Wire {
            queue,
            frames: Rc::new(RefCell::new(frames)),
        }
    }
}

impl Wire {
    /// The bytes queued since the last take.
    fn take(&self) -> Vec<u8> {
        let mut bytes = Vec::new();
        while let Ok(frame) = self.frames.borrow_mut().try_recv() {
            bytes.extend_from_slice(&frame);
        }
        bytes
    }
}

/// A data connection that takes every operation.
struct Taker;

impl OpSink for Taker {
    fn send(&self, _op: TransferOp) -> Result<(), TransferOp> {
        Ok(())
    }

    async fn close(self) {}

    fn abort(self) {}
}

impl Host for Recorder {
    type Sender = Taker;
    type Task = ();

    fn start(&self, job: Job<Self>) {
        let mut log = self.0.borrow_mut();
        match job {
            Job::Connect {
                dial: Dial::Target { target, dial, .. },
                ..
            } => log.connects.push((target, dial)),
            Job::Connect { .. } => {}
            Job::OpenData { session, .. } => log.data_opened.push(session),
            Job::Release {
                session,
                linger,
                why: Release::Close,
                ..
            } => {
                log.closes.push(session);
                log.lingers.push(linger);
            }
            Job::Release { .. } => {}
            Job::VerifyLanded { .. } => {}
            #[cfg(feature = "rdma")]
            _ => {}
        }
    }

    fn publish(&self, event: Event) {
        self.0.borrow_mut().published.push(event);
    }
}

fn layout() -> Layout {
    Layout {
        layers: 2,
        planes: 2,
        page_bytes: 64,
        pages: 16,
        aux_bytes: 0,
        state_bytes: 0,
        slots: 4,
    }
}

fn node(role: Role, id: u64, token: &[u8]) -> (Driver<Recorder>, Rc<RefCell<Log>>) {
    let mut info = EndpointInfo::new(role, NodeId(id), Incarnation(id), layout());
    info.token = token.to_vec();
    let now = Instant::now();
    let endpoint = kvferry_core::Endpoint::new(Config::default(), info, id, now).unwrap();
    let log = Rc::new(RefCell::new(Log::default()));
    let driver = Driver::new(
        endpoint,
        Recorder(log.clone()),
        3,
        Announcer::default(),
        now,
    );
    (driver, log)
}

/// A room's first generation.
const FIRST: Generation = 0;

const PEER: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 1);

/// Moves the bytes each side wrote to the other until neither writes more.
fn pump(
    a: &mut Driver<Recorder>,
    a_sid: SessionId,
    a_wire: &Wire,
    b: &mut Driver<Recorder>,
    b_sid: SessionId,
    b_wire: &Wire,
) {
    for _ in 0..100 {
        let to_b = a_wire.take();
        let to_a = b_wire.take();
        if to_a.is_empty() && to_b.is_empty() {
            return;
        }
        if !to_b.is_empty() {
            b.with(|e, now| e.handle_input(now, b_sid, &to_b));
        }
        if !to_a.is_empty() {
            a.with(|e, now| e.handle_input(now, a_sid, &to_a));
        }
    }
    panic!("the two drivers never went quiet");
}

/// A decode dialing a prefill, each driver recording; returns both sessions and wires.
fn dial(
    decode: &mut Driver<Recorder>,
    prefill: &mut Driver<Recorder>,
    handshake: oneshot::Sender<Result<SessionId, NodeError>>,
) -> (SessionId, Wire, SessionId, Wire) {
    let (d_wire, p_wire) = (Wire::default(), Wire::default());
    let d_sid = decode.attach_control(d_wire.queue.clone(), Some(PEER), None);
    decode.on_handshake(d_sid, handshake);
    let p_sid = prefill.attach_control(p_wire.queue.clone(), None, None);
    pump(decode, d_sid, &d_wire, prefill, p_sid, &p_wire);
    (d_sid, d_wire, p_sid, p_wire)
}

#[test]
fn a_caller_waiting_for_a_handshake_is_told_once_it_is_established() {
    let (mut decode, d_log) = node(Role::Decode, 1, b"t");
    let (mut prefill, p_log) = node(Role::Prefill, 2, b"t");
    let (tx, mut rx) = oneshot::channel();
    let (d_sid, ..) = dial(&mut decode, &mut prefill, tx);
    assert_eq!(rx.try_recv().unwrap().unwrap(), d_sid);
    // The side that dialed opens the data connections, as many as configured; the other none.
    assert_eq!(d_log.borrow().data_opened, vec![d_sid; 3]);
    assert!(p_log.borrow().data_opened.is_empty());
}

#[test]
fn a_caller_waiting_for_a_handshake_learns_why_the_peer_refused() {
    let (mut decode, d_log) = node(Role::Decode, 1, b"ours");
    let (mut prefill, p_log) = node(Role::Prefill, 2, b"theirs");
    let (tx, mut rx) = oneshot::channel();
    let (d_sid, _, p_sid, _) = dial(&mut decode, &mut prefill, tx);
    // The refusal closes the session; the host closes its connections and says so.
    assert!(d_log.borrow().closes.contains(&d_sid));
    decode.closed(d_sid);
    if p_log.borrow().closes.contains(&p_sid) {
        prefill.closed(p_sid);
    }
    match rx.try_recv().unwrap() {
        Err(NodeError::Refused { .. } | NodeError::RefusedAs(_) | NodeError::Rejected(_)) => {}
        other => panic!("expected the peer's refusal, got {other:?}"),
    }
}

#[test]
fn every_caller_waiting_for_a_handshake_learns_the_peers_refusal() {
    let (mut decode, log) = node(Role::Decode, 1, b"ours");
    let (mut prefill, _) = node(Role::Prefill, 2, b"theirs");
    let (tx, mut first) = oneshot::channel();
    let (d_sid, ..) = dial(&mut decode, &mut prefill, tx);
    let (tx, mut second) = oneshot::channel();
    decode.on_handshake(d_sid, tx);
    assert!(log.borrow().closes.contains(&d_sid));
    decode.closed(d_sid);
    for rx in [&mut first, &mut second] {
        match rx.try_recv().unwrap() {
            Err(NodeError::Refused { .. } | NodeError::RefusedAs(_) | NodeError::Rejected(_)) => {}
            other => panic!("expected the peer's refusal, got {other:?}"),
        }
    }
}

#[test]
fn a_caller_waiting_for_a_silent_peer_is_told_when_the_core_gives_up() {
    let (mut decode, log) = node(Role::Decode, 1, b"t");
    let (tx, mut rx) = oneshot::channel();
    let sid = decode.attach_control(Wire::default().queue, Some(PEER), None);
    decode.on_handshake(sid, tx);
    assert!(
        rx.try_recv().is_err(),
        "nothing is known before the peer answers"
    );
    let later = Instant::now() + Config::default().handshake_timeout + Duration::from_millis(1);
    decode.turn(later);
    assert_eq!(log.borrow().closes, vec![sid]);
    decode.closed(sid);
    assert!(matches!(
        rx.try_recv().unwrap(),
        Err(NodeError::HandshakeTimeout)
    ));
}

#[test]
fn a_drain_stops_at_its_budget_and_the_next_turn_finishes_it() {
    let (mut prefill, log) = node(Role::Prefill, 2, b"t");
    let rooms = TURN_BUDGET as u64 + 100;
    let wakeup = prefill.wakeup();
    let woken = |w: &tokio::sync::Notify| {
        futures_lite::future::block_on(futures_lite::future::poll_once(w.notified())).is_some()
    };
    assert!(!woken(&wakeup), "nothing asked for a turn yet");
    prefill.with(|e, now| {
        for r in 0..rooms {
            e.open_sender(now, RoomId(r), FIRST, None).unwrap();
        }
    });
    let published = log.borrow().published.len();
    assert!(
        published > 0 && published <= TURN_BUDGET,
        "{published} events in one drain"
    );
    assert!(woken(&wakeup), "a drain cut short asks for another turn");
    let mut turns = 0;
    while prefill
        .turn(Instant::now())
        .is_some_and(|t| t <= Instant::now())
    {
        turns += 1;
        assert!(turns < 100);
    }
    let states = log
        .borrow()
        .published
        .iter()
        .filter(|e| matches!(e, Event::RoomState { .. }))
        .count();
    assert!(
        states as u64 >= rooms,
        "every room's event went out: {states} of {rooms}"
    );
}

/// A decode keeping a target at `PEER`: the first connection the core asks for is attached.
fn dial_target(
    decode: &mut Driver<Recorder>,
    log: &Rc<RefCell<Log>>,
    prefill: &mut Driver<Recorder>,
) -> (TargetId, oneshot::Receiver<Result<SessionId, NodeError>>) {
    let target = decode.add_target(PEER).unwrap();
    let dialed: Vec<TargetId> = log.borrow().connects.iter().map(|(t, _)| *t).collect();
    assert_eq!(dialed, vec![target], "the core dials at once");
    let (tx, rx) = oneshot::channel();
    decode.on_target(target, tx);
    let (d_wire, p_wire) = (Wire::default(), Wire::default());
    let d_sid = decode.attach_control(d_wire.queue.clone(), Some(PEER), Some(target));
    let p_sid = prefill.attach_control(p_wire.queue.clone(), None, None);
    pump(decode, d_sid, &d_wire, prefill, p_sid, &p_wire);
    (target, rx)
}

#[test]
fn a_caller_waiting_for_a_targets_first_contact_gets_its_session() {
    let (mut decode, log) = node(Role::Decode, 1, b"t");
    let (mut prefill, _) = node(Role::Prefill, 2, b"t");
    let (target, mut rx) = dial_target(&mut decode, &log, &mut prefill);
    let session = rx.try_recv().unwrap().unwrap();
    assert_eq!(decode.endpoint().target_session(target), Some(session));
}

#[test]
fn a_caller_waiting_for_a_target_learns_at_once_that_its_peer_refused_us() {
    let (mut decode, log) = node(Role::Decode, 1, b"ours");
    let (mut prefill, _) = node(Role::Prefill, 2, b"theirs");
    let (_, mut rx) = dial_target(&mut decode, &log, &mut prefill);
    let closed = log.borrow().closes.clone();
    for sid in closed {
        decode.closed(sid);
    }
    // Not after the unreachable timeout: a refusal does not heal by retrying.
    match rx.try_recv().unwrap() {
        Err(NodeError::Refused { .. } | NodeError::RefusedAs(_) | NodeError::Rejected(_)) => {}
        other => panic!("expected the peer's refusal, got {other:?}"),
    }
}

#[test]
fn a_caller_waiting_for_a_target_nobody_answers_is_told_after_the_unreachable_timeout() {
    let (mut decode, log) = node(Role::Decode, 1, b"t");
    let target = decode.add_target(PEER).unwrap();
    let (tx, mut rx) = oneshot::channel();
    decode.on_target(target, tx);
    let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
    let (_, dial) = *log.borrow().connects.last().unwrap();
    decode.connect_failed(dial, &refused);
    decode.turn(Instant::now() + Duration::from_millis(1));
    assert!(rx.try_recv().is_err(), "still within the window");
    assert!(!log.borrow().connects.is_empty());
    let later = Instant::now() + Config::default().unreachable_timeout + Duration::from_millis(1);
    decode.turn(later);
    match rx.try_recv().unwrap() {
        Err(NodeError::Unreachable(reason)) => {
            assert_eq!(reason, kvferry_core::FailureReason::ConnectionRefused);
        }
        other => panic!("expected unreachable, got {other:?}"),
    }
}

#[test]
fn a_target_whose_connect_task_never_reports_is_dialed_again() {
    let (mut decode, log) = node(Role::Decode, 1, b"t");
    let target = decode.add_target(PEER).unwrap();
    // The host took the attempt and was never heard of again.
    let config = Config::default();
    // Given up at the connect timeout, counted as no answer one more later (nothing was
    // reported), dialed again after the reconnect interval.
    let start = Instant::now();
    decode.turn(start + config.connect_timeout);
    decode.turn(start + config.connect_timeout * 2);
    decode.turn(start + config.connect_timeout * 2 + config.reconnect_interval * 2);
    let dials = log.borrow().connects.clone();
    assert_eq!(dials.len(), 2, "a second attempt: {dials:?}");
    assert!(dials.iter().all(|(t, _)| *t == target));
    assert_ne!(dials[0].1, dials[1].1);
}

#[test]
fn a_closing_sessions_writer_lingers_until_the_core_says_it_is_over() {
    let (mut decode, log) = node(Role::Decode, 1, b"t");
    let sid = decode.attach_control(Wire::default().queue, Some(PEER), None);
    let closed_at = Instant::now();
    decode.with(|e, now| e.shutdown(now));
    assert_eq!(log.borrow().closes, vec![sid]);
    let mut linger = log.borrow_mut().lingers.pop().unwrap().unwrap();
    assert!(linger.try_recv().is_err(), "the writer may still send");
    decode.turn(closed_at + Config::default().close_linger + Duration::from_millis(1));
    assert_eq!(linger.try_recv(), Ok(()), "the core ended the linger");
}

#[test]
fn an_accepted_connection_is_dropped_when_the_core_says_its_time_is_up() {
    let (mut prefill, _) = node(Role::Prefill, 2, b"t");
    let accepted_at = Instant::now();
    let (_, mut deadline) = prefill.accepted();
    prefill.turn(accepted_at + Duration::from_millis(1));
    assert!(deadline.try_recv().is_err(), "still within its deadline");
    prefill.turn(accepted_at + Config::default().handshake_timeout + Duration::from_millis(1));
    assert_eq!(deadline.try_recv(), Ok(()));
    assert_eq!(prefill.endpoint().accepted_pending(), 0);
}

#[test]
fn an_accepted_connection_that_settled_is_not_dropped() {
    let (mut prefill, _) = node(Role::Prefill, 2, b"t");
    let accepted_at = Instant::now();
    let (conn, mut deadline) = prefill.accepted();
    prefill.accept_settled(conn);
    prefill.turn(accepted_at + Config::default().handshake_timeout * 2);
    assert_eq!(
        deadline.try_recv(),
        Err(oneshot::error::TryRecvError::Closed),
        "its end was let go without firing"
    );
}

#[test]
fn a_failed_accept_resumes_when_the_core_ends_the_backoff() {
    let (mut prefill, _) = node(Role::Prefill, 2, b"t");
    let failed_at = Instant::now();
    let mut resume = prefill.accept_failed();
    assert!(resume.try_recv().is_err(), "paused");
    prefill.turn(failed_at + Config::default().accept_backoff + Duration::from_millis(1));
    assert_eq!(resume.try_recv(), Ok(()));
}

#[test]
fn a_shutdown_ends_every_wait_the_core_would_have_ended() {
    let (mut prefill, _) = node(Role::Prefill, 2, b"t");
    let (_, mut before) = prefill.accepted();
    let mut paused = prefill.accept_failed();
    let (tx, mut done) = oneshot::channel();
    prefill.shutdown(tx);
    prefill.turn(Instant::now() + Config::default().shutdown_timeout);
    assert_eq!(done.try_recv(), Ok(()), "shut down");
    // The driver loop ends here: no core timer fires any more, so the waits end now.
    assert_eq!(before.try_recv(), Ok(()));
    assert_eq!(paused.try_recv(), Ok(()));
    let (_, mut after) = prefill.accepted();
    assert!(
        after
            .try_recv()
            .is_err_and(|e| e == oneshot::error::TryRecvError::Closed),
        "a connection accepted after the shutdown is let go at once"
    );
}

#[test]
fn a_session_whose_control_connection_ended_stops_its_writer_at_once() {
    let (mut decode, log) = node(Role::Decode, 1, b"t");
    let sid = decode.attach_control(Wire::default().queue, Some(PEER), None);
    decode.control_ended(sid);
    assert_eq!(log.borrow().closes, vec![sid]);
    let mut linger = log.borrow_mut().lingers.pop().unwrap().unwrap();
    assert!(
        linger
            .try_recv()
            .is_err_and(|e| e == oneshot::error::TryRecvError::Closed),
        "no linger: the peer is gone"
    );
}
