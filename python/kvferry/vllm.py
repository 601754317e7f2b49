"""kvferry as a vLLM KV connector (vLLM 0.32.0, the version ``python/README.md`` pins).

Selected with two config fields::

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
                           "kv_connector_module_path": "kvferry.vllm",
                           "kv_role": "kv_producer" | "kv_consumer",
                           "kv_load_failure_policy": "recompute"}'

One vLLM request is one kvferry room. The prefill (producer) computes the prompt, keeps its
blocks when the request finishes and returns, in the response's ``kv_transfer_params``, where
to reach its workers' kvferry nodes (one per TP rank) and the room's id. At TP > 1 each
decode rank loads its part from the prefill rank of the same index, under the same room id;
vLLM counts a request loaded only once every rank reported it, and failed if any rank did. The decode (consumer) allocates blocks
for the prompt tokens it does not hold, opens the room as receiver over those blocks and
waits; the prefill's worker sends the tail of its blocks that the decode granted, and frees
them only once kvferry says no write of the room can land any more. A room that fails is
reported as a failed load (vLLM recomputes or fails the request, as its
``kv_load_failure_policy`` says) with kvferry's reason in the log; it never hangs.

This module is imported by every vLLM process (the API server included) when the config is
built: it imports nothing heavy until a connector is constructed.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import hashlib
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from kvferry._addrs import socket_addr as _socket_addr
from kvferry._vllm_groups import KvGroups, NullBlockInRoom

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

logger = logging.getLogger("kvferry.vllm")

#: The vLLM version this connector is written and tested against.
VLLM_VERSION = "0.32.0"

# Keys of the kv_transfer_params the prefill returns (and the decode reads).
_ROOM = "kvferry_room"
_ADDRS = "kvferry_addrs"
_SHAPE = "kvferry_shape"
_DONE = "kvferry_consumed"
_PUSH = "kvferry_push"
_PROMPT = "kvferry_prompt"
#: The prefill's pipeline stages: ``kvferry_addrs`` names PP x TP listeners, stage-major.
_PP = "kvferry_pp"
#: Room ids a router draws for push mode carry this bit; a prefill's own (pull) ids do not.
PUSH_BIT = 1 << 62

#: The listener port of TP rank r of DP engine d is ``port + d * TP + r``
#: (``kv_connector_extra_config``).
DEFAULT_PORT = 14600
#: How long a prefill keeps a finished request's blocks for a decode that never asks.
DEFAULT_LEASE_S = 120.0


#: A pull room id's low 32 bits: a counter, then its tag (see ``_room_tag``).
_COUNTER_BITS = 20
_TAG_BITS = 12
#: How long a prefill's worker waits for the request of a room it was asked for but does not
#: know yet (its id checks out: the room is in the step on its way), and how long it
#: remembers rooms whose lease ran out (to refuse asks for them at once).
_ASK_GRACE_S = 10.0
_EXPIRED_KEPT = 4096


def _room_tag(key: bytes, count: int) -> int:
    """The tag of a pull room's counter: only this engine's scheduler and worker know it."""
    mac = hmac.new(key, count.to_bytes(4, "little"), hashlib.sha256).digest()
    return int.from_bytes(mac[:2], "little") & ((1 << _TAG_BITS) - 1)


#: Addresses one room's params may name: a prefill's TP ranks, rank ``r``'s listener at index
#: ``r``.
_MAX_ADDRS = 64


@dataclass(frozen=True)
class _Pulled:
    """The kvferry part of a decode request's ``kv_transfer_params``, checked: a room id
    kvferry can carry and the prefill's listener addresses."""

    room: int
    addrs: list[str]


def _params_of(request) -> Optional[dict]:
    """A request's ``kv_transfer_params`` if they are a mapping; anything else is as none
    (a router's garbage never reaches a ``.get``)."""
    params = request.kv_transfer_params
    if params is not None and not isinstance(params, dict):
        logger.error("kvferry: request %s: kv_transfer_params are not a mapping (%s); ignored",
                     request.request_id, type(params).__name__)
        return None
    return params


def _room_id(value: Any) -> Optional[int]:
    """``value`` if it is a room id kvferry can carry (an integer in 1..2^64-1), else None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 64:
        return None
    return value


def _pulled(params: Any) -> tuple[Optional[_Pulled], Optional[str]]:
    """Parses the room and addresses of ``params`` once, where they enter: the value, or
    why it cannot be loaded from (never an exception, whatever a router sent)."""
    if not isinstance(params, dict):
        return None, f"kv_transfer_params are not a mapping ({type(params).__name__})"
    room, addrs = _room_id(params.get(_ROOM)), params.get(_ADDRS)
    if room is None:
        return None, f"{_ROOM}={params.get(_ROOM)!r} is not a room id (an integer in 1..2^64-1)"
    if bool(room & PUSH_BIT) != bool(params.get(_PUSH)):
        # A prefill's own ids never carry the push bit and a router's push ids always do: a
        # pull for a push id would wait out the prefill's lease for a push that never comes.
        kind = "push" if params.get(_PUSH) else "pull"
        return None, f"{_ROOM}={room} is not a {kind} room id (bit 62 is set only in push rooms)"
    if (not isinstance(addrs, (list, tuple)) or not 0 < len(addrs) <= _MAX_ADDRS
            or not all(_socket_addr(a) for a in addrs)):
        return None, f"{_ROOM}={room}: {_ADDRS}={addrs!r} is not a list of 1..{_MAX_ADDRS} ip:port strings"
    return _Pulled(room=room, addrs=list(addrs)), None


def _stages(params: dict) -> int:
    """The prefill's pipeline stages its params name (1 when they name none)."""
    pp = params.get(_PP, 1)
    return pp if isinstance(pp, int) and not isinstance(pp, bool) and pp > 0 else 1


def _stages_refusal(params: dict, pulled: "_Pulled") -> Optional[str]:
    """Why ``kvferry_pp`` does not split the room's listeners into equal stages, or None."""
    pp = params.get(_PP, 1)
    if isinstance(pp, bool) or not isinstance(pp, int) or not 0 < pp <= len(pulled.addrs):
        return f"{_PP}={pp!r} is not a stage count (1..{len(pulled.addrs)})"
    if len(pulled.addrs) % pp:
        return f"{_PP}={pp} does not split {len(pulled.addrs)} listeners in {_ADDRS} into equal stages"
    return None


def _prompt_of(request) -> Optional[int]:
    """The prompt digest of ``request``'s prompt token ids: both sides name it, so a room
    handed to another prompt's request is refused (``prompt_mismatch``) instead of loaded.
    None (nothing checked) for a prompt given without token ids."""
    tokens = request.prompt_token_ids
    if tokens is None:
        return None
    import kvferry

    try:
        return kvferry.prompt_digest(tokens)
    except (kvferry.KvferryError, OverflowError, TypeError) as e:
        logger.warning("kvferry: request %s: its prompt has no digest (%s); its room is not bound to it",
                       request.request_id, e)
        return None


def _follow_vllm_logging() -> None:
    """Writes kvferry's log lines where and as vLLM writes its own (vLLM configures only its
    ``vllm`` logger, so an info line of another logger would never reach its log), unless the
    embedder configured kvferry's logging itself."""
    ours, theirs = logging.getLogger("kvferry"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())


def _extra(vllm_config) -> dict:
    return dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})


def _local_ip() -> str:
    """The address decode reaches this host on (the one that routes outward)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


def tp_rank(vllm_config) -> int:
    """This worker's TP rank: vLLM's tensor-parallel group where it is set up, else the rank
    vLLM's worker wrote into the config (``rank % TP``: PP is 1 here)."""
    try:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            model_parallel_is_initialized,
        )

        if model_parallel_is_initialized():
            return int(get_tensor_model_parallel_rank())
    except ImportError:
        pass
    parallel = vllm_config.parallel_config
    return int(parallel.rank) % int(parallel.tensor_parallel_size)


