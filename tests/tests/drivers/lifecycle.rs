//! Peers and rooms over their lifetimes: rooms asked for early, aborts, restarts, peers down,
//! connected twice or disconnected, stalled decodes, and the fences that keep pages clean.

use super::*;

/// A prefill and a decode node (ids `ids`), connected, and decode's room `room` over pages 1
/// and 2, opened; prefill's embedder has not subscribed to announcements yet.
pub(super) async fn a_room_asked_for(
    p: Runtime,
    d: Runtime,
    ids: (u64, u64),
    room: RoomId,
) -> (
    kvferry_tests::Node,
    kvferry_tests::Node,
    kvferry_tokio::RoomHandle,
) {
    let shape = small_shape();
    let prefill = start_on(p, Role::Prefill, &shape, fast_core(), ids.0);
    let addrs = prefill.listen(any_port()).await.unwrap();
    let decode = start_on(d, Role::Decode, &shape, fast_core(), ids.1);
    let peer = decode.connect(addrs).await.expect("connect");
    let grant = Grant {
        extras: Vec::new(),
        pages: vec![1, 2],
        aux_slot: None,
        state_slot: None,
        receivers: 1,
        skip_pages: 0,
        idle_sources: 0,
        prompt: None,
    };
    let h = decode
        .open_receiver(room, 0, vec![peer], Some(grant))
        .await
        .unwrap();
    (prefill, decode, h)
}

/// Prefill aborts a room: decode learns it at once, with the peer's reason.
pub(super) async fn a_prefill_abort_reaches_decode_at_once(p: Runtime, d: Runtime) {
    let (prefill, _decode, mut h) = a_room_asked_for(p, d, (91, 92), RoomId(5)).await;
    let a = prefill.room_announcements().recv().await.unwrap();
    prefill
        .open_sender(a.room, a.generation, None)
        .await
        .unwrap();
    let t0 = Instant::now();
    prefill.abort(RoomId(5)).await.unwrap();
    assert_eq!(
        h.terminal().await,
        KvPoll::Failed(FailureReason::AbortedByPeer)
    );
    // Not at the 2 s waiting deadline (the bound leaves room for a loaded machine).
    assert!(t0.elapsed() < Duration::from_secs(1), "not at the deadline");
    h.releasable().await;
}

/// A decode asks for a room before the prefill's embedder subscribes to announcements (a
/// persistent decode reconnecting to a prefill that just started listening): the room is
/// announced once it subscribes, and succeeds, instead of waiting for a sender that never
/// opens.
pub(super) async fn a_room_asked_for_before_the_prefill_subscribes_is_announced_when_it_does(
    p: Runtime,
    d: Runtime,
) {
    let (prefill, _decode, mut h) = a_room_asked_for(p, d, (95, 96), RoomId(7)).await;
    // The embedder is late: the request reaches prefill before anyone listens for it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut announced = prefill.room_announcements();
    let a = tokio::time::timeout(Duration::from_secs(5), announced.recv())
        .await
        .expect("the early request is announced")
        .unwrap();
    assert_eq!((a.room, a.pages), (RoomId(7), 2));
    prefill
        .open_sender(a.room, a.generation, None)
        .await
        .unwrap();
    let chunk = Chunk {
        extras: Vec::new(),
        pages: vec![3, 4],
        last: true,
        aux_slot: None,
        state_slot: None,
        layerwise: false,
    };
    prefill.send_chunk(a.room, chunk).await.unwrap();
    assert_eq!(h.terminal().await, KvPoll::Success);
}

/// A prefill restarted behind the same addresses (a new incarnation): the decode's persistent
/// peer reconnects by itself and rooms keep flowing.
pub(super) async fn a_restarted_prefill_is_reconnected_and_used_again(p: Runtime, d: Runtime) {
    let shape = small_shape();
    let at = free_ports(2);
    let (p1, addrs, server1) = prefill_on(p, &shape, fast_core(), 101, at).await;
    let decode = start_on(d, Role::Decode, &shape, fast_core(), 102);
    let peer = decode.connect_persistent(addrs.clone()).await.unwrap();
    assert_all_clean(&run_decode(&decode, peer, rooms(6, 1)).await, 6);
    p1.shutdown().await;
    server1.abort();
    drop(p1);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (_p2, addrs2, _server2) = prefill_on(p, &shape, fast_core(), 103, at).await;
    assert_eq!(addrs, addrs2);
    // No connect call: the core's reconnect backoff brings the sessions back.
    let report = run_decode(&decode, peer, rooms(10, 100)).await;
    assert_all_clean(&report, 10);
    // An explicit connect to the new incarnation works as well.
    let again = decode.connect(addrs2).await.unwrap();
    assert_ne!(again, peer);
    assert_all_clean(&run_decode(&decode, again, rooms(10, 200)).await, 10);
}

