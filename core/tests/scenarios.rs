//! One test per failure scenario of `../shared/research/existing-system-behaviour.md` §7 and
//! per seed report, each asserting the correct behaviour stated there.

mod common;

use std::time::Duration;

use common::{failed, mark_layer, open_room, run_ms, send_all, state, state_at};
use kvferry_core::codec::Message;
use kvferry_core::consensus::{combine, ConsensusLog};
use kvferry_core::sim::{small_layout, Faults, Sim, Workload};
use kvferry_core::{Event, FailureReason as R, KvPoll, RejectReason, RoomId, SessionState};

fn session_events(sim: &Sim, n: usize, f: impl Fn(&Event) -> bool) -> usize {
    sim.nodes[n].count_events(f)
}

// ------------------------------------------------------------------ 1: transient errors

#[test]
fn s01_transient_failures_are_retried_inside_the_core_and_rooms_succeed() {
    let mut config = common::config();
    config.transfer_retries = 6;
    let (mut sim, p, d) = common::pair(11, config);
    sim.faults.op_transient = 0.3;
    common::run_workload(
        &mut sim,
        Workload::new(vec![d], vec![vec![p]], 100),
        2_000_000,
    );
    let c = sim.nodes[p].endpoint.counters();
    assert_eq!(
        sim.workload_outcomes().get("success"),
        Some(&100),
        "{:?}",
        sim.workload_outcomes()
    );
    assert!(c.retries > 0 && c.retry_recoveries > 0, "{c:?}");
    assert_eq!(c.sessions_blacklisted, 0);
}

#[test]
fn s01_an_exhausted_operation_counts_one_failure_and_a_success_resets_the_count() {
    let (mut sim, p, d) = common::pair(12, common::config());
    let sp = sim.session(p, d).unwrap();
    sim.break_data_path(p, d, sim.now + Duration::from_secs(3600));
    open_room(&mut sim, d, &[p], 1, 4);
    send_all(&mut sim, p, 1, 4, false);
    run_ms(&mut sim, 200);
    assert_eq!(state(&sim, p, 1), failed(R::TransferFailed));
    assert_eq!(
        state(&sim, d, 1),
        failed(R::TransferFailed),
        "the reason travels to decode"
    );
    assert_eq!(sim.nodes[p].endpoint.session_failures(sp), Some(1));
    let c = sim.nodes[p].endpoint.counters();
    assert_eq!(
        c.retries,
        2 * c.ops_planned,
        "3 attempts = 2 retries per operation"
    );

    sim.break_data_path(p, d, sim.now);
    open_room(&mut sim, d, &[p], 2, 4);
    send_all(&mut sim, p, 2, 4, false);
    run_ms(&mut sim, 100);
    assert_eq!(state(&sim, d, 2), Some(KvPoll::Success));
    assert_eq!(sim.nodes[p].endpoint.session_failures(sp), Some(0));
    common::assert_invariants(&sim);
}

#[test]
fn s01_session_is_blacklisted_only_at_the_threshold_of_consecutive_failures() {
    let mut config = common::config();
    config.session_failure_threshold = 3;
    let (mut sim, p, d) = common::pair(13, config);
    let sp = sim.session(p, d).unwrap();
    sim.break_data_path(p, d, sim.now + Duration::from_secs(3600));
    for room in 1..=2 {
        open_room(&mut sim, d, &[p], room, 2);
        send_all(&mut sim, p, room, 2, false);
        run_ms(&mut sim, 100);
    }
    assert_eq!(
        sim.nodes[p].endpoint.session_state(sp),
        Some(SessionState::Established)
    );
    open_room(&mut sim, d, &[p], 3, 2);
    send_all(&mut sim, p, 3, 2, false);
    run_ms(&mut sim, 100);
    assert_eq!(
        sim.nodes[p].endpoint.session_state(sp),
        Some(SessionState::Blacklisted)
    );
    assert_eq!(
        session_events(&sim, p, |e| matches!(e, Event::SessionBlacklisted { .. })),
        1
    );
    common::assert_invariants(&sim);
}

// ------------------------------------------------------------------ 2: sticky blacklist

