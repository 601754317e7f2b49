//! Plain counters the core keeps; drivers export them (the tokio driver through `metrics`).

use crate::state::FailureReason;

/// Monotone counters of one endpoint. Read with [`crate::Endpoint::counters`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Attempts re-run after a transient failure.
    pub retries: u64,
    /// Operations that succeeded after at least one failed attempt.
    pub retry_recoveries: u64,
    /// Attempts that failed transiently (retried or not).
    pub transient_failures: u64,
    /// Attempts that failed fatally.
    pub fatal_failures: u64,
    /// Operations that exhausted their attempts or failed fatally.
    pub ops_exhausted: u64,
    /// Operations planned (probes excluded).
    pub ops_planned: u64,
    /// Payload bytes planned (probes excluded).
    pub bytes_planned: u64,
    /// Payload bytes of operations that completed.
    pub bytes_transferred: u64,
    /// Sessions that were blacklisted.
    pub sessions_blacklisted: u64,
    /// Blacklisted sessions un-blacklisted by a successful probe.
    pub sessions_recovered: u64,
    /// Blacklisted sessions forgotten after their idle timeout.
    pub sessions_expired: u64,
    /// Kept peers let go after `peer_idle_timeout` unused.
    pub peers_let_go: u64,
    /// Silent sessions taken over by a fresh connection to the same peer process.
    pub sessions_resumed: u64,
    /// Sessions rejected at the handshake (token, version, role, layout).
    pub sessions_rejected: u64,
    /// Probes sent to blacklisted sessions.
    pub probes_sent: u64,
    /// Fences asked of the driver.
    pub fences: u64,
    /// Fences the driver did not confirm within `fence_timeout` (their sessions were closed).
    pub fence_timeouts: u64,
    /// Control frames that failed to decode or broke the protocol.
    pub protocol_errors: u64,
    /// Messages dropped as late, duplicated or of an older generation.
    pub stale_messages: u64,
    /// Data-plane writes refused by [`crate::Endpoint::check_write`].
    pub writes_refused: u64,
    /// Decode: one-sided operations whose landed bytes matched their source's checksum.
    pub landed_checks_passed: u64,
    /// Decode: writes whose every byte was applied into a room's pages.
    pub writes_applied: u64,
    /// Decode: writes into a room's pages that the grant table left to the core and the
    /// core admitted under the driver's lock (a write that also probes, or one the table
    /// was not told of: never a clean room's).
    pub writes_admitted_locked: u64,
    /// Rooms that reached Success.
    pub rooms_succeeded: u64,
    /// Rooms that reached Failed, by reason ([`FailureReason::index`]).
    pub rooms_failed: [u64; FailureReason::ALL.len()],
    /// Rooms whose pages were declared releasable.
    pub rooms_released: u64,
    /// Room messages refused because the room id was already used for another decode
    /// (another node, or an earlier incarnation).
    pub rooms_refused_reused: u64,
}

impl Counters {
    /// Adds `other` into these counters (a sharded driver sums its shards' endpoints).
    pub fn add(&mut self, other: &Counters) {
        self.retries += other.retries;
        self.retry_recoveries += other.retry_recoveries;
        self.transient_failures += other.transient_failures;
        self.fatal_failures += other.fatal_failures;
        self.ops_exhausted += other.ops_exhausted;
        self.ops_planned += other.ops_planned;
        self.bytes_planned += other.bytes_planned;
        self.bytes_transferred += other.bytes_transferred;
        self.sessions_blacklisted += other.sessions_blacklisted;
        self.sessions_recovered += other.sessions_recovered;
        self.sessions_expired += other.sessions_expired;
        self.peers_let_go += other.peers_let_go;
        self.sessions_rejected += other.sessions_rejected;
        self.sessions_resumed += other.sessions_resumed;
        self.probes_sent += other.probes_sent;
        self.fences += other.fences;
        self.protocol_errors += other.protocol_errors;
        self.stale_messages += other.stale_messages;
        self.writes_refused += other.writes_refused;
        self.landed_checks_passed += other.landed_checks_passed;
        self.writes_applied += other.writes_applied;
        self.writes_admitted_locked += other.writes_admitted_locked;
        self.fence_timeouts += other.fence_timeouts;
        self.rooms_succeeded += other.rooms_succeeded;
        self.rooms_released += other.rooms_released;
        self.rooms_refused_reused += other.rooms_refused_reused;
        for (a, b) in self.rooms_failed.iter_mut().zip(other.rooms_failed) {
            *a += b;
        }
    }

    /// Failed rooms of all reasons.
    pub fn rooms_failed_total(&self) -> u64 {
        self.rooms_failed.iter().sum()
    }

    /// Failed rooms of one reason.
    pub fn failed(&self, reason: FailureReason) -> u64 {
        self.rooms_failed[reason.index()]
    }

    /// (name, value) pairs of every scalar counter, for exporters.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, u64)> {
        [
            ("retries", self.retries),
            ("retry_recoveries", self.retry_recoveries),
            ("transient_failures", self.transient_failures),
            ("fatal_failures", self.fatal_failures),
            ("ops_exhausted", self.ops_exhausted),
            ("ops_planned", self.ops_planned),
            ("bytes_planned", self.bytes_planned),
            ("bytes_transferred", self.bytes_transferred),
            ("sessions_blacklisted", self.sessions_blacklisted),
            ("sessions_recovered", self.sessions_recovered),
            ("sessions_expired", self.sessions_expired),
            ("peers_let_go", self.peers_let_go),
            ("sessions_rejected", self.sessions_rejected),
            ("sessions_resumed", self.sessions_resumed),
            ("probes_sent", self.probes_sent),
            ("fences", self.fences),
            ("fence_timeouts", self.fence_timeouts),
            ("protocol_errors", self.protocol_errors),
            ("stale_messages", self.stale_messages),
            ("writes_refused", self.writes_refused),
            ("landed_checks_passed", self.landed_checks_passed),
            ("writes_applied", self.writes_applied),
            ("writes_admitted_locked", self.writes_admitted_locked),
            ("rooms_succeeded", self.rooms_succeeded),
            ("rooms_released", self.rooms_released),
            ("rooms_refused_reused", self.rooms_refused_reused),
        ]
        .into_iter()
    }
}
