//! Operation outcomes driven by hand against a real pair of endpoints, to pin the order in
//! which the last operation of a room settles.
#![allow(clippy::unwrap_used)] // tests may panic

use std::time::Instant;

use kvferry_core::sim::{fast_config, small_layout};
use kvferry_core::{
    Chunk, ConnectFailure, Endpoint, EndpointInfo, FailureReason, Grant, Incarnation, KvPoll,
    NodeId, OpKind, Role, RoomId, SessionId, TransferOp, TransferOutcome,
};

struct Pair {
    now: Instant,
    p: Endpoint,
    d: Endpoint,
    sp: SessionId,
    sd: SessionId,
}

impl Pair {
    fn new() -> Pair {
        let now = Instant::now();
        let layout = small_layout(64);
        let mut config = fast_config();
        config.transfer_retries = 1;
        let p = Endpoint::new(
            config.clone(),
            EndpointInfo::new(Role::Prefill, NodeId(1), Incarnation(1), layout),
            1,
            now,
        )
        .unwrap();
        let d = Endpoint::new(
            config,
            EndpointInfo::new(Role::Decode, NodeId(2), Incarnation(2), layout),
            2,
            now,
        )
        .unwrap();
        let mut pair = Pair {
            now,
            p,
            d,
            sp: SessionId(0),
            sd: SessionId(0),
        };
        pair.sp = pair.p.open_session(now);
        pair.sd = pair.d.accept_session(now);
        pair.pump();
        pair
    }

    fn pump(&mut self) {
        loop {
            let mut buf = Vec::new();
            let mut moved = false;
            while self.p.poll_transmit(&mut buf).is_some() {
                moved = true;
            }
            self.d.handle_input(self.now, self.sd, &buf);
            buf.clear();
            while self.d.poll_transmit(&mut buf).is_some() {
                moved = true;
            }
            self.p.handle_input(self.now, self.sp, &buf);
            if !moved {
                return;
            }
        }
    }

    fn ops(&mut self) -> Vec<TransferOp> {
        std::iter::from_fn(|| self.p.poll_transfer(self.now)).collect()
    }
}

#[test]
fn a_room_whose_last_operation_fails_fails_instead_of_succeeding() {
    let mut t = Pair::new();
    let room = RoomId(1);
    let grant = Grant {
        extras: Vec::new(),
        pages: vec![1, 2],
        aux_slot: Some(3),
        state_slot: None,
        receivers: 1,
        skip_pages: 0,
        idle_sources: 0,
        prompt: None,
    };
    t.d.open_receiver(t.now, room, 0, &[t.sd], Some(grant))
        .unwrap();
    t.p.open_sender(t.now, room, 0, None).unwrap();
    t.pump();
    t.p.send_chunk(
        t.now,
        room,
        Chunk {
            extras: Vec::new(),
            pages: vec![5, 6],
            last: true,
            aux_slot: Some(0),
            state_slot: None,
            layerwise: false,
        },
    )
    .unwrap();
    let ops = t.ops();
    assert_eq!(ops.iter().filter(|o| o.kind == OpKind::Aux).count(), 1);
    for op in ops.iter().filter(|o| o.kind == OpKind::Kv) {
        t.p.handle_transfer_result(t.now, op.id, TransferOutcome::Done);
    }
    let aux = ops.iter().find(|o| o.kind == OpKind::Aux).unwrap();
    t.p.handle_transfer_result(t.now, aux.id, TransferOutcome::Fatal);
    t.pump();
    assert_failed_on_both_sides(&t, room, FailureReason::TransferFailed);
}