#[test]
fn s02_blacklisted_session_recovers_by_probe_with_exponential_backoff() {
    let mut config = common::config();
    config.session_failure_threshold = 1;
    let (mut sim, p, d) = common::pair(21, config);
    let sp = sim.session(p, d).unwrap();
    let heal_at = sim.now + Duration::from_secs(5);
    sim.break_data_path(p, d, heal_at);
    open_room(&mut sim, d, &[p], 1, 2);
    send_all(&mut sim, p, 1, 2, false);
    run_ms(&mut sim, 4_000);
    assert_eq!(
        sim.nodes[p].endpoint.session_state(sp),
        Some(SessionState::Blacklisted)
    );
    let probes = sim.nodes[p].endpoint.counters().probes_sent;
    // 100 ms doubling to a 2 s cap within ~4 s: about 5 probes, far fewer than a fixed 100 ms.
    assert!((3..=7).contains(&probes), "probes {probes}");
    run_ms(&mut sim, 4_000);
    assert_eq!(
        sim.nodes[p].endpoint.session_state(sp),
        Some(SessionState::Established)
    );
    assert_eq!(sim.nodes[p].endpoint.counters().sessions_recovered, 1);
    open_room(&mut sim, d, &[p], 2, 2);
    send_all(&mut sim, p, 2, 2, false);
    run_ms(&mut sim, 100);
    assert_eq!(state(&sim, d, 2), Some(KvPoll::Success));
    common::assert_invariants(&sim);
}

#[test]
fn s02_idle_blacklisted_session_expires() {
    let mut config = common::config();
    config.session_failure_threshold = 1;
    config.blacklist_idle_timeout = Duration::from_secs(3);
    let (mut sim, p, d) = common::pair(22, config);
    sim.break_data_path(p, d, sim.now + Duration::from_secs(3600));
    open_room(&mut sim, d, &[p], 1, 2);
    send_all(&mut sim, p, 1, 2, false);
    run_ms(&mut sim, 5_000);
    assert_eq!(sim.nodes[p].endpoint.counters().sessions_expired, 1);
    assert_eq!(
        session_events(&sim, p, |e| matches!(e, Event::SessionExpired { .. })),
        1
    );
    common::assert_invariants(&sim);
}

// ------------------------------------------------------------------ 3: fail at bootstrap

#[test]
fn s03_room_toward_blacklisted_session_fails_at_bootstrap_before_any_compute() {
    let mut config = common::config();
    config.session_failure_threshold = 1;
    let (mut sim, p, d) = common::pair(31, config);
    sim.break_data_path(p, d, sim.now + Duration::from_secs(3600));
    open_room(&mut sim, d, &[p], 1, 2);
    send_all(&mut sim, p, 1, 2, false);
    run_ms(&mut sim, 100);
    let t0 = sim.now;
    open_room(&mut sim, d, &[p], 2, 2);
    run_ms(&mut sim, 5);
    assert_eq!(
        state(&sim, p, 2),
        failed(R::SessionBlacklisted),
        "no chunk was ever sent"
    );
    assert_eq!(state(&sim, d, 2), failed(R::SessionBlacklisted));
    let at = common::state_at(&sim, d, 2, KvPoll::Failed(R::SessionBlacklisted)).unwrap();
    assert!(at - t0 < Duration::from_millis(5));
    assert!(
        common::released_at(&sim, d, 2).is_some(),
        "nothing was written: release at once"
    );
    common::assert_invariants(&sim);
}

// ------------------------------------------------------------------ 4 and 17: restarts

#[test]
fn s04_decode_restart_supersedes_the_old_session_and_cleans_its_rooms() {
    let (mut sim, p, d) = common::pair(41, common::config());
    sim.faults.op_delay = (Duration::from_millis(5), Duration::from_millis(10));
    open_room(&mut sim, d, &[p], 1, 8);
    send_all(&mut sim, p, 1, 8, false);
    run_ms(&mut sim, 1);
    sim.restart(d);
    sim.connect(d, p);
    run_ms(&mut sim, 50);
    assert_eq!(state(&sim, p, 1), failed(R::PeerRestarted));
    assert_eq!(
        session_events(&sim, p, |e| matches!(e, Event::PeerRestarted { .. })),
        1
    );
    assert_eq!(
        sim.nodes[p].endpoint.live_rooms(),
        0,
        "no record of the old life remains"
    );
    assert_eq!(sim.nodes[p].endpoint.session_ids().count(), 1);
    open_room(&mut sim, d, &[p], 2, 8);
    send_all(&mut sim, p, 2, 8, false);
    run_ms(&mut sim, 100);
    assert_eq!(state(&sim, d, 2), Some(KvPoll::Success));
    common::assert_invariants(&sim);
}

