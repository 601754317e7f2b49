"""vLLM's KV cache groups as kvferry moves them: which groups a request's blocks move in,
and the order of a room's pages over them.

vLLM's hybrid KV cache manager gives each group of layers (full attention, sliding window)
its own block table over one block pool; the groups' layers share the KV tensors, so block
``b`` of any group is the same bytes in every tensor, and only the group owning ``b`` writes
them. A room's pages are the prompt's blocks index-major, each index's groups in vLLM's
order, a sliding-window group's blocks only from the first one its window still needs for
the next token (vLLM frees the ones before it). A decode that holds the first ``c`` blocks
itself (a local prefix hit) grants the tail of the same list, so a prefill that knows only
how many pages were granted sends exactly the decode's pages.

This module imports vLLM only inside ``KvGroups.of``: it must never be what pulls vLLM into
a process that only builds a config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

#: The group kinds kvferry moves, by vLLM spec class: full attention keeps every block; a
#: sliding window frees the blocks wholly before its window; chunked local attention those
#: before the current chunk.
_FULL = ("FullAttentionSpec", "MLAAttentionSpec")
_WINDOW = ("SlidingWindowSpec",)
_CHUNKED = ("ChunkedLocalAttentionSpec",)
#: Recurrent state (Mamba, GDN): one state block per request, not one per token block.
_STATE = ("MambaSpec",)


_FULL_KIND = ("full", 0, 0)

#: Recurrent-state kinds whose blocks kvferry splits across TP ranks (vLLM's
#: ``MambaAttentionBackendEnum`` names): their conv state's channels and SSM state's heads are
#: each rank's share of the model's, side by side in vLLM's order.
_SPLIT_STATE = ("GDN_ATTN", "MAMBA1", "MAMBA2")
#: Most units one part of a split block may count (kvferry's ``u16``).
_MAX_UNITS = 0xFFFF


@dataclass(frozen=True)
class StateSpec:
    """What one recurrent-state group's block holds on this rank: vLLM's state kind, its
    state tensors' shapes (conv state first, then the SSM state) and element sizes, whether
    every rank holds the whole state, and whether the conv state is stored channel-major
    (vLLM's "DS" layout) rather than kernel-row-major ("SD", its default); for Mamba2, the
    model's B/C groups (0: unknown)."""

    kind: str
    shapes: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]
    replicated: bool = False
    dim_first: bool = False
    groups: int = 0

    def _split(self, tp: int) -> Optional[tuple[list[int], int, int, int]]:
        """``(conv channels of each projection, kernel rows, SSM units, bytes of one SSM
        unit)`` on a rank of a TP ``tp`` engine, or None where kvferry does not split this
        kind."""
        if self.kind not in _SPLIT_STATE or len(self.shapes) != 2 or len(self.shapes[0]) != 2:
            return None
        dim, rows = self.shapes[0] if self.dim_first else self.shapes[0][::-1]
        ssm = self.shapes[1]
        if self.kind == "GDN_ATTN" and len(ssm) == 3:
            # Query, key and value channels (query and key alike); value heads of (dv, dk) in
            # vLLM 0.32, (dk, dv) in other builds: where the two head sizes differ, the conv
            # channels must split under exactly one reading, or the state is not split.
            heads, a, b = ssm
            readings = {dv for dv in (a, b) if dim - heads * dv > 0 and (dim - heads * dv) % 2 == 0}
            if len(readings) != 1:
                return None
            dv = readings.pop()
            key = (dim - heads * dv) // 2
            return [key, key, heads * dv], rows, heads, a * b * self.sizes[1]
        if self.kind == "MAMBA1" and len(ssm) == 2 and ssm[0] == dim:
            return [dim], rows, ssm[0], ssm[1] * self.sizes[1]
        if self.kind == "MAMBA2" and len(ssm) == 3 and self.groups:
            # x (the heads' channels), then B and C (the groups' states). Where the groups do
            # not divide over the ranks vLLM repeats some on several: no share is one rank's.
            heads, head, state = ssm
            bc = dim - heads * head
            if bc <= 0 or bc % 2 or bc // 2 * tp != self.groups * state:
                return None
            return [heads * head, bc // 2, bc // 2], rows, heads, head * state * self.sizes[1]
        return None

    def splits(self, tp: int) -> bool:
        """Whether ranks of different TP sizes can exchange this state (each its share)."""
        if self.replicated:
            return True
        split = self._split(tp)
        return split is not None and all(n * tp <= _MAX_UNITS for n in split[0] + [split[2]])

    def model_shapes(self, tp: int) -> tuple[tuple[int, ...], ...]:
        """The state's shapes over the whole model (this rank's at TP 1): what engines at any
        TP size agree on. A state kvferry does not split keeps this rank's shapes."""
        split = None if self.replicated else self._split(tp)
        if split is None:
            return self.shapes
        conv, ssm = self.shapes
        conv = (conv[0] * tp, conv[1]) if self.dim_first else (conv[0], conv[1] * tp)
        return conv, (ssm[0] * tp, *ssm[1:])

    def parts(self, tp: int, rank: int) -> list[tuple[int, int, int, int, int, int, int]]:
        """kvferry's parts of this rank's state block (``Node(extra_parts=)``): each conv
        projection's channels (a part of kernel rows, or channel-major one run), then the
        SSM state's heads (channels for Mamba1); a replicated state one part all ranks hold."""
        conv_bytes = _numel(self.shapes[0]) * self.sizes[0]
        if self.replicated:
            return [(0, 1, 0, 1, 0, 1, conv_bytes + _numel(self.shapes[1]) * self.sizes[1])]
        split = self._split(tp)
        assert split is not None, self
        projections, rows, units, unit = split
        e = self.sizes[0]
        dim = sum(projections)
        parts, at = [], 0
        for n in projections:
            if self.dim_first:
                parts.append((at * rows * e, 1, 0, n * tp, rank * n, n, rows * e))
            else:
                parts.append((at * e, rows, dim * e, n * tp, rank * n, n, e))
            at += n
        parts.append((conv_bytes, 1, 0, units * tp, rank * units, units, unit))
        return parts


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class NullBlockInRoom(ValueError):
    """A block a room needs is vLLM's null block (freed by the group's window): moving it
    would read or overwrite bytes no request owns."""


@dataclass(frozen=True)
class KvGroups:
    """The KV cache groups a request's blocks move in, in vLLM's group order: each group's
    vLLM group id and its kind as ``(name, tokens, extra)``: ``("full", 0, 0)``,
    ``("sliding_window", window, extra tokens retained)``, ``("chunked_local", chunk, 0)``,
    ``("state", blocks per request, 0)`` (Mamba/GDN: its state blocks go after the prompt's,
    and the prefill computes all but the prompt's last token, which the decode recomputes
    from the state: ``backoff``)."""

    ids: tuple[int, ...]
    kinds: tuple[tuple[str, int, int], ...]
    block_size: int
    #: What a state group's blocks hold (its state shapes and dtypes): both sides must agree.
    states: tuple[str, ...] = ()
    #: vLLM's null block: a freed position in a group's block table.
    null_block: int = 0
    #: Each state group's block on this rank.
    state_specs: tuple[StateSpec, ...] = ()
    #: This engine's TP size.
    tp: int = 1

    @classmethod
    def of(cls, kv_cache_config, block_size: int, tp: int = 1, mamba_groups: int = 0) -> "KvGroups":
        """The groups of ``kv_cache_config`` (None: one full-attention group) of an engine at
        TP ``tp`` (a Mamba2 model's ``mamba_groups`` B/C groups, 0 unknown); a group kvferry
        cannot move (cross attention, state cached for prefixes, ...) is refused naming it."""
        if kv_cache_config is None:
            return cls((0,), (_FULL_KIND,), block_size)
        groups = list(kv_cache_config.kv_cache_groups)
        transfer = [i for i, g in enumerate(groups) if getattr(g, "enable_kv_transfer", True)]
        ids, kinds, states, specs = [], [], [], []
        for i in transfer:
            spec = groups[i].kv_cache_spec
            kind = type(spec).__name__
            where = f"KV cache group {i} ({kind}, layers {list(groups[i].layer_names)[:3]}...)"
            if kind in _FULL:
                this = _FULL_KIND
            elif kind in _WINDOW:
                this = ("sliding_window", int(spec.sliding_window),
                        int(getattr(spec, "extra_retained_tokens", 0) or 0))
            elif kind in _CHUNKED:
                this = ("chunked_local", int(spec.attention_chunk_size), 0)
            elif kind in _STATE:
                mode = str(getattr(spec, "mamba_cache_mode", "none"))
                if mode != "none":
                    raise ValueError(f"kvferry.vllm: {where} caches state with mamba_cache_mode={mode!r} "
                                     "(vLLM's choice when prefix caching is on); kvferry moves the state of "
                                     "mode 'none': start vLLM with --no-enable-prefix-caching")
                ids.append(i)
                kinds.append(("state", 1 + int(getattr(spec, "num_speculative_blocks", 0) or 0), 0))
                mamba_type = getattr(spec, "mamba_type", None)
                state = StateSpec(
                    kind=str(getattr(mamba_type, "name", mamba_type)),
                    shapes=tuple(tuple(int(d) for d in x) for x in spec.shapes),
                    sizes=tuple(int(d.itemsize) for d in spec.dtypes),
                    replicated=bool(getattr(spec, "tp_replicated", False)),
                    dim_first=_conv_dim_first(),
                    groups=int(mamba_groups or 0),
                )
                specs.append(state)
                # The model's shapes, so that engines of different TP sizes agree.
                shapes = state.model_shapes(tp) if state.splits(tp) else state.shapes
                states.append(f"{[list(x) for x in shapes]} {[str(d).replace('torch.', '') for d in spec.dtypes]}")
                continue
            else:
                raise ValueError(
                    f"kvferry.vllm: {where}: kvferry moves full-attention, sliding-window and "
                    "chunked local attention groups; this model's KV cache is refused rather "
                    "than loaded wrong"
                )
            if int(spec.block_size) != block_size:
                raise ValueError(f"kvferry.vllm: {where} has {spec.block_size}-token blocks, "
                                 f"the engine {block_size}")
            ids.append(i)
            kinds.append(this)
        if not ids:
            raise ValueError("kvferry.vllm: no KV cache group of this engine is transferable")
        return cls(tuple(ids), tuple(kinds), block_size, tuple(states), state_specs=tuple(specs), tp=tp)

    @property
    def backoff(self) -> int:
        """Prompt tokens the prefill leaves to the decode: 1 with recurrent state (the decode
        derives the last token's state from the one before it, which a prefill that computed
        the whole prompt no longer holds), else 0."""
        return 1 if any(name == "state" for name, _, _ in self.kinds) else 0

    @property
    def split_state(self) -> bool:
        """Whether the state blocks move split by TP rank (kvferry's extra pool of parts):
        every state group holds the same state, of a kind kvferry splits. Otherwise they move
        as whole blocks between ranks of equal TP sizes only."""
        specs = set(self.state_specs)
        return len(specs) == 1 and next(iter(specs)).splits(self.tp)

    @property
    def state_count(self) -> int:
        """State blocks per request: the last pages of every room's list."""
        return sum(size for name, size, _ in self.kinds if name == "state")

    @property
    def hybrid(self) -> bool:
        """Whether the pages are not simply the prompt's blocks of one full-attention group."""
        return self.kinds != (_FULL_KIND,)

    def signature(self) -> list:
        """What both sides must agree on: each group's kind and size (and the tokens a window
        retains past itself, where it does), in order."""
        out = [[name, size, extra] if extra else [name, size] for name, size, extra in self.kinds]
        return out + [["state_layout", s] for s in self.states]

    def first_block(self, group: int, tokens: int) -> int:
        """The first block of a ``tokens``-token prompt that group ``group`` still holds for
        the next token: vLLM frees the blocks wholly before what that token attends to (as
        its ``get_num_skipped_tokens`` counts them, for the prompt's tokens computed)."""
        name, size, extra = self.kinds[group]
        if name == "state":
            return 1 << 62  # no block per token
        if name == "sliding_window":
            skipped = max(0, tokens - size + 1 - extra)
        elif name == "chunked_local":
            skipped = tokens // size * size
        else:
            skipped = 0
        return skipped // self.block_size

    def pages(self, block_ids: Sequence[Sequence[int]], tokens: int, first: int = 0,
              end: Optional[int] = None) -> list[int]:
        """The room's pages of a ``tokens``-token prompt, over vLLM's per-group block tables
        ``block_ids`` (indexed by vLLM group id, each from the prompt's first block): from
        block ``first`` (the blocks before it held elsewhere) to ``end`` (default: the
        prompt's last). Raises ``NullBlockInRoom`` naming the block if one of them was freed."""
        n = -(-tokens // self.block_size)
        end = n if end is None else min(end, n)
        starts = [self.first_block(g, tokens) for g in range(len(self.ids))]
        out = []
        for index in range(first, end):
            for g, gid in enumerate(self.ids):
                if index < starts[g]:
                    continue
                table = block_ids[gid]
                if index >= len(table):
                    raise NullBlockInRoom(f"group {gid} holds {len(table)} blocks of the prompt's {n}")
                block = int(table[index])
                if block == self.null_block:
                    raise NullBlockInRoom(f"block {index} of group {gid} is vLLM's null block")
                out.append(block)
        if end == n:
            # The state blocks come last, so that a decode that holds the first blocks
            # still grants a tail of the same list.
            for (name, size, _), gid in zip(self.kinds, self.ids):
                if name != "state":
                    continue
                state = [int(b) for b in block_ids[gid] if int(b) != self.null_block]
                if len(state) != size:
                    raise NullBlockInRoom(f"group {gid} holds {len(state)} state blocks, not {size}")
                out.extend(state)
        return out

    def count(self, tokens: int) -> int:
        """How many pages a ``tokens``-token prompt's room has."""
        n = -(-tokens // self.block_size)
        return sum(size if name == "state" else n - min(n, self.first_block(g, tokens))
                   for g, (name, size, _) in enumerate(self.kinds))


def _conv_dim_first() -> bool:
    """Whether vLLM stores conv state channel-major ("DS"); its default is kernel-row-major."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    except ImportError:
        return False
    return bool(is_conv_state_dim_first())
