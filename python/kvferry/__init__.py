"""kvferry: moves the KV cache of LLM requests from prefill to decode nodes.

A :class:`Node` is one prefill or decode rank over memory the caller owns (numpy arrays,
torch tensors: anything with a stable address). Rooms are opened by id on both sides;
``poll(room)`` returns SGLang's ``KVPoll`` integers and never blocks.
"""

from ._kvferry import (  # noqa: F401
    AbortFailure,
    CapacityFailure,
    ConnectError,
    InvalidArgument,
    KvferryError,
    Node,
    NodeClosed,
    PeerFailure,
    ProtocolFailure,
    RoomFailed,
    ShutdownFailure,
    TimeoutFailure,
    TransferFailure,
    enable_metrics,
    metrics_text,
)


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
    "InvalidArgument",
    "KVPoll",
    "KvferryError",
    "Node",
    "NodeClosed",
    "PeerFailure",
    "ProtocolFailure",
    "RoomFailed",
    "ShutdownFailure",
    "TimeoutFailure",
    "TransferFailure",
    "enable_metrics",
    "metrics_text",
]