#[test]
fn s17_prefill_restart_at_the_same_address_is_noticed_by_incarnation() {
    let (mut sim, p, d) = common::pair(171, common::config());
    open_room(&mut sim, d, &[p], 1, 4);
    run_ms(&mut sim, 1);
    sim.restart(p);
    sim.connect(d, p);
    run_ms(&mut sim, 20);
    assert_eq!(state(&sim, d, 1), failed(R::PeerRestarted));
    assert_eq!(
        session_events(&sim, d, |e| matches!(e, Event::PeerRestarted { .. })),
        1
    );
    assert!(common::released_at(&sim, d, 1).is_some());
    open_room(&mut sim, d, &[p], 2, 4);
    send_all(&mut sim, p, 2, 4, false);
    run_ms(&mut sim, 100);
    assert_eq!(state(&sim, d, 2), Some(KvPoll::Success));
    common::assert_invariants(&sim);
}

// ------------------------------------------------------------------ 5: saturated decode

#[test]
fn s05_room_toward_saturated_decode_waits_with_a_known_reason_then_fails_decode_saturated() {
    let (mut sim, p, d) = common::pair(51, common::config());
    sim.nodes[d].endpoint.set_capacity(kvferry_core::Capacity {
        free_pages: 0,
        queued_rooms: 7,
    });
    let sd = sim.session(d, p).unwrap();
    let now = sim.now;
    sim.nodes[d]
        .endpoint
        .open_receiver(now, RoomId(1), 0, &[sd], None)
        .unwrap();
    sim.nodes[d]
        .endpoint
        .set_queue_position(now, RoomId(1), 7)
        .unwrap();
    sim.drain(d);
    sim.nodes[p]
        .endpoint
        .open_sender(now, RoomId(1), 0, None)
        .unwrap();
    sim.drain(p);
    run_ms(&mut sim, 1_000);
    assert_eq!(state(&sim, p, 1), Some(KvPoll::Bootstrapping));
    let sp = sim.session(p, d).unwrap();
    assert!(
        sim.nodes[p].endpoint.peer_capacity(sp).unwrap().saturated(),
        "capacity came in heartbeats"
    );
    run_ms(&mut sim, 1_100);
    assert_eq!(state(&sim, p, 1), failed(R::DecodeSaturated));
    assert_eq!(state(&sim, d, 1), failed(R::DecodeSaturated));
    common::assert_invariants(&sim);
}

#[test]
fn s05_a_queued_room_whose_decode_deadline_expires_first_fails_decode_saturated_on_prefill_too() {
    let (mut sim, p, d) = common::pair(52, common::config());
    let sd = sim.session(d, p).unwrap();
    let now = sim.now;
    sim.nodes[d]
        .endpoint
        .open_receiver(now, RoomId(1), 0, &[sd], None)
        .unwrap();
    sim.nodes[d]
        .endpoint
        .set_queue_position(now, RoomId(1), 3)
        .unwrap();
    sim.drain(d);
    // Prefill opens its side later, so decode's deadline is the first to expire and prefill
    // learns the verdict from decode's abort, not from a deadline of its own.
    run_ms(&mut sim, 1_000);
    let now = sim.now;
    sim.nodes[p]
        .endpoint
        .open_sender(now, RoomId(1), 0, None)
        .unwrap();
    sim.drain(p);
    run_ms(&mut sim, 1_200);
    assert_eq!(state(&sim, d, 1), failed(R::DecodeSaturated));
    assert_eq!(state(&sim, p, 1), failed(R::DecodeSaturated));
    common::assert_invariants(&sim);
}

// ------------------------------------------------------------------ 6: late request

#[test]
fn s06_late_request_for_a_timed_out_room_is_answered_at_once() {
    let (mut sim, p, d) = common::pair(61, common::config());
    let now = sim.now;
    sim.nodes[p]
        .endpoint
        .open_sender(now, RoomId(1), 0, None)
        .unwrap();
    run_ms(&mut sim, 2_100);
    assert_eq!(state(&sim, p, 1), failed(R::BootstrapTimeout));
    let t0 = sim.now;
    let dst = sim.nodes[d].alloc(RoomId(1), 0, 4).unwrap();
    let sd = sim.session(d, p).unwrap();
    let grant = kvferry_core::Grant {
        extras: Vec::new(),
        pages: dst,
        aux_slot: Some(1),
        state_slot: None,
        receivers: 1,
        skip_pages: 0,
        idle_sources: 0,
        prompt: None,
    };
    sim.nodes[d]
        .endpoint
        .open_receiver(t0, RoomId(1), 0, &[sd], Some(grant))
        .unwrap();
    sim.drain(d);
    run_ms(&mut sim, 5);
    assert_eq!(state(&sim, d, 1), failed(R::BootstrapTimeout));
    let released = common::released_at(&sim, d, 1).expect("released");
    assert!(
        released - t0 < Duration::from_millis(5),
        "pages released at once, not after a timeout"
    );
    assert_eq!(
        sim.nodes[p].endpoint.live_rooms(),
        0,
        "no table entry recreated for the dead room"
    );
    common::assert_invariants(&sim);
}

