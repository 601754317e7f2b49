"""The connector's settings from vLLM's config and process: ports, lease, host address, logging."""

from __future__ import annotations

import logging
import socket


#: The listener port of TP rank r of DP engine d is ``port + d * TP + r``
#: (``kv_connector_extra_config``).
DEFAULT_PORT = 14600
#: How long a prefill keeps a finished request's blocks for a decode that never asks.
DEFAULT_LEASE_S = 120.0


def _follow_vllm_logging() -> None:
    """Writes kvferry's log lines where and as vLLM writes its own (vLLM configures only its
    ``vllm`` logger, so an info line of another logger would never reach its log), unless the
    embedder configured kvferry's logging itself."""
    ours, theirs = logging.getLogger("kvferry"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())


def _extra(vllm_config) -> dict:
    return dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})


def _local_ip() -> str:
    """The address decode reaches this host on (the one that routes outward)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


def _plus(addr: str, n: int) -> str:
    """``host:port`` with ``n`` added to the port."""
    host, _, port = addr.rpartition(":")
    return f"{host}:{int(port) + n}"
