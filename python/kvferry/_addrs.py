"""Listener addresses as the engines' routers and connectors accept them (no vLLM import)."""

from __future__ import annotations

import ipaddress
from typing import Any


def socket_addr(a: Any) -> bool:
    """Whether ``a`` is an ``ip:port`` (``[v6]:port``) string a kvferry node can dial."""
    if not isinstance(a, str):
        return False
    host, sep, port = a.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return False
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