// ------------------------------------------------------------------ 7 and seed 002

#[test]
fn s07_seed_002_pp_bootstrap_race_fails_softly_on_every_rank() {
    // Two PP stages of one prefill instance, opened 1 ms apart, toward a saturated decode.
    let (mut sim, ps, ds) = common::cluster(71, common::config(), Faults::default());
    let (p0, p1, d) = (ps[0], ps[1], ds[0]);
    let sources = [sim.session(d, p0).unwrap(), sim.session(d, p1).unwrap()];
    let now = sim.now;
    sim.nodes[d]
        .endpoint
        .open_receiver(now, RoomId(9), 0, &sources, None)
        .unwrap();
    sim.nodes[d]
        .endpoint
        .set_queue_position(now, RoomId(9), 3)
        .unwrap();
    sim.drain(d);
    sim.nodes[p0]
        .endpoint
        .open_sender(now, RoomId(9), 0, None)
        .unwrap();
    run_ms(&mut sim, 1);
    let now = sim.now;
    sim.nodes[p1]
        .endpoint
        .open_sender(now, RoomId(9), 0, None)
        .unwrap();
    sim.drain(p1);
    // Stop right after rank 0's deadline: rank 0 failed, rank 1 still bootstrapping.
    sim.run_until(1_000_000, |s| {
        s.nodes[p0].endpoint.room_state(RoomId(9)) != Some(KvPoll::Bootstrapping)
    })
    .unwrap();
    let polls = [state(&sim, p0, 9).unwrap(), state(&sim, p1, 9).unwrap()];
    assert_eq!(polls[0], KvPoll::Failed(R::DecodeSaturated));
    assert_eq!(polls[1], KvPoll::Bootstrapping, "skew between the ranks");
    assert_eq!(combine(&polls), KvPoll::Failed(R::DecodeSaturated));

    let mut leader = ConsensusLog::new(1024);
    let mut follower = ConsensusLog::new(1024);
    let decision = leader.decide(RoomId(9), &polls).expect("terminal verdict");
    assert!(leader.decide(RoomId(9), &polls).is_none(), "decided once");
    for log_and_rank in [(&mut leader, p0), (&mut follower, p1)] {
        let (log, rank) = log_and_rank;
        // Delivered twice: applied once.
        let mut applied = log.apply(decision);
        applied.extend(log.apply(decision));
        assert_eq!(applied.len(), 1);
        let now = sim.now;
        sim.nodes[rank]
            .endpoint
            .fail_room(now, RoomId(9), R::DecodeSaturated);
        assert!(
            !sim.nodes[rank]
                .endpoint
                .fail_room(now, RoomId(9), R::DecodeSaturated),
            "idempotent"
        );
        sim.drain(rank);
    }
    run_ms(&mut sim, 100);
    assert_eq!(
        state(&sim, p1, 9),
        failed(R::DecodeSaturated),
        "soft failure, no assertion"
    );
    common::assert_invariants(&sim);
}

// ------------------------------------------------------------------ 9 and seed 003: abort

