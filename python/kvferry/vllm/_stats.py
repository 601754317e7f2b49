"""What the connector's rooms did, as vLLM collects connector stats and serves them on /metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)


@dataclass
class KvferryStats(KVConnectorStats):
    """What the connector's rooms did since the last report, as vLLM collects connector
    stats: rooms that landed (decode) or were sent (prefill), rooms that failed by their
    kvferry reason, bytes of the blocks moved, and each landed room's transfer time. Plain
    data, so vLLM carries it from the workers to its loggers."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"succeeded": 0, "failed": 0, "failed_by_reason": {}, "bytes": 0, "transfer_seconds": []}

    def record_success(self, nbytes: int, seconds: Optional[float]) -> None:
        self.data["succeeded"] += 1
        self.data["bytes"] += nbytes
        if seconds is not None:
            self.data["transfer_seconds"].append(seconds)

    def record_failure(self, reason: str) -> None:
        self.data["failed"] += 1
        reasons = self.data["failed_by_reason"]
        reasons[reason] = reasons.get(reason, 0) + 1

    def aggregate(self, other: KVConnectorStats) -> "KvferryStats":
        if other.is_empty():
            return self
        theirs = other.data
        self.data["succeeded"] += theirs.get("succeeded", 0)
        self.data["failed"] += theirs.get("failed", 0)
        self.data["bytes"] += theirs.get("bytes", 0)
        self.data["transfer_seconds"].extend(theirs.get("transfer_seconds", []))
        reasons = self.data["failed_by_reason"]
        for reason, n in theirs.get("failed_by_reason", {}).items():
            reasons[reason] = reasons.get(reason, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        seconds = d["transfer_seconds"]
        out: dict[str, int | float] = {
            "kvferry_rooms_succeeded": d["succeeded"],
            "kvferry_rooms_failed": d["failed"],
            "kvferry_bytes": d["bytes"],
            "kvferry_transfer_ms_avg": round(1000 * sum(seconds) / len(seconds), 3) if seconds else 0.0,
        }
        for reason, n in sorted(d["failed_by_reason"].items()):
            out[f"kvferry_failed_{reason}"] = n
        return out

    def is_empty(self) -> bool:
        return self.data.get("succeeded", 0) + self.data.get("failed", 0) == 0


class KvferryPromMetrics(KVConnectorPromMetrics):
    """The connector's figures on vLLM's ``/metrics``, per engine:
    ``vllm:kvferry_rooms_succeeded_total``, ``vllm:kvferry_rooms_failed_total{reason}``,
    ``vllm:kvferry_bytes_total`` and ``vllm:kvferry_transfer_time_seconds``."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        labels = list(labelnames)
        self._succeeded = create_metric_per_engine(
            self._counter_cls(
                name="vllm:kvferry_rooms_succeeded",
                documentation="kvferry rooms whose KV landed (decode) or was sent (prefill).",
                labelnames=labels,
            ),
            per_engine_labelvalues,
        )
        self._failed = self._counter_cls(
            name="vllm:kvferry_rooms_failed",
            documentation="kvferry rooms that failed, by kvferry's failure reason.",
            labelnames=labels + ["reason"],
        )
        self._bytes = create_metric_per_engine(
            self._counter_cls(
                name="vllm:kvferry_bytes",
                documentation="Bytes of the KV blocks kvferry rooms moved.",
                labelnames=labels,
            ),
            per_engine_labelvalues,
        )
        self._seconds = create_metric_per_engine(
            self._histogram_cls(
                name="vllm:kvferry_transfer_time_seconds",
                documentation="From a kvferry room's opening on the decode to its KV landed.",
                buckets=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
                labelnames=labels,
            ),
            per_engine_labelvalues,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._succeeded[engine_idx].inc(transfer_stats_data.get("succeeded", 0))
        self._bytes[engine_idx].inc(transfer_stats_data.get("bytes", 0))
        for seconds in transfer_stats_data.get("transfer_seconds", []):
            self._seconds[engine_idx].observe(seconds)
        labels = self.per_engine_labelvalues[engine_idx]
        for reason, n in transfer_stats_data.get("failed_by_reason", {}).items():
            self._failed.labels(*labels, reason).inc(n)