#[test]
fn a_room_whose_last_operation_is_refused_fails_instead_of_succeeding() {
    let mut t = Pair::new();
    let room = RoomId(2);
    let grant = Grant {
        extras: Vec::new(),
        pages: vec![1],
        aux_slot: None,
        state_slot: None,
        receivers: 1,
        skip_pages: 0,
        idle_sources: 0,
        prompt: None,
    };
    t.d.open_receiver(t.now, room, 0, &[t.sd], Some(grant))
        .unwrap();
    t.p.open_sender(t.now, room, 0, None).unwrap();
    t.pump();
    t.p.send_chunk(
        t.now,
        room,
        Chunk {
            extras: Vec::new(),
            pages: vec![5],
            last: true,
            aux_slot: None,
            state_slot: None,
            layerwise: false,
        },
    )
    .unwrap();
    let ops = t.ops();
    assert_eq!(ops.len(), 1);
    t.p.handle_transfer_result(t.now, ops[0].id, TransferOutcome::Refused);
    assert_eq!(
        t.p.room_state(room),
        Some(KvPoll::Failed(FailureReason::AbortedByPeer))
    );
}

/// Reports `id` flushed, lets the retry backoff pass and returns the operation run again.
fn flush(t: &mut Pair, id: kvferry_core::TransferId) -> Option<TransferOp> {
    t.p.handle_transfer_result(t.now, id, TransferOutcome::Flushed);
    // Past the backoff (at most 2.5 steps of 5 ms at the first attempt), well inside the
    // heartbeats' patience.
    t.now += std::time::Duration::from_millis(20);
    t.p.handle_timeout(t.now);
    t.pump();
    t.ops().into_iter().next()
}

#[test]
fn a_write_flushed_by_its_neighbours_failures_spends_no_attempt_and_its_room_succeeds() {
    // One attempt only: a flush that spent it would fail the room at the first flush.
    let mut t = Pair::new();
    let room = RoomId(4);
    let mut ops = open_room_and_plan(&mut t, room);
    for _ in 0..5 {
        let again = flush(&mut t, ops[0].id).expect("a flushed write runs again");
        assert_eq!(again.attempt, 1, "a flush spends no attempt");
        ops[0] = again;
    }
    land_all(&mut t, room, &ops);
    assert_eq!(t.p.room_state(room), Some(KvPoll::Success));
    assert_eq!(t.d.room_state(room), Some(KvPoll::Success));
}

#[test]
fn a_write_its_path_flushes_again_and_again_fails_its_room_as_a_failed_transfer() {
    let mut t = Pair::new();
    let room = RoomId(5);
    let ops = open_room_and_plan(&mut t, room);
    let mut id = ops[0].id;
    let mut runs = 0;
    while let Some(again) = flush(&mut t, id) {
        id = again.id;
        runs += 1;
        assert!(runs <= 16, "flushes are bounded");
    }
    assert_eq!(runs, 16);
    t.pump();
    assert_failed_on_both_sides(&t, room, FailureReason::TransferFailed);
}

#[test]
fn a_target_is_reconnected_with_exponential_backoff_until_removed() {
    use kvferry_core::{Action, Timer};
    use std::time::Duration;
    let now = Instant::now();
    let layout = small_layout(16);
    let mut d = Endpoint::new(
        fast_config(),
        EndpointInfo::new(Role::Decode, NodeId(2), Incarnation(2), layout),
        2,
        now,
    )
    .unwrap();
    let t = d.add_target(now);
    let connect = |d: &mut Endpoint| match d.poll_action() {
        Some(Action::Connect { target, dial }) if target == t => dial,
        other => panic!("expected a connect to {t}, got {other:?}"),
    };
    let dial = connect(&mut d);
    d.handle_connect_failed(now, dial, ConnectFailure::Refused);
    let (first, why) = d.poll_timeout().unwrap();
    assert_eq!(why, Timer::Reconnect(t));
    assert!(first - now >= Duration::from_millis(100) && first - now <= Duration::from_millis(125));
    d.handle_timeout(first);
    let dial = connect(&mut d);
    d.handle_connect_failed(first, dial, ConnectFailure::Refused);
    let (second, _) = d.poll_timeout().unwrap();
    assert!(
        second - first >= Duration::from_millis(200),
        "the backoff doubles"
    );
    d.handle_timeout(second);
    connect(&mut d);
    let sid = d.open_session_for(second, t);
    assert_eq!(d.target_session(t), None, "not before the handshake");
    d.handle_disconnected(second, sid);
    let (third, why) = d.poll_timeout().unwrap();
    assert_eq!(why, Timer::Reconnect(t), "a dropped session is reconnected");
    d.remove_target(t);
    d.handle_timeout(third);
    while let Some(a) = d.poll_action() {
        assert!(
            !matches!(a, Action::Connect { .. }),
            "a removed target is left alone"
        );
    }
}

