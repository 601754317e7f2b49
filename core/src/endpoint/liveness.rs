//! A session's liveness: when its peer was last heard, whether the peer confirms the frames
//! we send, and whether its link is being checked with fresh connections.
//!
//! Invariants of [`Liveness`]: `unconfirmed_since` is set only while a frame we sent waits
//! for the peer's heartbeats to confirm it (as far as they said); `healthy_since` is set
//! only during a link check; the windows are the ones the handshake agreed once it did.

use std::time::{Duration, Instant};

use tracing::info;

use crate::ids::SessionId;

/// What a session's peer was heard and confirmed doing, and the link check it drives.
#[derive(Debug)]
pub(super) struct Liveness {
    last_rx: Instant,
    /// Frames handed to the driver for this connection, and frames read from it.
    frames_sent: u64,
    frames_received: u64,
    /// The most frames the peer's heartbeats said it received.
    frames_confirmed: u64,
    /// Since when frames we sent wait for the peer to confirm them, with no progress: a link
    /// the peer is heard on can still swallow what we send (TCP retransmission backoff).
    unconfirmed_since: Option<Instant>,
    /// How long this session may stay silent before it is given up: the longer of our
    /// liveness window and the one the peer announced.
    window: Duration,
    /// Silence after which the link is checked: longer than the peer's heartbeat interval.
    silence: Duration,
    /// The dialer checks this session's link with fresh connections.
    checking: bool,
    /// During a check: since when both directions move again on the old connection.
    healthy_since: Option<Instant>,
}

/// What a look at a session's silence found.
pub(super) enum Look {
    /// Both directions moved within the silence allowed (and, during a check, for a whole
    /// window): look again at this instant.
    Moving(Instant),
    /// Quiet, or our frames unconfirmed, for the silence allowed: the link needs checking.
    Stalled,
}

/// Why a link check starts, for its log line.
pub(super) struct Stall {
    /// Nothing heard for the silence allowed (otherwise: heard, but our frames unconfirmed).
    pub(super) quiet: bool,
    pub(super) quiet_ms: u64,
    pub(super) unconfirmed_ms: Option<u64>,
}

impl Liveness {
    /// A session just opened at `now`, with our own windows until the handshake agrees.
    pub(super) fn new(now: Instant, window: Duration, silence: Duration) -> Self {
        Liveness {
            last_rx: now,
            frames_sent: 0,
            frames_received: 0,
            frames_confirmed: 0,
            unconfirmed_since: None,
            window,
            silence,
            checking: false,
            healthy_since: None,
        }
    }

    /// The windows the handshake agreed on.
    pub(super) fn agree(&mut self, window: Duration, silence: Duration) {
        self.window = window;
        self.silence = silence;
    }

    /// A message from the peer arrived at `now`.
    pub(super) fn heard(&mut self, now: Instant) {
        self.last_rx = now;
    }

    /// One more frame read from the connection (the count our heartbeats report).
    pub(super) fn frame_received(&mut self) {
        self.frames_received += 1;
    }

    /// Frames read from the connection so far.
    pub(super) fn frames_received(&self) -> u64 {
        self.frames_received
    }

    /// One more frame handed to the driver at `now`: it waits for the peer's confirmation.
    pub(super) fn frame_sent(&mut self, now: Instant) {
        self.frames_sent += 1;
        self.unconfirmed_since.get_or_insert(now);
    }

    /// The peer's heartbeat said it read `frames_received` of our frames: all of them
    /// confirms the link; more than before restarts the wait for the rest.
    pub(super) fn confirmed(&mut self, frames_received: u64, now: Instant) {
        if frames_received >= self.frames_sent {
            self.unconfirmed_since = None;
        } else if frames_received > self.frames_confirmed {
            self.unconfirmed_since = Some(now);
        }
        self.frames_confirmed = self.frames_confirmed.max(frames_received);
    }

    /// How long the session may stay silent before it is given up.
    pub(super) fn window(&self) -> Duration {
        self.window
    }

    /// When the session's silence outlasts its window, as of what was heard so far.
    pub(super) fn gives_up_at(&self) -> Instant {
        self.last_rx + self.window
    }

