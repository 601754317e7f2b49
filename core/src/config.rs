//! The one typed configuration of an endpoint, with documented defaults and `KVFERRY_*` loading.

use core::fmt;
use std::time::Duration;

/// Every knob of the core. `Config::default()` holds the documented defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Attempts per data-path operation before it counts as exhausted (`KVFERRY_TRANSFER_RETRIES`, 3).
    pub transfer_retries: u32,
    /// Linear backoff step between attempts, plus up to half of it as jitter (`KVFERRY_RETRY_BACKOFF_MS`, 50).
    pub retry_backoff: Duration,
    /// Consecutive exhausted operations that blacklist a session (`KVFERRY_SESSION_FAILURE_THRESHOLD`, 10).
    pub session_failure_threshold: u32,
    /// First probe delay after a blacklist (`KVFERRY_PROBE_INTERVAL_MS`, 1000).
    pub probe_interval: Duration,
    /// Cap of the exponential probe backoff (`KVFERRY_PROBE_MAX_INTERVAL_MS`, 30000).
    pub probe_max_interval: Duration,
    /// A blacklisted session no room targets is forgotten after this (`KVFERRY_BLACKLIST_IDLE_TIMEOUT_MS`, 600000).
    pub blacklist_idle_timeout: Duration,
    /// Deadline of the Bootstrapping state on both sides (`KVFERRY_BOOTSTRAP_TIMEOUT_MS`, 300000).
    pub bootstrap_timeout: Duration,
    /// Decode: longest silence about a room after its request was sent (`KVFERRY_WAITING_TIMEOUT_MS`, 300000).
    pub waiting_timeout: Duration,
    /// Decode: wait for every drain acknowledgement before fencing (`KVFERRY_ABORT_ACK_TIMEOUT_MS`, 5000).
    pub abort_ack_timeout: Duration,
    /// Interval of heartbeats on every session (`KVFERRY_HEARTBEAT_INTERVAL_MS`, 500).
    pub heartbeat_interval: Duration,
    /// Missed heartbeat intervals after which a session is dead: the liveness window is
    /// `heartbeat_interval × heartbeat_misses` (`KVFERRY_HEARTBEAT_MISSES`, 30, so 15 s).
    pub heartbeat_misses: u32,
    /// Interval of room progress keepalives from prefill (`KVFERRY_PROGRESS_INTERVAL_MS`, 5000).
    pub progress_interval: Duration,
    /// A session that heard nothing for this long has its link checked with fresh
    /// connections, so a healed link is used at once instead of after the old connection's
    /// retransmission backoff (`KVFERRY_SILENCE_TIMEOUT_MS`, 1000; above the heartbeat interval).
    pub silence_timeout: Duration,
    /// Longest wait for a link check's connection attempt, and the first deadline of other
    /// attempts: a target's unanswered attempts double it (up to 8x) until a session's
    /// handshake measured the link (then twice that handshake's time, within those bounds),
    /// a session's data connections get at least twice its handshake's time (doubled after
    /// each of theirs that timed out, up to `handshake_timeout`), and an embedder's one-shot
    /// connect 8x; an attempt without an answer is evidence of an unreachable link
    /// (`KVFERRY_CONNECT_TIMEOUT_MS`, 200).
    pub connect_timeout: Duration,
    /// Deadline for the peer's hello after a session opened (`KVFERRY_HANDSHAKE_TIMEOUT_MS`, 10000).
    pub handshake_timeout: Duration,
    /// How long a shutdown waits for every session's connections to close before it is
    /// reported complete anyway (`KVFERRY_SHUTDOWN_TIMEOUT_MS`, 2000).
    pub shutdown_timeout: Duration,
    /// Longest wait for a closing session's last control frames (the error that says why) to
    /// leave before its connection is dropped; the wait ends as soon as they are written
    /// (`KVFERRY_CLOSE_LINGER_MS`, 100).
    pub close_linger: Duration,
    /// Wait after a listener's accept failed (out of descriptors, say) before it accepts
    /// again (`KVFERRY_ACCEPT_BACKOFF_MS`, 50).
    pub accept_backoff: Duration,
    /// Wait before a broken data connection of a live session is replaced (the session's
    /// control connection is up, so the peer is there: a short, fixed wait)
    /// (`KVFERRY_DATA_RECONNECT_INTERVAL_MS`, 10).
    pub data_reconnect_interval: Duration,
    /// An attempt not reported within this is treated as a transient failure and its session
    /// is fenced (`KVFERRY_OPERATION_TIMEOUT_MS`, 30000).
    pub operation_timeout: Duration,
    /// Longest wait for the data path to confirm a fence (nothing in flight can land any
    /// more: TCP data connections closed, an RDMA queue pair drained); past it the session is
    /// closed with `Error(FenceTimeout)` and its rooms fail `transfer_failed`
    /// (`KVFERRY_FENCE_TIMEOUT_MS`, 10000).
    pub fence_timeout: Duration,
    /// Most bytes in one data-path operation (`KVFERRY_MAX_OP_BYTES`, 64 MiB).
    pub max_op_bytes: u64,
    /// Most slice rows in one data-path operation, a contiguous slice being one row
    /// (`KVFERRY_MAX_OP_SLICES`, 4096).
    pub max_op_slices: u32,
    /// Operations in flight per session (`KVFERRY_MAX_OPS_IN_FLIGHT`, 8).
    pub max_ops_in_flight: u32,
    /// Operations queued per session; beyond it `send_chunk` is refused (`KVFERRY_MAX_QUEUED_OPS`, 65536).
    pub max_queued_ops: u32,
    /// Largest control frame accepted or sent (`KVFERRY_MAX_FRAME_LEN`, 1 MiB).
    pub max_frame_len: u32,
    /// Concluded rooms remembered to answer late messages (`KVFERRY_TOMBSTONES`, 65536).
    pub tombstones: u32,
    /// Prefill: room requests buffered before the sender room is opened (`KVFERRY_PENDING_REQUESTS`, 65536).
    pub pending_requests: u32,
    /// Malformed frames tolerated on one session before it is closed (`KVFERRY_PROTOCOL_STRIKES`, 3).
    pub protocol_strikes: u32,
    /// First delay before reconnecting a target, doubling per failure (`KVFERRY_RECONNECT_INTERVAL_MS`, 100).
    pub reconnect_interval: Duration,
    /// Cap of the reconnect backoff (`KVFERRY_RECONNECT_MAX_INTERVAL_MS`, 500): a peer that
    /// restarts at the same address is found again within this.
    pub reconnect_max_interval: Duration,
    /// Decode: rooms toward a target without a session fail with `PeerUnreachable` once the
    /// target has been down this long (`KVFERRY_UNREACHABLE_TIMEOUT_MS`, 10000).
    pub unreachable_timeout: Duration,
    /// Decode: a kept peer (target) no room has used for this long is let go: no more
    /// connection attempts, its session closed, its id unknown (`KVFERRY_PEER_IDLE_TIMEOUT_MS`,
    /// 300000; 0 = keep for ever). A prefill scaled away is not dialed for ever.
    pub peer_idle_timeout: Duration,
    /// End-to-end checksum of every write: the receiver verifies each batch's bytes against
    /// the sender's XXH3-64 before it acknowledges (over RDMA: each operation's landed bytes
    /// before the room succeeds), and a mismatch fails the room with `checksum_mismatch`.
    /// Both peers must agree (`KVFERRY_CHECKSUM`, 0 = off, 1 = on); needs `max_op_slices`
    /// <= 4096 and `max_frame_len` >= 131100.
    pub checksum: bool,
    /// Listen beyond loopback with no cluster token, or with the CLI's built-in demo token
    /// that everyone knows (`KVFERRY_ALLOW_NO_TOKEN`, 0 = refuse, 1 = allow): anyone who
    /// reaches the port can then ask for rooms.
    pub allow_no_token: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            transfer_retries: 3,
            retry_backoff: Duration::from_millis(50),
            session_failure_threshold: 10,
            probe_interval: Duration::from_secs(1),
            probe_max_interval: Duration::from_secs(30),
            blacklist_idle_timeout: Duration::from_secs(600),
            bootstrap_timeout: Duration::from_secs(300),
            waiting_timeout: Duration::from_secs(300),
            abort_ack_timeout: Duration::from_secs(5),
            heartbeat_interval: Duration::from_millis(500),
            heartbeat_misses: 30,
            progress_interval: Duration::from_secs(5),
            silence_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_millis(200),
            handshake_timeout: Duration::from_secs(10),
            shutdown_timeout: Duration::from_secs(2),
            close_linger: Duration::from_millis(100),
            accept_backoff: Duration::from_millis(50),
            data_reconnect_interval: Duration::from_millis(10),
            operation_timeout: Duration::from_secs(30),
            fence_timeout: Duration::from_secs(10),
            max_op_bytes: 64 << 20,
            max_op_slices: 4096,
            max_ops_in_flight: 8,
            max_queued_ops: 65536,
            max_frame_len: 1 << 20,
            tombstones: 65536,
            pending_requests: 65536,
            protocol_strikes: 3,
            reconnect_interval: Duration::from_millis(100),
            reconnect_max_interval: Duration::from_millis(500),
            unreachable_timeout: Duration::from_secs(10),
            peer_idle_timeout: Duration::from_secs(300),
            checksum: false,
            allow_no_token: false,
        }
    }
}