/// Opens room `room` on both sides with two granted pages and returns prefill's operations.
fn assert_failed_on_both_sides(t: &Pair, room: RoomId, reason: FailureReason) {
    assert_eq!(t.p.room_state(room), Some(KvPoll::Failed(reason)));
    assert_eq!(t.d.room_state(room), Some(KvPoll::Failed(reason)));
}

fn open_room_and_plan(t: &mut Pair, room: RoomId) -> Vec<TransferOp> {
    let grant = Grant {
        extras: Vec::new(),
        pages: vec![1, 2],
        aux_slot: Some(3),
        state_slot: None,
        receivers: 1,
        skip_pages: 0,
        idle_sources: 0,
        prompt: None,
    };
    t.d.open_receiver(t.now, room, 0, &[t.sd], Some(grant))
        .unwrap();
    t.p.open_sender(t.now, room, 0, None).unwrap();
    t.pump();
    let chunk = Chunk {
        extras: Vec::new(),
        pages: vec![5, 6],
        last: true,
        aux_slot: Some(0),
        state_slot: None,
        layerwise: false,
    };
    t.p.send_chunk(t.now, room, chunk).unwrap();
    t.ops()
}

fn releasable(d: &mut Endpoint, room: RoomId) -> bool {
    std::iter::from_fn(|| d.poll_event())
        .any(|e| matches!(e, kvferry_core::Event::Releasable { room: r, .. } if r == room))
}

/// Lands every operation through decode's permits and reports it done to prefill.
fn land_all(t: &mut Pair, room: RoomId, ops: &[TransferOp]) {
    for op in ops {
        let permit = t.d.begin_write(t.now, t.sd, room, 0, &op.slices).unwrap();
        t.d.end_write(t.now, permit.applied(), &op.slices);
        t.p.handle_transfer_result(t.now, op.id, TransferOutcome::Done);
    }
    t.pump();
}

#[test]
fn a_write_still_landing_holds_a_succeeded_rooms_pages_until_it_ends() {
    let mut t = Pair::new();
    let room = RoomId(3);
    let ops = open_room_and_plan(&mut t, room);
    // A first attempt of the aux write whose sender already gave up on it (broken connection)
    // is still being applied by decode's receive path.
    let aux = ops.iter().find(|o| o.kind == OpKind::Aux).unwrap();
    let orphan = t.d.begin_write(t.now, t.sd, room, 0, &aux.slices).unwrap();
    land_all(&mut t, room, &ops);
    assert_eq!(t.d.room_state(room), Some(KvPoll::Success));
    assert!(
        !releasable(&mut t.d, room),
        "pages released under a landing write"
    );
    t.d.end_write(t.now, orphan, &aux.slices);
    assert!(releasable(&mut t.d, room));
}

