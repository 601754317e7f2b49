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

This package is imported by every vLLM process (the API server included) when the config is
built: it imports nothing heavy until a connector is constructed. Its modules: ``_params``
(the kv_transfer_params and room ids), ``_config`` (settings), ``_layout`` (TP/PP ranks,
heads, KV regions), ``_metadata`` (what a step tells the workers), ``_stats`` (vLLM's
connector stats and metrics), ``_connector`` (KvferryConnector and its scheduler half) and
``_worker`` (its worker half).
"""

from __future__ import annotations

import logging

# What vLLM, the tests and embedders import from ``kvferry.vllm``, wherever it is defined.
from kvferry._addrs import socket_addr as _socket_addr  # noqa: F401
from kvferry._vllm_groups import KvGroups, NullBlockInRoom  # noqa: F401
from kvferry.vllm._config import (  # noqa: F401
    DEFAULT_LEASE_S,
    DEFAULT_PORT,
    _extra,
    _follow_vllm_logging,
    _local_ip,
    _plus,
)
from kvferry.vllm._connector import KvferryConnector  # noqa: F401
from kvferry.vllm._layout import (  # noqa: F401
    kv_heads,
    kv_regions,
    kv_shape,
    pp_rank,
    rank_heads,
    shape_mismatch,
    stage_layers,
    tp_pair_refusal,
    tp_rank,
    tp_sources,
)
from kvferry.vllm._metadata import (  # noqa: F401
    KvferryMetadata,
    _Pushed,
    _PushStep,
    _Recv,
    _Send,
)
from kvferry.vllm._params import (  # noqa: F401
    _ADDRS,
    _COUNTER_BITS,
    _DONE,
    _MAX_ADDRS,
    _PP,
    _PROMPT,
    _PUSH,
    _ROOM,
    _SHAPE,
    _TAG_BITS,
    PUSH_BIT,
    _mixed,
    _params_of,
    _prompt_of,
    _Pulled,
    _pulled,
    _rank_bound,
    _room_id,
    _room_tag,
    _stages,
    _stages_refusal,
)
from kvferry.vllm._stats import KvferryPromMetrics, KvferryStats  # noqa: F401
from kvferry.vllm._worker import _ASK_GRACE_S, _EXPIRED_KEPT, _Worker  # noqa: F401

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: F401
    KVConnectorPromMetrics,
    KVConnectorStats,
)

logger = logging.getLogger("kvferry.vllm")

#: The vLLM version this connector is written and tested against.
VLLM_VERSION = "0.32.0"
