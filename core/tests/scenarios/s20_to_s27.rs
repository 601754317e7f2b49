//! Scenarios 20 to 27 of the study (refusals, terminal states, layers, progress,
//! generations) and seed reports 000 and 001.

use super::*;

// ------------------------------------------------------------------ 20: config mismatch

#[test]
fn s20_incompatible_layout_rejects_that_peer_only() {
    let (mut sim, p, d) = common::pair(201, common::config());
    let mut other = small_layout(1024);
    other.page_bytes = 2048;
    let bad = sim.add_decode(common::config(), other, 1);
    sim.connect(bad, p);
    run_ms(&mut sim, 5);
    let rejected: usize = [p, bad]
        .iter()
        .map(|&n| {
            sim.nodes[n].count_events(|e| {
                matches!(
                    e,
                    Event::SessionRejected {
                        reason: RejectReason::IncompatibleLayout(m),
                        ..
                    } if m.field == "page_bytes" && m.ours + m.theirs == 1024 + 2048
                )
            })
        })
        .sum();
    assert!(
        rejected >= 1,
        "the first side to read the other's hello refuses it"
    );
    assert_eq!(sim.session(p, bad), None);
    open_room(&mut sim, d, &[p], 1, 4);
    send_all(&mut sim, p, 1, 4, false);
    run_ms(&mut sim, 50);
    assert_eq!(
        state(&sim, d, 1),
        Some(KvPoll::Success),
        "other peers keep working"
    );
    common::assert_invariants(&sim);
}

#[test]
fn s20_wrong_cluster_token_is_refused() {
    let (mut sim, p, _d) = common::pair(202, common::config());
    let layout = small_layout(1024);
    let mut info = kvferry_core::EndpointInfo::new(
        kvferry_core::Role::Decode,
        kvferry_core::NodeId(7),
        kvferry_core::Incarnation(7),
        layout,
    );
    info.token = b"intruder".to_vec();
    let bad = sim.add_node(common::config(), info);
    sim.connect(bad, p);
    run_ms(&mut sim, 5);
    let rejected: usize = [p, bad]
        .iter()
        .map(|&n| {
            sim.nodes[n].count_events(|e| {
                matches!(
                    e,
                    Event::SessionRejected {
                        reason: RejectReason::BadToken,
                        ..
                    }
                )
            })
        })
        .sum();
    assert!(rejected >= 1);
    assert_eq!(sim.session(p, bad), None);
}

// ------------------------------------------------------------------ 24: terminal is final

#[test]
fn s24_a_terminal_state_is_never_overwritten() {
    let (mut sim, p, d) = common::pair(241, common::config());
    open_room(&mut sim, d, &[p], 1, 4);
    send_all(&mut sim, p, 1, 4, false);
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, d, 1), Some(KvPoll::Success));
    let now = sim.now;
    assert!(sim.nodes[d].endpoint.abort(now, RoomId(1)).is_err());
    assert!(!sim.nodes[d]
        .endpoint
        .fail_room(now, RoomId(1), R::WaitingTimeout));
    // A late failure status from the peer for the concluded room is dropped.
    let sd = sim.session(d, p).unwrap();
    let mut buf = Vec::new();
    Message::RoomStatus {
        room: RoomId(1),
        generation: 0,
        failure: Some(R::TransferFailed),
    }
    .encode(&mut buf);
    sim.nodes[d].endpoint.handle_input(now, sd, &buf);
    sim.drain(d);
    assert_eq!(state(&sim, d, 1), Some(KvPoll::Success));
    assert!(sim.nodes[d].endpoint.counters().stale_messages >= 1);
    common::assert_invariants(&sim);
}

// ------------------------------------------------------------------ 25 and seed 004: layerwise

#[test]
fn s25_seed_004_layerwise_ops_leave_only_when_their_layer_is_ready() {
    let (mut sim, p, d) = common::pair(251, common::config());
    open_room(&mut sim, d, &[p], 1, 8);
    run_ms(&mut sim, 2);
    send_all(&mut sim, p, 1, 8, true);
    run_ms(&mut sim, 5);
    assert_eq!(sim.ops_emitted, 0, "nothing moves before a layer is ready");
    for layer in 0..3 {
        let before = sim.ops_emitted;
        mark_layer(&mut sim, p, 1, layer);
        assert!(
            sim.ops_emitted > before,
            "layer {layer} moves as soon as it is ready"
        );
        run_ms(&mut sim, 5);
    }
    assert_eq!(
        state(&sim, d, 1),
        Some(KvPoll::Transferring),
        "not done without the last layer"
    );
    mark_layer(&mut sim, p, 1, 3);
    run_ms(&mut sim, 10);
    assert_eq!(state(&sim, d, 1), Some(KvPoll::Success));
    common::assert_invariants(&sim);
}

