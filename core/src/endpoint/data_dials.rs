//! The data connections a session dials, and how long each may take to open: a link whose
//! round trip is longer than `connect_timeout` (a long haul, a slow TLS handshake) would
//! otherwise have every data connection given up before it opened.
//!
//! Invariants of [`DataDials`]: the deadline is never under `connect_timeout` nor over its
//! cap; it grows only when one of this session's own dials timed out, to twice that dial's
//! own deadline (dials that started together and time out together double it once); the
//! session's control handshake, which crossed the same link, sets a floor of twice its
//! duration.

use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::ids::DialId;

/// A session's data-connection dials under way, and the deadline the next one gets.
#[derive(Debug)]
pub(super) struct DataDials {
    /// When the session opened (its control connection connected).
    opened: Instant,
    timeout: Duration,
    cap: Duration,
    /// Each dial under way, with the deadline it was given.
    pending: SmallVec<[(DialId, Duration); 2]>,
}

impl DataDials {
    /// A session that opened at `opened`: dials start at `connect_timeout`, and never wait
    /// longer than `cap` (the listener's `handshake_timeout` for a connection to become a
    /// session's: waiting longer would wait for a connection it has dropped).
    pub(super) fn new(opened: Instant, connect_timeout: Duration, cap: Duration) -> Self {
        DataDials {
            opened,
            timeout: connect_timeout,
            cap: cap.max(connect_timeout),
            pending: SmallVec::new(),
        }
    }

    /// The control handshake completed at `now`: a data connection's dial crosses the link
    /// as often as that handshake did (connect, preamble and hello, TLS where on), so it gets
    /// at least twice the handshake's time.
    pub(super) fn established(&mut self, now: Instant) {
        let handshake = now.saturating_duration_since(self.opened);
        self.timeout = self.timeout.max(handshake * 2).min(self.cap);
    }

    /// The deadline a dial starting now gets.
    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A dial of this session started with the current deadline.
    pub(super) fn started(&mut self, dial: DialId) {
        self.pending.push((dial, self.timeout));
    }

    /// A dial connected or failed: its deadline, if it was this session's.
    pub(super) fn settled(&mut self, dial: DialId) -> Option<Duration> {
        let i = self.pending.iter().position(|(d, _)| *d == dial)?;
        Some(self.pending.swap_remove(i).1)
    }

    /// A dial reached its deadline: if it was this session's, the next ones wait twice what
    /// it had (up to the cap), and the new deadline is returned.
    pub(super) fn timed_out(&mut self, dial: DialId) -> Option<Duration> {
        let had = self.settled(dial)?;
        self.timeout = self.timeout.max(had * 2).min(self.cap);
        Some(self.timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::{DataDials, DialId, Duration, Instant};

    const CONNECT: Duration = Duration::from_millis(200);
    const CAP: Duration = Duration::from_secs(10);

    #[test]
    fn a_fast_handshake_leaves_the_connect_timeout() {
        let t0 = Instant::now();
        let mut d = DataDials::new(t0, CONNECT, CAP);
        d.established(t0 + Duration::from_millis(3));
        assert_eq!(d.timeout(), CONNECT);
    }

    #[test]
    fn a_slow_handshake_gives_data_dials_twice_its_time() {
        let t0 = Instant::now();
        let mut d = DataDials::new(t0, CONNECT, CAP);
        d.established(t0 + Duration::from_millis(600));
        assert_eq!(d.timeout(), Duration::from_millis(1200));
        d.established(t0 + Duration::from_secs(60));
        assert_eq!(d.timeout(), CAP, "never over the cap");
    }

    #[test]
    fn only_this_sessions_timed_out_dial_doubles_the_deadline_up_to_the_cap() {
        let mut d = DataDials::new(Instant::now(), CONNECT, CAP);
        d.started(DialId(1));
        assert_eq!(d.timed_out(DialId(2)), None, "another session's dial");
        assert_eq!(d.timeout(), CONNECT);
        assert_eq!(d.timed_out(DialId(1)), Some(CONNECT * 2));
        assert_eq!(d.timed_out(DialId(1)), None, "a dial times out once");
        for i in 3..20 {
            d.started(DialId(i));
            d.timed_out(DialId(i));
        }
        assert_eq!(d.timeout(), CAP);
    }

    #[test]
    fn dials_that_started_together_and_time_out_together_double_the_deadline_once() {
        let mut d = DataDials::new(Instant::now(), CONNECT, CAP);
        d.started(DialId(1));
        d.started(DialId(2));
        d.timed_out(DialId(1));
        d.timed_out(DialId(2));
        assert_eq!(d.timeout(), CONNECT * 2);
    }

    #[test]
    fn a_settled_dial_changes_nothing() {
        let mut d = DataDials::new(Instant::now(), CONNECT, CAP);
        d.started(DialId(4));
        assert_eq!(d.settled(DialId(4)), Some(CONNECT));
        assert_eq!(d.settled(DialId(4)), None);
        assert_eq!(d.timed_out(DialId(4)), None);
        assert_eq!(d.timeout(), CONNECT);
    }
}
