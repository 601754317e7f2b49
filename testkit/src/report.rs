//! What a run saw: rooms by outcome, bytes checked, latencies, the nodes' counters.

use kvferry_core::FailureReason;
use std::collections::BTreeMap;

/// The outcome of a decode run: exactly the fields of `--json`.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// The runtime that ran the nodes (`tokio`, `glommio`, or `prefill/decode` when mixed).
    pub runtime: String,
    /// The data-plane backend (`tcp`).
    pub backend: String,
    /// The data paths the prefill's sessions took (`tcp`, `tcp_staged`, `rdma`,
    /// `rdma_dmabuf`, `cma`; several joined by `+`).
    pub prefill_path: String,
    /// The data paths the decode's sessions took.
    pub decode_path: String,
    /// Rooms requested.
    pub rooms_total: u64,
    /// Rooms that reached Success.
    pub rooms_succeeded: u64,
    /// Rooms that reached Failed.
    pub rooms_failed: u64,
    /// Failed rooms by reason.
    pub failed_by_reason: BTreeMap<String, u64>,
    /// Rooms with no terminal state when the run ended.
    pub rooms_unfinished: u64,
    /// Rooms the node refused to open, by the embedder-API error (`room_exists`, ...).
    pub refused_by_error: BTreeMap<String, u64>,
    /// Rooms never opened because the node shut down first (SIGINT or SIGTERM mid-run).
    pub rooms_not_opened: u64,
    /// Bytes that landed in successful rooms and were verified (pages and aux rows that held
    /// exactly what prefill wrote).
    pub bytes_transferred: u64,
    /// Wall time of the run.
    pub elapsed_s: f64,
    /// Payload GB/s.
    pub throughput_gbps: f64,
    /// Room latency percentiles in milliseconds: p50, p99, max.
    pub latency_ms: (f64, f64, f64),
    /// Operation attempts retried.
    pub retries: u64,
    /// Sessions blacklisted.
    pub sessions_blacklisted: u64,
    /// Sessions recovered by a probe.
    pub sessions_recovered: u64,
    /// Pages of successful rooms whose bytes were checked.
    pub pages_verified: u64,
    /// Of those, pages whose bytes were wrong (never more than `pages_verified`).
    pub pages_corrupted: u64,
    /// Aux rows of successful rooms checked.
    pub aux_verified: u64,
    /// Of those, aux rows that held the wrong bytes.
    pub aux_corrupted: u64,
    /// Free pages checked before reuse.
    pub free_pages_checked: u64,
    /// Of those, free pages something wrote into (a stray write).
    pub free_pages_written: u64,
}

impl Report {
    /// The `--json` object.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "runtime": self.runtime,
            "backend": self.backend,
            "prefill_path": self.prefill_path,
            "decode_path": self.decode_path,
            "rooms_total": self.rooms_total,
            "rooms_succeeded": self.rooms_succeeded,
            "rooms_failed": self.rooms_failed,
            "failed_by_reason": self.failed_by_reason,
            "rooms_unfinished": self.rooms_unfinished,
            "refused_by_error": self.refused_by_error,
            "rooms_not_opened": self.rooms_not_opened,
            "bytes_transferred": self.bytes_transferred,
            "elapsed_s": self.elapsed_s,
            "throughput_gbps": self.throughput_gbps,
            "latency_ms": { "p50": self.latency_ms.0, "p99": self.latency_ms.1, "max": self.latency_ms.2 },
            "retries": self.retries,
            "sessions_blacklisted": self.sessions_blacklisted,
            "sessions_recovered": self.sessions_recovered,
            "pages_verified": self.pages_verified,
            "pages_corrupted": self.pages_corrupted,
            "aux_verified": self.aux_verified,
            "aux_corrupted": self.aux_corrupted,
            "free_pages_checked": self.free_pages_checked,
            "free_pages_written": self.free_pages_written,
        })
    }

    /// Whether anything checked held the wrong bytes: the run must not pass.
    pub fn corrupted(&self) -> bool {
        self.pages_corrupted + self.aux_corrupted + self.free_pages_written > 0
    }

    /// The human-readable table.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let row = |s: &mut String, k: &str, v: String| s.push_str(&format!("  {k:<22} {v}\n"));
        row(&mut s, "runtime", self.runtime.clone());
        row(&mut s, "backend", self.backend.clone());
        row(
            &mut s,
            "data path",
            match self.prefill_path.as_str() {
                // A decode run against a prefill in another process.
                "" => format!("decode {}", self.decode_path),
                prefill => format!("prefill {prefill}, decode {}", self.decode_path),
            },
        );
        row(
            &mut s,
            "rooms",
            format!(
                "{} total, {} succeeded, {} failed, {} unfinished",
                self.rooms_total, self.rooms_succeeded, self.rooms_failed, self.rooms_unfinished
            ),
        );
        for (reason, n) in &self.failed_by_reason {
            let why = FailureReason::ALL
                .iter()
                .find(|r| r.as_str() == reason)
                .map(|r| r.explain())
                .unwrap_or("");
            row(
                &mut s,
                &format!("  failed: {reason}"),
                format!("{n}  ({why})"),
            );
        }
        for (error, n) in &self.refused_by_error {
            row(&mut s, &format!("  refused: {error}"), n.to_string());
        }
        if self.rooms_not_opened > 0 {
            row(
                &mut s,
                "  not opened",
                format!("{}  (the node shut down first)", self.rooms_not_opened),
            );
        }
        row(
            &mut s,
            "bytes transferred",
            format!(
                "{} ({:.2} GiB)",
                self.bytes_transferred,
                self.bytes_transferred as f64 / (1u64 << 30) as f64
            ),
        );
        row(&mut s, "elapsed", format!("{:.3} s", self.elapsed_s));
        row(
            &mut s,
            "throughput",
            format!("{:.3} GB/s", self.throughput_gbps),
        );
        row(
            &mut s,
            "room latency",
            format!(
                "p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
                self.latency_ms.0, self.latency_ms.1, self.latency_ms.2
            ),
        );
        row(&mut s, "retries", self.retries.to_string());
        row(
            &mut s,
            "sessions",
            format!(
                "{} blacklisted, {} recovered",
                self.sessions_blacklisted, self.sessions_recovered
            ),
        );
        for (error, n) in &self.refused_by_error {
            row(&mut s, &format!("  refused: {error}"), n.to_string());
        }
        row(
            &mut s,
            "pages",
            format!(
                "{} verified, {} corrupted",
                self.pages_verified, self.pages_corrupted
            ),
        );
        row(
            &mut s,
            "aux rows",
            format!(
                "{} verified, {} corrupted",
                self.aux_verified, self.aux_corrupted
            ),
        );
        row(
            &mut s,
            "free pages",
            format!(
                "{} checked, {} written to",
                self.free_pages_checked, self.free_pages_written
            ),
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::Report;

    #[test]
    fn a_decode_run_against_a_remote_prefill_names_only_its_own_data_path() {
        let report = Report {
            decode_path: "rdma".to_owned(),
            ..Report::default()
        };
        assert!(report
            .table()
            .contains("data path              decode rdma\n"));
        let pair = Report {
            prefill_path: "tcp_staged".to_owned(),
            decode_path: "tcp".to_owned(),
            ..Report::default()
        };
        assert!(pair
            .table()
            .contains("data path              prefill tcp_staged, decode tcp\n"));
    }
}
