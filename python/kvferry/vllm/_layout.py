"""vLLM's parallel layout and KV tensors as kvferry sees them: ranks, heads, layers, shape, regions."""

from __future__ import annotations

from typing import Any, Optional

from kvferry.vllm._params import _ADDRS, _SHAPE


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
    by heads where each side splits the heads evenly. A prefill with more ranks than heads
    holds each head on several ranks: the decode ranks of one head must then be a multiple
    of its prefill ranks, or fewer. MLA's latent KV is whole on every rank: any pair where the
    decode's size is a multiple of the prefill's, or smaller."""
    if prefill_tp == decode_tp:
        return None
    why = None
    if mla:
        if decode_tp > prefill_tp and decode_tp % prefill_tp:
            why = "MLA: the decode's TP is not a multiple of the prefill's"
    elif not total:
        why = "the model names no KV head count"
    elif prefill_tp > total:
        replicas, per_head = prefill_tp // total, max(1, decode_tp // total)
        if prefill_tp % total or (total % decode_tp and decode_tp % total):
            why = f"{total} KV heads do not split evenly over both"
        elif per_head > replicas and per_head % replicas:
            why = (f"each of the {total} KV heads is on {replicas} prefill ranks and {per_head} "
                   "decode ranks, not a multiple")
    elif total % prefill_tp or (total % decode_tp and decode_tp % total):
        why = f"{total} KV heads do not split evenly over both"
    elif decode_tp < total and (total // prefill_tp) % (total // decode_tp) and (total // decode_tp) % (total // prefill_tp):
        # A prefill rank's heads would straddle two decode ranks' (each then loading from a
        # different number of ranks than the others).
        why = (f"{total // prefill_tp} KV heads per prefill rank and {total // decode_tp} per "
               "decode rank: neither holds a whole number of the other's")
    if why is None:
        return None
    return f"the prefill runs TP {prefill_tp} ({_ADDRS} names {prefill_tp} ranks), this decode TP {decode_tp}: {why}"


def tp_sources(prefill_tp: int, decode_tp: int, total: int, rank: int,
               mla: bool = False) -> tuple[list[int], int, list[int]]:
    """The prefill ranks decode rank ``rank`` names in its room (those holding any of its
    heads; rank to rank at equal sizes), how many decode ranks each of them sends to, and the
    positions among them of idle sources (they only confirm). MLA: rank ``rank % prefill_tp``
    sends the latent KV, and each prefill rank no decode rank loads from is an idle source of
    decode rank ``p % decode_tp``, so that every prefill rank hears of the room. A prefill
    holding each head on several ranks: see :func:`replica_sources`."""
    if prefill_tp == decode_tp:
        return [rank], 1, []
    if mla:
        idle = [p for p in range(decode_tp, prefill_tp) if p % decode_tp == rank]
        receivers = decode_tp // prefill_tp if decode_tp > prefill_tp else 1
        return [rank % prefill_tp] + idle, receivers, list(range(1, 1 + len(idle)))
    if prefill_tp > total:
        return replica_sources(prefill_tp, decode_tp, total, rank)
    first, count = rank_heads(total, decode_tp, rank)
    per = total // prefill_tp
    sources = list(range(first // per, (first + count - 1) // per + 1))
    # Decode ranks holding heads of the first source (every source serves as many).
    lo, hi = sources[0] * per, sources[0] * per + per
    receivers = sum(1 for r in range(decode_tp)
                    if (lambda f, c: f < hi and f + c > lo)(*rank_heads(total, decode_tp, r)))
    return sources, receivers, []


def state_sources(prefill_tp: int, decode_tp: int, rank: int) -> tuple[list[int], int, list[int]]:
    """As :func:`tp_sources` for a model whose recurrent state is split by TP rank: decode
    rank ``rank`` names every prefill rank holding some of its share of the state (each
    rank's share is its equal part of the model's), and each of them writes its part of
    that share and the KV heads both hold; with more prefill ranks than KV heads, every
    replica of a head then writes it."""
    if prefill_tp >= decode_tp:
        per = prefill_tp // decode_tp
        return list(range(rank * per, (rank + 1) * per)), 1, []
    return [rank * prefill_tp // decode_tp], decode_tp // prefill_tp, []


def state_pair_refusal(prefill_tp: int, decode_tp: int) -> Optional[str]:
    """Why ranks at these TP sizes cannot exchange a state split by TP rank, or None: one
    size must be a multiple of the other (every rank's share then lies within one rank's of
    the smaller size)."""
    if max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp):
        return (f"the prefill runs TP {prefill_tp}, this decode TP {decode_tp}: a recurrent state "
                "split by TP rank moves between sizes that divide one another")
    return None


def replica_sources(prefill_tp: int, decode_tp: int, total: int,
                    rank: int) -> tuple[list[int], int, list[int]]:
    """As :func:`tp_sources` for a prefill with more ranks than heads, each head on
    ``prefill_tp / total`` consecutive ranks (its replicas): each of a decode rank's heads
    comes from one replica, the decode ranks of one head taking its replicas in turn (so
    each replica feeds as many). A replica no decode rank loads from is an idle source of a
    decode rank holding its head (a prefill rank serves only ranks that share its heads), so
    that its blocks go back when the room ends."""
    replicas = prefill_tp // total
    per_head = max(1, decode_tp // total)
    first, count = rank_heads(total, decode_tp, rank)
    # This rank's turn among the decode ranks of its head (one rank per head: its own rank,
    # so that the decode ranks spread over the replicas).
    turn = rank % per_head if decode_tp > total else rank
    # The replicas of a head its decode ranks load from (the same for every head).
    loaded = {t % replicas for t in (range(per_head) if decode_tp > total else [turn])}
    sources, idle = [], []
    for h in range(first, first + count):
        sources.append(h * replicas + turn % replicas)
        idle += [h * replicas + j for j in range(replicas)
                 if j not in loaded and j % per_head == turn % per_head]
    receivers = max(1, per_head // replicas)
    return sources + idle, receivers, list(range(len(sources), len(sources) + len(idle)))


def kv_heads(kv_caches: dict, num_blocks: int, block_size: int, total: int, tp: int,
             rank: int) -> Optional[tuple[int, int, int, int]]:
    """The heads this rank's KV blocks hold, as kvferry's ``heads`` (total, first, count,
    bytes of one head in a token row), from vLLM's layouts: ``[blocks, heads, block_size,
    2 * head_size]`` (the CPU backend: each head's rows contiguous, so one "row" per block of
    ``heads`` parts) or ``[2, blocks, block_size, heads, head_size]`` (token rows of heads).
    None where the layout is neither (such a rank moves whole blocks: equal TP sizes only)."""
    first, count = rank_heads(total, tp, rank)
    # The attention layers' tensors (a state layer's views are lists or strided).
    attention = [t for t in kv_caches.values() if not isinstance(t, (list, tuple)) and t.is_contiguous()]
    if not attention:
        return None
    t = attention[0]
    dims, elem = tuple(t.shape), t.element_size()
    if len(dims) == 4 and dims[0] == num_blocks and dims[1] == count and dims[2] == block_size:
        return total, first, count, block_size * dims[3] * elem
    if len(dims) == 5 and dims[:2] == (2, num_blocks) and dims[2] == block_size and dims[3] == count:
        return total, first, count, dims[4] * elem
    return None


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


def _layer_base(entry) -> int:
    """Where a layer's KV starts: its tensor's, or for recurrent state (a list of views into
    the layer's blocks: conv, then SSM state) the first view's."""
    if isinstance(entry, (list, tuple)):
        return min(int(t.data_ptr()) for t in entry)
    return int(entry.data_ptr())


def _state_region(name: str, views, num_blocks: int, block: int) -> tuple[int, int]:
    """``(start, bytes)`` of a recurrent-state layer's blocks: its views must lie in
    ``num_blocks`` blocks of ``block`` bytes from the first view's start (the blocks the
    attention layers sharing its tensor hold), else it is refused naming them."""
    base = _layer_base(views)
    for t in views:
        step = int(t.stride(0) * t.element_size())
        # The bytes of one block the view spans.
        extent = (1 + sum((n - 1) * st for n, st in zip(t.shape[1:], t.stride()[1:]))) * t.element_size()
        if tuple(t.shape)[0] != num_blocks or step != block or extent > block:
            raise ValueError(f"kvferry.vllm: the state of {name} {tuple(t.shape)} is not {num_blocks} blocks "
                             f"of {block} bytes (a block every {step} bytes)")
    return base, block * num_blocks


def _state_views(kv_caches: dict, num_blocks: int) -> dict:
    """The recurrent-state layers among ``kv_caches``, each as its list of views: vLLM
    registers a state layer as its state tensors (conv, SSM), or as one strided view of the
    blocks' state bytes."""
    states = {}
    for name, t in kv_caches.items():
        if isinstance(t, (list, tuple)):
            states[name] = t
        elif t.dim() > 1 and tuple(t.shape)[0] == num_blocks and not t.is_contiguous():
            states[name] = [t]
    return states