#[test]
fn s25_each_layer_is_reported_delivered_once_acknowledged_and_before_success() {
    let (mut sim, p, d) = common::pair(254, common::config());
    open_room(&mut sim, d, &[p], 1, 8);
    run_ms(&mut sim, 2);
    send_all(&mut sim, p, 1, 8, true);
    let delivered = |sim: &Sim| -> Vec<u16> {
        sim.nodes[p]
            .events
            .iter()
            .filter_map(|(_, e)| match e {
                Event::LayerDelivered { room, layer, .. } if *room == RoomId(1) => Some(*layer),
                _ => None,
            })
            .collect()
    };
    for layer in 0..4 {
        mark_layer(&mut sim, p, 1, layer);
        assert_eq!(
            delivered(&sim).len(),
            usize::from(layer),
            "layer {layer} is not delivered before its operations were acknowledged"
        );
        run_ms(&mut sim, 5);
        assert_eq!(delivered(&sim), (0..=layer).collect::<Vec<_>>());
    }
    let success = state_at(&sim, p, 1, KvPoll::Success).expect("the room succeeded");
    let last = sim.nodes[p]
        .events
        .iter()
        .rev()
        .find_map(|(t, e)| matches!(e, Event::LayerDelivered { .. }).then_some(*t))
        .unwrap();
    assert!(last <= success);
    common::assert_invariants(&sim);
}

#[test]
fn s25_a_whole_batch_room_reports_every_layer_delivered_at_once() {
    let (mut sim, p, d) = common::pair(255, common::config());
    open_room(&mut sim, d, &[p], 1, 8);
    run_ms(&mut sim, 2);
    send_all(&mut sim, p, 1, 8, false);
    run_ms(&mut sim, 20);
    assert_eq!(state(&sim, p, 1), Some(KvPoll::Success));
    let n = sim.nodes[p].count_events(|e| matches!(e, Event::LayerDelivered { .. }));
    assert_eq!(n, 4);
    common::assert_invariants(&sim);
}

#[test]
fn s25_a_failed_room_reports_no_further_layer_delivered() {
    let (mut sim, p, d) = common::pair(256, common::config());
    open_room(&mut sim, d, &[p], 1, 8);
    run_ms(&mut sim, 2);
    send_all(&mut sim, p, 1, 8, true);
    mark_layer(&mut sim, p, 1, 0);
    run_ms(&mut sim, 5);
    sim.faults.op_fatal = 1.0;
    mark_layer(&mut sim, p, 1, 1);
    run_ms(&mut sim, 50);
    assert!(matches!(state(&sim, p, 1), Some(KvPoll::Failed(_))));
    let n = sim.nodes[p].count_events(|e| matches!(e, Event::LayerDelivered { .. }));
    assert_eq!(n, 1, "only layer 0 arrived");
    common::assert_invariants(&sim);
}

#[test]
fn s25_a_missing_layer_fails_the_room_instead_of_reporting_success() {
    let (mut sim, p, d) = common::pair(252, common::config());
    open_room(&mut sim, d, &[p], 1, 8);
    send_all(&mut sim, p, 1, 8, true);
    for layer in 0..3 {
        mark_layer(&mut sim, p, 1, layer);
    }
    run_ms(&mut sim, 3_000);
    assert_eq!(state(&sim, d, 1), failed(R::WaitingTimeout));
    assert_eq!(state(&sim, p, 1), failed(R::WaitingTimeout));
    common::assert_invariants(&sim);
}

