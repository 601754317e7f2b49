"""One side of a disaggregated vLLM deployment without a model: vLLM's own ``Scheduler``
with kvferry's connector (scheduler half), and the connector's worker half over real KV
tensors, stepped as vLLM's engine core and model runner step them. The "forward pass" of a
prefill writes each block of a request with bytes derived from the request's prompt, the
block's index in the request and the layer, so a decode can check every byte it received.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Optional

import torch
from engine_processes import assert_data_path, mp_context  # noqa: F401 (the suite calls both here)

BLOCK_SIZE = 32
LAYERS = 2
KV_HEADS = 2
HEAD_SIZE = 32
EOS = 2


def tiny_model_dir(kv_heads: int = KV_HEADS) -> str:
    """A directory holding a tiny Llama's ``config.json`` with ``kv_heads`` KV heads (no
    weights: the scheduler reads the shape only)."""
    d = os.path.join(tempfile.gettempdir(), "kvferry-vllm-tiny-llama" + ("" if kv_heads == KV_HEADS else f"-{kv_heads}kv"))
    os.makedirs(d, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": kv_heads * 2 * HEAD_SIZE,
        "intermediate_size": 256,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": kv_heads * 2,
        "num_key_value_heads": kv_heads,
        "head_dim": HEAD_SIZE,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": EOS,
        "tie_word_embeddings": False,
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


#: MLA's latent KV per token: ``kv_lora_rank`` 64 + ``qk_rope_head_dim`` 16 (``tiny_mla_dir``).
MLA_LATENT = 80


def tiny_mla_dir() -> str:
    """A directory holding a tiny DeepSeek-V2's ``config.json``: vLLM's ModelConfig says
    ``use_mla`` for it (no weights: the scheduler reads the shape only)."""
    d = os.path.join(tempfile.gettempdir(), "kvferry-vllm-tiny-mla")
    os.makedirs(d, exist_ok=True)
    cfg = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 1000,
        "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
        "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 4,
        "kv_lora_rank": 64, "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
        "v_head_dim": 32, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": LAYERS, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": EOS, "tie_word_embeddings": False,
        "rope_theta": 10000, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "norm_topk_prob": False, "scoring_func": "softmax",
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def make_config(role: str, port: int, block_size: int = BLOCK_SIZE, dtype: str = "float32",
                policy: str = "recompute", extra: Optional[dict] = None,
                max_num_batched_tokens: int = 64, tp: int = 1, kv_heads: int = KV_HEADS,
                dp: tuple[int, int] = (0, 1), mla: bool = False, pp: int = 1, hybrid: bool = False,
                prefix_off: bool = False):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(model=tiny_mla_dir() if mla else tiny_model_dir(kv_heads), dtype=dtype, seed=0, skip_tokenizer_init=True)
    scheduler = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=2048,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        # A hybrid engine (``window``) runs vLLM's hybrid KV cache manager, as vLLM does for
        # a model with sliding-window layers when the connector supports it.
        disable_hybrid_kv_cache_manager=False if hybrid else None,
    )
    # Recurrent state cached in vLLM's "none" mode: no prefix caching (``Side(mamba=True)``).
    cache = CacheConfig(block_size=block_size, cache_dtype="auto", enable_prefix_caching=not prefix_off)
    transfer = KVTransferConfig(
        kv_connector="KvferryConnector",
        kv_connector_module_path="kvferry.vllm",
        kv_role=role,
        kv_load_failure_policy=policy,
        kv_connector_extra_config={
            "port": port,
            "host": "127.0.0.1",
            "listen_host": "127.0.0.1",
            "lease_s": 30,
            "bootstrap_timeout_ms": 5000,
            "unreachable_timeout_ms": 2000,
            **(extra or {}),
        },
    )
    return VllmConfig(
        model_config=model,
        scheduler_config=scheduler,
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                       data_parallel_rank=dp[0],
                                       data_parallel_size=dp[1]),
    )


def pattern(prompt: list[int], block: int, layer: int, nbytes: int) -> torch.Tensor:
    """The bytes a prefill's forward pass leaves in block ``block`` of a request."""
    seed = (sum((i + 1) * t for i, t in enumerate(prompt)) * 1_000_003 + block * 7919 + layer * 104729) % (2**31)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


