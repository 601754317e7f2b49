"""An engine at TP > 1 without a model, as vLLM runs one: vLLM's ``Scheduler`` (with the
connector's scheduler half) in the test's process, and one process per TP rank running the
connector's worker half over that rank's KV heads. Each step goes to every rank with the same
metadata, as vLLM's executor broadcasts it, and their outputs are combined by vLLM's own
``KVOutputAggregator``: a request counts as loaded (or sent) only once every rank said so.

A rank holds the heads vLLM places on it (``kvferry.vllm.rank_heads``: an equal share, or one
head replicated over ``TP / heads`` ranks) and its "forward pass" writes exactly those heads
of the pattern ``harness.pattern`` gives the whole block, so a decode rank that received
another rank's heads fails the check.
"""

from __future__ import annotations

import queue
import time

import torch

from harness import (
    HEAD_SIZE,
    KV_HEADS,
    LAYERS,
    MLA_LATENT,
    Side,
    state_bytes,
    state_share,
    state_spec,
    with_groups,
    make_config,
    mp_context,
    pattern,
)


def _rank_heads(total: int, tp: int, rank: int) -> tuple[int, int]:
    from kvferry.vllm import rank_heads

    first, count = rank_heads(total, tp, rank)
    return first, first + count


def kv_groups(names: list[str], block_size: int, heads: int, dtype, window: int,
              state_block: int = 0, tp: int = 1, kind: str = "gdn") -> list:
    """The KV cache groups of ``names``' layers: one full-attention group, or with ``window``
    (tokens) a hybrid model's two: layer 0 full attention, layer 1 a sliding window; with
    ``state_block`` (tokens: the model's length, one block per request), layer 1 keeps
    recurrent state of ``kind`` in vLLM's "none" mode."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    shape = dict(block_size=block_size, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=dtype)
    if state_block:
        full = FullAttentionSpec(**shape)
        state = state_spec(state_block, dtype, full.page_size_bytes, tp, kind)
        return [KVCacheGroupSpec(names[:1], full), KVCacheGroupSpec(names[1:], state)]
    if not window:
        return [KVCacheGroupSpec(names, FullAttentionSpec(**shape))]
    return [KVCacheGroupSpec(names[:1], FullAttentionSpec(**shape)),
            KVCacheGroupSpec(names[1:], SlidingWindowSpec(sliding_window=window, **shape))]


def first_block(layer: int, tokens: int, block_size: int, window: int) -> int:
    """The first block of a ``tokens``-token prompt ``layer`` keeps for the next token (its
    sliding window's, with ``window``; vLLM frees the ones wholly before it)."""
    if not window or layer == 0:
        return 0
    return max(0, tokens - window + 1) // block_size


def _rank_main(role: str, port: int, tp: int, rank: int, engine_id: str, num_blocks: int, kw: dict,
               inbox, outbox) -> None:
    """One worker (global ``rank``: pipeline stage ``rank // tp``, TP rank ``rank % tp``):
    kvferry's worker connector over its KV tensors (its stage's layers, its heads), stepped
    by the engine's process."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvferry.vllm import KvferryConnector

    window = kw.pop("window", 0)
    mamba = kw.pop("mamba", False)
    # ``mamba``: True for a GDN layer's state, or the state kind ("mamba2").
    kind = mamba if isinstance(mamba, str) else "gdn"
    mamba = bool(mamba)
    config = with_groups(make_config(role, port, tp=tp, hybrid=bool(window or mamba), prefix_off=mamba, **kw), kind)
    # MLA: every rank holds the whole latent KV, [blocks, block_size, latent] (one "head").
    mla = kw.get("mla", False)
    total = 1 if mla else kw.get("kv_heads", KV_HEADS)
    # One engine's config, as vLLM hands its workers: the engine's id, and each its rank.
    config.kv_transfer_config.engine_id = engine_id
    config.parallel_config.rank = rank
    bs = config.cache_config.block_size
    dtype = config.model_config.dtype
    lo, hi = (0, 1) if mla else _rank_heads(total, tp, rank % tp)
    per = LAYERS // kw.get("pp", 1)
    mine = list(range(rank // tp * per, (rank // tp + 1) * per))
    names = {layer: f"model.layers.{layer}.self_attn.attn" for layer in mine}
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                              kv_cache_groups=kv_groups(list(names.values()), bs, hi - lo, dtype, window,
                                                        config.model_config.max_model_len if mamba else 0, tp, kind))
    shape = (num_blocks, bs, MLA_LATENT) if mla else (num_blocks, hi - lo, bs, 2 * HEAD_SIZE)
    kv = {name: torch.zeros(shape, dtype=dtype) for name in names.values()}
    if window or mamba:
        # vLLM's hybrid allocation: the groups' layers share one tensor.
        shared = next(iter(kv.values()))
        kv = {name: shared for name in kv}
    registered = kv
    if mamba:
        # The state layer's cache as vLLM 0.32.0 registers it (first): an int8 view of the
        # state's bytes at the start of each block of the shared tensor.
        page = shared[0].numel() * shared.element_size()
        state = state_bytes(tp, kind=kind)
        view = torch.as_strided(shared.view(torch.int8), (num_blocks, 1, 1, state), (page, state, state, 1))
        registered = {names[1]: view, **{n: t for n, t in kv.items() if n != names[1]}}
    worker = KvferryConnector(config, KVConnectorRole.WORKER, kv_config)
    worker.register_kv_caches(registered)
    full_bytes = total * bs * (MLA_LATENT if mla else 2 * HEAD_SIZE) * torch.tensor([], dtype=dtype).element_size()

    def rows_of(block: int, layer: int) -> torch.Tensor:
        return kv[names[layer]][block].view(torch.uint8).view(hi - lo, bs, -1)

    def want_of(prompt: list[int], index: int, layer: int) -> torch.Tensor:
        return pattern(prompt, index, layer, full_bytes).view(total, bs, -1)[lo:hi]

    def state_of(table: list[int]) -> torch.Tensor:
        """The request's state bytes on this rank (its state group's one block)."""
        live = [b for b in table if b != 0]
        assert len(live) == 1, f"state blocks {table}"
        return kv[names[mine[0]]][live[0]].view(torch.uint8).reshape(-1)[:state_bytes(tp, kind=kind)]

    def state_want(tokens: list[int], tp_rank: int) -> torch.Tensor:
        """The state TP rank ``tp_rank``'s share holds after ``tokens``: each rank's differs."""
        return state_share(tokens, tp, tp_rank, kind=kind)

    def is_state(layer: int) -> bool:
        return mamba and layer == 1

    outbox.put(("ready", rank))
    while True:
        cmd = inbox.get()
        if cmd[0] == "stop":
            worker.shutdown()
            outbox.put(("stopped", rank))
            return
        if cmd[0] == "paths":
            outbox.put(("paths", worker.session_paths()))
            continue
        if cmd[0] == "plant":
            # Another rank's heads of the pattern, written over this rank's blocks.
            _, prompt, tables, other = cmd
            olo, ohi = _rank_heads(total, tp, other % tp)
            if mamba:
                state_of(tables[1]).copy_(state_want(prompt, other % tp))
            for index in range(-(-len(prompt) // bs)):
                for layer in mine:
                    if is_state(layer) or index < first_block(layer, len(prompt), bs, window):
                        continue
                    whole = pattern(prompt, index, layer, full_bytes).view(total, bs, -1)
                    rows_of(tables[layer][index], layer).copy_(whole[olo:ohi])
            outbox.put(("planted", None))
            continue
        if cmd[0] == "check":
            _, prompt, tables = cmd
            said = None
            if mamba and 1 in mine and not torch.equal(state_of(tables[1]), state_want(prompt, rank % tp)):
                said = f"rank {rank}: the state differs"
            for index in range(-(-len(prompt) // bs)):
                rows = min(len(prompt) - index * bs, bs)
                for layer in mine:
                    if is_state(layer) or index < first_block(layer, len(prompt), bs, window):
                        continue  # out of the layer's window: vLLM freed it
                    got = rows_of(tables[layer][index], layer)[:, :rows, :]
                    want = want_of(prompt, index, layer)[:, :rows, :]
                    if said is None and not torch.equal(got, want):
                        said = (f"rank {rank}: block {index} layer {layer} differs "
                                f"({int((got == want).sum())} of {want.numel()} bytes equal)")
            outbox.put(("checked", said))
            continue
        _, meta, finished, writes = cmd
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        for layer in mine:
            if is_state(layer):
                # The step leaves a state of every token computed so far; vLLM's state
                # layers do not call save_kv_layer.
                for prompt, first, last, tables in writes:
                    state_of(tables[layer]).copy_(state_want(prompt[:last], rank % tp))
                continue
            for prompt, first, last, tables in writes:
                for index in range(first // bs, (last - 1) // bs + 1):
                    a = max(first, index * bs) - index * bs
                    b = min(last, (index + 1) * bs) - index * bs
                    block = tables[layer][index]
                    assert block != 0, f"layer {layer} computes into vLLM's null block"
                    rows_of(block, layer)[:, a:b, :] = want_of(prompt, index, layer)[:, a:b, :]
            if writes:
                worker.save_kv_layer(names[layer], kv[names[layer]], None)
        worker.wait_for_save()
        results = worker.get_transfer_results(finished)
        invalid = worker.get_block_ids_with_load_errors()
        stats = worker.get_kv_connector_stats()
        worker.clear_connector_metadata()
        outbox.put(("stepped", (results.finished_sending, results.finished_recving, results.failed_recving,
                                invalid, stats.data if stats is not None else None)))


class Ranks:
    """vLLM's scheduler of one engine and its TP ranks, one process each, stepped by hand."""

    def __init__(self, role: str, port: int, tp: int, num_blocks: int = 256, pp: int = 1, **kw):
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import KVCacheConfig
        from vllm.v1.structured_output import StructuredOutputManager

        self.role, self.tp, self.port = role, tp, port
        kw = dict(kw, pp=pp)
        #: With ``window`` (tokens): a hybrid model, layer 1 a sliding window (``kv_groups``).
        self.window = kw.get("window", 0)
        #: With ``mamba``: layer 1 keeps recurrent state (``kv_groups``), each rank its shard.
        self.mamba = bool(kw.get("mamba", False))
        kind = kw["mamba"] if isinstance(kw.get("mamba"), str) else "gdn"
        config_kw = {k: v for k, v in kw.items() if k not in ("window", "mamba")}
        self.config = with_groups(make_config(role, port, tp=tp, hybrid=bool(self.window or self.mamba),
                                              prefix_off=self.mamba, **config_kw), kind)
        bs = self.config.cache_config.block_size
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        state_block = self.config.model_config.max_model_len if self.mamba else 0
        groups = kv_groups(names, bs, max(1, kw.get("kv_heads", KV_HEADS) // tp),
                           self.config.model_config.dtype, self.window, state_block, tp, kind)
        #: The KV cache group of each layer.
        self.group_of = [0] + [len(groups) - 1] * (LAYERS - 1)
        kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=kv_config,
                                   structured_output_manager=StructuredOutputManager(self.config),
                                   block_size=state_block or bs, log_stats=True)
        #: Every worker, stage-major: vLLM's executor hears each of them.
        self.workers = tp * pp
        self.aggregator = KVOutputAggregator(expected_finished_count=self.workers)
        ctx = mp_context()
        self.inboxes, self.outboxes, self.procs = [], [], []
        for rank in range(self.workers):
            inbox, outbox = ctx.Queue(), ctx.Queue()
            proc = ctx.Process(target=_rank_main, args=(role, port, tp, rank, self.config.kv_transfer_config.engine_id, num_blocks, kw,
                                     inbox, outbox),
                               daemon=True)
            proc.start()
            self.inboxes.append(inbox)
            self.outboxes.append(outbox)
            self.procs.append(proc)
        for rank in range(self.workers):
            assert self._answer(rank, "ready", 600) == rank
        self.outputs: dict[str, object] = {}
        self.params: dict[str, dict] = {}
        self.load_failures: set[str] = set()
        self.loaded: set[str] = set()
        #: Ranks whose process was killed: they answer nothing any more.
        self.dead: set[int] = set()
        #: Rooms each rank reported through vLLM's connector stats: succeeded, failed.
        self.rank_rooms = [[0, 0] for _ in range(self.workers)]

    def _answer(self, rank: int, kind: str, timeout: float = 60):
        """The next answer of ``rank``, which must be ``kind``; a rank that died says so."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                got, value = self.outboxes[rank].get(timeout=1)
                assert got == kind, (got, kind)
                return value
            except queue.Empty:
                assert self.procs[rank].is_alive(), f"TP rank {rank} of the {self.role} died"
                assert time.monotonic() < deadline, f"TP rank {rank} of the {self.role} did not answer {kind}"

    def _live(self) -> list[int]:
        return [r for r in range(self.workers) if r not in self.dead]

    # The same request vLLM's engine builds, added to this engine's scheduler.
    add = Side.add

    def tables_of(self, request_id: str) -> list[list[int]]:
        """The block table of each layer's KV cache group for the request."""
        tables = self.scheduler.kv_cache_manager.get_blocks(request_id).get_block_ids()
        return [list(tables[g]) for g in self.group_of]

    def step(self) -> list:
        """One engine step over every rank; returns the requests that finished."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        from kvferry.vllm import KvferryConnector

        out = self.scheduler.schedule()
        writes = []
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            params = req.kv_transfer_params or {}
            if (self.role == "kv_consumer" and params.get("do_remote_prefill")
                    and req_id not in self.load_failures):
                continue  # it runs on loaded KV: the check sees what kvferry delivered
            first = req.num_computed_tokens - n
            last = min(first + n, req.num_prompt_tokens)
            if last > first:
                writes.append((list(req.prompt_token_ids), first, last, self.tables_of(req_id)))
        for rank in self._live():
            self.inboxes[rank].put(("step", out.kv_connector_metadata, out.finished_req_ids, writes))
        sampled = {}
        for req_id in out.num_scheduled_tokens:
            req = self.scheduler.requests[req_id]
            sampled[req_id] = [7] if req.num_computed_tokens >= req.num_tokens else []
        req_ids = list(sampled)
        outputs = []
        for rank in self._live():
            sent, recvd, failed, invalid, stats = self._answer(rank, "stepped")
            if stats:
                self.rank_rooms[rank][0] += stats["succeeded"]
                self.rank_rooms[rank][1] += stats["failed"]
            outputs.append(ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[sampled[r] for r in req_ids],
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=[],
                kv_connector_output=KVConnectorOutput(
                    finished_sending=sent or None,
                    finished_recving=recvd or None,
                    failed_recving=failed,
                    invalid_block_ids=invalid,
                    kv_connector_stats=KvferryConnector.build_kv_connector_stats(stats) if stats else None,
                ),
            ))
        mro = self.aggregator.aggregate(outputs, 0)
        kv_out = mro.kv_connector_output
        if kv_out is not None:
            self.load_failures |= kv_out.failed_recving
            self.loaded |= (kv_out.finished_recving or set()) - kv_out.failed_recving
        finished = []
        for eco in self.scheduler.update_from_output(out, mro).values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.outputs[o.request_id] = o
                    if o.kv_transfer_params:
                        self.params[o.request_id] = o.kv_transfer_params
                    finished.append(o)
        return finished

    def check_blocks(self, request_id: str, prompt: list[int]) -> int:
        """Checks every byte of the request's prompt blocks on every rank (each its heads, and
        with ``mamba`` its shard of the state); returns the blocks checked."""
        if self.mamba and len(prompt) > 1:
            # The decode loads all but the last token, which it recomputes from the state.
            prompt = prompt[:-1]
        tables = self.tables_of(request_id)
        for rank in self._live():
            self.inboxes[rank].put(("check", list(prompt), tables))
        said = [s for s in (self._answer(rank, "checked") for rank in self._live()) if s]
        if said:
            raise AssertionError(f"{request_id}: " + "; ".join(said))
        return -(-len(prompt) // self.config.cache_config.block_size)

    def plant_heads_of(self, request_id: str, prompt: list[int], rank: int, heads_of: int) -> None:
        """Writes rank ``heads_of``'s heads of the request's pattern (and its state, with
        ``mamba``) over rank ``rank``'s blocks."""
        if self.mamba and len(prompt) > 1:
            prompt = prompt[:-1]
        self.inboxes[rank].put(("plant", list(prompt), self.tables_of(request_id), heads_of))
        self._answer(rank, "planted")

    def session_paths(self) -> list:
        paths = []
        for rank in self._live():
            self.inboxes[rank].put(("paths",))
            paths += self._answer(rank, "paths")
        return paths

    def kill(self, rank: int) -> None:
        """Kills one rank's process (SIGKILL), as a crashed worker goes."""
        self.procs[rank].kill()
        self.procs[rank].join()
        self.dead.add(rank)

    def idle(self) -> bool:
        return not self.scheduler.requests

    def shutdown(self) -> None:
        for rank in self._live():
            self.inboxes[rank].put(("stop",))
        for rank in self._live():
            try:
                self._answer(rank, "stopped", 30)
            finally:
                self.procs[rank].join(timeout=10)
        self.scheduler.shutdown()