#[test]
fn s25_a_failed_layer_operation_fails_the_room() {
    let (mut sim, p, d) = common::pair(253, common::config());
    open_room(&mut sim, d, &[p], 1, 8);
    send_all(&mut sim, p, 1, 8, true);
    for layer in 0..2 {
        mark_layer(&mut sim, p, 1, layer);
    }
    run_ms(&mut sim, 5);
    sim.faults.op_fatal = 1.0;
    for layer in 2..4 {
        mark_layer(&mut sim, p, 1, layer);
    }
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, d, 1), failed(R::TransferFailed));
    common::assert_invariants(&sim);
}

// ------------------------------------------------------------------ 26: liveness deadline

#[test]
fn s26_progress_keeps_a_long_queued_room_alive_on_decode() {
    let mut prefill_config = common::config();
    prefill_config.waiting_timeout = Duration::from_secs(30);
    let mut sim = Sim::new(261, Faults::default());
    let layout = small_layout(1024);
    let p = sim.add_prefill(prefill_config, layout, 0, 0..layout.layers);
    let d = sim.add_decode(common::config(), layout, 0);
    sim.connect(d, p);
    run_ms(&mut sim, 5);
    open_room(&mut sim, d, &[p], 1, 4);
    // Prefill's compute queue holds the room for 5 s, well past decode's 2 s waiting timeout.
    run_ms(&mut sim, 5_000);
    assert_eq!(
        state(&sim, d, 1),
        Some(KvPoll::WaitingForInput),
        "alive: progress keepalives arrive"
    );
    send_all(&mut sim, p, 1, 4, false);
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, d, 1), Some(KvPoll::Success));
    common::assert_invariants(&sim);
}

// ------------------------------------------------------------------ 27: replays

#[test]
fn s27_messages_of_an_older_generation_are_dropped_and_reuse_needs_a_new_generation() {
    let (mut sim, p, d) = common::pair(271, common::config());
    open_room(&mut sim, d, &[p], 1, 4);
    send_all(&mut sim, p, 1, 4, false);
    run_ms(&mut sim, 50);
    let now = sim.now;
    let sd = sim.session(d, p).unwrap();
    let err = sim.nodes[d]
        .endpoint
        .open_receiver(now, RoomId(1), 0, &[sd], None);
    assert!(matches!(
        err,
        Err(kvferry_core::ApiError::StaleGeneration { .. })
    ));
    sim.nodes[d]
        .endpoint
        .open_receiver(now, RoomId(1), 1, &[sd], None)
        .unwrap();
    sim.drain(d);
    let mut buf = Vec::new();
    Message::RoomStatus {
        room: RoomId(1),
        generation: 0,
        failure: None,
    }
    .encode(&mut buf);
    let stale_before = sim.nodes[d].endpoint.counters().stale_messages;
    sim.nodes[d].endpoint.handle_input(now, sd, &buf);
    assert_eq!(
        state(&sim, d, 1),
        Some(KvPoll::Bootstrapping),
        "the replay did not touch generation 1"
    );
    assert_eq!(
        sim.nodes[d].endpoint.counters().stale_messages,
        stale_before + 1
    );
}

#[test]
fn s27_duplicated_and_reordered_messages_do_not_break_rooms() {
    let faults = Faults {
        msg_duplicate: 0.2,
        ..Faults::default()
    };
    let (mut sim, ps, ds) = common::cluster(272, common::config(), faults);
    common::run_workload(&mut sim, Workload::new(ds, vec![ps], 300), 2_000_000);
    assert_eq!(
        sim.workload_outcomes().get("success"),
        Some(&300),
        "{:?}",
        sim.workload_outcomes()
    );
}

// ------------------------------------------------------------------ seeds 000 and 001

#[test]
fn seed_000_default_retries_and_threshold_keep_a_hiccup_from_killing_the_session() {
    let (mut sim, p, d) = common::pair(1000, kvferry_core::sim::fast_config());
    let sp = sim.session(p, d).unwrap();
    assert_eq!(sim.nodes[p].endpoint.config().transfer_retries, 3);
    assert_eq!(sim.nodes[p].endpoint.config().session_failure_threshold, 10);
    sim.break_data_path(p, d, sim.now + Duration::from_secs(3600));
    for room in 1..=9 {
        open_room(&mut sim, d, &[p], room, 1);
        send_all(&mut sim, p, room, 1, false);
        run_ms(&mut sim, 100);
    }
    assert_eq!(
        sim.nodes[p].endpoint.session_state(sp),
        Some(SessionState::Established),
        "9 < 10"
    );
    sim.break_data_path(p, d, sim.now);
    open_room(&mut sim, d, &[p], 10, 1);
    send_all(&mut sim, p, 10, 1, false);
    run_ms(&mut sim, 100);
    assert_eq!(
        state(&sim, d, 10),
        Some(KvPoll::Success),
        "the hiccup is over, the session lives"
    );
    assert_eq!(sim.nodes[p].endpoint.session_failures(sp), Some(0));
    common::assert_invariants(&sim);
}