/// A configuration value that cannot be used, naming where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The variable or field name, e.g. `KVFERRY_TRANSFER_RETRIES`.
    pub name: String,
    /// The offending value as given.
    pub value: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid {}={:?}: {}", self.name, self.value, self.reason)
    }
}

impl std::error::Error for ConfigError {}

enum Field {
    Count(fn(&mut Config) -> &mut u32),
    Bytes(fn(&mut Config) -> &mut u64),
    Millis(fn(&mut Config) -> &mut Duration),
    Flag(fn(&mut Config) -> &mut bool),
}

/// (name without the `KVFERRY_` prefix, field): one table drives env loading and key=value parsing.
const FIELDS: &[(&str, Field)] = &[
    (
        "TRANSFER_RETRIES",
        Field::Count(|c| &mut c.transfer_retries),
    ),
    ("RETRY_BACKOFF_MS", Field::Millis(|c| &mut c.retry_backoff)),
    (
        "SESSION_FAILURE_THRESHOLD",
        Field::Count(|c| &mut c.session_failure_threshold),
    ),
    (
        "PROBE_INTERVAL_MS",
        Field::Millis(|c| &mut c.probe_interval),
    ),
    (
        "PROBE_MAX_INTERVAL_MS",
        Field::Millis(|c| &mut c.probe_max_interval),
    ),
    (
        "BLACKLIST_IDLE_TIMEOUT_MS",
        Field::Millis(|c| &mut c.blacklist_idle_timeout),
    ),
    (
        "BOOTSTRAP_TIMEOUT_MS",
        Field::Millis(|c| &mut c.bootstrap_timeout),
    ),
    (
        "WAITING_TIMEOUT_MS",
        Field::Millis(|c| &mut c.waiting_timeout),
    ),
    (
        "ABORT_ACK_TIMEOUT_MS",
        Field::Millis(|c| &mut c.abort_ack_timeout),
    ),
    (
        "HEARTBEAT_INTERVAL_MS",
        Field::Millis(|c| &mut c.heartbeat_interval),
    ),
    (
        "HEARTBEAT_MISSES",
        Field::Count(|c| &mut c.heartbeat_misses),
    ),
    (
        "PROGRESS_INTERVAL_MS",
        Field::Millis(|c| &mut c.progress_interval),
    ),
    (
        "SILENCE_TIMEOUT_MS",
        Field::Millis(|c| &mut c.silence_timeout),
    ),
    (
        "CONNECT_TIMEOUT_MS",
        Field::Millis(|c| &mut c.connect_timeout),
    ),
    (
        "SHUTDOWN_TIMEOUT_MS",
        Field::Millis(|c| &mut c.shutdown_timeout),
    ),
    ("CLOSE_LINGER_MS", Field::Millis(|c| &mut c.close_linger)),
    (
        "ACCEPT_BACKOFF_MS",
        Field::Millis(|c| &mut c.accept_backoff),
    ),
    (
        "DATA_RECONNECT_INTERVAL_MS",
        Field::Millis(|c| &mut c.data_reconnect_interval),
    ),
    (
        "HANDSHAKE_TIMEOUT_MS",
        Field::Millis(|c| &mut c.handshake_timeout),
    ),
    (
        "OPERATION_TIMEOUT_MS",
        Field::Millis(|c| &mut c.operation_timeout),
    ),
    ("FENCE_TIMEOUT_MS", Field::Millis(|c| &mut c.fence_timeout)),
    ("MAX_OP_BYTES", Field::Bytes(|c| &mut c.max_op_bytes)),
    ("MAX_OP_SLICES", Field::Count(|c| &mut c.max_op_slices)),
    (
        "MAX_OPS_IN_FLIGHT",
        Field::Count(|c| &mut c.max_ops_in_flight),
    ),
    ("MAX_QUEUED_OPS", Field::Count(|c| &mut c.max_queued_ops)),
    ("MAX_FRAME_LEN", Field::Count(|c| &mut c.max_frame_len)),
    ("TOMBSTONES", Field::Count(|c| &mut c.tombstones)),
    (
        "PENDING_REQUESTS",
        Field::Count(|c| &mut c.pending_requests),
    ),
    (
        "PROTOCOL_STRIKES",
        Field::Count(|c| &mut c.protocol_strikes),
    ),
    (
        "RECONNECT_INTERVAL_MS",
        Field::Millis(|c| &mut c.reconnect_interval),
    ),
    (
        "RECONNECT_MAX_INTERVAL_MS",
        Field::Millis(|c| &mut c.reconnect_max_interval),
    ),
    (
        "UNREACHABLE_TIMEOUT_MS",
        Field::Millis(|c| &mut c.unreachable_timeout),
    ),
    (
        "PEER_IDLE_TIMEOUT_MS",
        Field::Millis(|c| &mut c.peer_idle_timeout),
    ),
    ("CHECKSUM", Field::Flag(|c| &mut c.checksum)),
    ("ALLOW_NO_TOKEN", Field::Flag(|c| &mut c.allow_no_token)),
];

