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
    said = tp_pair_refusal(4, 2, 2)
    assert "the prefill runs TP 4" in said and "this decode TP 2" in said and "replicates" in said
    assert "do not split evenly" in tp_pair_refusal(2, 3, 8)
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
