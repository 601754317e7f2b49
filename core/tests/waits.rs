//! The waits a driver holds sockets for, decided by the core: an accepted connection's
//! deadline, a connection attempt's, the pause after a failed accept, and a closing
//! session's linger. The simulation
//! fires them like every other timer.
#![allow(clippy::unwrap_used)] // tests may panic

mod common;

use std::time::{Duration, Instant};

use common::{config, open_room, pair, run_ms, send_all};
use kvferry_core::sim::{small_layout, Faults, Sim, WaitEnded};
use kvferry_core::{
    Action, ConnectFailure, DialId, Endpoint, EndpointInfo, Event, FailureReason, Incarnation,
    KvPoll, NodeId, Role, RoomId, SessionState, TargetId, Timer,
};

/// One decode node alone.
fn lone_decode() -> (Sim, usize) {
    let mut sim = Sim::new(5, Faults::default());
    let d = sim.add_decode(config(), small_layout(64), 0);
    (sim, d)
}

#[test]
fn an_accepted_connection_that_never_becomes_a_session_is_dropped_at_the_handshake_timeout() {
    let (mut sim, d) = lone_decode();
    let start = sim.now;
    let conn = sim.nodes[d].endpoint.handle_accepted(sim.now);
    run_ms(&mut sim, 999);
    assert!(
        sim.nodes[d].waits_ended.is_empty(),
        "kept until its deadline"
    );
    run_ms(&mut sim, 1_000);
    assert_eq!(
        sim.nodes[d].waits_ended,
        vec![(
            start + config().handshake_timeout,
            WaitEnded::DropAccepted(conn)
        )],
        "dropped once, at the handshake timeout"
    );
    assert_eq!(sim.nodes[d].endpoint.accepted_pending(), 0);
}

#[test]
fn an_accepted_connection_that_became_a_session_is_never_dropped() {
    let (mut sim, d) = lone_decode();
    let conn = sim.nodes[d].endpoint.handle_accepted(sim.now);
    run_ms(&mut sim, 10);
    sim.nodes[d].endpoint.handle_accept_settled(conn);
    run_ms(&mut sim, 3_000);
    assert!(sim.nodes[d].waits_ended.is_empty());
    assert_eq!(sim.nodes[d].endpoint.accepted_pending(), 0);
}

#[test]
fn each_accepted_connection_has_its_own_deadline() {
    let (mut sim, d) = lone_decode();
    let start = sim.now;
    let first = sim.nodes[d].endpoint.handle_accepted(sim.now);
    run_ms(&mut sim, 400);
    let second = sim.nodes[d].endpoint.handle_accepted(sim.now);
    run_ms(&mut sim, 2_000);
    let timeout = config().handshake_timeout;
    assert_eq!(
        sim.nodes[d].waits_ended,
        vec![
            (start + timeout, WaitEnded::DropAccepted(first)),
            (
                start + Duration::from_millis(400) + timeout,
                WaitEnded::DropAccepted(second)
            ),
        ]
    );
}

#[test]
fn a_failed_accept_pauses_the_listener_for_the_accept_backoff() {
    let (mut sim, d) = lone_decode();
    let start = sim.now;
    sim.nodes[d].endpoint.handle_accept_failed(sim.now);
    run_ms(&mut sim, 5_000);
    assert_eq!(
        sim.nodes[d].waits_ended,
        vec![(start + config().accept_backoff, WaitEnded::ResumeAccepting)],
        "accepting resumes once, after the backoff"
    );
}

#[test]
fn a_second_failed_accept_extends_the_pause() {
    let (mut sim, d) = lone_decode();
    sim.nodes[d].endpoint.handle_accept_failed(sim.now);
    run_ms(&mut sim, 10);
    let again = sim.now;
    sim.nodes[d].endpoint.handle_accept_failed(sim.now);
    run_ms(&mut sim, 5_000);
    assert_eq!(
        sim.nodes[d].waits_ended,
        vec![(again + config().accept_backoff, WaitEnded::ResumeAccepting)]
    );
}