    /// Whether the peer was heard within the window at `now`.
    pub(super) fn alive_at(&self, now: Instant) -> bool {
        now < self.gives_up_at()
    }

    /// Whether the dialer is checking this session's link.
    pub(super) fn checking(&self) -> bool {
        self.checking
    }

    /// Looks at the silence at `now`. A check ends once the old connection moved both ways
    /// for a whole window: an old control connection that moves again says nothing of its
    /// data connections, each in a TCP backoff of its own.
    pub(super) fn look(&mut self, sid: SessionId, now: Instant) -> Look {
        let heard = self.last_rx + self.silence;
        let confirmed = self.unconfirmed_since.map(|t| t + self.silence);
        let due = confirmed.map_or(heard, |c| c.min(heard));
        if due <= now {
            self.healthy_since = None;
            return Look::Stalled;
        }
        let since = *self.healthy_since.get_or_insert(now);
        if self.checking && now.saturating_duration_since(since) < self.window {
            return Look::Stalled;
        }
        if self.checking {
            info!(session = %sid, "link check ended: the connection moved both ways for a whole window");
        }
        self.checking = false;
        self.healthy_since = None;
        Look::Moving(due)
    }

    /// The link is being checked as of `now`; what stalled it when the check starts now.
    pub(super) fn start_check(&mut self, now: Instant) -> Option<Stall> {
        if std::mem::replace(&mut self.checking, true) {
            return None;
        }
        Some(Stall {
            quiet: self.last_rx + self.silence <= now,
            quiet_ms: now.saturating_duration_since(self.last_rx).as_millis() as u64,
            unconfirmed_ms: self
                .unconfirmed_since
                .map(|t| now.saturating_duration_since(t).as_millis() as u64),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{Liveness, Look};
    use crate::ids::SessionId;
    use std::time::{Duration, Instant};

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn frames_sent_and_not_confirmed_stall_a_link_the_peer_is_heard_on() {
        let t0 = Instant::now();
        let mut l = Liveness::new(t0, 100 * MS, 10 * MS);
        l.frame_sent(t0);
        l.heard(t0 + 9 * MS);
        assert!(matches!(l.look(SessionId(1), t0 + 10 * MS), Look::Stalled));
        let stall = l.start_check(t0 + 10 * MS).expect("the check starts here");
        assert!(!stall.quiet);
        assert_eq!(stall.unconfirmed_ms, Some(10));
        assert!(l.start_check(t0 + 11 * MS).is_none(), "one check at a time");
    }

    #[test]
    fn a_link_check_ends_only_after_a_whole_window_of_movement() {
        let t0 = Instant::now();
        let mut l = Liveness::new(t0, 100 * MS, 10 * MS);
        assert!(matches!(l.look(SessionId(1), t0 + 20 * MS), Look::Stalled));
        assert!(l.start_check(t0 + 20 * MS).is_some_and(|s| s.quiet));
        l.heard(t0 + 21 * MS);
        assert!(matches!(l.look(SessionId(1), t0 + 22 * MS), Look::Stalled));
        l.heard(t0 + 121 * MS);
        assert!(matches!(
            l.look(SessionId(1), t0 + 122 * MS),
            Look::Moving(_)
        ));
        assert!(!l.checking());
    }

    #[test]
    fn a_heartbeat_that_confirms_every_frame_clears_the_wait() {
        let t0 = Instant::now();
        let mut l = Liveness::new(t0, 100 * MS, 10 * MS);
        l.frame_sent(t0);
        l.frame_sent(t0);
        l.confirmed(1, t0 + 5 * MS);
        l.heard(t0 + 14 * MS);
        assert!(matches!(
            l.look(SessionId(1), t0 + 14 * MS),
            Look::Moving(_)
        ));
        l.confirmed(2, t0 + 15 * MS);
        l.heard(t0 + 15 * MS);
        match l.look(SessionId(1), t0 + 16 * MS) {
            Look::Moving(due) => assert_eq!(due, t0 + 25 * MS),
            Look::Stalled => panic!("every frame was confirmed"),
        }
    }
}
