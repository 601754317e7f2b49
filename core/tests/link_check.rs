//! When the dialing side checks its link with fresh connections: after hearing nothing for
//! `silence_timeout`, and after its own frames went unconfirmed for as long while the peer is
//! still heard. The second case is what an outage leaves behind on TCP: the peer's
//! retransmissions arrive at once, while ours wait out their retransmission backoff (seconds).
#![allow(clippy::unwrap_used)] // tests may panic

use std::time::{Duration, Instant};

use kvferry_core::sim::small_layout;
use kvferry_core::{
    Action, Config, ConnectFailure, Endpoint, EndpointInfo, Incarnation, NodeId, Role, SessionId,
};

/// A decode that dials a prefill (as the CLI and the drivers do: a target), joined by a pipe
/// whose two directions can each be cut.
struct Link {
    now: Instant,
    d: Endpoint,
    p: Endpoint,
    sd: SessionId,
    sp: SessionId,
    /// Frames from decode to prefill are dropped (the decode's outbound direction stalls).
    d_to_p_cut: bool,
    p_to_d_cut: bool,
    /// Connection attempts the decode asked of its driver.
    dials: usize,
}

impl Link {
    fn new() -> Link {
        let now = Instant::now();
        let layout = small_layout(64);
        let config = Config::default();
        let mut p = Endpoint::new(
            config.clone(),
            EndpointInfo::new(Role::Prefill, NodeId(1), Incarnation(1), layout),
            1,
            now,
        )
        .unwrap();
        let mut d = Endpoint::new(
            config,
            EndpointInfo::new(Role::Decode, NodeId(2), Incarnation(2), layout),
            2,
            now,
        )
        .unwrap();
        let target = d.add_target(now);
        let sd = d.open_session_for(now, target);
        let sp = p.accept_session(now);
        let mut link = Link {
            now,
            d,
            p,
            sd,
            sp,
            d_to_p_cut: false,
            p_to_d_cut: false,
            dials: 0,
        };
        link.pump();
        link.dials = 0; // the first connection is not a check
        assert!(link
            .d
            .link_session(kvferry_core::Link::Target(target))
            .is_some());
        link
    }

    fn pump(&mut self) {
        loop {
            let mut moved = false;
            let mut buf = Vec::new();
            while self.d.poll_transmit(&mut buf).is_some() {
                moved = true;
            }
            if !self.d_to_p_cut {
                self.p.handle_input(self.now, self.sp, &buf);
            }
            buf.clear();
            while self.p.poll_transmit(&mut buf).is_some() {
                moved = true;
            }
            if !self.p_to_d_cut {
                self.d.handle_input(self.now, self.sd, &buf);
            }
            while let Some(a) = self.d.poll_action() {
                // A fresh connection gets no answer (this pipe has no third lane): the core's
                // deadline ends it, and the attempt reports no answer, as a driver's does.
                match a {
                    Action::Connect { .. } => self.dials += 1,
                    Action::AbandonDial(dial) => {
                        self.d
                            .handle_connect_failed(self.now, dial, ConnectFailure::NoAnswer);
                    }
                    _ => {}
                }
            }
            while self.p.poll_action().is_some() {}
            while self.d.poll_event().is_some() {}
            while self.p.poll_event().is_some() {}
            if !moved {
                return;
            }
        }
    }

    /// Lets `ms` milliseconds pass in 10 ms steps, firing both sides' timers.
    fn run_ms(&mut self, ms: u64) {
        for _ in 0..ms / 10 {
            self.now += Duration::from_millis(10);
            let now = self.now;
            self.d.handle_timeout(now);
            self.p.handle_timeout(self.now);
            self.pump();
        }
    }
}

#[test]
fn a_healthy_link_is_never_checked() {
    let mut link = Link::new();
    link.run_ms(20_000);
    assert_eq!(link.dials, 0);
}

#[test]
fn a_silent_peer_gets_the_link_checked_after_the_silence_timeout() {
    let mut link = Link::new();
    link.run_ms(1_000);
    link.d_to_p_cut = true;
    link.p_to_d_cut = true;
    let silence = link.d.config().silence_timeout.as_millis() as u64;
    link.run_ms(silence - 50);
    assert_eq!(link.dials, 0, "not before the silence timeout");
    link.run_ms(100);
    assert_eq!(link.dials, 1);
    // One attempt per connect timeout while no attempt is answered.
    let pace = link.d.config().connect_timeout.as_millis() as u64;
    link.run_ms(10 * pace);
    assert!(
        (10..=11).contains(&(link.dials - 1)),
        "{} attempts",
        link.dials - 1
    );
}

#[test]
fn frames_the_peer_stops_confirming_get_the_link_checked_although_the_peer_is_heard() {
    let mut link = Link::new();
    link.run_ms(1_000);
    // Only our direction is dark: the prefill's heartbeats keep arriving.
    link.d_to_p_cut = true;
    let silence = link.d.config().silence_timeout.as_millis() as u64;
    link.run_ms(silence - 50);
    assert_eq!(
        link.dials, 0,
        "a frame may wait a heartbeat interval for its confirmation"
    );
    link.run_ms(600);
    assert!(
        link.dials >= 1,
        "the check starts while the peer is still heard"
    );
    // Connection attempts go on at the connect pace until the link moves again.
    let before = link.dials;
    link.run_ms(1_000);
    assert!(link.dials > before);
}

#[test]
fn a_check_goes_on_after_the_old_connection_moves_again_until_a_whole_window_passed() {
    let mut link = Link::new();
    link.run_ms(1_000);
    link.d_to_p_cut = true;
    link.p_to_d_cut = true;
    link.run_ms(1_500);
    assert!(link.dials >= 1);
    // The old connection moves both ways again: its data connections may still sit in a
    // backoff of their own, so the check goes on (a fresh connection would take over) ...
    link.d_to_p_cut = false;
    link.p_to_d_cut = false;
    link.run_ms(1_000);
    let moving = link.dials;
    link.run_ms(1_000);
    assert!(link.dials > moving, "still checking");
    // ... until the connection moved both ways for a whole liveness window.
    let window = link.d.config().heartbeat_interval * link.d.config().heartbeat_misses;
    link.run_ms(window.as_millis() as u64);
    let settled = link.dials;
    link.run_ms(5_000);
    assert_eq!(link.dials, settled, "the check ended");
}
