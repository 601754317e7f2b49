"""SGLang's ``KVArgs`` and parallel context as a kvferry node's layout, and the layouts it refuses."""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.server_args import ServerArgs


class UnsupportedLayout(ValueError):
    """The model's KV pool or parallel layout is one the kvferry backend does not move."""


def _model_shape(server_args: ServerArgs) -> tuple:
    """(layers, KV heads) of the served model, from its config (what SGLang's ModelConfig
    reads); used where ``KVArgs`` does not carry them (decode ranks, pipeline stages)."""
    try:
        # SGLang's own reading of the model: the KV head count it sizes prefill pools with.
        from sglang.srt.configs.model_config import ModelConfig

        mc = ModelConfig.from_server_args(server_args)
        return int(mc.num_hidden_layers), int(mc.get_total_num_kv_heads())
    except Exception:  # noqa: BLE001 - fall back to the config file itself
        pass
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            server_args.model_path,
            trust_remote_code=getattr(server_args, "trust_remote_code", False),
            revision=getattr(server_args, "revision", None),
        )
    except Exception as e:  # noqa: BLE001 - any failure to read it is the same refusal
        raise UnsupportedLayout(
            f"kvferry backend: cannot read the model config at {server_args.model_path!r} "
            f"to learn its layer and KV head counts: {e}"
        ) from None
    text = getattr(config, "text_config", None) or config
    heads = getattr(text, "num_key_value_heads", None) or getattr(
        text, "num_attention_heads", 0
    )
    return int(getattr(text, "num_hidden_layers", 0)), int(heads or 0)


# State components whose indices are whole items of every buffer, paired by position on
# both sides: they move as kvferry extra pools.
_STATE_TYPES = ("mamba", "swa", "dsa")