#[test]
fn a_write_stuck_landing_is_fenced_and_its_void_permit_is_ignored() {
    let mut t = Pair::new();
    let room = RoomId(4);
    let ops = open_room_and_plan(&mut t, room);
    let aux = ops.iter().find(|o| o.kind == OpKind::Aux).unwrap();
    let stuck = t.d.begin_write(t.now, t.sd, room, 0, &aux.slices).unwrap();
    land_all(&mut t, room, &ops);
    assert!(!releasable(&mut t.d, room));
    // The abort deadline bounds the wait: decode fences the session.
    t.now += t.d.config().abort_ack_timeout * 2;
    t.d.handle_timeout(t.now);
    let fence = std::iter::from_fn(|| t.d.poll_action())
        .any(|a| a == kvferry_core::Action::FenceSession(t.sd));
    assert!(fence, "decode fences the session whose write never ends");
    t.d.handle_fence_complete(t.now, t.sd);
    assert!(releasable(&mut t.d, room));
    // The stuck write's permit is void after the fence: handing it back changes nothing.
    t.d.end_write(t.now, stuck, &aux.slices);
    assert_eq!(t.d.live_rooms(), 0);
}

#[test]
fn a_permit_is_refused_for_a_concluded_room() {
    let mut t = Pair::new();
    let room = RoomId(5);
    let ops = open_room_and_plan(&mut t, room);
    land_all(&mut t, room, &ops);
    // Succeeded and released: a retry of a write whose first attempt landed (its
    // acknowledgement lost with the connection) is answered from the tombstone, as landed,
    // and never writes the embedder's pages.
    assert_eq!(
        t.d.begin_write(t.now, t.sd, room, 0, &ops[0].slices),
        Err(kvferry_core::WriteRefused::AlreadyLanded)
    );
    // Another generation of the room is no repeat.
    assert_eq!(
        t.d.begin_write(t.now, t.sd, room, 1, &ops[0].slices),
        Err(kvferry_core::WriteRefused::UnknownRoom)
    );
}

#[test]
fn transport_bytes_reach_the_peers_backend_unchanged_and_only_on_a_ready_session() {
    let mut t = Pair::new();
    let hello = vec![0xAB; 300];
    t.p.send_transport(t.now, t.sp, &hello).unwrap();
    t.pump();
    let got: Vec<Vec<u8>> = std::iter::from_fn(|| t.d.poll_event())
        .filter_map(|e| match e {
            kvferry_core::Event::TransportReceived { session, payload } if session == t.sd => {
                Some(payload)
            }
            _ => None,
        })
        .collect();
    assert_eq!(got, vec![hello]);
    let too_long = vec![0u8; kvferry_core::codec::MAX_TRANSPORT_LEN + 1];
    assert_eq!(
        t.p.send_transport(t.now, t.sp, &too_long),
        Err(kvferry_core::ApiError::TransportTooLong(too_long.len()))
    );
    let fresh = t.p.open_session(t.now);
    assert_eq!(
        t.p.send_transport(t.now, fresh, b"x"),
        Err(kvferry_core::ApiError::SessionNotReady(fresh))
    );
    assert_eq!(
        t.p.send_transport(t.now, SessionId(999), b"x"),
        Err(kvferry_core::ApiError::UnknownSession(SessionId(999)))
    );
}

#[test]
fn a_shutdown_completes_when_its_last_session_closes_or_at_its_timeout() {
    use kvferry_core::Event;
    use std::time::Duration;
    let shut_down = |e: &mut Endpoint| {
        std::iter::from_fn(|| e.poll_event()).find_map(|ev| match ev {
            Event::ShutDown { unclosed } => Some(unclosed),
            _ => None,
        })
    };
    let mut t = Pair::new();
    assert_eq!(t.p.may_connect(), Ok(()));
    t.p.shutdown(t.now);
    // A node going away opens no session, from the moment its shutdown begins.
    assert_eq!(t.p.may_connect(), Err(kvferry_core::ApiError::ShutDown));
    assert_eq!(shut_down(&mut t.p), None, "its session is still closing");
    // The driver closed the session's connections.
    t.p.handle_disconnected(t.now, t.sp);
    assert_eq!(shut_down(&mut t.p), Some(0));
    assert!(t.p.shutdown_complete());
    // A session whose connections never close: complete at the timeout, and says so.
    let timeout = t.d.config().shutdown_timeout;
    t.d.shutdown(t.now);
    t.d.handle_timeout(t.now + timeout - Duration::from_millis(1));
    assert_eq!(shut_down(&mut t.d), None);
    t.d.handle_timeout(t.now + timeout);
    assert_eq!(shut_down(&mut t.d), Some(1));
}

