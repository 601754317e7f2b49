"""GPU-resident KV: a node told its KV lives on a CUDA device never reads it with the CPU.
This wheel carries no CUDA copy engine, so such a node is refused at start with
``UnsupportedMemory`` naming the region, never a crash."""

import numpy as np
import pytest

import kvferry

LAYOUT = dict(layers=2, planes=2, page_bytes=4096, pages=16)


def spans():
    # Host buffers standing in for device addresses: the node must refuse before touching them.
    kv = np.zeros((4, LAYOUT["pages"], LAYOUT["page_bytes"]), dtype=np.uint8)
    return kv, [(kv[r].ctypes.data, kv[r].nbytes) for r in range(4)]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_device_kv_without_a_copy_engine_is_refused_naming_the_region(role):
    _kv, kv = spans()
    with pytest.raises(kvferry.UnsupportedMemory) as refused:
        kvferry.Node(role, LAYOUT, kv, kv_device=0)
    said = str(refused.value)
    assert "CUDA device 0" in said
    assert "layer: 0" in said and "plane: 0" in said
    assert isinstance(refused.value, kvferry.KvferryError)


def test_host_kv_is_still_served():
    _kv, kv = spans()
    node = kvferry.Node("decode", LAYOUT, kv)
    node.shutdown()


def test_tensor_spans_of_host_arrays_name_no_device():
    kv = [np.zeros(8192, dtype=np.uint8) for _ in range(4)]
    got, device = kvferry.tensor_spans(kv)
    assert device is None
    assert got == [(a.ctypes.data, a.nbytes) for a in kv]


def test_tensor_spans_of_torch_tensors_name_their_device():
    torch = pytest.importorskip("torch")
    kv = [torch.zeros(8192, dtype=torch.uint8) for _ in range(4)]
    got, device = kvferry.tensor_spans(kv)
    assert device is None
    assert got == [(t.data_ptr(), 8192) for t in kv]
    if torch.cuda.is_available():
        on_gpu = [t.cuda() for t in kv]
        _, device = kvferry.tensor_spans(on_gpu)
        assert device == on_gpu[0].device.index
        with pytest.raises(kvferry.InvalidArgument):
            kvferry.tensor_spans(kv[:2] + on_gpu[:2])