#: Recurrent state over the whole model (vLLM's default "SD" conv layout, float32), per
#: kind: 3 kernel rows of each conv projection's channels, then an SSM state of 4 heads of
#: (8, 8). GDN: 16 query, 16 key and 32 value channels (value heads of (dv, dk)); Mamba2:
#: 32 x channels (4 heads of 8), 16 B and 16 C channels (2 groups of state 8). A TP rank
#: holds its share of each projection and of the heads.
STATE_KINDS = {
    "gdn": dict(projections=(16, 16, 32), mamba_type="GDN_ATTN", groups=0),
    "mamba2": dict(projections=(32, 16, 16), mamba_type="MAMBA2", groups=2),
}
STATE_ROWS, STATE_HEADS, STATE_HEAD = 3, 4, (8, 8)


def state_shapes(tp: int, kind: str = "gdn") -> tuple[tuple[int, int], tuple[int, int, int]]:
    """A state layer's shapes on a rank of a TP ``tp`` engine, as vLLM computes them."""
    return (STATE_ROWS, sum(STATE_KINDS[kind]["projections"]) // tp), (STATE_HEADS // tp, *STATE_HEAD)


def state_bytes(tp: int, elem: int = 4, kind: str = "gdn") -> int:
    """Bytes of a rank's state (conv, then SSM state) at TP ``tp``."""
    conv, ssm = state_shapes(tp, kind)
    return (conv[0] * conv[1] + ssm[0] * ssm[1] * ssm[2]) * elem


def state_share(prompt: list[int], tp: int = 1, rank: int = 0, elem: int = 4, kind: str = "gdn") -> torch.Tensor:
    """The bytes rank ``rank`` of a TP ``tp`` engine holds of the state ``prompt`` leaves:
    its share of the model's (each conv row's share of every projection, then its heads), so
    that ranks of any TP sizes hold parts of one state."""
    whole = pattern(prompt, 0, 1, state_bytes(1, elem, kind))
    projections = STATE_KINDS[kind]["projections"]
    conv = whole[: STATE_ROWS * sum(projections) * elem].view(STATE_ROWS, -1, elem)
    ssm = whole[conv.numel():].view(STATE_HEADS, -1)
    rows, at = [], 0
    for n in projections:
        k = n // tp
        rows.append(conv[:, at + rank * k:at + (rank + 1) * k])
        at += n
    h = STATE_HEADS // tp
    return torch.cat([torch.cat(rows, dim=1).reshape(-1), ssm[rank * h:(rank + 1) * h].reshape(-1)])


def state_spec(block_size: int, dtype, page_bytes: int, tp: int = 1, kind: str = "gdn"):
    """vLLM's ``MambaSpec`` of a state layer at TP ``tp`` (recurrent state in mode "none")."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=block_size, shapes=state_shapes(tp, kind), dtypes=(dtype, dtype),
                     page_size_padded=page_bytes,
                     mamba_type=MambaAttentionBackendEnum[STATE_KINDS[kind]["mamba_type"]])


def with_groups(config, kind: str):
    """``config`` with its model naming the state kind's B/C groups (Mamba2), as such a
    model's config does."""
    groups = STATE_KINDS[kind]["groups"]
    if groups:
        config.model_config.hf_config.n_groups = groups
    return config


class Side:
    """vLLM's scheduler and kvferry's worker connector of one engine, stepped by hand. With
    ``window`` (tokens), a hybrid model: layer 0 full attention, layer 1 a sliding window,
    each its own KV cache group with its own block table, both layers over one tensor; with
    ``chunk`` (tokens), layer 1 chunked local attention instead; with ``mamba``, layer 1
    keeps recurrent state (conv and SSM state views into the shared tensor's blocks, one
    block per request), and a step writes a state derived from every token computed so far."""

    def __init__(self, role: str, port: int, num_blocks: int = 256, window: int = 0, chunk: int = 0,
                 mamba: bool = False, **kw):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            ChunkedLocalAttentionSpec,
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        from kvferry.vllm import KvferryConnector

        hybrid = bool(window or chunk or mamba)
        self.config = make_config(role, port, hybrid=hybrid, prefix_off=mamba, **kw)
        block_size = self.config.cache_config.block_size
        dtype = self.config.model_config.dtype
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=dtype)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        self.mamba = mamba
        scheduler_block = block_size
        if mamba:
            # One state block per request ("none" mode: its block spans the model's length).
            scheduler_block = self.config.model_config.max_model_len
            local = state_spec(scheduler_block, dtype, spec.page_size_bytes)
            groups = [KVCacheGroupSpec(names[:1], spec), KVCacheGroupSpec(names[1:], local)]
        elif window or chunk:
            shape = dict(block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=dtype)
            local = (SlidingWindowSpec(sliding_window=window, **shape) if window
                     else ChunkedLocalAttentionSpec(attention_chunk_size=chunk, **shape))
            groups = [KVCacheGroupSpec(names[:1], spec), KVCacheGroupSpec(names[1:], local)]
        else:
            groups = [KVCacheGroupSpec(names, spec)]
        #: The KV cache group of each layer.
        self.group_of = [next(g for g, group in enumerate(groups) if n in group.layer_names) for n in names]
        self.window, self.chunk = window, chunk
        kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=scheduler_block,
            log_stats=True,
        )
        # vLLM's CPU layout: [num_blocks, num_kv_heads, block_size, 2 * head_size] per layer.
        self.kv = {
            name: torch.zeros((num_blocks, KV_HEADS, block_size, 2 * HEAD_SIZE), dtype=dtype)
            for name in names
        }
        if hybrid:
            # vLLM's hybrid allocation: one tensor per position in a group, shared by the
            # groups' layers (a block belongs to one group at a time).
            shared = self.kv[names[0]]
            self.kv = {name: shared.view(shared.shape) for name in names}
        registered = self.kv
        if mamba:
            # vLLM 0.32.0's cache of a state layer: an int8 view of the state's bytes at the
            # start of each block of the tensor it shares (strided by the attention page),
            # here registered before the attention layer, as a model whose first layer
            # keeps state registers it.
            state = state_bytes(1, shared.element_size())
            view = torch.as_strided(shared.view(torch.int8), (num_blocks, 1, 1, state),
                                    (spec.page_size_bytes, state, state, 1))
            registered = {names[1]: view, **{n: t for n, t in self.kv.items() if n != names[1]}}
        self.worker = KvferryConnector(self.config, KVConnectorRole.WORKER, kv_config)
        self.worker.register_kv_caches(registered)
        self.block_bytes = KV_HEADS * block_size * 2 * HEAD_SIZE * self.kv[names[0]].element_size()
        #: Bytes of the state this harness writes in a state block (conv, then SSM state).
        self.state_bytes = state_bytes(1, self.kv[names[0]].element_size())
        self.outputs: dict[str, object] = {}
        self.load_failures: set[str] = set()
        self.loaded: set[str] = set()
        #: What the worker reported through vLLM's connector stats, every step together.
        self.transfer_stats = None
        self.role = role

    def add(self, request_id: str, prompt: list[int], max_tokens: int, params: Optional[dict]):
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"kv_transfer_params": params} if params else None)
        req = Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=sp,
                      pooling_params=None, mm_features=None,
                      block_hasher=get_request_block_hasher(self.config.cache_config.block_size, sha256))
        if params is not None:
            req.kv_transfer_params = params
        self.scheduler.add_request(req)
        return req

    def blocks_of(self, request_id: str, layer: int = 0) -> list[int]:
        """The block table of ``layer``'s KV cache group for the request."""
        blocks = self.scheduler.kv_cache_manager.get_blocks(request_id)
        return blocks.get_block_ids()[self.group_of[layer]]

    def first_block(self, layer: int, tokens: int) -> int:
        """The first block of a ``tokens``-token prompt that ``layer`` keeps for the next
        token (a sliding window frees the blocks wholly before it)."""
        if self.group_of[layer] == 0:
            return 0
        bs = self.config.cache_config.block_size
        if self.window:
            return max(0, tokens - self.window + 1) // bs
        if self.chunk:
            return tokens // self.chunk * self.chunk // bs
        return 0

    def block_bytes_of(self, block: int, layer: int) -> torch.Tensor:
        name = f"model.layers.{layer}.self_attn.attn"
        return self.kv[name][block].contiguous().view(torch.uint8).reshape(-1)

    def step(self):
        """One engine step: schedule, bind the metadata, the 'forward pass', the transfer
        results, and vLLM's bookkeeping of them. Returns the requests that finished."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        # The model runner's order: preemptions first (before any block is overwritten).
        self.worker.handle_preemptions(out.kv_connector_metadata)
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        sampled = {}
        # The forward pass, layer by layer over the batch, as vLLM's model runs it: each
        # layer writes its KV for every scheduled request, then the connector hears of it.
        for layer in range(LAYERS):
            for req_id, n in out.num_scheduled_tokens.items():
                req = self.scheduler.requests[req_id]
                # schedule() already counted the scheduled tokens as computed.
                self._forward(req, req.num_computed_tokens - n, n, layer)
            if out.num_scheduled_tokens and not (self.mamba and layer == 1):
                # vLLM's state layers (Mamba, GDN) do not call save_kv_layer.
                name = f"model.layers.{layer}.self_attn.attn"
                self.worker.save_kv_layer(name, self.kv[name], None)
        for req_id in out.num_scheduled_tokens:
            req = self.scheduler.requests[req_id]
            sampled[req_id] = [7] if req.num_computed_tokens >= req.num_tokens else []
        self.worker.wait_for_save()
        results = self.worker.get_transfer_results(out.finished_req_ids)
        invalid = self.worker.get_block_ids_with_load_errors()
        # As the model runner does, after the transfer results.
        stats = self.worker.get_kv_connector_stats()
        if stats is not None:
            self.transfer_stats = stats if self.transfer_stats is None else self.transfer_stats.aggregate(stats)
        self.worker.clear_connector_metadata()
        self.load_failures |= results.failed_recving
        self.loaded |= results.finished_recving - results.failed_recving
        req_ids = list(sampled)
        connector_out = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=invalid,
            kv_connector_stats=stats,
        )
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=connector_out,
        )
        finished = []
        for eco in self.scheduler.update_from_output(out, mro).values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.outputs[o.request_id] = o
                    finished.append(o)
        return finished

    def _forward(self, req, first: int, n: int, layer: int) -> None:
        """Writes the pattern into every block the scheduled tokens touch: a prefill's
        compute, or a decode's that recomputes a prompt it could not load. A decode that
        loaded the prompt recomputes only its last token, which would rewrite the same bytes:
        it writes nothing, so the check sees exactly what kvferry delivered."""
        params = req.kv_transfer_params or {}
        if self.role == "kv_consumer" and params.get("do_remote_prefill") and req.request_id not in self.load_failures:
            return
        last = min(first + n, req.num_prompt_tokens)
        if last <= first:
            return
        blocks = self.blocks_of(req.request_id, layer)
        if self.mamba and layer == 1:
            # Recurrent state: the step leaves a state of every token computed so far.
            self.state_of(blocks)[:] = state_share(req.prompt_token_ids[:last])
            return
        bs = self.config.cache_config.block_size
        # Only the token rows this step computes: a block sent before all its tokens were
        # written would fail the check.
        for index in range(first // bs, (last - 1) // bs + 1):
            assert blocks[index] != 0, f"{req.request_id}: layer {layer} computes into vLLM's null block"

            lo = max(first, index * bs) - index * bs
            hi = min(last, (index + 1) * bs) - index * bs
            rows = self.block_bytes_of(blocks[index], layer).view(KV_HEADS, bs, -1)
            want = pattern(req.prompt_token_ids, index, layer, self.block_bytes).view(KV_HEADS, bs, -1)
            rows[:, lo:hi, :] = want[:, lo:hi, :]

    def state_of(self, blocks: list[int]) -> torch.Tensor:
        """The bytes of a request's state (its state group's one block) this harness writes."""
        live = [b for b in blocks if b != 0]
        assert len(live) == 1, f"state blocks {blocks}"
        page = self.kv["model.layers.0.self_attn.attn"][live[0]]
        return page.view(torch.uint8).reshape(-1)[: self.state_bytes]

    def check_blocks(self, request_id: str, prompt: list[int], held: int = 0) -> int:
        """Checks every byte of the request's prompt blocks from block ``held`` (the ones
        before it this engine held itself: another prompt's pattern); returns the prompt's
        blocks."""
        if self.mamba and len(prompt) > 1:
            # The decode loads all but the last token, which it recomputes from the state.
            prompt = prompt[:-1]
        bs = self.config.cache_config.block_size
        n = -(-len(prompt) // bs)
        checked = 0
        for index in range(held, n):
            rows = min(len(prompt) - index * bs, bs)  # the prompt's tokens in this block
            for layer in range(LAYERS):
                if self.mamba and layer == 1:
                    continue
                if index < self.first_block(layer, len(prompt)):
                    continue  # out of the layer's window: vLLM freed it
                blocks = self.blocks_of(request_id, layer)
                checked += 1
                got = self.block_bytes_of(blocks[index], layer).view(KV_HEADS, bs, -1)[:, :rows, :]
                want = pattern(prompt, index, layer, self.block_bytes).view(KV_HEADS, bs, -1)[:, :rows, :]
                if not torch.equal(got, want):
                    same = int((got == want).sum())
                    raise AssertionError(
                        f"{request_id}: block {index} layer {layer} differs "
                        f"({same} of {want.numel()} bytes equal, zero: {not bool(got.any())})"
                    )
        assert checked, f"{request_id}: no block checked"
        if self.mamba:
            got = self.state_of(self.blocks_of(request_id, 1))
            if not torch.equal(got, state_share(prompt)):
                raise AssertionError(f"{request_id}: the state differs")
        return n

    def idle(self) -> bool:
        return not self.scheduler.requests

    def shutdown(self):
        self.worker.shutdown()
        self.scheduler.shutdown()
