//! A session's record toward the blacklist and its way back: consecutive exhausted
//! operations, and the probes of a blacklisted session.
//!
//! Invariants of [`Probation`]: `failures` counts exhausted operations since the last one
//! that landed (or since a recovery); at most one probe write and one probe challenge are
//! outstanding; the probe backoff starts at `probe_interval` on every blacklisting and
//! recovery and doubles per probe up to `probe_max_interval`.

use std::time::Duration;

use crate::ids::TransferId;

/// Consecutive failures and the probes that can lift a blacklisting.
#[derive(Debug)]
pub(super) struct Probation {
    /// Consecutive exhausted operations.
    failures: u32,
    probe_backoff: Duration,
    /// The probe's challenge sent after its write landed, until the peer answers it.
    probe_nonce: Option<u64>,
    /// The probe write in the session's queue or in flight.
    probe_op: Option<TransferId>,
}

impl Probation {
    /// A fresh session's record: no failures, probes `probe_interval` apart at first.
    pub(super) fn new(probe_interval: Duration) -> Self {
        Probation {
            failures: 0,
            probe_backoff: probe_interval,
            probe_nonce: None,
            probe_op: None,
        }
    }

    /// Consecutive exhausted operations so far.
    pub(super) fn failures(&self) -> u32 {
        self.failures
    }

    /// A session that takes another over carries on its `failures` in a row.
    pub(super) fn carry_over(&mut self, failures: u32) {
        self.failures = failures;
    }

    /// An operation landed: the count starts again.
    pub(super) fn landed(&mut self) {
        self.failures = 0;
    }

    /// An operation exhausted its attempts: whether that reaches `threshold` in a row.
    pub(super) fn exhausted(&mut self, threshold: u32) -> bool {
        self.failures += 1;
        self.failures >= threshold
    }

    /// The session was blacklisted: probes start again `probe_interval` apart.
    pub(super) fn blacklisted(&mut self, probe_interval: Duration) {
        self.probe_backoff = probe_interval;
    }

    /// How long until the next probe (before jitter); each probe doubles the next wait up
    /// to `max`.
    pub(super) fn next_probe_wait(&mut self, max: Duration) -> Duration {
        let base = self.probe_backoff;
        self.probe_backoff = (base * 2).min(max);
        base
    }

    /// Whether a probe write is queued or in flight.
    pub(super) fn probing(&self) -> bool {
        self.probe_op.is_some()
    }

    /// The probe write `id` was queued.
    pub(super) fn probe_queued(&mut self, id: TransferId) {
        self.probe_op = Some(id);
    }

    /// Whether `id` was this session's probe write (it is over now).
    pub(super) fn probe_ended(&mut self, id: TransferId) -> bool {
        if self.probe_op != Some(id) {
            return false;
        }
        self.probe_op = None;
        true
    }

    /// The probe's write landed and `nonce` challenges the peer's control loop.
    pub(super) fn challenged(&mut self, nonce: u64) {
        self.probe_nonce = Some(nonce);
    }

    /// The peer answered `nonce`: if it was our challenge the session recovers, with no
    /// failures and probes back at `probe_interval` for the next blacklisting.
    pub(super) fn answered(&mut self, nonce: u64, probe_interval: Duration) -> bool {
        if self.probe_nonce != Some(nonce) {
            return false;
        }
        self.probe_nonce = None;
        self.failures = 0;
        self.probe_backoff = probe_interval;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::Probation;
    use crate::ids::TransferId;
    use std::time::Duration;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn probes_back_off_to_the_maximum_and_start_over_when_blacklisted_again() {
        let mut p = Probation::new(S);
        let waits: Vec<_> = (0..4).map(|_| p.next_probe_wait(5 * S)).collect();
        assert_eq!(waits, [S, 2 * S, 4 * S, 5 * S]);
        p.blacklisted(S);
        assert_eq!(p.next_probe_wait(5 * S), S);
    }

    #[test]
    fn only_the_failures_in_a_row_reach_the_threshold() {
        let mut p = Probation::new(S);
        assert!(!p.exhausted(2));
        p.landed();
        assert!(!p.exhausted(2));
        assert!(p.exhausted(2));
    }

    #[test]
    fn only_our_own_challenge_answered_recovers_the_session() {
        let mut p = Probation::new(S);
        p.probe_queued(TransferId(7));
        assert!(!p.probe_ended(TransferId(8)));
        assert!(p.probe_ended(TransferId(7)));
        p.challenged(42);
        assert!(!p.answered(41, S));
        assert!(p.answered(42, S));
        assert_eq!(p.failures(), 0);
        assert!(!p.answered(42, S), "an answer counts once");
    }
}