/// Prefix of every environment variable the core reads.
pub const ENV_PREFIX: &str = "KVFERRY_";

impl Config {
    /// Defaults overridden by every `KVFERRY_*` variable of the process environment.
    pub fn from_env() -> Result<Config, ConfigError> {
        Self::from_vars(std::env::vars())
    }

    /// Defaults overridden by the `KVFERRY_*` pairs of `vars`; other names are ignored.
    pub fn from_vars<I, K, V>(vars: I) -> Result<Config, ConfigError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut config = Config::default();
        for (name, value) in vars {
            let (name, value) = (name.as_ref(), value.as_ref());
            if let Some(key) = name.strip_prefix(ENV_PREFIX) {
                if FIELDS.iter().any(|(k, _)| *k == key) {
                    config.set(key, value).map_err(|reason| ConfigError {
                        name: name.to_owned(),
                        value: value.to_owned(),
                        reason,
                    })?;
                }
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Sets one knob by its name without prefix (`TRANSFER_RETRIES`) or its lower-case form
    /// (`transfer_retries`), as a TOML file would spell it.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), &'static str> {
        let upper = key.to_ascii_uppercase();
        let (_, field) = FIELDS
            .iter()
            .find(|(k, _)| *k == upper)
            .ok_or("unknown configuration key")?;
        if let Field::Flag(f) = field {
            *f(self) = match value.trim().to_ascii_lowercase().as_str() {
                "1" | "true" | "on" | "yes" => true,
                "0" | "false" | "off" | "no" => false,
                _ => return Err("not a switch (1/0, true/false, on/off)"),
            };
            return Ok(());
        }
        let number: u64 = value
            .trim()
            .parse()
            .map_err(|_| "not a non-negative integer")?;
        match field {
            Field::Count(f) => *f(self) = u32::try_from(number).map_err(|_| "too large")?,
            Field::Bytes(f) => *f(self) = number,
            Field::Millis(f) => *f(self) = Duration::from_millis(number),
            Field::Flag(_) => {}
        }
        Ok(())
    }

    /// Names of every knob (without prefix), for documentation and CLI help.
    pub fn keys() -> impl Iterator<Item = &'static str> {
        FIELDS.iter().map(|(k, _)| *k)
    }