def state_regions(kv_caches: dict, num_blocks: int, block: int) -> list[tuple[int, int, int]]:
    """The tensors holding recurrent state, once each, as a kvferry extra pool's tensors
    ``(address, bytes, item bytes)``: one item per vLLM block (a state block is a page of the
    tensor its layer shares with the attention layers)."""
    out, seen = [], set()
    for name, views in _state_views(kv_caches, num_blocks).items():
        base, size = _state_region(name, views, num_blocks, block)
        if base not in seen:
            seen.add(base)
            out.append((base, size, block))
    return out


def kv_regions(kv_caches: dict, num_blocks: int) -> tuple[list[tuple[int, int]], int, int, int]:
    """``(spans, planes, page_bytes, pages)`` of vLLM's KV tensors as kvferry regions: one
    region per distinct layer tensor (layers that share a cache appear once) and plane, one
    page per vLLM block. A layer is ``[num_blocks, ...]`` (K and V inside each block: vLLM's
    CPU layout, one plane) or ``[2, num_blocks, ...]`` (K, then V: two planes). Anything
    else, or blocks that are not contiguous equal byte ranges, is refused naming the shape."""
    spans, seen, shape = [], set(), None
    # Recurrent state shares the blocks of the attention layers' tensors (vLLM's views of a
    # state layer's blocks are padded to the attention page, so strided): checked against
    # the attention layers' blocks below.
    states = _state_views(kv_caches, num_blocks)
    for name, t in kv_caches.items():
        if name in states:
            continue
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
    for name, views in states.items():
        if shape[0] != 1:
            raise ValueError(f"kvferry.vllm: {name} keeps recurrent state beside K and V planes; "
                             "kvferry moves state in block-major layouts only")
        region = _state_region(name, views, num_blocks, shape[1])
        if region[0] not in seen:
            seen.add(region[0])
            spans.append(region)
    return spans, shape[0], shape[1], num_blocks