#[test]
fn a_closing_session_whose_writer_cannot_flush_is_stopped_after_the_close_linger() {
    let (mut sim, p, d) = pair(11, config());
    // The peer stopped reading: the writer would take 10 s to send what is queued.
    sim.faults.close_flush = Duration::from_secs(10);
    let session = sim.session(d, p).unwrap();
    let closed_at = sim.now;
    sim.nodes[d].endpoint.shutdown(sim.now);
    sim.drain(d);
    run_ms(&mut sim, 1_000);
    let linger = config().close_linger;
    assert_eq!(
        sim.nodes[d].waits_ended,
        vec![(closed_at + linger, WaitEnded::StopLingering(session))],
        "the writer is stopped at the linger's end"
    );
    assert_eq!(sim.nodes[d].endpoint.session_state(session), None);
    let shut_down_at = sim.nodes[d]
        .events
        .iter()
        .find_map(|(t, e)| matches!(e, Event::ShutDown { .. }).then_some(*t));
    assert_eq!(
        shut_down_at,
        Some(closed_at + linger),
        "the shutdown completes when the linger stopped the writer, not at its timeout"
    );
}

#[test]
fn a_closing_session_whose_writer_flushes_in_time_does_not_linger() {
    let (mut sim, p, d) = pair(12, config());
    sim.faults.close_flush = Duration::from_millis(10);
    let session = sim.session(d, p).unwrap();
    sim.nodes[d].endpoint.shutdown(sim.now);
    sim.drain(d);
    run_ms(&mut sim, 1_000);
    assert!(sim.nodes[d].waits_ended.is_empty(), "no linger stopped it");
    assert_eq!(sim.nodes[d].endpoint.session_state(session), None);
}

#[test]
fn a_handshake_that_never_completes_closes_its_session_and_its_writer_lingers_no_longer() {
    let (mut sim, d) = lone_decode();
    let start = sim.now;
    // A connector that never says hello: its session waits `handshake_timeout`, then
    // closes, and its writer (with the error frame) gets `close_linger`.
    let session = sim.nodes[d].endpoint.accept_session(sim.now);
    run_ms(&mut sim, 999);
    assert_eq!(
        sim.nodes[d].endpoint.session_state(session),
        Some(SessionState::Handshaking)
    );
    run_ms(&mut sim, 1_000);
    assert_eq!(
        sim.nodes[d].endpoint.session_state(session),
        Some(SessionState::Closing)
    );
    assert_eq!(
        sim.nodes[d].waits_ended,
        vec![(
            start + config().handshake_timeout + config().close_linger,
            WaitEnded::StopLingering(session)
        )]
    );
}

#[test]
fn a_fence_the_data_path_never_confirms_closes_the_session_at_the_fence_timeout() {
    let (mut sim, p, d) = pair(13, config());
    // Writes never report, so the operation timeout fences the session; and the data path
    // never confirms the fence (a queue pair whose flush does not complete).
    sim.faults.op_hang = 1.0;
    sim.faults.fence_stuck = true;
    // The closing side's writer sends its `Error` before the connection goes.
    sim.faults.close_flush = Duration::from_millis(5);
    let session = sim.session(p, d).unwrap();
    open_room(&mut sim, d, &[p], 1, 4);
    run_ms(&mut sim, 5);
    let sent_at = sim.now;
    send_all(&mut sim, p, 1, 4, false);
    let timeouts = config().operation_timeout + config().fence_timeout;
    sim.run_for(
        sent_at + timeouts - Duration::from_millis(50) - sim.now,
        5_000_000,
    )
    .unwrap();
    assert_eq!(
        sim.nodes[p].endpoint.session_state(session),
        Some(SessionState::Established),
        "still waiting for the fence"
    );
    assert_eq!(sim.nodes[p].endpoint.counters().fences, 1);
    run_ms(&mut sim, 200);
    assert_eq!(sim.nodes[p].endpoint.counters().fence_timeouts, 1);
    assert_eq!(sim.nodes[p].endpoint.session_state(session), None, "closed");
    let failed = |n: usize| match sim.nodes[n].states.get(&(RoomId(1), 0)) {
        Some(KvPoll::Failed(reason)) => Some(*reason),
        _ => None,
    };
    assert_eq!(failed(p), Some(FailureReason::TransferFailed));
    assert_eq!(
        failed(d),
        Some(FailureReason::TransferFailed),
        "the peer heard why"
    );
}