#[test]
fn s09_seed_003_decode_abort_mid_transfer_quarantines_pages_until_the_drain_ack() {
    let (mut sim, p, d) = common::pair(91, common::config());
    sim.faults.op_delay = (Duration::from_millis(20), Duration::from_millis(20));
    let mut config_pages = 64;
    if config_pages > 64 {
        config_pages = 64;
    }
    open_room(&mut sim, d, &[p], 1, config_pages);
    send_all(&mut sim, p, 1, config_pages, false);
    run_ms(&mut sim, 5);
    assert!(sim.nodes[p].endpoint.live_ops() > 0, "writes are in flight");
    let now = sim.now;
    sim.nodes[d].endpoint.abort(now, RoomId(1)).unwrap();
    sim.drain(d);
    run_ms(&mut sim, 2);
    assert_eq!(
        state(&sim, p, 1),
        failed(R::AbortedByPeer),
        "prefill notified at once"
    );
    assert!(
        common::released_at(&sim, d, 1).is_none(),
        "pages stay quarantined while writes fly"
    );
    // Reuse every free page for the next room the moment they are released.
    run_ms(&mut sim, 100);
    let released = common::released_at(&sim, d, 1).expect("released after the ack");
    assert!(released - now >= Duration::from_millis(15));
    assert_eq!(
        sim.nodes[d].endpoint.counters().fences,
        0,
        "the ack came: no fence needed"
    );
    open_room(&mut sim, d, &[p], 2, 64);
    send_all(&mut sim, p, 2, 64, false);
    run_ms(&mut sim, 200);
    assert_eq!(state(&sim, d, 2), Some(KvPoll::Success));
    common::assert_invariants(&sim);
}

#[test]
fn s09_lost_abort_leads_to_a_fence_and_never_to_an_early_release() {
    let (mut sim, p, d) = common::pair(92, common::config());
    sim.faults.op_delay = (Duration::from_millis(20), Duration::from_millis(20));
    open_room(&mut sim, d, &[p], 1, 16);
    send_all(&mut sim, p, 1, 16, false);
    run_ms(&mut sim, 5);
    let now = sim.now;
    sim.blackhole(d, p, now + Duration::from_millis(600));
    sim.nodes[d].endpoint.abort(now, RoomId(1)).unwrap();
    sim.drain(d);
    run_ms(&mut sim, 450);
    assert!(
        common::released_at(&sim, d, 1).is_none(),
        "no release on a plain timer"
    );
    run_ms(&mut sim, 200);
    let released = common::released_at(&sim, d, 1).expect("released after the fence");
    assert!(
        released - now >= Duration::from_millis(500),
        "abort-ack timeout first"
    );
    assert!(sim.nodes[d].endpoint.counters().fences >= 1);
    common::assert_invariants(&sim);
}

// ------------------------------------------------------------------ 10: unsettled operation

#[test]
fn s10_timed_out_operation_is_unsettled_until_a_fence_then_retried() {
    let (mut sim, p, d) = common::pair(101, common::config());
    sim.faults.op_hang = 1.0;
    open_room(&mut sim, d, &[p], 1, 4);
    send_all(&mut sim, p, 1, 4, false);
    run_ms(&mut sim, 10);
    sim.faults.op_hang = 0.0;
    run_ms(&mut sim, 1_000);
    assert_eq!(state(&sim, d, 1), Some(KvPoll::Success));
    assert!(
        sim.nodes[p].endpoint.counters().fences >= 1,
        "the hung attempt was fenced"
    );
    assert!(sim.nodes[p].endpoint.counters().retries >= 1);
    common::assert_invariants(&sim);
}

// ------------------------------------------------------------------ 11: prefill abort

#[test]
fn s11_prefill_abort_is_pushed_to_decode_at_once_with_its_reason() {
    let (mut sim, p, d) = common::pair(111, common::config());
    sim.faults.op_delay = (Duration::from_millis(10), Duration::from_millis(10));
    open_room(&mut sim, d, &[p], 1, 16);
    send_all(&mut sim, p, 1, 16, false);
    run_ms(&mut sim, 2);
    let now = sim.now;
    sim.nodes[p].endpoint.abort(now, RoomId(1)).unwrap();
    sim.drain(p);
    assert!(
        common::released_at(&sim, p, 1).is_none(),
        "source pages pinned while reads fly"
    );
    run_ms(&mut sim, 1);
    assert_eq!(state(&sim, d, 1), failed(R::AbortedByPeer));
    run_ms(&mut sim, 50);
    assert!(common::released_at(&sim, p, 1).is_some());
    assert!(common::released_at(&sim, d, 1).is_some());
    common::assert_invariants(&sim);
}

// ------------------------------------------------------------------ 12: typed reasons

#[test]
fn s12_failure_reasons_travel_typed_to_the_other_side() {
    let (mut sim, p, d) = common::pair(121, common::config());
    // Prefill fails the room softly with a chosen reason; decode reports exactly that reason.
    open_room(&mut sim, d, &[p], 1, 2);
    run_ms(&mut sim, 2);
    let now = sim.now;
    assert!(sim.nodes[p]
        .endpoint
        .fail_room(now, RoomId(1), R::ProtocolError));
    sim.drain(p);
    run_ms(&mut sim, 2);
    assert_eq!(state(&sim, d, 1), failed(R::ProtocolError));
    common::assert_invariants(&sim);
}

