"""KvferryConnector: the class vLLM loads, its scheduler half, and the calls it hands its worker."""

from __future__ import annotations

import copy
import hashlib
import logging
import secrets
import time
from typing import Any, Optional

from kvferry._vllm_groups import KvGroups, NullBlockInRoom
from kvferry.vllm._config import (
    DEFAULT_LEASE_S,
    DEFAULT_PORT,
    _extra,
    _follow_vllm_logging,
    _local_ip,
)
from kvferry.vllm._layout import kv_shape, shape_mismatch, tp_pair_refusal
from kvferry.vllm._metadata import KvferryMetadata, _PushStep, _Recv, _Send
from kvferry.vllm._params import (
    _ADDRS,
    _COUNTER_BITS,
    _CUT,
    _DONE,
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
    _pulled,
    _room_id,
    _room_tag,
    _stages,
    _stages_refusal,
)
from kvferry.vllm._stats import KvferryPromMetrics, KvferryStats
from kvferry.vllm._worker import _Worker

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

# The package's name, in every module: what vLLM's log shows and embedders filter on.
logger = logging.getLogger("kvferry.vllm")


def _mamba_groups(vllm_config) -> int:
    """A Mamba2 model's B/C groups, as its config names them (0 where it names none)."""
    model = getattr(vllm_config, "model_config", None)
    for config in (getattr(model, "hf_text_config", None), getattr(model, "hf_config", None)):
        for name in ("n_groups", "mamba_n_groups", "mamba_ngroups"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return 0


class KvferryConnector(KVConnectorBase_V1, SupportsHMA):
    """kvferry's vLLM connector: the scheduler half decides which requests move and which
    blocks they use; the worker half runs a kvferry node over vLLM's KV tensors. With vLLM's
    hybrid KV cache manager on, every full-attention, sliding-window, chunked local attention
    and recurrent-state group moves with the request (``KvGroups``)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        _follow_vllm_logging()
        self._config = vllm_config
        self._extra = _extra(vllm_config)
        self._shape = kv_shape(vllm_config)
        #: The KV cache groups a request's blocks move in, and the order of a room's pages.
        self._groups = KvGroups.of(kv_cache_config, self._shape["block_size"],
                                   int(vllm_config.parallel_config.tensor_parallel_size),
                                   _mamba_groups(vllm_config))
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
        count = self._loaded_tokens(request) - num_computed_tokens
        if count <= 0:
            return 0, False
        return count, True

    def _loaded_tokens(self, request) -> int:
        """Decode: the prompt tokens a room brings (all but the ones the prefill leaves to
        the decode: ``KvGroups.backoff``)."""
        tokens = len(request.prompt_token_ids or [])
        # A prompt no longer than that loads nothing: the decode computes it whole.
        return max(0, tokens - self._groups.backoff)

    def on_new_request(self, request) -> None:
        """Prefill of a model with recurrent state: the request computes all but its prompt's
        last token, so that the state it leaves is the one the decode derives the last
        token's from (the decode recomputes that token)."""
        params = _params_of(request)
        backoff = self._groups.backoff
        if (not backoff or not self._producer or not params or not params.get("do_remote_decode")
                or params.get(_CUT) or request.num_prompt_tokens <= backoff
                or request.prompt_token_ids is None or request.get_skip_reading_prefix_cache()):
            return
        del request.prompt_token_ids[-backoff:]
        del request._all_token_ids[-backoff:]
        request.num_prompt_tokens -= backoff
        request.max_tokens = 1
        params[_CUT] = True

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
        tokens = self._loaded_tokens(request)
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
            # A decode's request still holds the token its prefill left to it.
            prompt=self._bound(_prompt_of(request, self._groups.backoff)) if refused is None else None,
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