def rank_heads(total: int, tp: int, rank: int) -> tuple[int, int]:
    """``(first, count)`` of the model's ``total`` KV heads that TP rank ``rank`` of ``tp``
    holds, as vLLM places them: an equal share each, or, with more ranks than heads, one head
    per rank, each head on ``tp / total`` consecutive ranks."""
    if tp <= total:
        return rank * (total // tp), total // tp
    return rank // (tp // total), 1


def tp_pair_refusal(prefill_tp: int, decode_tp: int, total: int, mla: bool = False) -> Optional[str]:
    """Why a decode at ``decode_tp`` cannot load from a prefill at ``prefill_tp`` (a model of
    ``total`` KV heads), or None: equal sizes always pair rank to rank; different ones pair
    by heads where each side splits the heads evenly and no prefill head is replicated. MLA's
    latent KV is whole on every rank: any pair where the decode's size is a multiple of the
    prefill's, or smaller."""
    if prefill_tp == decode_tp:
        return None
    why = None
    if mla:
        if decode_tp > prefill_tp and decode_tp % prefill_tp:
            why = "MLA: the decode's TP is not a multiple of the prefill's"
    elif not total:
        why = "the model names no KV head count"
    elif prefill_tp > total:
        why = f"the prefill replicates KV heads ({total} heads on {prefill_tp} ranks), not served yet"
    elif total % prefill_tp or (total % decode_tp and decode_tp % total):
        why = f"{total} KV heads do not split evenly over both"
    if why is None:
        return None
    return f"the prefill runs TP {prefill_tp} ({_ADDRS} names {prefill_tp} ranks), this decode TP {decode_tp}: {why}"


def tp_sources(prefill_tp: int, decode_tp: int, total: int, rank: int,
               mla: bool = False) -> tuple[list[int], int, list[int]]:
    """The prefill ranks decode rank ``rank`` names in its room (those holding any of its
    heads; rank to rank at equal sizes), how many decode ranks each of them sends to, and the
    positions among them of idle sources (they only confirm). MLA: rank ``rank % prefill_tp``
    sends the latent KV, and each prefill rank no decode rank loads from is an idle source of
    decode rank ``p % decode_tp``, so that every prefill rank hears of the room."""
    if prefill_tp == decode_tp:
        return [rank], 1, []
    if mla:
        idle = [p for p in range(decode_tp, prefill_tp) if p % decode_tp == rank]
        receivers = decode_tp // prefill_tp if decode_tp > prefill_tp else 1
        return [rank % prefill_tp] + idle, receivers, list(range(1, 1 + len(idle)))
    first, count = rank_heads(total, decode_tp, rank)
    per = total // prefill_tp
    sources = list(range(first // per, (first + count - 1) // per + 1))
    # Decode ranks holding heads of the first source (every source serves as many).
    lo, hi = sources[0] * per, sources[0] * per + per
    receivers = sum(1 for r in range(decode_tp)
                    if (lambda f, c: f < hi and f + c > lo)(*rank_heads(total, decode_tp, r)))
    return sources, receivers, []


def kv_heads(kv_caches: dict, num_blocks: int, block_size: int, total: int, tp: int,
             rank: int) -> Optional[tuple[int, int, int, int]]:
    """The heads this rank's KV blocks hold, as kvferry's ``heads`` (total, first, count,
    bytes of one head in a token row), from vLLM's layouts: ``[blocks, heads, block_size,
    2 * head_size]`` (the CPU backend: each head's rows contiguous, so one "row" per block of
    ``heads`` parts) or ``[2, blocks, block_size, heads, head_size]`` (token rows of heads).
    None where the layout is neither (such a rank moves whole blocks: equal TP sizes only)."""
    first, count = rank_heads(total, tp, rank)
    t = next(iter(kv_caches.values()))
    dims, elem = tuple(t.shape), t.element_size()
    if len(dims) == 4 and dims[0] == num_blocks and dims[1] == count and dims[2] == block_size:
        return total, first, count, block_size * dims[3] * elem
    if len(dims) == 5 and dims[:2] == (2, num_blocks) and dims[2] == block_size and dims[3] == count:
        return total, first, count, dims[4] * elem
    return None


def _mixed(prompt: Optional[int], label: bytes, what: bytes) -> Optional[int]:
    """A prompt digest mixed with ``what`` under ``label``: a room bound to it is refused
    (``prompt_mismatch``) by a side whose ``what`` differs. None stays None."""
    if prompt is None:
        return None
    mixed = hashlib.sha256(label + prompt.to_bytes(8, "little") + what)
    return int.from_bytes(mixed.digest()[:8], "little")


def _rank_bound(prompt: Optional[int], rank: int) -> Optional[int]:
    """The digest a room of prefill rank ``rank`` is bound to: the prompt's and the rank's,
    so that a decode rank handed another rank's listener (a router that reordered
    ``kvferry_addrs``) is refused (``prompt_mismatch``) instead of loading other heads."""
    return _mixed(prompt, b"kvferry/vllm rank", rank.to_bytes(4, "little"))


def pp_rank(vllm_config) -> int:
    """This worker's pipeline stage: vLLM's pipeline group where it is set up, else from the
    rank vLLM's worker wrote into the config (``rank // TP``)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, model_parallel_is_initialized

        if model_parallel_is_initialized():
            return int(get_pp_group().rank_in_group)
    except ImportError:
        pass
    parallel = vllm_config.parallel_config
    return int(parallel.rank) // int(parallel.tensor_parallel_size) % int(parallel.pipeline_parallel_size)


def stage_layers(names) -> Optional[tuple[int, int]]:
    """``(first, end)`` of the model layers a pipeline stage's KV cache names cover
    (``model.layers.N...``), or None where a name carries no layer number or the numbers
    are not one run."""
    import re

    matches = [re.search(r"(?:^|\.)layers\.(\d+)\.", n) for n in names]
    if not matches or not all(matches):
        return None
    found = sorted({int(m.group(1)) for m in matches})
    if found != list(range(found[0], found[-1] + 1)):
        return None
    return found[0], found[-1] + 1


def _plus(addr: str, n: int) -> str:
    """``host:port`` with ``n`` added to the port."""
    host, _, port = addr.rpartition(":")
    return f"{host}:{int(port) + n}"


def kv_shape(vllm_config) -> dict:
    """What both sides must agree on for a block to mean the same bytes: vLLM's block size,
    the KV dtype, the model's KV head count and head size, and the layer count."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    dtype = cache.cache_dtype
    if dtype == "auto":
        dtype = str(model.dtype).replace("torch.", "")
    return {
        "block_size": int(cache.block_size),
        "kv_dtype": str(dtype),
        "num_kv_heads": int(model.get_total_num_kv_heads()),
        "head_size": int(model.get_head_size()),
        "num_layers": int(model.get_total_num_hidden_layers()),
    }


def shape_mismatch(ours: dict, theirs: Any) -> Optional[str]:
    """``None`` when the prefill's block shape is ours, else what differs with both values."""
    if not isinstance(theirs, dict):
        return f"the prefill sent no block shape ({_SHAPE}: {theirs!r})"
    # Every key either side names: a prefill of hybrid groups and a decode of one group
    # differ as much as the other way round.
    keys = list(ours) + [k for k in theirs if k not in ours]
    diffs = [
        f"{key}: prefill {theirs.get(key)!r}, decode {ours.get(key)!r}"
        for key in keys
        if theirs.get(key) != ours.get(key)
    ]
    return "; ".join(diffs) or None


@dataclass
class _Send:
    """A finished prefill request whose blocks wait for its decode."""

    room: int
    blocks: list[int]
    deadline: float
    #: The prompt digest of the tokens the blocks hold.
    prompt: Optional[int] = None


@dataclass
class _PushStep:
    """A push-mode prefill request in one step: its room, the blocks of the prompt computed
    by the end of this step (in prompt order), how many the prompt has in all."""

    room: int
    computed: list[int]
    total: int
    prompt: Optional[int] = None


@dataclass
class _Pushed:
    """A push-mode room on the prefill worker."""

    req_id: str
    total: int
    prompt: Optional[int] = None
    #: Blocks complete once the current step's forward pass ends.
    computed: list[int] = field(default_factory=list)
    #: Blocks complete now (every layer written): what may go out whole.
    safe: list[int] = field(default_factory=list)
    granted: Optional[int] = None
    opened: bool = False
    sent: int = 0
    failed: bool = False


@dataclass
class _Recv:
    """A decode request whose blocks a prefill fills."""

    room: int
    addrs: list[str]
    blocks: list[int]
    refused: Optional[str] = None
    #: The prompt digest of the tokens this request wants the KV of.
    prompt: Optional[int] = None
    logged: bool = False
    opened: bool = False
    #: When the room opened here (``time.monotonic()``), for its transfer time.
    opened_at: Optional[float] = None
    #: The prefill's pipeline stages (``addrs`` holds stages x its TP, stage-major).
    stages: int = 1


@dataclass
class KvferryMetadata(KVConnectorMetadata):
    """What one scheduler step tells the workers."""

    sends: dict[str, _Send] = field(default_factory=dict)
    recvs: dict[str, _Recv] = field(default_factory=dict)
    #: Decode requests that ended (abort, error) while their room was open.
    aborts: set[str] = field(default_factory=set)
    #: Decode: rooms of pulled prompts this decode will never load (request ended first,
    #: block shape refused), with the reason: each is opened without pages and failed with
    #: it (counted under it), so its prefill frees the blocks at once instead of at the end
    #: of its lease.
    releases: list[tuple[int, list[str], int, str]] = field(default_factory=list)
    #: Push-mode prefill requests scheduled this step.
    pushes: dict[str, _PushStep] = field(default_factory=dict)
    #: Push-mode prefill requests that ended without their prompt computed (abort).
    push_aborts: set[int] = field(default_factory=set)
    #: Push-mode rooms whose prefill request vLLM preempted this step (its blocks are
    #: already free in the scheduler and are overwritten from this step on).
    push_preempted: set[int] = field(default_factory=set)


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


class KvferryConnector(KVConnectorBase_V1, SupportsHMA):
    """kvferry's vLLM connector: the scheduler half decides which requests move and which
    blocks they use; the worker half runs a kvferry node over vLLM's KV tensors. With vLLM's
    hybrid KV cache manager on, every full-attention and sliding-window group moves with the
    request (``KvGroups``)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        _follow_vllm_logging()
        self._config = vllm_config
        self._extra = _extra(vllm_config)
        self._shape = kv_shape(vllm_config)
        #: The KV cache groups a request's blocks move in, and the order of a room's pages.
        self._groups = KvGroups.of(kv_cache_config, self._shape["block_size"])
        if self._groups.hybrid:
            # A prefill whose groups differ is refused naming both (``shape_mismatch``).
            self._shape["kv_groups"] = self._groups.signature()
        # Block ids are unique only within a group: with several, vLLM's scheduler takes a
        # failed load by request only (it raises on block ids).
        self._blocks_name_loads = kv_cache_config is None or len(kv_cache_config.kv_cache_groups) == 1
        #: MLA: every rank holds the whole latent KV (no head split).
        self._mla = bool(getattr(vllm_config.model_config, "use_mla", False))
        parallel = vllm_config.parallel_config
        #: This engine's TP size and pipeline stages: one kvferry node per worker, the worker
        #: of stage s and TP rank r listening on port + DP index x PP x TP + s x TP + r, so the
        #: DP engines of one host never share a port.
        self._tp = int(parallel.tensor_parallel_size)
        self._pp = int(parallel.pipeline_parallel_size)
        self._producer = vllm_config.kv_transfer_config.is_kv_producer
        self._consumer = vllm_config.kv_transfer_config.is_kv_consumer
        if self._pp != 1 and not self._producer:
            raise ValueError(
                "kvferry.vllm serves pipeline-parallel prefills, not decodes "
                f"(this consumer: PP {self._pp}); run the decode at PP 1"
            )
        if self._pp != 1 and self._groups.hybrid:
            raise ValueError(
                f"kvferry.vllm serves hybrid KV cache groups ({self._groups.signature()}) at PP 1 "
                f"only (this engine: PP {self._pp})"
            )
        dp_index = int(getattr(parallel, "data_parallel_index", 0) or 0)
        self._port = int(self._extra.get("port", DEFAULT_PORT)) + dp_index * self._pp * self._tp
        host = str(self._extra.get("host") or _local_ip())
        self._advertised = [f"{host}:{self._port + r}" for r in range(self._pp * self._tp)]
        # The listener binds the address decode dials unless told otherwise: a wildcard
        # listener needs a cluster token (KVFERRY_TOKEN), which kvferry enforces.
        self._listen_host = str(self._extra.get("listen_host", host))
        self._lease = float(self._extra.get("lease_s", DEFAULT_LEASE_S))
        # Room ids: a prefix drawn from this engine's id (a new one at every start, the
        # same in its scheduler and worker processes) above 32 random bits, so a restarted
        # prefill never reuses an id its previous life handed out, and its worker knows at
        # once an ask for a room of a previous life.
        engine_id = str(vllm_config.kv_transfer_config.engine_id or secrets.token_hex(16))
        digest = hashlib.sha256(engine_id.encode()).digest()
        self._room_prefix = int.from_bytes(digest[:4], "little") & 0x3FFF_FFFF
        # Below the prefix, a counter and a tag only this engine's halves can make: its worker
        # refuses an ask for an id it never handed out at once, without waiting for a step.
        self._room_key = hashlib.sha256(b"kvferry/vllm room tag" + engine_id.encode()).digest()
        self._room_counter = secrets.randbits(_COUNTER_BITS)
        # Scheduler state, per step.
        self._pending = KvferryMetadata()
        self._loading: dict[str, int] = {}
        # Push-mode prefill requests: room, prompt blocks in all, the request and its prompt
        # digest, by request.
        self._pushing: dict[str, tuple[int, int, Any, Optional[int]]] = {}
        self._preempted: set[str] = set()
        self._worker: Optional[_Worker] = None

    # ---- scheduler side -------------------------------------------------------------

    def _next_room(self) -> int:
        # A counter, unique among the rooms one lease can hold, and its tag: an id a decode
        # got wrong names another live room only if its tag also checks (1 in 4096).
        while True:
            count = self._room_counter
            self._room_counter = (count + 1) & ((1 << _COUNTER_BITS) - 1)
            low = (count << _TAG_BITS) | _room_tag(self._room_key, count)
            if low:
                return (self._room_prefix << 32) | low

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        params = _params_of(request)
        if not self._consumer or not params or not params.get("do_remote_prefill"):
            return 0, False
        if params.get(_DONE):
            return 0, False
        count = len(request.prompt_token_ids or []) - num_computed_tokens
        if count <= 0:
            return 0, False
        return count, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        params = _params_of(request)
        if self._producer and params and params.get("do_remote_decode") and params.get(_PUSH):
            if request.request_id in self._preempted:
                return
            room = _room_id(params.get(_ROOM))
            if room is not None and room & PUSH_BIT:
                total = self._groups.count(len(request.prompt_token_ids or []))
                self._pushing.setdefault(request.request_id, (room, total, request, self._bound(_prompt_of(request))))
            else:
                logger.error("kvferry: push request %s has no router room (%s=%r)",
                             request.request_id, _ROOM, params.get(_ROOM))
            return
        if not self._consumer or not params or not params.get("do_remote_prefill"):
            return
        if params.get(_DONE) or num_external_tokens <= 0:
            return
        # One transfer per request, even after a preemption or a failed load (which then
        # recomputes).
        params[_DONE] = True
        tokens = len(request.prompt_token_ids or [])
        # The blocks this decode holds itself (a local prefix hit) are the prompt's first.
        held = (tokens - num_external_tokens) // self._shape["block_size"]
        block_ids: list[int] = []
        try:
            block_ids = self._groups.pages(blocks.get_block_ids(), tokens, first=held)
        except NullBlockInRoom as e:
            held_refusal: Optional[str] = f"this decode's blocks for the room: {e}"
        else:
            held_refusal = None
        # A router's push room comes before the prefill has said anything: the block shape
        # is checked by kvferry's handshake (layers and block bytes) instead.
        pulled, refused = _pulled(params)
        if refused is None:
            refused = held_refusal
        if refused is None:
            refused = _stages_refusal(params, pulled)
        if refused is None:
            refused = tp_pair_refusal(len(pulled.addrs) // _stages(params), self._tp,
                                      self._shape["num_kv_heads"], self._mla)
        if refused is None and not params.get(_PUSH):
            refused = shape_mismatch(self._shape, params.get(_SHAPE))
        if refused is not None:
            logger.error(
                "kvferry: request %s cannot load its KV from the prefill: %s",
                request.request_id,
                refused,
            )
            if pulled is not None and not params.get(_PUSH):
                # The prefill holds the prompt's blocks for this room: let it go now (where
                # the two nodes' layouts differ, kvferry's handshake refuses even that, and
                # the prefill frees them at the end of its lease).
                self._pending.releases.append((pulled.room, pulled.addrs, _stages(params), "incompatible_peer"))
            pulled = None
        self._pending.recvs[request.request_id] = _Recv(
            room=pulled.room if pulled else 0,
            addrs=pulled.addrs if pulled else [],
            stages=_stages(params),
            blocks=block_ids,
            refused=refused,
            prompt=self._bound(_prompt_of(request)) if refused is None else None,
        )
        self._loading[request.request_id] = pulled.room if pulled else 0

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta, self._pending = self._pending, KvferryMetadata()
        bs = self._shape["block_size"]
        for req_id in scheduler_output.preempted_req_ids or ():
            push = self._pushing.pop(req_id, None)
            if push is not None:
                # Its blocks went back to vLLM: the room fails before they are overwritten
                # (the worker waits in handle_preemptions), and the resumed request computes
                # for no room.
                meta.push_preempted.add(push[0])
                self._preempted.add(req_id)
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            push = self._pushing.get(req_id)
            if push is None or self._kv_cache_manager is None:
                continue
            room, total, request, prompt = push
            # Runs before vLLM counts this step's tokens as computed.
            done = min(request.num_computed_tokens + n, request.num_prompt_tokens)
            full = total if done >= request.num_prompt_tokens else done // bs
            tables = self._kv_cache_manager.get_blocks(req_id).get_block_ids()
            try:
                computed = self._groups.pages(tables, request.num_prompt_tokens, end=full)
            except NullBlockInRoom as e:
                # Not reachable while vLLM frees only blocks before a window; if it were, the
                # room fails rather than sending a block another request may own.
                logger.error("kvferry: push room %d of request %s: %s", room, req_id, e)
                self._pushing.pop(req_id, None)
                meta.push_aborts.add(room)
                continue
            meta.pushes[req_id] = _PushStep(room=room, computed=computed, total=total, prompt=prompt)
        return meta

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_recving or ():
            self._loading.pop(req_id, None)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        """The groups a load fills: every group kvferry moves (vLLM zeroes no block of them)."""
        return self._groups.ids

    def request_finished(self, request, block_ids: list[int]):
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        params = _params_of(request)
        req_id = request.request_id
        push = self._pushing.pop(req_id, None)
        if push is not None:
            return self._push_finished(request, push[0], block_ids)
        if req_id in self._preempted:
            self._preempted.discard(req_id)
            return False, None
        if self._producer and params and params.get(_PUSH) and isinstance(params.get(_ROOM), int):
            # A push request that ended before vLLM ever scheduled it: its room fails now
            # rather than when the decode's wait runs out (a room id that is none was never
            # pushed: nothing to fail).
            if _room_id(params[_ROOM]) is not None:
                self._pending.push_aborts.add(params[_ROOM])
            return False, None
        if req_id in self._loading:
            # A decode request that ended while its room was open: its worker aborts the
            # room and reports it loaded once no write can land (vLLM holds its blocks).
            self._pending.aborts.add(req_id)
            return False, None
        if (self._consumer and params and params.get("do_remote_prefill") and not params.get(_DONE)
                and not params.get(_PUSH)):
            # A decode request that ended before it was ever scheduled (aborted, rejected):
            # the prefill holds the prompt's blocks for its room, so tell it to let them go.
            params[_DONE] = True
            pulled, _ = _pulled(params)
            if pulled is not None:
                self._pending.releases.append((pulled.room, pulled.addrs, _stages(params), "aborted_locally"))
            return False, None
        if not self._producer or not params or not params.get("do_remote_decode"):
            return False, None
        from vllm.v1.request import RequestStatus

        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ) or not any(block_ids):
            return False, None
        # The prompt's blocks only (a caller that let the prefill generate more than one
        # token must not shift the decode's tail).
        try:
            pages = self._groups.pages(block_ids, request.num_prompt_tokens)
        except NullBlockInRoom as e:
            logger.error("kvferry: request %s: its blocks cannot be a room: %s", req_id, e)
            return False, None
        room = self._next_room()
        prompt = _prompt_of(request)
        self._pending.sends[req_id] = _Send(
            room=room, blocks=pages, deadline=time.monotonic() + self._lease,
            prompt=self._bound(prompt),
        )
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            _ROOM: room,
            _ADDRS: self._advertised,
            _PP: self._pp,
            _SHAPE: self._shape,
            # For routers and logs: the decode's own digest is what the prefill checks.
            _PROMPT: prompt,
            "remote_num_tokens": request.num_computed_tokens,
        }

    def _bound(self, prompt: Optional[int]) -> Optional[int]:
        """The digest a room of prompt digest ``prompt`` is bound to: the prompt's, mixed with
        the KV cache groups where they are hybrid, so that a push room (whose shape only
        kvferry's handshake checks) between engines of different groups is refused, never
        loaded."""
        if not self._groups.hybrid:
            return prompt
        return _mixed(prompt, b"kvferry/vllm groups", repr(self._groups.signature()).encode())

    def _push_finished(self, request, room: int, block_ids: tuple[list[int], ...]):
        """A push-mode prefill request ended: its room already has (or will have) every
        block; the blocks stay until kvferry releases them. One that ended without its
        prompt computed (aborted) fails its room at once."""
        from vllm.v1.request import RequestStatus

        done = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not done:
            self._pending.push_aborts.add(room)
        if not any(block_ids):
            return False, None
        try:
            pages = self._groups.pages(block_ids, request.num_prompt_tokens)
        except NullBlockInRoom as e:
            logger.error("kvferry: push room %d of request %s: %s", room, request.request_id, e)
            self._pending.push_aborts.add(room)
            pages, done = [], False
        self._pending.sends[request.request_id] = _Send(
            room=room, blocks=pages, deadline=time.monotonic() + self._lease,
            prompt=self._bound(_prompt_of(request)),
        )
        if not done:
            return True, None
        return True, {"do_remote_prefill": True, "do_remote_decode": False, _ROOM: room,
                      _ADDRS: self._advertised, _SHAPE: self._shape, _PUSH: True}

    # ---- worker side ----------------------------------------------------------------

    def num_blocks(self) -> int:
        """Blocks per layer of vLLM's KV cache."""
        return int(self._kv_cache_config.num_blocks)

    def register_kv_caches(self, kv_caches: dict) -> None:
        self._worker = _Worker(self, kv_caches)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        if self._worker is not None and kv_connector_metadata is not None:
            self._worker.preempted(kv_connector_metadata.push_preempted)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.take(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: vLLM schedules a request only once its room succeeded.
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        # Pull mode sends a request's blocks once it finished (the decode learns the room
        # from the response). Push mode (the router told both sides the room) sends each
        # step's blocks layer by layer as the forward pass writes them.
        worker = self._worker
        if worker is None or not self.has_connector_metadata():
            return
        if worker._step_rooms is None:
            worker.begin_forward(self._get_connector_metadata())
        worker.layer_done(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.end_forward(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]):
        if self._worker is None:
            return None, None
        sent, received, _ = self._worker.progress()
        return sent or None, received or None

    def get_transfer_results(self, finished_req_ids: set[str]):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )

        if self._worker is None:
            return KVConnectorTransferResults()
        sent, received, failed = self._worker.progress()
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=received, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        errors = self._worker.take_load_errors()
        # Every failed load is also reported by request (``failed_recving``).
        return errors if self._blocks_name_loads else set()

    def get_kv_connector_stats(self) -> Optional[KvferryStats]:
        """The rooms this worker ended since the last call (``None`` if none): vLLM's model
        runner hands them to its loggers and ``/metrics``."""
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> KvferryStats:
        # A copy: aggregating into the result must not change the data it was built from.
        return KvferryStats(data=copy.deepcopy(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvferryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def session_paths(self) -> list[tuple[int, str]]:
        """The data path ("tcp", "rdma", ...) of each session of this worker's kvferry node;
        empty on the scheduler half."""
        return self._worker.node.session_paths() if self._worker is not None else []

    def push_chunks(self) -> dict:
        """Push-mode chunks this worker sent layer by layer and whole (for tests and logs)."""
        return dict(self._worker.chunks) if self._worker is not None else {}

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None


def kv_regions(kv_caches: dict, num_blocks: int) -> tuple[list[tuple[int, int]], int, int, int]:
    """``(spans, planes, page_bytes, pages)`` of vLLM's KV tensors as kvferry regions: one
    region per distinct layer tensor (layers that share a cache appear once) and plane, one
    page per vLLM block. A layer is ``[num_blocks, ...]`` (K and V inside each block: vLLM's
    CPU layout, one plane) or ``[2, num_blocks, ...]`` (K, then V: two planes). Anything
    else, or blocks that are not contiguous equal byte ranges, is refused naming the shape."""
    spans, seen, shape = [], set(), None
    for name, t in kv_caches.items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        dims = tuple(t.shape)
        if not t.is_contiguous():
            raise ValueError(f"kvferry.vllm: the KV cache of {name} {dims} is not contiguous")
        if dims[0] == num_blocks:
            planes = [t]
        elif len(dims) > 1 and dims[0] == 2 and dims[1] == num_blocks:
            planes = [t[0], t[1]]
        else:
            raise ValueError(
                f"kvferry.vllm: the KV cache of {name} is {dims}; kvferry serves "
                f"[{num_blocks} blocks, ...] and [2, {num_blocks} blocks, ...] layouts"
            )
        block = int(planes[0].stride(0) * t.element_size())
        this = (len(planes), block)
        if shape is None:
            shape = this
        elif this != shape:
            raise ValueError(
                f"kvferry.vllm: layer {name} has {len(planes)} planes of {block}-byte blocks, "
                f"others {shape[0]} of {shape[1]}"
            )
        spans.extend((int(p.data_ptr()), block * num_blocks) for p in planes)
    if shape is None:
        raise ValueError("kvferry.vllm: vLLM registered no KV cache")
    return spans, shape[0], shape[1], num_blocks


class _Worker:
    """The worker half: a kvferry node over vLLM's KV tensors, the rooms it serves, and a
    thread that answers decodes' asks for rooms as they come."""

    def __init__(self, connector: KvferryConnector, kv_caches: dict):
        import kvferry
        from kvferry._peers import KeptPeers

        self._kvferry = kvferry
        spans, planes, page_bytes, pages = kv_regions(kv_caches, connector.num_blocks())
        device = next(iter(kv_caches.values())).device
        #: Bytes of one vLLM block over every layer and plane.
        self._block_bytes = page_bytes * len(spans)
        self._stats = KvferryStats()
        #: Prefill: when each room's chunk went out, and its bytes.
        self._sent_at: dict[int, tuple[float, int]] = {}
        self._producer = connector._producer
        #: This worker's TP rank and its engine's TP size: it loads from (and sends to) the
        #: peer rank of the same index.
        self._rank, self._tp = tp_rank(connector._config), connector._tp
        #: This worker's pipeline stage, and the model layers its KV holds (None: all).
        stage = pp_rank(connector._config) if connector._pp > 1 else 0
        layer_range = None
        if connector._pp > 1:
            layer_range = stage_layers(list(kv_caches))
            if layer_range is None or layer_range[1] - layer_range[0] != len(spans) // planes:
                raise ValueError(
                    f"kvferry.vllm: pipeline stage {stage}'s KV cache names no single run of "
                    f"model layers ({sorted(kv_caches)[:4]}...)"
                )
        #: This worker's listener: the engine's base port + stage x TP + rank.
        self._port = connector._port + stage * self._tp + self._rank
        extra = connector._extra
        metrics = extra.get("metrics_addr") or os.environ.get("KVFERRY_METRICS_ADDR")
        try:
            # Each worker serves its own metrics, on the given port plus its listener's
            # offset from the configured port.
            offset = self._port - int(extra.get("port", DEFAULT_PORT))
            kvferry.enable_metrics(_plus(metrics, offset) if metrics and offset else metrics)
        except kvferry.InvalidArgument:
            pass  # already enabled in this process
        layout = {
            "layers": int(connector._shape["num_layers"]) if layer_range else len(spans) // planes,
            "planes": planes,
            "page_bytes": page_bytes,
            "pages": pages,
        }
        #: The model's KV heads, and those this rank's blocks hold (None: a layout without a
        #: head split kvferry knows, served at equal TP sizes only).
        self._total_heads = int(connector._shape["num_kv_heads"])
        self._mla = connector._mla
        self._heads = None if self._mla else kv_heads(kv_caches, pages, int(connector._shape["block_size"]),
                                                      self._total_heads, self._tp, self._rank)
        knobs = {k: int(v) for k, v in extra.items() if k.endswith("_ms")}
        self.node = kvferry.Node(
            "prefill" if self._producer else "decode",
            layout,
            spans,
            token=os.environ.get("KVFERRY_TOKEN", "").encode(),
            kv_device=device.index if device.type == "cuda" else None,
            transport=extra.get("transport"),
            rdma_device=extra.get("rdma_device"),
            heads=self._heads,
            layer_range=layer_range,
            **knobs,
        )
        logger.info("kvferry %s node over vLLM's KV (TP rank %d of %d): %s, heads %s, KV cache groups %s",
                    "prefill" if self._producer else "decode", self._rank, self._tp, layout,
                    self._heads or "whole blocks", connector._groups.signature())
        # kvferry's layer index of each vLLM layer name (layers sharing a cache share it;
        # a pipeline stage's are the model's).
        index: dict[int, int] = {}
        first = layer_range[0] if layer_range else 0
        self._layer_of = {
            name: first + index.setdefault(t.data_ptr(), len(index)) for name, t in kv_caches.items()
        }
        #: How many vLLM layers write each kvferry layer (a hybrid model's groups share
        #: tensors): a push chunk's layer goes only once all of them ran.
        self._writers = collections.Counter(self._layer_of.values())
        self._written: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._peers = KeptPeers(self.node)
        # Prefill, push mode: per room, what is computed and what went to the decode.
        self._pushes: dict[int, _Pushed] = {}
        self._step_rooms: Optional[list[int]] = None
        self._marked: set[int] = set()
        self._layers = range(first, first + len(index))
        # On a GPU, save_kv_layer runs when a layer's kernels are queued, not when they ran:
        # push rooms then go whole after the forward pass, once its stream is synchronized.
        self._cuda = device if device.type == "cuda" else None
        #: Push-mode chunks sent layer by layer during a forward pass, and sent whole.
        self.chunks = {"layerwise": 0, "whole": 0}
        self._free_now: set[str] = set()
        # Prefill: rooms waiting for their decode, by room; asks that came before the room.
        self._sends: dict[int, tuple[str, _Send]] = {}
        self._asked: dict[int, tuple[Optional[int], float]] = {}
        self._sending: dict[int, str] = {}
        self._room_prefix = connector._room_prefix
        self._room_key = connector._room_key
        self._lease = connector._lease
        # Rooms whose lease ran out, newest last: an ask for one is refused at once.
        self._expired: collections.OrderedDict[int, None] = collections.OrderedDict()
        # Decode: rooms being received, by request.
        self._recvs: dict[str, _Recv] = {}
        self._aborting: set[str] = set()
        self._failed_now: set[str] = set()
        self._load_errors: set[int] = set()
        self._stop = threading.Event()
        self._openers = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kvferry-open")
        self._asks = None
        if self._producer:
            self.node.listen(f"{connector._listen_host}:{self._port}")
            self._asks = threading.Thread(target=self._answer_asks, name="kvferry-asks", daemon=True)
            self._asks.start()

    # ---- per step -------------------------------------------------------------------

    def begin_forward(self, meta: KvferryMetadata) -> None:
        """Push mode, as the forward pass starts: each granted room gets, as one layerwise
        chunk, the blocks this step completes; its layers go as they finish."""
        with self._lock:
            rooms = []
            for req_id, step in meta.pushes.items():
                pushed = self._pushed(req_id, step)
                pushed.computed = step.computed
                if self._cuda is None and self._push_more(step.room, pushed, pushed.computed, layerwise=True):
                    rooms.append(step.room)
            self._step_rooms = rooms

    def _pushed(self, req_id: str, step: _PushStep) -> "_Pushed":
        """The worker's state of a push room, made at the room's first step (granting it at
        once if its decode asked before); the caller holds the lock."""
        pushed = self._pushes.get(step.room)
        if pushed is None:
            pushed = self._pushes[step.room] = _Pushed(req_id=req_id, total=step.total, prompt=step.prompt)
            asked = self._asked.pop(step.room, None)
            if asked is not None:
                self._grant_push(step.room, asked[0])
        return pushed

    def layer_done(self, layer_name: str) -> None:
        """Push mode: a layer's forward pass ended; its part of this step's chunks may go."""
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        self._written[layer] += 1
        if self._written[layer] >= self._writers[layer]:
            self._mark(layer)

    def _mark(self, layer: int) -> None:
        rooms = self._step_rooms
        if not rooms or layer in self._marked:
            return
        self._marked.add(layer)
        try:
            self.node.mark_layer_ready(rooms, layer)
        except self._kvferry.KvferryError as e:
            logger.warning("kvferry: layer %d of rooms %s not marked ready: %s", layer, rooms, e)

    def _push_more(self, room: int, pushed: "_Pushed", blocks: list[int], layerwise: bool) -> bool:
        """Sends the blocks of ``blocks`` (a prefix of the prompt's) that the decode granted
        (the tail) and has not had yet; whether a chunk went."""
        if pushed.granted is None or pushed.failed or len(blocks) <= pushed.sent:
            return False
        first = pushed.total - pushed.granted
        fresh = [b for i, b in enumerate(blocks) if i >= max(first, pushed.sent)]
        pushed.sent = len(blocks)
        if not fresh:
            return False
        self.chunks["layerwise" if layerwise else "whole"] += 1
        last = pushed.sent == pushed.total
        try:
            self.node.send_chunk(room, fresh, last=last, layerwise=layerwise)
        except self._kvferry.KvferryError as e:
            logger.error("kvferry: push room %d: chunk not sent: %s", room, e)
            pushed.failed = True
            self._abort(room)
            return False
        return layerwise

    def preempted(self, rooms: set[int]) -> None:
        """Push rooms whose prefill blocks vLLM took back: each fails, and this returns only
        once no read of those blocks can still go out (before the step overwrites them)."""
        for room in rooms:
            with self._lock:
                pushed = self._pushes.pop(room, None)
                if pushed is None:
                    continue
                pushed.failed = True
                if pushed.granted is None:
                    self._refuse(room, "vLLM preempted the prefill request")
                    continue
                self._abort(room)
            logger.warning("kvferry: push room %d: vLLM preempted the prefill request; the room fails", room)
            deadline = time.monotonic() + 60
            while not self._released(room):
                if time.monotonic() > deadline:
                    logger.error("kvferry: push room %d still not released 60 s after its abort", room)
                    break
                time.sleep(0.001)
            self._forget(room)

    def _released(self, room: int) -> bool:
        """Whether nothing of ``room`` can still be read or written (unknown rooms are)."""
        try:
            return self.node.releasable(room)
        except self._kvferry.InvalidArgument:
            return True

    def _forget(self, room: int) -> None:
        try:
            self.node.forget(room)
        except self._kvferry.KvferryError:
            pass

    def _abort(self, room: int) -> None:
        try:
            self.node.abort(room)
        except self._kvferry.KvferryError:
            pass  # it ended already

    def end_forward(self, meta: KvferryMetadata) -> None:
        """Push mode, after the forward pass (vLLM's ``wait_for_save``): this step's blocks
        are complete; every layer not reported yet is released, and what no layerwise chunk
        carried (a room granted mid-step, a step that reported no layer) goes whole now."""
        for layer in self._layers:
            self._mark(layer)
        if meta.pushes and self._cuda is not None:
            # The forward pass's kernels were only queued: the KV is written once they ran.
            import torch

            torch.cuda.current_stream(self._cuda).synchronize()
        with self._lock:
            for req_id, step in meta.pushes.items():
                pushed = self._pushed(req_id, step)
                pushed.computed = pushed.safe = step.computed
                self._push_more(step.room, pushed, pushed.safe, layerwise=False)
        self._step_rooms = None
        self._marked = set()
        self._written = collections.Counter()

    def take(self, meta: KvferryMetadata) -> None:
        """A step's requests that finished, opened or ended: rooms to serve, open or abort."""
        with self._lock:
            for room in meta.push_aborts:
                pushed = self._pushes.get(room)
                if pushed is None:
                    # Never scheduled: no block of it exists; an ask for it is refused.
                    pushed = self._pushes[room] = _Pushed(req_id="", total=0, failed=True)
                    if room in self._asked:
                        del self._asked[room]
                        self._refuse(room, "the prefill request was aborted")
                        del self._pushes[room]
                    continue
                pushed.failed = True
                if pushed.granted is not None:
                    self._abort(room)
            for req_id, send in meta.sends.items():
                pushed = self._pushes.pop(send.room, None)
                if pushed is not None and pushed.granted is not None and pushed.opened:
                    # Its sender is open: the blocks go back once no write can land.
                    self._sending[send.room] = req_id
                    continue
                if pushed is not None and pushed.failed:
                    # Aborted before any decode asked: nothing of it was sent.
                    self._refuse(send.room, "the prefill request was aborted")
                    self._free_now.add(req_id)
                    continue
                self._sends[send.room] = (req_id, send)
                asked = self._asked.pop(send.room, None)
                if asked is not None:
                    self._start_send(send.room, asked[0])
        for req_id, recv in meta.recvs.items():
            self._open_recv(req_id, recv)
        for room, addrs, stages, reason in meta.releases:
            self._submit(self._release_now, room, addrs, stages, reason)
        for req_id in meta.aborts:
            with self._lock:
                recv = self._recvs.get(req_id)
                if recv is not None and recv.refused is None:
                    # Not opened yet: the opener aborts it once it is.
                    if recv.opened:
                        self._abort(recv.room)
                    self._aborting.add(req_id)

    def _open_recv(self, req_id: str, recv: _Recv) -> None:
        """Opens a decode room: in vLLM's step where every prefill rank it names had its
        first contact (the open does not wait then, and a hand-off to another thread costs
        up to Python's 5 ms switch interval while the engine runs Python), else off the
        step, since a first contact waits up to kvferry's ``unreachable_timeout``."""
        with self._lock:
            self._recvs[req_id] = recv
            if recv.refused is not None:
                self._failed_now.add(req_id)
                return
        if self._contacted(recv):
            self._open_now(req_id, recv)
        else:
            self._submit(self._open_now, req_id, recv)

    def _contacted(self, recv: _Recv) -> bool:
        """Whether every prefill rank ``recv``'s room names had its first contact."""
        try:
            named, _, _ = self._sources(recv.addrs, recv.stages)
        except Exception:  # noqa: BLE001 - the opener reports what is wrong with them
            return False
        return all(self._peers.contacted([addr]) for addr in named)

    def _submit(self, work, *args) -> None:
        """Runs ``work`` on the opener threads; an exception it raises is logged with its
        traceback, never left unread in a future."""

        def reported(future: concurrent.futures.Future) -> None:
            e = future.exception()
            if e is not None:
                logger.error("kvferry: %s%r failed", work.__name__, args, exc_info=e)

        self._openers.submit(work, *args).add_done_callback(reported)

    def _bound(self, prompt: Optional[int], rank: int) -> Optional[int]:
        """The digest a room between this rank and prefill rank ``rank`` is bound to: the
        prompt's, and the rank's where the blocks declare no heads (with heads declared,
        kvferry refuses a request for heads the prefill rank does not hold; MLA's latent KV
        is the same on every rank)."""
        return prompt if self._heads is not None or self._mla else _rank_bound(prompt, rank)

    def _open_now(self, req_id: str, recv: _Recv) -> None:
        peers: list[int] = []
        try:
            prefill_tp = len(recv.addrs) // recv.stages
            if prefill_tp != self._tp and self._heads is None and not self._mla:
                raise ValueError(f"the prefill runs TP {prefill_tp}, this decode TP {self._tp}, and this rank's "
                                 "KV layout has no head split kvferry knows (whole blocks: equal TP only)")
            named, receivers, idle = self._sources(recv.addrs, recv.stages)
            for addr in named:
                peers.append(self._peer(addr))
                self._peers.reach(peers[-1])
            self.node.open_receiver(recv.room, peers, pages=recv.blocks, receivers=receivers,
                                    idle_sources=idle, prompt=self._bound(recv.prompt, self._rank))
        except Exception as e:  # noqa: BLE001 - whatever it was, the request must end
            # A load failure: vLLM recomputes the request instead of waiting for a room
            # that was never opened.
            logger.error("kvferry: request %s: room %d not opened: %s", req_id, recv.room, e)
            if peers and isinstance(e, (self._kvferry.PeerRefused, self._kvferry.PeerUnreachable)):
                # A prefill rank refused us or stayed unreachable: the room fails here with
                # that reason (and is counted under it) without waiting on the peer again,
                # and each source reached before it hears that it may free its blocks.
                for peer in peers:
                    self._fail_unopened(recv.room, peer, e.args[0])
            with self._lock:
                recv.refused = str(e)
                self._failed_now.add(req_id)
            return
        with self._lock:
            recv.opened = True
            recv.opened_at = time.monotonic()
            if req_id in self._aborting:
                self._abort(recv.room)

    def _fail_unopened(self, room: int, peer: int, reason: str) -> bool:
        """Opens ``room`` without granting a page and fails it with ``reason`` at once: the
        failure is counted under its reason, and a prefill that hears it frees the blocks
        it held for the room; it is forgotten once nothing of it can land. False if this
        decode already has the room (it was counted when it ended)."""
        try:
            self.node.open_receiver(room, [peer])
        except self._kvferry.UnknownPeer as e:
            logger.info("kvferry: room %d: its prefill was let go meanwhile (%s): nothing to release", room, e)
            return False
        except self._kvferry.InvalidArgument as e:
            logger.info("kvferry: room %d is already known here (%s): nothing to fail or release", room, e)
            return False
        self.node.fail(room, reason)
        deadline = time.monotonic() + 60
        while not self._released(room) and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.05)
        self._forget(room)
        return True

    def _release_now(self, room: int, addrs: list[str], stages: int, reason: str) -> None:
        """Tells the prefill ranks this rank pairs with that this decode will not load
        ``room`` (``reason``), so that they free the blocks they held for it."""
        for addr in self._sources(addrs, stages)[0]:
            try:
                peer = self._peer(addr)
                self._peers.reach(peer)
            except self._kvferry.KvferryError as e:
                logger.warning("kvferry: the prefill rank at %s of room %d cannot be told to free its "
                               "blocks (%s): they are freed when its lease runs out", addr, room, e)
                continue
            self._fail_unopened(room, peer, reason)

    def _sources(self, addrs: list[str], stages: int) -> tuple[list[str], int, list[int]]:
        """The listeners this rank's room names, of a room whose params name one per prefill
        worker (``stages`` x its TP, stage-major): in every stage, the ranks holding any of
        its heads; with how many decode ranks each sends to and the positions of idle
        sources. For a pair of TP sizes that is refused, every prefill worker p with
        p % TP == r, so that the decode's ranks together release each of them."""
        prefill_tp = len(addrs) // stages
        if tp_pair_refusal(prefill_tp, self._tp, self._total_heads, self._mla) is not None:
            return [a for p, a in enumerate(addrs) if p % self._tp == self._rank], 1, []
        sources, receivers, idle = tp_sources(prefill_tp, self._tp, self._total_heads, self._rank, self._mla)
        named = [addrs[s * prefill_tp + p] for s in range(stages) for p in sources]
        return named, receivers, [s * len(sources) + i for s in range(stages) for i in idle]

    def _peer(self, addr: str) -> int:
        """The kvferry peer of a prefill rank, named once (the core keeps it connected, and
        lets it go after ``KVFERRY_PEER_IDLE_TIMEOUT_MS`` unused)."""
        return self._peers.get([addr], reach=False)

    def progress(self) -> tuple[set[str], set[str], set[str]]:
        """Requests whose blocks are free to reuse (prefill), loaded or failed (decode)."""
        sent: set[str] = set()
        received: set[str] = set()
        failed: set[str] = set()
        kvferry = self._kvferry
        with self._lock:
            sent |= self._free_now
            self._free_now = set()
            for room, req_id in list(self._sending.items()):
                try:
                    state = self.node.poll(room)
                    if state not in (kvferry.KVPoll.Success, kvferry.KVPoll.Failed) or not self.node.releasable(room):
                        continue
                    sent_at = self._sent_at.pop(room, None)
                    if state == kvferry.KVPoll.Failed:
                        reason = self.node.failure(room)
                        logger.warning("kvferry: room %d of request %s failed: %s", room, req_id, reason)
                        self._stats.record_failure(str(reason))
                    elif sent_at is not None:
                        self._stats.record_success(sent_at[1], time.monotonic() - sent_at[0])
                except kvferry.InvalidArgument:
                    pass  # the node no longer follows it: nothing of it can be read
                del self._sending[room]
                self._forget(room)
                sent.add(req_id)
        with self._lock:
            for req_id in list(self._failed_now):
                self._failed_now.discard(req_id)
                self._aborting.discard(req_id)
                recv = self._recvs.pop(req_id, None)
                if recv is not None:
                    self._load_errors.update(recv.blocks)
                    self._stats.record_failure("not_opened")
                received.add(req_id)
                failed.add(req_id)
            opened = [(r, recv) for r, recv in self._recvs.items() if recv.opened]
        for req_id, recv in opened:
            state = self.node.poll(recv.room)
            if req_id in self._aborting:
                if state in (kvferry.KVPoll.Success, kvferry.KVPoll.Failed) and self.node.releasable(recv.room):
                    self._aborting.discard(req_id)
                    del self._recvs[req_id]
                    self.node.forget(recv.room)
                    received.add(req_id)
                continue
            if state == kvferry.KVPoll.Success:
                del self._recvs[req_id]
                self.node.forget(recv.room)
                received.add(req_id)
                with self._lock:
                    self._stats.record_success(
                        len(recv.blocks) * self._block_bytes,
                        time.monotonic() - recv.opened_at if recv.opened_at is not None else None,
                    )
            elif state == kvferry.KVPoll.Failed:
                if not recv.logged:
                    recv.logged = True
                    logger.error(
                        "kvferry: request %s failed to load its KV (room %d): %s; vLLM recomputes it",
                        req_id, recv.room, self.node.failure(recv.room),
                    )
                if self.node.releasable(recv.room):
                    reason = self.node.failure(recv.room)
                    del self._recvs[req_id]
                    self.node.forget(recv.room)
                    self._load_errors.update(recv.blocks)
                    received.add(req_id)
                    failed.add(req_id)
                    with self._lock:
                        self._stats.record_failure(str(reason))
        return sent, received, failed

    def take_stats(self) -> Optional[KvferryStats]:
        """The rooms ended since the last call, or ``None``."""
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KvferryStats()
        return stats

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- prefill: answering asks --------------------------------------------------------

    def _answer_asks(self) -> None:
        """The prefill's transport work, on its own thread so that it goes on while vLLM
        does not step an idle engine: answering asks, refusing rooms it does not hold, and
        the end of leases."""
        while not self._stop.is_set():
            try:
                got = self.node.next_announcement(0.2)
            except self._kvferry.KvferryError:
                return
            with self._lock:
                if got is not None:
                    room, _generation, pages, skip = got
                    # An idle source's ask (it wants nothing: skip None) sends every block;
                    # kvferry moves none of them and the room ends when the decode confirms.
                    self._answer(room, None if skip is None else pages)
                self._expire(time.monotonic())

    def _answer(self, room: int, pages: Optional[int]) -> None:
        """A decode asked for ``room`` (``pages``: its tail it granted; None: it asked this
        rank for nothing, as an idle source); the caller holds the lock."""
        if room in self._sends:
            self._start_send(room, pages)
        elif room in self._pushes:
            self._grant_push(room, pages)
        elif room & PUSH_BIT:
            # The router told the decode first: the prefill's step will find it.
            self._asked[room] = (pages, time.monotonic())
        elif room >> 32 != self._room_prefix:
            self._refuse(room, "the prefill that had this room restarted")
        elif room in self._expired:
            self._refuse(room, f"its lease ran out ({self._lease:.0f} s) before this decode asked")
        elif _room_tag(self._room_key, (room & 0xFFFF_FFFF) >> _TAG_BITS) != room & ((1 << _TAG_BITS) - 1):
            self._refuse(room, "this prefill never handed out that room id")
        else:
            # Handed out by this engine's scheduler: its request is in a step on its way.
            self._asked[room] = (pages, time.monotonic())

    def _expire(self, now: float) -> None:
        """Ends the leases that ran out and the asks nothing came for; the caller holds the
        lock."""
        for room, (req_id, send) in list(self._sends.items()):
            if room not in self._sending and now > send.deadline:
                logger.warning(
                    "kvferry: no decode asked for room %d of request %s within %.0f s; its blocks are freed",
                    room, req_id, self._lease,
                )
                del self._sends[room]
                self._free_now.add(req_id)
                self._expired[room] = None
                while len(self._expired) > _EXPIRED_KEPT:
                    self._expired.popitem(last=False)
        for room, (_, at) in list(self._asked.items()):
            # A push room's prefill request may wait in vLLM's queue for a while.
            if now - at > (self._lease if room & PUSH_BIT else _ASK_GRACE_S):
                # Asked for a room this prefill never had: a decode must not wait out its timeout.
                del self._asked[room]
                self._refuse(room, "no such room on this prefill")

    def _grant_push(self, room: int, pages: Optional[int]) -> None:
        """A decode asked for a push room being computed: open it and send what is done (an
        idle source's ask, ``pages`` None, as if it asked for every block)."""
        pushed = self._pushes[room]
        if pushed.granted is not None:
            return
        if pages is None:
            pages = pushed.total
        pushed.granted = pages
        if pushed.failed:
            self._refuse(room, "the prefill request was aborted")
            if not pushed.req_id:
                del self._pushes[room]
            return
        try:
            self.node.open_sender(room, prompt=self._bound(pushed.prompt, self._rank))
        except self._kvferry.KvferryError as e:
            logger.error("kvferry: push room %d not opened: %s", room, e)
            pushed.failed = True
            return
        pushed.opened = True
        if pages <= 0 or pages > pushed.total:
            logger.error("kvferry: push room %d: the decode granted %d blocks, the prompt has %d",
                         room, pages, pushed.total)
            pushed.failed = True
            self._abort(room)
            return
        # Mid-forward, this step's blocks are still being written: only earlier ones go.
        self._push_more(room, pushed, pushed.safe, layerwise=False)

    def _start_send(self, room: int, pages: Optional[int]) -> None:
        """Sends the tail of the room's blocks the decode granted (it holds the rest); every
        block for an idle source's ask (``pages`` None: kvferry moves none of them)."""
        req_id, send = self._sends.pop(room)
        if pages is None:
            pages = len(send.blocks)
        try:
            self.node.open_sender(room, prompt=self._bound(send.prompt, self._rank))
        except self._kvferry.KvferryError as e:
            logger.error("kvferry: room %d of request %s not opened: %s", room, req_id, e)
            self._free_now.add(req_id)
            return
        self._sending[room] = req_id
        if self.node.poll(room) == self._kvferry.KVPoll.Failed:
            return  # refused as it opened (another prompt's request): freed once it is over
        try:
            if pages == 0:
                logger.info("kvferry: the decode of request %s will not load room %d; its blocks are freed",
                            req_id, room)
                self.node.abort(room)
                return
            if pages < 0 or pages > len(send.blocks):
                logger.error(
                    "kvferry: room %d of request %s: the decode granted %d blocks, the prefill holds %d",
                    room, req_id, pages, len(send.blocks),
                )
                self.node.abort(room)
                return
            self.node.send_chunk(room, send.blocks[-pages:], last=True)
            # The caller holds the lock.
            self._sent_at[room] = (time.monotonic(), pages * self._block_bytes)
        except self._kvferry.KvferryError as e:
            logger.error("kvferry: room %d of request %s not sent: %s", room, req_id, e)
            try:
                self.node.abort(room)
            except self._kvferry.KvferryError:
                pass

    def _refuse(self, room: int, why: str) -> None:
        logger.warning("kvferry: refusing room %d: %s", room, why)
        try:
            self.node.open_sender(room)
            self.node.abort(room)
            self.node.forget(room)
        except self._kvferry.KvferryError:
            pass

    def shutdown(self) -> None:
        self._stop.set()
        if self._asks is not None:
            self._asks.join(timeout=2)
        self._openers.shutdown(wait=False, cancel_futures=True)
        self.node.shutdown()