#[test]
fn a_fence_the_data_path_confirms_keeps_the_session() {
    let (mut sim, p, d) = pair(14, config());
    sim.faults.op_hang = 1.0;
    let session = sim.session(p, d).unwrap();
    open_room(&mut sim, d, &[p], 1, 4);
    run_ms(&mut sim, 5);
    send_all(&mut sim, p, 1, 4, false);
    run_ms(&mut sim, 3_000);
    assert!(sim.nodes[p].endpoint.counters().fences >= 1);
    assert_eq!(sim.nodes[p].endpoint.counters().fence_timeouts, 0);
    assert_eq!(
        sim.nodes[p].endpoint.session_state(session),
        Some(SessionState::Established)
    );
}

/// When node `n` was told to abandon a connection attempt, counted from `since` (abandons
/// before it left out).
fn abandoned_since(sim: &Sim, n: usize, since: Instant) -> Vec<Duration> {
    sim.nodes[n]
        .waits_ended
        .iter()
        .filter(|(t, w)| *t >= since && matches!(w, WaitEnded::AbandonDial(_)))
        .map(|(t, _)| *t - since)
        .collect()
}

/// A decode and a prefill, not connected yet.
fn decode_and_prefill(seed: u64) -> (Sim, usize, usize) {
    let mut sim = Sim::new(seed, Faults::default());
    let d = sim.add_decode(config(), small_layout(64), 0);
    let p = sim.add_prefill(config(), small_layout(64), 0, 0..4);
    (sim, d, p)
}

#[test]
fn a_connection_attempt_nobody_answers_is_abandoned_at_the_connect_timeout() {
    let (mut sim, d, p) = decode_and_prefill(21);
    sim.silence_dials(p, true);
    let start = sim.now;
    sim.add_target(d, p);
    let timeout = config().connect_timeout;
    run_ms(&mut sim, timeout.as_millis() as u64 - 1);
    assert!(
        sim.nodes[d].waits_ended.is_empty(),
        "kept until its deadline"
    );
    run_ms(&mut sim, 1);
    let abandoned = abandoned_since(&sim, d, start);
    assert_eq!(
        abandoned,
        vec![timeout],
        "given up once, at the connect timeout"
    );
}

#[test]
fn a_target_dials_again_after_an_abandoned_attempt_and_connects_once_answered() {
    let (mut sim, d, p) = decode_and_prefill(22);
    sim.silence_dials(p, true);
    let target = sim.add_target(d, p);
    run_ms(&mut sim, 3_000);
    let abandoned = abandoned_since(&sim, d, sim.start).len();
    assert!(
        abandoned >= 3,
        "attempts go on, each abandoned: {abandoned}"
    );
    assert_eq!(sim.nodes[d].endpoint.target_session(target), None);
    sim.silence_dials(p, false);
    // The attempt under way stays unanswered; the next one, at most a capped deadline, a
    // connect timeout and a pause later, connects.
    run_ms(&mut sim, 3_000);
    assert!(
        sim.nodes[d].endpoint.target_session(target).is_some(),
        "the next attempt connects"
    );
    assert_eq!(sim.nodes[d].endpoint.dials_pending(), 0);
}

/// A link whose connect takes longer than `connect_timeout` (a long haul): the attempt cut
/// short is followed by one given twice as long, which connects.
#[test]
fn a_target_whose_connect_outlasts_the_connect_timeout_is_reached_by_a_longer_attempt() {
    let (mut sim, d, p) = decode_and_prefill(24);
    let timeout = config().connect_timeout;
    sim.slow_dials(p, timeout * 3 / 2);
    let target = sim.add_target(d, p);
    run_ms(&mut sim, 20 * timeout.as_millis() as u64);
    assert!(
        sim.nodes[d].endpoint.target_session(target).is_some(),
        "reached"
    );
    let abandoned = abandoned_since(&sim, d, sim.start).len();
    assert_eq!(
        abandoned, 1,
        "one attempt cut short, the next waited long enough"
    );
}

