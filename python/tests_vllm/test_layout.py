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