#[test]
fn seed_001_blacklisted_session_is_unblacklisted_when_the_probe_succeeds() {
    let mut config = common::config();
    config.session_failure_threshold = 2;
    let (mut sim, p, d) = common::pair(1001, config);
    let sp = sim.session(p, d).unwrap();
    sim.break_data_path(p, d, sim.now + Duration::from_millis(1500));
    for room in 1..=2 {
        open_room(&mut sim, d, &[p], room, 1);
        send_all(&mut sim, p, room, 1, false);
        run_ms(&mut sim, 100);
    }
    assert_eq!(
        sim.nodes[p].endpoint.session_state(sp),
        Some(SessionState::Blacklisted)
    );
    run_ms(&mut sim, 3_000);
    assert_eq!(
        sim.nodes[p].endpoint.session_state(sp),
        Some(SessionState::Established)
    );
    assert_eq!(
        sim.nodes[p].count_events(|e| matches!(e, Event::SessionRecovered { .. })),
        1
    );
    assert_eq!(sim.nodes[p].endpoint.counters().sessions_recovered, 1);
    common::assert_invariants(&sim);
}

#[test]
fn blacklist_survives_a_reconnect_of_the_same_incarnation() {
    let mut config = common::config();
    config.session_failure_threshold = 1;
    let (mut sim, p, d) = common::pair(1002, config);
    sim.break_data_path(p, d, sim.now + Duration::from_secs(3600));
    open_room(&mut sim, d, &[p], 1, 1);
    send_all(&mut sim, p, 1, 1, false);
    run_ms(&mut sim, 100);
    sim.reset_link(p, d);
    run_ms(&mut sim, 1);
    sim.connect(d, p);
    run_ms(&mut sim, 5);
    let sp = sim.session(p, d).unwrap();
    assert_eq!(
        sim.nodes[p].endpoint.session_state(sp),
        Some(SessionState::Blacklisted)
    );
    common::assert_invariants(&sim);
}

#[test]
fn s03_a_request_waiting_for_prefill_to_open_fails_at_once_when_its_session_is_blacklisted() {
    let mut config = common::config();
    config.session_failure_threshold = 1;
    config.waiting_timeout = Duration::from_secs(30);
    let (mut sim, p, d) = common::pair(33, config);
    // Room 2's request reaches prefill, which has not opened the room yet.
    let sd = sim.session(d, p).unwrap();
    let dst = sim.nodes[d].alloc(RoomId(2), 0, 2).unwrap();
    let now = sim.now;
    let grant = kvferry_core::Grant {
        extras: Vec::new(),
        pages: dst,
        aux_slot: None,
        state_slot: None,
        receivers: 1,
        skip_pages: 0,
        idle_sources: 0,
        prompt: None,
    };
    sim.nodes[d]
        .endpoint
        .open_receiver(now, RoomId(2), 0, &[sd], Some(grant))
        .unwrap();
    sim.drain(d);
    run_ms(&mut sim, 5);
    // Room 1 exhausts its retries: the session is blacklisted.
    sim.break_data_path(p, d, sim.now + Duration::from_secs(3600));
    open_room(&mut sim, d, &[p], 1, 2);
    send_all(&mut sim, p, 1, 2, false);
    let t0 = sim.now;
    run_ms(&mut sim, 200);
    assert_eq!(
        state(&sim, d, 2),
        failed(R::SessionBlacklisted),
        "told at once, not at its waiting deadline"
    );
    let at = common::state_at(&sim, d, 2, KvPoll::Failed(R::SessionBlacklisted)).unwrap();
    assert!(at - t0 < Duration::from_millis(200));
    assert!(common::released_at(&sim, d, 2).is_some());
    common::assert_invariants(&sim);
}
