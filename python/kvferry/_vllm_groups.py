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

    @classmethod
    def of(cls, kv_cache_config, block_size: int) -> "KvGroups":
        """The groups of ``kv_cache_config`` (None: one full-attention group); a group kvferry
        cannot move (Mamba or GDN state, cross attention, ...) is refused naming it."""
        if kv_cache_config is None:
            return cls((0,), (_FULL_KIND,), block_size)
        groups = list(kv_cache_config.kv_cache_groups)
        transfer = [i for i, g in enumerate(groups) if getattr(g, "enable_kv_transfer", True)]
        ids, kinds, states = [], [], []
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
                states.append(f"{[list(x) for x in spec.shapes]} {[str(d).replace('torch.', '') for d in spec.dtypes]}")
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
        return cls(tuple(ids), tuple(kinds), block_size, tuple(states))

    @property
    def backoff(self) -> int:
        """Prompt tokens the prefill leaves to the decode: 1 with recurrent state (the decode
        derives the last token's state from the one before it, which a prefill that computed
        the whole prompt no longer holds), else 0."""
        return 1 if any(name == "state" for name, _, _ in self.kinds) else 0

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
