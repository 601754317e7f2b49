"""kvferry: moves the KV cache of LLM requests from prefill to decode nodes.

A :class:`Node` is one prefill or decode rank over memory the caller owns (numpy arrays,
torch tensors: anything with a stable address). Rooms are opened by id on both sides;
``poll(room)`` returns SGLang's ``KVPoll`` integers and never blocks.
"""

from ._kvferry import (  # noqa: F401
    AbortFailure,
    CapacityFailure,
    ConnectError,
    HandshakeTimeout,
    InvalidArgument,
    KvferryError,
    Node,
    NodeClosed,
    PeerFailure,
    PeerRefused,
    PeerUnreachable,
    ProtocolFailure,
    RoomFailed,
    ShutdownFailure,
    TimeoutFailure,
    TransferFailure,
    TransportUnavailable,
    UnknownPeer,
    UnsupportedMemory,
    enable_metrics,
    metrics_text,
    prompt_digest,
)


def tensor_spans(tensors):
    """``(spans, kv_device)`` for ``Node(kv=spans, kv_device=kv_device)`` over torch tensors
    (or numpy arrays): each one's address and size in bytes, and the CUDA device they all live
    on (``None`` for host memory). Tensors on different devices, or some on a GPU and some on
    the host, are refused: a node's KV lives in one place."""
    spans, devices = [], set()
    for t in tensors:
        if hasattr(t, "data_ptr"):
            if not t.is_contiguous():
                raise InvalidArgument("tensor_spans: a KV tensor must be contiguous")
            spans.append((int(t.data_ptr()), int(t.numel() * t.element_size())))
            devices.add(t.device.index if t.device.type == "cuda" else None)
            if t.device.type not in ("cuda", "cpu"):
                raise InvalidArgument(f"tensor_spans: {t.device.type} tensors are not supported")
        else:
            spans.append((int(t.ctypes.data), int(t.nbytes)))
            devices.add(None)
    if len(devices) > 1:
        raise InvalidArgument(f"tensor_spans: KV tensors on several devices {sorted(map(str, devices))}")
    return spans, (devices.pop() if devices else None)


class KVPoll:
    """SGLang's room states, as ``Node.poll`` returns them."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


__all__ = [
    "AbortFailure",
    "CapacityFailure",
    "ConnectError",
    "HandshakeTimeout",
    "InvalidArgument",
    "KVPoll",
    "KvferryError",
    "Node",
    "NodeClosed",
    "PeerFailure",
    "PeerRefused",
    "PeerUnreachable",
    "ProtocolFailure",
    "RoomFailed",
    "ShutdownFailure",
    "TimeoutFailure",
    "TransferFailure",
    "TransportUnavailable",
    "UnknownPeer",
    "UnsupportedMemory",
    "enable_metrics",
    "tensor_spans",
    "metrics_text",
    "prompt_digest",
]
