"""Where the SGLang backend says an SGLang rank's KV pool lives (no SGLang needed)."""

import pytest

from kvferry.sglang.devices import kv_device_of


def test_a_cpu_server_has_host_kv():
    assert kv_device_of("cpu", 3) is None


def test_a_cuda_server_has_its_ranks_gpu():
    assert kv_device_of("cuda", 3) == 3
    assert kv_device_of(None, 1) == 1, "SGLang's default device is cuda"
    assert kv_device_of("cuda:0", 2) == 2


def test_other_devices_are_refused_by_name():
    with pytest.raises(ValueError, match="npu"):
        kv_device_of("npu", 0)