    /// Checks the relations between knobs; the error names the offending variable.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: &str, value: String, reason| {
            Err(ConfigError {
                name: format!("{ENV_PREFIX}{key}"),
                value,
                reason,
            })
        };
        let positive_counts = [
            ("TRANSFER_RETRIES", self.transfer_retries),
            ("SESSION_FAILURE_THRESHOLD", self.session_failure_threshold),
            ("HEARTBEAT_MISSES", self.heartbeat_misses),
            ("MAX_OP_SLICES", self.max_op_slices),
            ("MAX_OPS_IN_FLIGHT", self.max_ops_in_flight),
            ("MAX_QUEUED_OPS", self.max_queued_ops),
            ("PROTOCOL_STRIKES", self.protocol_strikes),
        ];
        for (key, v) in positive_counts {
            if v == 0 {
                return bad(key, v.to_string(), "must be at least 1");
            }
        }
        let positive_times = [
            ("PROBE_INTERVAL_MS", self.probe_interval),
            ("HEARTBEAT_INTERVAL_MS", self.heartbeat_interval),
            ("BOOTSTRAP_TIMEOUT_MS", self.bootstrap_timeout),
            ("WAITING_TIMEOUT_MS", self.waiting_timeout),
            ("ABORT_ACK_TIMEOUT_MS", self.abort_ack_timeout),
            ("PROGRESS_INTERVAL_MS", self.progress_interval),
            ("CONNECT_TIMEOUT_MS", self.connect_timeout),
            ("SHUTDOWN_TIMEOUT_MS", self.shutdown_timeout),
            ("DATA_RECONNECT_INTERVAL_MS", self.data_reconnect_interval),
            ("HANDSHAKE_TIMEOUT_MS", self.handshake_timeout),
            ("OPERATION_TIMEOUT_MS", self.operation_timeout),
            ("FENCE_TIMEOUT_MS", self.fence_timeout),
            ("RECONNECT_INTERVAL_MS", self.reconnect_interval),
            ("UNREACHABLE_TIMEOUT_MS", self.unreachable_timeout),
        ];
        for (key, v) in positive_times {
            if v.is_zero() {
                return bad(key, "0".into(), "must be positive");
            }
        }
        // Announced in every hello: a peer refuses values outside these bounds.
        if self.heartbeat_interval < Duration::from_millis(1)
            || self.heartbeat_interval
                > Duration::from_millis(u64::from(crate::codec::MAX_HEARTBEAT_INTERVAL_MS))
        {
            return bad(
                "HEARTBEAT_INTERVAL_MS",
                self.heartbeat_interval.as_millis().to_string(),
                "must be 1 to 600000 ms",
            );
        }
        if self.heartbeat_misses > crate::codec::MAX_HEARTBEAT_MISSES {
            return bad(
                "HEARTBEAT_MISSES",
                self.heartbeat_misses.to_string(),
                "must be at most 10000",
            );
        }
        if self.probe_max_interval < self.probe_interval {
            return bad(
                "PROBE_MAX_INTERVAL_MS",
                self.probe_max_interval.as_millis().to_string(),
                "must not be below KVFERRY_PROBE_INTERVAL_MS",
            );
        }
        if self.silence_timeout <= self.heartbeat_interval {
            return bad(
                "SILENCE_TIMEOUT_MS",
                self.silence_timeout.as_millis().to_string(),
                "must be above KVFERRY_HEARTBEAT_INTERVAL_MS (a healthy peer is never that silent)",
            );
        }
        if self.max_op_bytes == 0 {
            return bad("MAX_OP_BYTES", "0".into(), "must be at least 1");
        }
        if self.max_frame_len < 256 {
            return bad(
                "MAX_FRAME_LEN",
                self.max_frame_len.to_string(),
                "must be at least 256",
            );
        }
        // Over RDMA each operation's checksum names every slice in one `OpChecksum` frame.
        if self.checksum && self.max_op_slices as usize > crate::codec::MAX_CHECKED_RANGES {
            return bad(
                "MAX_OP_SLICES",
                self.max_op_slices.to_string(),
                "must be at most 4096 with KVFERRY_CHECKSUM (one operation's checksum names every slice)",
            );
        }
        if self.checksum && (self.max_frame_len as usize) < crate::codec::MAX_OP_CHECKSUM_FRAME {
            return bad(
                "MAX_FRAME_LEN",
                self.max_frame_len.to_string(),
                "must be at least 131100 with KVFERRY_CHECKSUM (the largest operation checksum frame)",
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod doc_tests {
    use super::*;

    /// `docs/PROTOCOL.md`'s timeout table lists every deadline with its variable and default,
    /// so the doc cannot drift from the code.
    #[test]
    fn every_deadline_is_in_the_protocol_docs_timeout_table_with_its_default() {
        let doc = include_str!("../../docs/PROTOCOL.md");
        let table = &doc[doc.find("## Timeouts").expect("a Timeouts section")..];
        let mut defaults = Config::default();
        for (name, field) in FIELDS {
            let Field::Millis(get) = field else { continue };
            let ms = get(&mut defaults).as_millis();
            let shown = if ms % 1000 == 0 {
                format!("{} s", ms / 1000)
            } else {
                format!("{ms} ms")
            };
            let row = format!("| {shown} | `KVFERRY_{name}` |");
            assert!(
                table.contains(&row),
                "no row {row:?} in PROTOCOL.md's timeouts"
            );
        }
        assert!(table.contains("| 30 | `KVFERRY_HEARTBEAT_MISSES` |"));
    }
}