/// Attempts nobody answers wait longer each time, up to eight connect timeouts: a slow link
/// is reached, and a healed one is still found within that.
#[test]
fn unanswered_attempts_wait_longer_each_time_up_to_a_cap() {
    let (mut sim, d, p) = decode_and_prefill(25);
    sim.silence_dials(p, true);
    let start = sim.now;
    let target = sim.add_target(d, p);
    let timeout = config().connect_timeout;
    run_ms(&mut sim, 60 * timeout.as_millis() as u64);
    let at = abandoned_since(&sim, d, start);
    assert_eq!(at[0], timeout, "the first waits one connect timeout");
    let gaps: Vec<Duration> = at.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(gaps[1] > gaps[0] && gaps[2] > gaps[1], "growing: {gaps:?}");
    // Each gap: the attempt's own deadline, the driver's connect timeout to report it, and
    // the pause before the next (`reconnect_interval` and its jitter).
    let most = timeout * 8 + timeout + config().reconnect_interval * 2;
    assert!(gaps.iter().all(|g| *g <= most), "capped: {gaps:?}");
    assert!(gaps[gaps.len() - 1] >= timeout * 8, "at the cap: {gaps:?}");
    sim.silence_dials(p, false);
    run_ms(&mut sim, most.as_millis() as u64);
    assert!(
        sim.nodes[d].endpoint.target_session(target).is_some(),
        "a healed link is found within the cap"
    );
}

/// Once a session measured the link, an attempt that times out is an outage, not a slow
/// link: the attempts after a lost session keep `connect_timeout`, so a heal is found at once.
#[test]
fn after_a_session_an_outages_attempts_keep_the_connect_timeout() {
    let (mut sim, d, p) = decode_and_prefill(26);
    let target = sim.add_target(d, p);
    run_ms(&mut sim, 1_000);
    assert!(sim.nodes[d].endpoint.target_session(target).is_some());
    sim.silence_dials(p, true);
    sim.reset_link(d, p);
    let start = sim.now;
    let timeout = config().connect_timeout;
    run_ms(&mut sim, 20 * timeout.as_millis() as u64);
    let at = abandoned_since(&sim, d, start);
    let gaps: Vec<Duration> = at.windows(2).map(|w| w[1] - w[0]).collect();
    // Each gap: the deadline, the driver's connect timeout to report, the backoff's pause.
    let most = timeout * 2 + config().reconnect_max_interval + config().reconnect_max_interval / 4;
    assert!(
        gaps.len() >= 3 && gaps.iter().all(|g| *g <= most),
        "{gaps:?}"
    );
}

/// An embedder's one-shot attempt has no later attempt to learn from: it gets the longest
/// deadline a kept peer's attempts may reach, so a link slower than `connect_timeout` is
/// still reached.
#[test]
fn a_callers_one_shot_attempt_waits_eight_connect_timeouts() {
    let now = Instant::now();
    let info = EndpointInfo::new(Role::Decode, NodeId(2), Incarnation(2), small_layout(64));
    let mut e = Endpoint::new(config(), info, 7, now).unwrap();
    let dial = e.handle_dial_started(now);
    let timeout = config().connect_timeout;
    assert_eq!(e.poll_timeout().map(|(at, _)| at), Some(now + timeout * 8));
    e.handle_timeout(now + timeout * 8 - Duration::from_millis(1));
    assert!(e.poll_action().is_none(), "kept until its deadline");
    e.handle_timeout(now + timeout * 8);
    assert!(matches!(e.poll_action(), Some(Action::AbandonDial(d)) if d == dial));
}

#[test]
fn a_connection_attempt_that_connects_is_never_abandoned() {
    let (mut sim, d, p) = decode_and_prefill(23);
    let target = sim.add_target(d, p);
    run_ms(&mut sim, 1_000);
    assert!(sim.nodes[d].endpoint.target_session(target).is_some());
    assert_eq!(sim.nodes[d].endpoint.dials_pending(), 0);
    assert!(
        !sim.nodes[d]
            .waits_ended
            .iter()
            .any(|(_, w)| matches!(w, WaitEnded::AbandonDial(_))),
        "settled before its deadline"
    );
}