#[test]
fn a_broken_data_connection_is_replaced_by_the_dialer_after_a_short_wait() {
    use kvferry_core::Action;
    use std::time::Duration;
    let opens = |e: &mut Endpoint| {
        std::iter::from_fn(|| e.poll_action())
            .filter(|a| matches!(a, Action::OpenDataConnection(_)))
            .count()
    };
    let mut t = Pair::new();
    let base = t.p.config().data_reconnect_interval;
    // The dialer (prefill here) replaces it after the first wait.
    t.p.handle_data_connection_lost(t.now, t.sp);
    t.p.handle_timeout(t.now + base - Duration::from_micros(1));
    assert_eq!(opens(&mut t.p), 0, "not before the wait");
    t.p.handle_timeout(t.now + base);
    assert_eq!(opens(&mut t.p), 1);
    // Two losses close together: both replaced at the one timer.
    let later = t.now + base;
    t.p.handle_data_connection_lost(later, t.sp);
    t.p.handle_data_connection_lost(later, t.sp);
    t.p.handle_timeout(later + base);
    assert_eq!(opens(&mut t.p), 2);
    // The accepting side never dials: it waits for the dialer's connection.
    t.d.handle_data_connection_lost(t.now, t.sd);
    t.d.handle_timeout(t.now + Duration::from_secs(1));
    assert_eq!(opens(&mut t.d), 0);
}

/// Lands every operation through decode's permits only: the prefill has not heard of them.
fn land_on_decode(t: &mut Pair, room: RoomId, ops: &[TransferOp]) {
    for op in ops {
        let permit = t.d.begin_write(t.now, t.sd, room, 0, &op.slices).unwrap();
        t.d.end_write(t.now, permit.applied(), &op.slices);
    }
}

#[test]
fn a_tcp_room_succeeds_when_its_last_byte_lands_without_waiting_for_the_sources_word() {
    let mut t = Pair::new();
    let room = RoomId(6);
    let ops = open_room_and_plan(&mut t, room);
    let (last, rest) = ops.split_last().unwrap();
    land_on_decode(&mut t, room, rest);
    assert_ne!(
        t.d.room_state(room),
        Some(KvPoll::Success),
        "a write is missing"
    );
    land_on_decode(&mut t, room, std::slice::from_ref(last));
    assert_eq!(t.d.room_state(room), Some(KvPoll::Success));
    // Nothing of the room is being applied: its pages are free at once.
    assert!(releasable(&mut t.d, room));
    // The prefill learns from its acknowledgements; its word changes nothing here.
    for op in &ops {
        t.p.handle_transfer_result(t.now, op.id, TransferOutcome::Done);
    }
    t.pump();
    assert_eq!(t.p.room_state(room), Some(KvPoll::Success));
    assert_eq!(t.d.room_state(room), Some(KvPoll::Success));
}

#[test]
fn a_tcp_room_with_a_write_still_landing_succeeds_only_once_it_ends() {
    let mut t = Pair::new();
    let room = RoomId(8);
    let ops = open_room_and_plan(&mut t, room);
    // A second attempt of the first write is being applied while the first one lands.
    let repeat =
        t.d.begin_write(t.now, t.sd, room, 0, &ops[0].slices)
            .unwrap();
    land_on_decode(&mut t, room, &ops);
    assert_ne!(
        t.d.room_state(room),
        Some(KvPoll::Success),
        "a write into the room's pages is still landing"
    );
    t.d.end_write(t.now, repeat.applied(), &ops[0].slices);
    assert_eq!(t.d.room_state(room), Some(KvPoll::Success));
}