// ------------------------------------------------------------------ 14: dead worker

#[test]
fn s14_a_data_path_that_never_reports_fails_rooms_within_their_deadlines() {
    let (mut sim, p, d) = common::pair(141, common::config());
    sim.faults.op_hang = 1.0;
    open_room(&mut sim, d, &[p], 1, 4);
    send_all(&mut sim, p, 1, 4, false);
    // 3 attempts x 500 ms operation timeout + backoff.
    run_ms(&mut sim, 2_000);
    assert_eq!(state(&sim, p, 1), failed(R::TransferFailed));
    assert_eq!(state(&sim, d, 1), failed(R::TransferFailed));
    run_ms(&mut sim, 1_000);
    assert!(common::released_at(&sim, d, 1).is_some());
    assert!(common::released_at(&sim, p, 1).is_some());
    common::assert_invariants(&sim);
}

#[test]
fn s14_a_prefill_room_that_never_gets_input_fails_by_its_waiting_deadline() {
    let (mut sim, p, d) = common::pair(142, common::config());
    open_room(&mut sim, d, &[p], 1, 4);
    run_ms(&mut sim, 2_100);
    assert_eq!(state(&sim, p, 1), failed(R::WaitingTimeout));
    assert_eq!(state(&sim, d, 1), failed(R::WaitingTimeout));
    common::assert_invariants(&sim);
}

// ------------------------------------------------------------------ 16: prefill dies

#[test]
fn s16_silent_prefill_fails_exactly_its_sessions_rooms_by_liveness() {
    let (mut sim, ps, ds) = common::cluster(161, common::config(), Faults::default());
    let d = ds[0];
    let single_stage = |sim: &mut Sim, room: u64, p: usize| {
        let sd = sim.session(d, p).unwrap();
        let now = sim.now;
        sim.nodes[d]
            .endpoint
            .open_receiver(now, RoomId(room), 0, &[sd], None)
            .unwrap();
        sim.drain(d);
    };
    single_stage(&mut sim, 1, ps[0]);
    single_stage(&mut sim, 2, ps[1]);
    let now = sim.now;
    sim.blackhole(d, ps[0], now + Duration::from_secs(3600));
    run_ms(&mut sim, 1_000);
    assert_eq!(
        state(&sim, d, 1),
        failed(R::PeerSilent),
        "3 x 250 ms heartbeats missed"
    );
    assert_eq!(
        state(&sim, d, 2),
        Some(KvPoll::Bootstrapping),
        "the healthy peer's room is untouched"
    );
    common::assert_invariants(&sim);
}

// ------------------------------------------------------------------ 18: decode deadlines

#[test]
fn s18_decode_room_never_granted_pages_fails_in_bootstrapping() {
    let (mut sim, p, d) = common::pair(181, common::config());
    let sd = sim.session(d, p).unwrap();
    let now = sim.now;
    sim.nodes[d]
        .endpoint
        .open_receiver(now, RoomId(1), 0, &[sd], None)
        .unwrap();
    sim.drain(d);
    run_ms(&mut sim, 2_100);
    assert_eq!(state(&sim, d, 1), failed(R::BootstrapTimeout));
    common::assert_invariants(&sim);
}

#[test]
fn s18_decode_room_whose_prefill_never_opens_fails_by_waiting_deadline() {
    let (mut sim, p, d) = common::pair(182, common::config());
    let sd = sim.session(d, p).unwrap();
    let dst = sim.nodes[d].alloc(RoomId(1), 0, 2).unwrap();
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
        .open_receiver(now, RoomId(1), 0, &[sd], Some(grant))
        .unwrap();
    sim.drain(d);
    run_ms(&mut sim, 2_100);
    assert_eq!(state(&sim, d, 1), failed(R::WaitingTimeout));
    run_ms(&mut sim, 10);
    assert!(
        common::released_at(&sim, d, 1).is_some(),
        "prefill acked: nothing was written"
    );
    let now = sim.now;
    assert_eq!(
        sim.nodes[p].endpoint.open_sender(now, RoomId(1), 0, None),
        Ok(()),
        "a late open is accepted and fails at once"
    );
    sim.drain(p);
    assert_eq!(state(&sim, p, 1), failed(R::AbortedByPeer));
    common::assert_invariants(&sim);
}

#[path = "scenarios/s20_to_s27.rs"]
mod s20_to_s27;