def _extras_of(args: KVArgs, prefill: bool) -> list:
    """kvferry extra pools for SGLang's state components: per component, its buffers as
    ``(address, bytes, item bytes)``, every buffer cut to the items all of them hold."""
    types = [str(getattr(t, "value", t)) for t in (getattr(args, "state_types", None) or [])]
    ptrs = getattr(args, "state_data_ptrs", None) or []
    if not types and not any(ptrs):
        return []
    other = [t for t in types if t not in _STATE_TYPES]
    if other or len(types) != len(ptrs):
        raise UnsupportedLayout(
            f"kvferry backend: state types {other or types} are not supported (state pools "
            f"move for {', '.join(_STATE_TYPES)}; this pool lists {types} over "
            f"{len(ptrs)} components)"
        )
    from sglang.srt.runtime_context import get_parallel

    pp_prefill = get_parallel().pp_size if prefill else 1
    if pp_prefill > 1:
        raise UnsupportedLayout(
            f"kvferry backend: state pools ({', '.join(types)}) with pipeline-parallel "
            f"prefill (PP {pp_prefill}) are not supported: each stage holds only its layers' "
            "state"
        )
    pools = []
    for i, kind in enumerate(types):
        bufs = [int(p) for p in ptrs[i]]
        lens = [int(n) for n in args.state_data_lens[i]]
        items = [int(n) for n in args.state_item_lens[i]]
        if not bufs or len(lens) != len(bufs) or len(items) != len(bufs) or min(items) <= 0:
            raise UnsupportedLayout(
                f"kvferry backend: {kind} state lists {len(bufs)} buffers, {len(lens)} "
                f"lengths and {len(items)} item sizes {items}"
            )
        held = min(n // item for n, item in zip(lens, items))
        pools.append([(p, held * item, item) for p, item in zip(bufs, items)])
    return pools


def _state_parts(args: KVArgs, extras: list, heads: Optional[tuple], tp: int, rank: int,
                 page_size: int) -> list:
    """kvferry's parts of each state buffer's items (``Node(extra_parts=)``), so that ranks
    of different attention TP sizes exchange their shares: Mamba state from SGLang's own
    slicing descriptors (a GDN conv buffer's query, key and value channels, each head-sharded
    on its own; a temporal buffer's heads; a replicated buffer whole), sliding-window pages
    (NHD) by heads as the KV pages. Empty where the layout holds the same heads everywhere
    (MLA, so also the KDA models, whose attention is MLA) or any buffer's split is not known
    (Mamba2's conv order, DSA on MHA, HND window pages): its pools then move between equal
    heads only, and peers holding other heads are refused at the handshake."""
    if heads is None or not extras:
        return []
    types = [str(getattr(t, "value", t)) for t in (getattr(args, "state_types", None) or [])]
    out = []
    for i, (kind, pool) in enumerate(zip(types, extras)):
        items = [item for _addr, _bytes, item in pool]
        if kind == "swa":
            total, first, count, head = heads
            # Token rows of heads (NHD): SGLang's HND pages hold the same bytes in another order.
            layout = getattr(args, "swa_kv_cache_layout", None)
            if layout not in (None, "nhd", "NHD") or any(item != page_size * count * head for item in items):
                return []
            out.append([[(0, page_size, count * head, total, first, count, head)]] * len(items))
        elif kind == "mamba":
            parts = _mamba_parts(args, i, items, tp, rank)
            if parts is None:
                return []
            out.append(parts)
        else:
            return []
    return out


def _mamba_parts(args: KVArgs, pool: int, items: List[int], tp: int, rank: int) -> Optional[list]:
    """The parts of a Mamba pool's buffers from SGLang's descriptors (``state_dim_per_tensor``:
    each buffer's slice-axis size here, 0 for a replicated one; ``state_slice_outer_counts``:
    the rows before that axis; ``state_conv_shard_groups``: a conv buffer's full sub-block
    sizes); None where one is missing or a buffer's split is not known."""
    def of(name: str) -> list:
        lists = getattr(args, name, None) or []
        return list(lists[pool]) if pool < len(lists) and lists[pool] is not None else []

    dims, outer, groups = of("state_dim_per_tensor"), of("state_slice_outer_counts"), of("state_conv_shard_groups")
    if len(dims) != len(items) or len(outer) != len(items):
        return None
    groups = groups + [None] * (len(items) - len(groups))
    # A pool whose conv buffers name their sub-blocks (GDN): its other buffers are single
    # head-sharded axes. Without any (Mamba2's conv order), nothing is split.
    if not any(groups):
        return None
    parts = []
    for item, d, rows, g in zip(items, (int(x) for x in dims), (int(x) for x in outer), groups):
        if d == 0:
            parts.append([(0, 1, 0, 1, 0, 1, item)])
            continue
        if rows <= 0 or item % (rows * d):
            return None
        unit = item // (rows * d)
        blocks = [int(x) for x in g] if g else [d * tp]
        if any(b % tp for b in blocks) or sum(b // tp for b in blocks) != d or max(blocks) > 0xFFFF:
            return None
        at, mine = 0, []
        for b in blocks:
            n = b // tp
            mine.append((at * unit, rows, d * unit, b, rank * n, n, unit))
            at += n
        parts.append(mine)
    return parts


def _state_items(state_indices: Optional[List]) -> List[List[int]]:
    """SGLang's per-component state indices (an array, a list holding one array for Mamba,
    or None for a component not sent) as kvferry's per-pool item lists."""
    out = []
    for x in state_indices or []:
        if x is None:
            out.append([])
        else:
            out.append(np.asarray(x, dtype=np.int64).reshape(-1).tolist())
    return out


def _layout_of(args: KVArgs, server_args: ServerArgs, is_mla: bool, prefill: bool) -> tuple:
    """kvferry's layout for SGLang's buffers: one region per (layer, K or V) of the layers
    this rank holds (MLA: one per layer), the heads it holds, its layers (a prefill pipeline
    stage holds a range), one staging row per aux slot holding every aux buffer's item, and
    one extra pool per state component.

    Returns ``(layout, kv spans, heads or None, layer range or None, extra pools, their
    parts)``.
    """
    extras = _extras_of(args, prefill)
    if getattr(args, "num_draft_entries", 0):
        raise UnsupportedLayout(
            "kvferry backend: speculative decoding's draft KV buffers are not supported; this "
            f"pool has {args.num_draft_entries} (run without --speculative-algorithm)"
        )
    if getattr(args, "kv_layout", None) not in (None, "nhd", "NHD"):
        raise UnsupportedLayout(
            f"kvferry backend: KV layout {args.kv_layout!r} is not supported (only NHD)"
        )
    item_lens = list(args.kv_item_lens)
    if not item_lens or len(set(item_lens)) != 1:
        raise UnsupportedLayout(
            "kvferry backend: every KV buffer must have the same page size (K and V of the "
            f"same head size), got {sorted(set(item_lens))}"
        )
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    page_bytes = item_lens[0]
    pages = min(n // i for n, i in zip(args.kv_data_lens, item_lens))
    ptrs = [int(p) for p in args.kv_data_ptrs]
    planes = 1 if is_mla else 2
    if len(ptrs) % planes:
        raise UnsupportedLayout(
            f"kvferry backend: {len(ptrs)} KV buffers do not split into K and V per layer"
        )
    held = len(ptrs) // planes
    if is_mla:
        spans = [(p, pages * page_bytes) for p in ptrs]
    else:
        # SGLang lists every K buffer, then every V buffer; kvferry's regions go by layer.
        spans = [
            (p, pages * page_bytes) for layer in range(held) for p in (ptrs[layer], ptrs[held + layer])
        ]
    layer_range = None
    layers = held
    if prefill and parallel.pp_size > 1:
        start, end = int(args.prefill_start_layer), int(args.prefill_end_layer)
        if end - start != held:
            raise UnsupportedLayout(
                f"kvferry backend: PP stage layers {start}..{end} but {held} KV layers registered"
            )
        layers = _model_shape(server_args)[0]
        if not end <= layers:
            raise UnsupportedLayout(
                f"kvferry backend: PP stage layers {start}..{end} outside the model's {layers}"
            )
        layer_range = (start, end)
    heads = None
    if not is_mla:
        per_rank = int(getattr(args, "kv_head_num", 0) or 0)
        total = int(getattr(args, "total_kv_head_num", 0) or 0)
        tp = parallel.attn_tp_size
        if not total:
            total = _model_shape(server_args)[1]
        if not per_rank:
            per_rank = max(1, total // tp)
        page_size = int(getattr(args, "page_size", 0) or server_args.page_size or 1)
        row = page_bytes // page_size if page_bytes % page_size == 0 else 0
        if not total or not row or row % per_rank:
            raise UnsupportedLayout(
                f"kvferry backend: a page of {page_bytes} bytes is not {page_size} token rows "
                f"of {per_rank} KV heads (of {total})"
            )
        # SGLang's head placement: ranks share heads when there are fewer heads than ranks.
        replicas = max(1, tp // total)
        local = args.engine_rank % tp
        heads = (total, (local // replicas) * per_rank, per_rank, row // per_rank)
    aux_items = list(args.aux_item_lens)
    slots = min(n // i for n, i in zip(args.aux_data_lens, aux_items)) if aux_items else 0
    layout = dict(
        layers=layers,
        planes=planes,
        page_bytes=page_bytes,
        pages=pages,
        aux_bytes=sum(aux_items),
        slots=slots,
    )
    parts = []
    if heads is not None:
        tp = parallel.attn_tp_size
        page_size = int(getattr(args, "page_size", 0) or server_args.page_size or 1)
        parts = _state_parts(args, extras, heads, tp, args.engine_rank % tp, page_size)
    return layout, spans, heads, layer_range, extras, parts
