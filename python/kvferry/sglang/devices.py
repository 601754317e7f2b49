"""Where an SGLang rank's KV pool lives, for ``kvferry.Node(kv_device=...)``. No SGLang import:
the rule is tested without it."""

from __future__ import annotations

from typing import Optional


def kv_device_of(server_device: Optional[str], gpu_id: int) -> Optional[int]:
    """The CUDA device of SGLang's KV pool (``--device``, the rank's ``gpu_id``), or None for a
    CPU server. Other devices are refused here, before any pointer reaches kvferry."""
    device = (server_device or "cuda").split(":")[0]
    if device == "cpu":
        return None
    if device == "cuda":
        return int(gpu_id)
    raise ValueError(
        f"kvferry backend: KV pools on {server_device!r} are not supported (cuda or cpu)"
    )