/// A decode endpoint keeping one prefill target, and the attempt it asked for at once.
fn decode_dialing() -> (Endpoint, TargetId, DialId, Instant) {
    let now = Instant::now();
    let info = EndpointInfo::new(Role::Decode, NodeId(2), Incarnation(2), small_layout(64));
    let mut d = Endpoint::new(config(), info, 2, now).unwrap();
    let target = d.add_target(now);
    let dial = next_dial(&mut d, target);
    (d, target, dial, now)
}

/// The next connection attempt `d` asks for `target`, firing its timers until it does.
fn next_dial(d: &mut Endpoint, target: TargetId) -> DialId {
    for _ in 0..100 {
        while let Some(action) = d.poll_action() {
            if let Action::Connect { target: t, dial } = action {
                if t == target {
                    return dial;
                }
            }
        }
        let (at, _) = d.poll_timeout().unwrap();
        d.handle_timeout(at);
    }
    panic!("no connection attempt asked for {target}");
}

#[test]
fn a_target_attempt_its_driver_never_reports_is_counted_as_no_answer_after_one_more_connect_timeout(
) {
    let (mut d, target, first, now) = decode_dialing();
    let timeout = config().connect_timeout;
    d.handle_timeout(now + timeout);
    assert_eq!(d.poll_action(), Some(Action::AbandonDial(first)));
    assert_eq!(
        d.dials_pending(),
        1,
        "its driver may still say what it found"
    );
    d.handle_timeout(now + timeout * 2);
    assert_eq!(d.dials_pending(), 0, "counted: the attempt ended");
    let (at, why) = d.poll_timeout().unwrap();
    assert_eq!(
        why,
        Timer::Reconnect(target),
        "dialed again after the shortest pause"
    );
    assert!(at - (now + timeout * 2) <= config().reconnect_interval * 5 / 4);
    let second = next_dial(&mut d, target);
    assert_ne!(first, second);
    assert_eq!(d.dials_pending(), 1, "only the new attempt is pending");
}

#[test]
fn an_abandoned_target_attempt_counts_what_its_driver_found() {
    let (mut d, target, first, now) = decode_dialing();
    let timeout = config().connect_timeout;
    d.handle_timeout(now + timeout);
    assert_eq!(d.poll_action(), Some(Action::AbandonDial(first)));
    // The refusal was there to read; the busy driver reads it only now.
    d.handle_connect_failed(now + timeout, first, ConnectFailure::Refused);
    assert_eq!(d.dials_pending(), 0);
    d.handle_timeout(now + timeout * 2);
    assert!(
        d.poll_action().is_none(),
        "counted once, not again at the second deadline"
    );
    let second = next_dial(&mut d, target);
    assert_ne!(first, second);
}

#[test]
fn a_failure_reported_after_its_attempt_was_counted_does_not_count_against_the_next() {
    let (mut d, target, first, now) = decode_dialing();
    let timeout = config().connect_timeout;
    d.handle_timeout(now + timeout);
    d.handle_timeout(now + timeout * 2);
    let second = next_dial(&mut d, target);
    // The first attempt's refusal arrives late: the second one is still under way.
    d.handle_connect_failed(now + timeout * 2, first, ConnectFailure::Refused);
    assert_eq!(d.dials_pending(), 1, "the second attempt is still pending");
    assert!(
        d.poll_action().is_none(),
        "no attempt beside the pending one"
    );
    let sid = d.open_session_for(now + timeout * 2, target);
    assert_eq!(d.dials_pending(), 0, "the second attempt connected");
    assert_ne!(first, second);
    assert!(d.session_state(sid).is_some());
}

#[test]
fn a_target_attempt_its_driver_begins_late_gets_its_whole_connect_timeout() {
    let (mut d, _, dial, now) = decode_dialing();
    let timeout = config().connect_timeout;
    let late = Duration::from_millis(150);
    d.handle_dial_began(now + late, dial);
    d.handle_timeout(now + timeout);
    assert!(
        !std::iter::from_fn(|| d.poll_action()).any(|a| a == Action::AbandonDial(dial)),
        "the wait for a CPU is not the peer's"
    );
    d.handle_timeout(now + late + timeout);
    assert_eq!(d.poll_action(), Some(Action::AbandonDial(dial)));
}