/// A persistent peer that went away is said to be unreachable once it stayed down for the
/// whole `unreachable_timeout`, at once and without waiting (an embedder asks its router for
/// the peer's new address before opening a room that would fail), and no longer once it is
/// back.
pub(super) async fn a_persistent_peer_down_past_its_window_is_reported_unreachable(
    p: Runtime,
    d: Runtime,
) {
    let shape = small_shape();
    let at = free_ports(2);
    let (p1, addrs, server1) = prefill_on(p, &shape, peer_loss_core(), 121, at).await;
    let decode = start_on(d, Role::Decode, &shape, peer_loss_core(), 122);
    let peer = decode.connect_persistent(addrs.clone()).await.unwrap();
    // Reached first: a peer never reached counts as down since it was named, so its window
    // would start before `going` (slow handshakes, queue pairs under emulation).
    decode.reach(peer).await.unwrap();
    assert_eq!(decode.unreachable(peer).await.unwrap(), None);
    let window = peer_loss_core().unreachable_timeout;
    // The decode cannot see the peer down before this: a bound on how long it has been down
    // that holds however late this task runs on a loaded machine.
    let going = std::time::Instant::now();
    p1.shutdown().await;
    server1.abort();
    drop(p1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let inside = decode.unreachable(peer).await.unwrap();
    if going.elapsed() < window {
        assert_eq!(inside, None, "inside its window");
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let asked = std::time::Instant::now();
    let reason = decode.unreachable(peer).await.unwrap();
    // At once: a call that waited for the peer would wait until it is back (never here).
    assert!(asked.elapsed() < window, "answered at once");
    assert!(
        matches!(
            reason,
            Some(FailureReason::ConnectionRefused | FailureReason::PeerUnreachable)
        ),
        "{reason:?}"
    );
    let (_p2, _addrs2, _server2) = prefill_on(p, &shape, peer_loss_core(), 123, at).await;
    // The core dials it again every 20-100 ms: back within a few intervals.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while decode.unreachable(peer).await.unwrap().is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "still unreachable once back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A decode that keeps a prefill connected and also connects to it explicitly has one
/// session to it (the second connection takes the first over), and both of its handles to
/// the peer keep serving rooms: the kept peer's target follows the take-over instead of
/// dialing again and taking the explicit session over in turn, which left the explicit
/// handle naming a session that no longer existed (`unknown_session`).
pub(super) async fn a_peer_connected_twice_serves_rooms_on_both_handles(p: Runtime, d: Runtime) {
    let shape = small_shape();
    let (_prefill, addrs, _server) = prefill_on(p, &shape, fast_core(), 111, any_port()).await;
    let decode = start_on(d, Role::Decode, &shape, fast_core(), 112);
    let kept = decode.connect_persistent(addrs.clone()).await.unwrap();
    assert_all_clean(&run_decode(&decode, kept, rooms(4, 1)).await, 4);
    let explicit = decode.connect(addrs).await.unwrap();
    // Several reconnect intervals (100 ms): a target left behind would have dialed again.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_all_clean(&run_decode(&decode, explicit, rooms(10, 100)).await, 10);
    assert_all_clean(&run_decode(&decode, kept, rooms(10, 200)).await, 10);
}

/// The decode's receive paths admit a clean room's writes against the core's grant table,
/// without the driver's lock: none left to the core, and over TCP (where this node applies
/// the writes itself) every write applied.
pub(super) async fn a_clean_rooms_writes_are_admitted_without_the_drivers_lock(
    p: Runtime,
    d: Runtime,
) {
    let shape = small_shape();
    let (_prefill, addrs, _server) = prefill_on(p, &shape, fast_core(), 131, any_port()).await;
    let decode = start_on(d, Role::Decode, &shape, fast_core(), 132);
    let peer = decode.connect(addrs).await.unwrap();
    assert_all_clean(&run_decode(&decode, peer, rooms(20, 1)).await, 20);
    let c = decode.counters().await;
    assert_eq!(c.writes_admitted_locked, 0, "{c:?}");
    if kvferry_testkit::path_label(&decode).await == "tcp" {
        assert!(c.writes_applied >= 20, "{c:?}");
    }
}

/// Established sessions of `node` (those whose data path is chosen).
pub(super) async fn sessions_of(node: &kvferry_tests::Node) -> usize {
    node.data_paths().await.len()
}

/// Waits until `node` has no established session (at most 5 s).
pub(super) async fn until_no_session(node: &kvferry_tests::Node, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while sessions_of(node).await > 0 {
        assert!(Instant::now() < deadline, "{what}: sessions left");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A decode lets a kept prefill go (scaled away): its sessions close on both sides, it is
/// dialed no more, and its id is unknown from then on (rooms toward it are refused).
pub(super) async fn a_disconnected_persistent_peer_is_closed_and_dialed_no_more(
    p: Runtime,
    d: Runtime,
) {
    let shape = small_shape();
    let (prefill, addrs, _server) = prefill_on(p, &shape, fast_core(), 131, any_port()).await;
    let decode = start_on(d, Role::Decode, &shape, fast_core(), 132);
    let peer = decode.connect_persistent(addrs).await.unwrap();
    assert_all_clean(&run_decode(&decode, peer, rooms(4, 1)).await, 4);
    decode.disconnect(peer).await.unwrap();
    until_no_session(&prefill, "the prefill").await;
    until_no_session(&decode, "the decode").await;
    // Several reconnect intervals (20-100 ms): a target left behind would have dialed again.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(sessions_of(&prefill).await, 0, "dialed no more");
    let refused = decode.open_receiver(RoomId(50), 0, vec![peer], None).await;
    assert!(
        matches!(refused, Err(kvferry_tokio::NodeError::UnknownPeer(_))),
        "{refused:?}"
    );
    assert!(matches!(
        decode.disconnect(peer).await,
        Err(kvferry_tokio::NodeError::UnknownPeer(_))
    ));
}

/// A connect to a peer's addresses that fails on one of them closes the sessions it opened
/// to the others: a failed call leaves nothing behind, so an embedder that retries does not
/// pile sessions up.
pub(super) async fn a_connect_that_fails_part_way_leaves_no_session_behind(p: Runtime, d: Runtime) {
    let shape = small_shape();
    let (prefill, addrs, _server) = prefill_on(p, &shape, fast_core(), 141, any_port()).await;
    let decode = start_on(d, Role::Decode, &shape, fast_core(), 142);
    let mut with_nobody = addrs.clone();
    with_nobody.push(free_ports(1));
    for _ in 0..3 {
        assert!(decode.connect(with_nobody.clone()).await.is_err());
    }
    until_no_session(&prefill, "the prefill").await;
    let peer = decode.connect(addrs).await.unwrap();
    assert_all_clean(&run_decode(&decode, peer, rooms(4, 1)).await, 4);
}

/// A wait for a kept peer's first contact ends when the embedder lets the peer go.
pub(super) async fn a_wait_for_a_kept_peer_ends_when_it_is_disconnected(_p: Runtime, d: Runtime) {
    let shape = small_shape();
    let decode = start_on(d, Role::Decode, &shape, peer_loss_core(), 151);
    let peer = decode
        .connect_persistent(vec![free_ports(1)])
        .await
        .unwrap();
    let waiting = {
        let decode = decode.clone();
        tokio::spawn(async move { decode.reach(peer).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    decode.disconnect(peer).await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the wait ends")
        .unwrap();
    assert!(
        matches!(ended, Err(kvferry_tokio::NodeError::Disconnected)),
        "{ended:?}"
    );
}

/// One decode stops reading entirely; rooms toward another decode of the same prefill are
/// not delayed (no head-of-line blocking).
pub(super) async fn a_stalled_decode_does_not_delay_rooms_toward_another_decode(
    p: Runtime,
    d: Runtime,
) {
    let shape = small_shape();
    let (_prefill, addrs, _server) = prefill_on(p, &shape, fast_core(), 111, any_port()).await;
    let mut proxies = Vec::new();
    for (i, &addr) in addrs.iter().enumerate() {
        proxies.push(FaultProxy::start(addr, 9 + i as u64).await.unwrap());
    }
    let behind: Vec<SocketAddr> = proxies.iter().map(|p| p.addr).collect();
    let slow = start_on(d, Role::Decode, &shape, fast_core(), 112);
    let fast = start_on(d, Role::Decode, &shape, fast_core(), 113);
    let slow_peer = slow.connect(behind).await.unwrap();
    let fast_peer = fast.connect(addrs).await.unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    for proxy in &proxies {
        proxy.set(|f| {
            f.stall_up = true;
            f.stall_down = true;
        });
    }
    let stuck = tokio::spawn(async move { run_decode(&slow, slow_peer, rooms(8, 1)).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let report = run_decode(&fast, fast_peer, rooms(50, 1000)).await;
    assert_all_clean(&report, 50);
    assert!(
        // Blocked rooms would wait for the stalled ones' 2 s deadlines.
        report.latency_ms.1 < 1000.0,
        "p99 {} ms: no head-of-line blocking",
        report.latency_ms.1
    );
    stuck.abort();
}

/// Decode aborts a room while its writes are in flight: the pages become releasable on the
/// drain acknowledgement (no fence), and prefill learns of the abort.
pub(super) async fn a_decode_abort_mid_transfer_releases_pages_on_the_drain_ack(
    p: Runtime,
    d: Runtime,
) {
    let shape = Shape {
        page_bytes: 64 * 1024,
        pages_per_room: 64,
        ..small_shape()
    };
    // A fence timer far beyond the ack, so "released on the ack" cannot be confused with it
    // however loaded the machine.
    let core = Config {
        abort_ack_timeout: Duration::from_secs(5),
        ..fast_core()
    };
    let prefill = start_on(p, Role::Prefill, &shape, core.clone(), 21);
    let addrs = prefill.listen(any_port()).await.unwrap();
    let mut announced = prefill.room_announcements();
    let decode = start_on(d, Role::Decode, &shape, core, 22);
    let peer = decode.connect(addrs).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let room = RoomId(7);
    let pages: Vec<u32> = (0..64).collect();
    let grant = Grant {
        extras: Vec::new(),
        pages: pages.clone(),
        aux_slot: Some(0),
        state_slot: None,
        receivers: 1,
        skip_pages: 0,
        idle_sources: 0,
        prompt: None,
    };
    let mut handle = decode
        .open_receiver(room, 0, vec![peer], Some(grant))
        .await
        .unwrap();
    // Prefill opens the room when decode's request arrives and sends layer by layer, 2 x 4 MiB
    // per layer. Only layers 0 and 1 are ever computed, so however fast this machine moves
    // them, the room is still in flight when decode aborts.
    let a = announced.recv().await.unwrap();
    assert_eq!(a.room, room);
    prefill.open_sender(room, 0, None).await.unwrap();
    let chunk = Chunk {
        extras: Vec::new(),
        pages,
        last: true,
        aux_slot: Some(0),
        state_slot: None,
        layerwise: true,
    };
    prefill.send_chunk(room, chunk).await.unwrap();
    for layer in 0..2 {
        prefill.mark_layer_ready(vec![room], layer).await.unwrap();
    }
    tokio::time::sleep(Duration::from_micros(300)).await;
    decode.abort(room).await.unwrap();
    let aborted_at = Instant::now();
    assert_eq!(
        handle.terminal().await,
        KvPoll::Failed(FailureReason::AbortedLocally)
    );
    handle.releasable().await;
    assert_eq!(decode.counters().await.fences, 0, "released on the ack");
    assert!(
        aborted_at.elapsed() < Duration::from_millis(2500),
        "released on the ack, not on the fence timer"
    );
    let until = Instant::now() + Duration::from_secs(2);
    while prefill
        .counters()
        .await
        .failed(FailureReason::AbortedByPeer)
        == 0
        && Instant::now() < until
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        prefill
            .counters()
            .await
            .failed(FailureReason::AbortedByPeer),
        1,
        "prefill learnt of the abort"
    );
}

/// The link goes dark right when decode aborts: neither the abort nor its acknowledgement get
/// through, and the pages stay quarantined until the abort deadline fences the session.
pub(super) async fn a_lost_abort_keeps_pages_quarantined_until_the_fence(p: Runtime, d: Runtime) {
    let shape = Shape {
        page_bytes: 64 * 1024,
        pages_per_room: 64,
        ..small_shape()
    };
    // Liveness (6 s) outlasts the abort-ack timeout, so the fence is what releases the pages.
    // The room's waiting deadline is not what this tests, and it must not fire first: over
    // soft-RoCE the prefill's post runs the whole transfer inside the syscall (rxe does a
    // user queue pair's work in the poster's context), which in the emulated CI guest holds
    // a tokio prefill's runtime, and this test with it, for seconds while a glommio decode's
    // clock runs on.
    let core = Config {
        waiting_timeout: Duration::from_secs(30),
        ..fast_core()
    };
    let (_prefill, addrs, _server) = prefill_on(p, &shape, core.clone(), 81, any_port()).await;
    let mut proxies = Vec::new();
    for (i, &addr) in addrs.iter().enumerate() {
        proxies.push(FaultProxy::start(addr, 5 + i as u64).await.unwrap());
    }
    let behind: Vec<SocketAddr> = proxies.iter().map(|p| p.addr).collect();
    let decode = start_on(d, Role::Decode, &shape, core, 82);
    let peer = decode.connect(behind).await.unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    // 64 KiB chunks 5 ms apart: the room's 32 MiB need far longer than this test waits.
    for proxy in &proxies {
        proxy.set(|f| f.delay = Duration::from_millis(5));
    }
    let grant = Grant {
        extras: Vec::new(),
        pages: (0..64).collect(),
        aux_slot: Some(0),
        state_slot: None,
        receivers: 1,
        skip_pages: 0,
        idle_sources: 0,
        prompt: None,
    };
    let mut h = decode
        .open_receiver(RoomId(1), 0, vec![peer], Some(grant))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    // Prefill may already have said it is transferring; what matters is that it is not done.
    assert!(
        matches!(
            h.view().state,
            KvPoll::WaitingForInput | KvPoll::Transferring
        ),
        "writes not finished: {:?}",
        h.view().state
    );
    for proxy in &proxies {
        proxy.set(|f| f.blackhole_until = Some(Instant::now() + Duration::from_secs(30)));
    }
    let t0 = Instant::now();
    decode.abort(RoomId(1)).await.unwrap();
    assert_eq!(
        h.terminal().await,
        KvPoll::Failed(FailureReason::AbortedLocally)
    );
    tokio::time::timeout(Duration::from_secs(5), h.releasable())
        .await
        .expect("released after the fence");
    assert!(
        t0.elapsed() >= Duration::from_millis(450),
        "no release before the abort-ack timeout ({:?})",
        t0.elapsed()
    );
    assert!(
        decode.counters().await.fences >= 1,
        "the session was fenced"
    );
}

/// A link whose round trip is longer than `connect_timeout` (a long-haul link, a slow TLS
/// handshake): the control session comes up, and the data connections, whose dial includes
/// their preamble's round trip, get twice what the session's handshake took over the same
/// link; rooms then move, none failed by dials cut short. (The proxy accepts at once, so
/// only the bytes after the connect are slow; the kept peer's slow connect is the
/// simulation's `a_target_whose_connect_outlasts_the_connect_timeout_...`.)
pub(super) async fn rooms_move_over_a_link_slower_than_the_connect_timeout(p: Runtime, d: Runtime) {
    let shape = small_shape();
    let core = Config {
        connect_timeout: Duration::from_millis(200),
        operation_timeout: Duration::from_secs(10),
        bootstrap_timeout: Duration::from_secs(20),
        waiting_timeout: Duration::from_secs(20),
        ..fast_core()
    };
    let (_prefill, addrs, _server) = prefill_on(p, &shape, core.clone(), 121, any_port()).await;
    let mut proxies = Vec::new();
    for (i, &addr) in addrs.iter().enumerate() {
        let proxy = FaultProxy::start(addr, 13 + i as u64).await.unwrap();
        // 150 ms each way: every round trip on the link takes 300 ms, over the 200 ms.
        proxy.set(|f| f.delay = Duration::from_millis(150));
        proxies.push(proxy);
    }
    let behind: Vec<SocketAddr> = proxies.iter().map(|p| p.addr).collect();
    let decode = start_on(d, Role::Decode, &shape, core, 122);
    let peer = decode.connect(behind).await.unwrap();
    let report = run_decode(&decode, peer, rooms(3, 1)).await;
    assert_all_clean(&report, 3);
}
