"""How vLLM's KV tensors become kvferry regions, and which layouts are refused."""

import pytest
import torch

from kvferry.vllm import kv_regions, shape_mismatch


def test_a_block_major_layer_is_one_region_of_one_page_per_block():
    kv = {f"l{i}": torch.zeros((10, 2, 32, 64), dtype=torch.float16) for i in range(3)}
    spans, planes, page_bytes, pages = kv_regions(kv, 10)
    assert (planes, page_bytes, pages) == (1, 2 * 32 * 64 * 2, 10)
    assert spans == [(t.data_ptr(), 10 * page_bytes) for t in kv.values()]


def test_layers_sharing_a_cache_are_registered_once():
    t = torch.zeros((10, 2, 32, 64), dtype=torch.float16)
    spans, *_ = kv_regions({"a": t, "b": t}, 10)
    assert spans == [(t.data_ptr(), t.numel() * 2)]


def test_a_k_then_v_layer_is_two_regions():
    t = torch.zeros((2, 10, 32, 2, 64), dtype=torch.bfloat16)
    spans, planes, page_bytes, pages = kv_regions({"l0": t}, 10)
    assert (planes, page_bytes, pages) == (2, 32 * 2 * 64 * 2, 10)
    assert spans == [(t[0].data_ptr(), 10 * page_bytes), (t[1].data_ptr(), 10 * page_bytes)]


def test_a_layout_that_is_not_block_major_is_refused_naming_its_shape():
    t = torch.zeros((32, 10, 64))
    with pytest.raises(ValueError, match=r"\(32, 10, 64\)"):
        kv_regions({"l0": t}, 10)


def test_a_state_layers_strided_view_into_the_attention_blocks_is_their_region_in_any_order():
    # vLLM 0.32.0 (CPU): a GDN layer's cache is an int8 view of its state bytes in each block
    # of the tensor it shares with an attention layer (the block padded to the attention
    # page, so the view is strided), and it may come before the attention layer.
    page = 2 * 384 * 64 * 2
    raw = torch.zeros(11 * page, dtype=torch.int8)
    attn = raw[: 10 * page].view(torch.bfloat16).view(10, 2, 384, 64)
    state = torch.as_strided(raw, (10, 1, 1, 68608), (page, 68608, 68608, 1))
    for kv in ({"l0.linear_attn": state, "l1.attn": attn}, {"l1.attn": attn, "l0.linear_attn": state}):
        spans, planes, page_bytes, pages = kv_regions(kv, 10)
        assert (spans, planes, page_bytes, pages) == ([(attn.data_ptr(), 10 * page)], 1, page, 10)
    # A view reaching past its block is refused naming it.
    wide = torch.as_strided(raw, (10, 1, 1, page + 2), (page, page + 2, page + 2, 1))
    with pytest.raises(ValueError, match=r"the state of l0.linear_attn \(10, 1, 1, 98306\)"):
        kv_regions({"l0.linear_attn": wide, "l1.attn": attn}, 10)


def test_layers_of_different_block_sizes_are_refused():
    kv = {"a": torch.zeros((10, 4, 8)), "b": torch.zeros((10, 4, 16))}
    with pytest.raises(ValueError, match="others"):
        kv_regions(kv, 10)


def test_a_block_shape_mismatch_names_both_values():
    ours = {"block_size": 64, "kv_dtype": "float16", "num_kv_heads": 2}
    theirs = {"block_size": 32, "kv_dtype": "bfloat16", "num_kv_heads": 2}
    said = shape_mismatch(ours, theirs)
    assert said == "block_size: prefill 32, decode 64; kv_dtype: prefill 'bfloat16', decode 'float16'"
    assert shape_mismatch(ours, dict(ours)) is None
    # A key only the prefill names (its hybrid KV cache groups) differs too.
    hybrid = dict(ours, kv_groups=[["full", 0], ["sliding_window", 48]])
    assert shape_mismatch(ours, hybrid) == "kv_groups: prefill [['full', 0], ['sliding_window', 48]], decode None"
    assert "no block shape" in shape_mismatch(ours, None)