#[test]
fn a_refusal_that_comes_after_its_attempt_was_counted_still_names_the_reason() {
    // A machine so busy that every refusal is reported just after the core counted its
    // attempt as no answer.
    let (mut d, target, _, now) = decode_dialing();
    let mut abandoned = None;
    while d.target_unreachable(target).is_none() {
        let (at, _) = d.poll_timeout().unwrap();
        d.handle_timeout(at);
        while let Some(action) = d.poll_action() {
            if let Action::AbandonDial(dial) = action {
                abandoned = Some(dial);
            }
        }
        if d.dials_pending() == 0 {
            if let Some(dial) = abandoned.take() {
                d.handle_connect_failed(at, dial, ConnectFailure::Refused);
            }
        }
        assert!(
            at - now < config().unreachable_timeout * 2,
            "reported in time"
        );
    }
    assert_eq!(
        d.target_unreachable(target),
        Some(FailureReason::ConnectionRefused),
        "the host answered: nothing listens"
    );
}

#[test]
fn a_target_attempt_that_connected_but_never_became_its_session_still_ends_at_its_deadline() {
    let (mut d, target, dial, now) = decode_dialing();
    // The driver connected and forgot the attempt, but its session never reached the core.
    d.handle_dial_settled(dial);
    assert_eq!(
        d.dials_pending(),
        1,
        "a target's attempt ends by its outcome"
    );
    d.handle_timeout(now + config().connect_timeout);
    assert_eq!(d.poll_action(), Some(Action::AbandonDial(dial)));
    assert_ne!(
        next_dial(&mut d, target),
        dial,
        "and the target is dialed again"
    );
}

#[test]
fn a_replaced_data_path_that_never_drains_is_let_go_at_the_operation_timeout() {
    let (mut sim, d) = lone_decode();
    let start = sim.now;
    let drain = sim.nodes[d].endpoint.handle_drain_started(sim.now);
    let timeout = config().operation_timeout;
    run_ms(&mut sim, timeout.as_millis() as u64 - 1);
    assert!(
        sim.nodes[d].waits_ended.is_empty(),
        "collected until its deadline"
    );
    run_ms(&mut sim, 1);
    assert_eq!(
        sim.nodes[d].waits_ended,
        vec![(start + timeout, WaitEnded::StopDraining(drain))],
        "let go once, at the operation timeout"
    );
    assert_eq!(sim.nodes[d].endpoint.drains_pending(), 0);
}

#[test]
fn a_replaced_data_path_that_drains_in_time_is_never_stopped() {
    let (mut sim, d) = lone_decode();
    let drain = sim.nodes[d].endpoint.handle_drain_started(sim.now);
    run_ms(&mut sim, 10);
    sim.nodes[d].endpoint.handle_drain_settled(drain);
    run_ms(&mut sim, 10_000);
    assert!(sim.nodes[d].waits_ended.is_empty());
    assert_eq!(sim.nodes[d].endpoint.drains_pending(), 0);
}

#[test]
fn a_node_shutting_down_dials_its_kept_peers_no_more() {
    let (mut sim, d, p) = decode_and_prefill(24);
    let target = sim.add_target(d, p);
    run_ms(&mut sim, 100);
    assert!(sim.nodes[d].endpoint.target_session(target).is_some());
    sim.nodes[d].endpoint.shutdown(sim.now);
    sim.drain(d);
    run_ms(&mut sim, 3_000);
    assert_eq!(sim.session(d, p), None, "no session opened again");
    assert!(sim.nodes[d].endpoint.shutdown_complete());
}

#[test]
fn a_connection_that_arrives_after_the_shutdown_began_is_closed_at_once() {
    let (mut sim, d) = lone_decode();
    sim.nodes[d].endpoint.shutdown(sim.now);
    let accepted = sim.nodes[d].endpoint.accept_session(sim.now);
    let dialed = sim.nodes[d].endpoint.open_session(sim.now);
    for session in [accepted, dialed] {
        assert_eq!(
            sim.nodes[d].endpoint.session_state(session),
            Some(SessionState::Closing),
            "told it is shutting down, and closed"
        );
    }
}