def test_heads_are_placed_as_vllm_places_them():
    from kvferry.vllm import rank_heads

    assert [rank_heads(8, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # More ranks than heads: each head on tp / heads consecutive ranks.
    assert [rank_heads(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]


def test_each_decode_rank_loads_from_the_prefill_ranks_holding_its_heads():
    from kvferry.vllm import tp_sources

    assert [tp_sources(2, 2, 8, r) for r in range(2)] == [([0], 1, []), ([1], 1, [])]
    assert tp_sources(2, 1, 8, 0) == ([0, 1], 1, [])
    assert [tp_sources(4, 2, 8, r) for r in range(2)] == [([0, 1], 1, []), ([2, 3], 1, [])]
    # Each prefill rank feeds two decode ranks.
    assert [tp_sources(1, 2, 8, r) for r in range(2)] == [([0], 2, []), ([0], 2, [])]
    assert [tp_sources(2, 4, 8, r) for r in range(4)] == [([0], 2, []), ([0], 2, []), ([1], 2, []), ([1], 2, [])]
    # Two heads over four decode ranks: each head to the two ranks that replicate it.
    assert [tp_sources(2, 4, 2, r) for r in range(4)] == [([0], 2, []), ([0], 2, []), ([1], 2, []), ([1], 2, [])]
    assert [tp_sources(1, 4, 2, r) for r in range(4)] == [([0], 4, [])] * 4


def test_a_prefill_holding_each_head_on_several_ranks_feeds_each_decode_head_from_one_of_them():
    from kvferry.vllm import rank_heads, tp_sources

    # Two heads on four prefill ranks (0, 1 hold head 0; 2, 3 head 1): one decode rank loads
    # head 0 from rank 0 and head 1 from rank 2; ranks 1 and 3 are idle sources.
    assert tp_sources(4, 1, 2, 0) == ([0, 2, 1, 3], 1, [2, 3])
    # Two decode ranks take the replicas in turn; each names the idle replica of its head.
    assert [tp_sources(4, 2, 2, r) for r in range(2)] == [([0, 1], 1, [1]), ([3, 2], 1, [1])]
    # Four decode ranks per head over two replicas: each replica feeds two of them.
    assert [tp_sources(4, 8, 2, r) for r in range(8)] == [
        ([0], 2, []), ([1], 2, []), ([0], 2, []), ([1], 2, []),
        ([2], 2, []), ([3], 2, []), ([2], 2, []), ([3], 2, []),
    ]
    # One head (MQA) on two prefill ranks, one decode rank.
    assert tp_sources(2, 1, 1, 0) == ([0, 1], 1, [1])
    # Every prefill rank hears of the room, each from decode ranks that share its head.
    for p_tp, d_tp, total in [(4, 1, 2), (4, 2, 2), (8, 2, 2), (8, 4, 2), (4, 8, 2), (8, 1, 4), (8, 2, 4)]:
        named = [(r, p) for r in range(d_tp) for p in tp_sources(p_tp, d_tp, total, r)[0]]
        assert {p for _, p in named} == set(range(p_tp)), (p_tp, d_tp, total)
        for r, p in named:
            first, count = rank_heads(total, d_tp, r)
            assert first <= rank_heads(total, p_tp, p)[0] < first + count, (p_tp, d_tp, total, r, p)
        loading = [p for r in range(d_tp)
                   for i, p in enumerate(tp_sources(p_tp, d_tp, total, r)[0])
                   if i not in tp_sources(p_tp, d_tp, total, r)[2]]
        receivers = tp_sources(p_tp, d_tp, total, 0)[1]
        assert all(loading.count(p) == receivers for p in set(loading)), (p_tp, d_tp, total)


def test_mla_loads_from_one_prefill_rank_and_names_the_others_idle():
    from kvferry.vllm import tp_sources

    assert [tp_sources(2, 2, 4, r, mla=True) for r in range(2)] == [([0], 1, []), ([1], 1, [])]
    # Prefill rank 1 sends to nobody: decode rank 0 names it as an idle source.
    assert tp_sources(2, 1, 4, 0, mla=True) == ([0, 1], 1, [1])
    assert [tp_sources(4, 2, 4, r, mla=True) for r in range(2)] == [([0, 2], 1, [1]), ([1, 3], 1, [1])]
    assert [tp_sources(1, 2, 4, r, mla=True) for r in range(2)] == [([0], 2, []), ([0], 2, [])]


def test_tp_pairs_the_heads_cannot_serve_are_refused_naming_both_sizes():
    from kvferry.vllm import tp_pair_refusal

    assert tp_pair_refusal(4, 4, 2) is None
    assert tp_pair_refusal(2, 1, 8) is None
    # A prefill holding each head on several ranks pairs with any decode whose ranks per
    # head are a multiple of its own, or fewer.
    assert tp_pair_refusal(4, 2, 2) is None and tp_pair_refusal(4, 8, 2) is None
    said = tp_pair_refusal(4, 6, 2)
    assert "the prefill runs TP 4" in said and "this decode TP 6" in said and "not a multiple" in said
    assert "do not split evenly" in tp_pair_refusal(2, 3, 8)
    # 6 heads over 3 prefill ranks (2 each) and 2 decode ranks (3 each): prefill rank 1's
    # heads straddle both decode ranks.
    assert "neither holds a whole number" in tp_pair_refusal(3, 2, 6)
    assert tp_pair_refusal(3, 1, 6) is None and tp_pair_refusal(2, 6, 6) is None
    # MLA: any pair where the decode's size is a multiple of the prefill's, or smaller.
    assert tp_pair_refusal(4, 2, 1, mla=True) is None and tp_pair_refusal(4, 3, 1, mla=True) is None
    assert "not a multiple" in tp_pair_refusal(2, 3, 1, mla=True)


def test_the_heads_of_vllms_layouts_are_declared_and_others_are_not():
    from kvferry.vllm import kv_heads

    # The CPU backend: [blocks, heads, block_size, 2 * head_size], each head's rows together.
    cpu = {"l0": torch.zeros((10, 2, 16, 64), dtype=torch.float16)}
    assert kv_heads(cpu, 10, 16, 8, 4, 1) == (8, 2, 2, 16 * 64 * 2)
    # K then V, token rows of heads.
    nhd = {"l0": torch.zeros((2, 10, 16, 2, 32), dtype=torch.bfloat16)}
    assert kv_heads(nhd, 10, 16, 8, 4, 3) == (8, 6, 2, 32 * 2)
    # MLA's latent KV: no heads.
    assert kv_heads({"l0": torch.zeros((10, 16, 576))}, 10, 16, 1, 2, 0) is None


def _hybrid_config(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def _spec(window: int = 0, block_size: int = 32):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if window:
        return SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=32,
                                 dtype=torch.float32, sliding_window=window)
    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.float32)


def test_a_rooms_pages_are_the_prompts_blocks_index_major_without_the_windows_freed_ones():
    from kvferry._vllm_groups import KvGroups

    groups = KvGroups.of(_hybrid_config(_spec(), _spec(window=48)), 32)
    full = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    window = [0, 0, 0, 0, 0, 0, 26, 27, 28]  # vLLM's null block where the window freed one
    # 257 tokens: the window needs tokens 210..256, blocks 6-8.
    assert groups.pages([full, window], 257) == [10, 11, 12, 13, 14, 15, 16, 26, 17, 27, 18, 28]
    assert groups.count(257) == 12


def test_a_decode_holding_the_first_blocks_grants_the_tail_of_the_prefills_pages():
    from kvferry._vllm_groups import KvGroups

    groups = KvGroups.of(_hybrid_config(_spec(), _spec(window=48), _spec(window=100)), 32)
    tables = [list(range(100, 110)), list(range(200, 210)), list(range(300, 310))]
    for tokens in (5, 48, 70, 150, 300):
        whole = groups.pages(tables, tokens)
        for held in range(-(-tokens // 32) + 1):
            part = groups.pages(tables, tokens, first=held)
            assert part == whole[len(whole) - len(part):], (tokens, held)


def test_a_freed_block_a_room_needs_is_refused_naming_it():
    from kvferry._vllm_groups import KvGroups, NullBlockInRoom

    groups = KvGroups.of(_hybrid_config(_spec(), _spec(window=48)), 32)
    with pytest.raises(NullBlockInRoom, match="block 7 of group 1"):
        groups.pages([[1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 0, 0, 0, 0, 0, 26, 0, 28]], 257)


def test_chunked_local_attention_and_retained_window_tokens_keep_what_vllm_keeps():
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

    from kvferry._vllm_groups import KvGroups

    chunked = ChunkedLocalAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32,
                                        attention_chunk_size=64)
    groups = KvGroups.of(_hybrid_config(_spec(), chunked), 32)
    # 150 tokens: the next token's chunk starts at 128 (block 4).
    assert groups.first_block(1, 150) == 4 and groups.first_block(1, 128) == 4 and groups.first_block(1, 127) == 2
    assert groups.signature() == [["full", 0], ["chunked_local", 64]]
    retained = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32,
                                 sliding_window=48, extra_retained_tokens=40)
    groups = KvGroups.of(_hybrid_config(_spec(), retained), 32)
    # 257 tokens: the window needs 210..256, and 40 more tokens are kept: 170.. (block 5).
    assert groups.first_block(1, 257) == 5
    assert groups.signature() == [["full", 0], ["sliding_window", 48, 40]]


def test_a_kv_cache_group_kvferry_cannot_move_is_refused_naming_it():
    from vllm.v1.kv_cache_interface import CrossAttentionSpec, MambaSpec

    from kvferry._vllm_groups import KvGroups

    cached = MambaSpec(block_size=32, shapes=((4, 8), (2, 8, 8)), dtypes=(torch.float32, torch.float32),
                       mamba_cache_mode="align")
    with pytest.raises(ValueError, match=r"KV cache group 1 \(MambaSpec.*mamba_cache_mode='align'.*--no-enable-prefix-caching"):
        KvGroups.of(_hybrid_config(_spec(), cached), 32)
    cross = CrossAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"KV cache group 1 \(CrossAttentionSpec"):
        KvGroups.of(_hybrid_config(_spec(), cross), 32)
    with pytest.raises(ValueError, match="16-token blocks"):
        KvGroups.of(_hybrid_config(_spec(), _spec(window=48, block_size=16)), 32)


def test_one_full_attention_group_is_not_hybrid_and_its_pages_are_the_prompts_blocks():
    from kvferry._vllm_groups import KvGroups

    groups = KvGroups.of(_hybrid_config(_spec()), 32)
    assert not groups.hybrid and KvGroups.of(None, 32) == groups
    assert groups.pages([[5, 6, 7, 8]], 100, first=1) == [6, 7, 8]


def test_state_blocks_come_after_the_prompts_blocks_and_the_prefill_leaves_the_last_token():
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvferry._vllm_groups import KvGroups, NullBlockInRoom

    state = MambaSpec(block_size=2048, shapes=((4, 8), (2, 8, 8)), dtypes=(torch.float32, torch.float32))
    groups = KvGroups.of(_hybrid_config(_spec(), state), 32)
    assert groups.backoff == 1 and groups.count(100) == 4 + 1
    tables = [[10, 11, 12, 13], [77]]
    assert groups.pages(tables, 100) == [10, 11, 12, 13, 77]
    # A decode holding the first two blocks grants the tail: the state still comes last.
    assert groups.pages(tables, 100, first=2) == [12, 13, 77]
    # A push step that completed only the first blocks sends no state yet.
    assert groups.pages(tables, 100, end=2) == [10, 11]
    with pytest.raises(NullBlockInRoom, match="0 state blocks"):
        groups.pages([[10, 11, 12, 13], [0]], 100)
