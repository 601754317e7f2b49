"""Type stubs of kvferry's native module."""

from typing import Optional, Sequence, Tuple

Span = Tuple[int, int]

class KvferryError(Exception): ...
class InvalidArgument(KvferryError): ...
class UnknownPeer(InvalidArgument): ...
class NodeClosed(KvferryError): ...
class TransportUnavailable(KvferryError): ...
class UnsupportedMemory(KvferryError): ...
class ConnectError(KvferryError): ...
class PeerRefused(ConnectError):
    """args[0]: the room failure reason's snake_case name; args[1]: the message."""
class PeerUnreachable(ConnectError):
    """args[0]: what the connection attempts found (snake_case reason); args[1]: the message."""
class HandshakeTimeout(ConnectError): ...
class RoomFailed(KvferryError):
    """args[0]: the failure reason's snake_case name; args[1]: its explanation."""
class TimeoutFailure(RoomFailed): ...
class PeerFailure(RoomFailed): ...
class TransferFailure(RoomFailed): ...
class AbortFailure(RoomFailed): ...
class CapacityFailure(RoomFailed): ...
class ProtocolFailure(RoomFailed): ...
class ShutdownFailure(RoomFailed): ...

def enable_metrics(addr: Optional[str] = None) -> None:
    """Records every node's metrics in this process (the CLI's names and labels), served on
    ``http://ADDR/metrics`` when ``addr`` is given. Once per process."""

def metrics_text() -> str:
    """Every node's metrics in Prometheus' text format (after ``enable_metrics``)."""

def prompt_digest(tokens: Sequence[int]) -> int:
    """The digest of a prompt's token ids (XXH3-64 of each id as a little-endian u32) that
    ``open_sender``, ``open_receiver`` and ``grant_pages`` take as ``prompt``."""

class Node:
    """One prefill or decode rank over caller-owned memory.

    ``heads=(total, start, count, head_bytes)``: the model's KV heads this rank holds in each
    token row of its pages (attention TP); peers holding other heads exchange head slices.
    ``layer_range=(start, end)``: the layers a pipeline stage holds (``kv`` may then list only
    those layers' regions); the last stage writes aux and state.
    ``extras``: extra pools that move with rooms besides the KV pages (a hybrid model's state
    slots, sliding-window pages, indexer pages), each a list of its tensors as ``(address,
    bytes, item_bytes)`` holding the same number of items; rooms name their items per pool
    (``extras=`` of ``open_receiver``/``grant_pages`` and of the last ``send_chunk``).
    ``extra_parts``: per extra pool, per tensor, the parts tensor parallelism splits its items
    into, each ``(offset, rows, stride, units, first, count, unit_bytes)``: ``rows`` rows
    ``stride`` bytes apart from ``offset`` in the item, each holding this rank's ``count``
    units (``first..first + count`` of the model's ``units``) of ``unit_bytes`` bytes. Peers
    holding other heads (another TP size) then copy, row by row, the units both hold; a pool
    left out moves whole items.

    Every buffer in ``kv``, ``aux``, ``state`` and ``extras`` must stay allocated, and must not move,
    until ``shutdown()`` returns; a room's pages must not be touched between granting or
    sending them and the room's ``releasable()``.
    """

    def __init__(
        self,
        role: str,
        layout: dict,
        kv: Sequence[Span],
        aux: Optional[Span] = None,
        state: Optional[Span] = None,
        token: bytes = b"",
        node_id: Optional[int] = None,
        rank: int = 0,
        data_connections: int = 2,
        kv_device: Optional[int] = None,
        staging_buffers: int = 16,
        staging_buffer_bytes: int = 1 << 20,
        heads: Optional[Tuple[int, int, int, int]] = None,
        layer_range: Optional[Tuple[int, int]] = None,
        extras: Sequence[Sequence[Tuple[int, int, int]]] = (),
        extra_parts: Sequence[Sequence[Sequence[Tuple[int, int, int, int, int, int, int]]]] = (),
        transport: Optional[str] = None,
        rdma_device: Optional[str] = None,
        rdma_port: int = 1,
        **config: object,
    ) -> None: ...
    def listen(self, addr: str) -> list[str]: ...
    def connect(self, addrs: Sequence[str]) -> int: ...
    def connect_persistent(self, addrs: Sequence[str], reach: bool = True) -> int: ...
    def reach(self, peer: int) -> None: ...
    def disconnect(self, peer: int) -> None:
        """Lets a peer go: dialed no more, its sessions closed, its id refused from now on."""
    def session_paths(self) -> list[Tuple[int, str]]:
        """``(session, path)`` of each live session: "tcp", "tcp_staged", "rdma" or "rdma_dmabuf"."""
    def knows_peer(self, peer: int) -> bool:
        """False once a peer was disconnected, or let go after ``peer_idle_timeout`` unused."""
    def unreachable(self, peer: int) -> Optional[str]:
        """Why a kept peer is unreachable now (down past its window), or None; never waits."""
    def open_receiver(
        self,
        room: int,
        peers: Sequence[int],
        pages: Optional[Sequence[int]] = None,
        aux_slot: Optional[int] = None,
        state_slot: Optional[int] = None,
        generation: int = 0,
        receivers: int = 1,
        skip_pages: int = 0,
        idle_sources: Sequence[int] = (),
        extras: Sequence[Sequence[int]] = (),
        prompt: Optional[int] = None,
    ) -> None: ...
    def grant_pages(
        self,
        room: int,
        pages: Sequence[int],
        aux_slot: Optional[int] = None,
        state_slot: Optional[int] = None,
        receivers: int = 1,
        skip_pages: int = 0,
        idle_sources: Sequence[int] = (),
        extras: Sequence[Sequence[int]] = (),
        prompt: Optional[int] = None,
    ) -> None: ...
    def next_announcement(self, timeout: float = 0.0) -> Optional[Tuple[int, int, int, Optional[int]]]: ...
    def fail(self, room: int, reason: str) -> bool:
        """Fails an open room with the reason named (e.g. "incompatible_peer"): its peers hear
        an abort, and it is counted under that reason; False if it had already ended."""
    def open_sender(self, room: int, generation: int = 0, prompt: Optional[int] = None) -> None: ...
    def send_chunk(
        self,
        room: int,
        pages: Sequence[int],
        last: bool = True,
        aux_slot: Optional[int] = None,
        state_slot: Optional[int] = None,
        layerwise: bool = False,
        extras: Sequence[Sequence[int]] = (),
    ) -> None:
        """Sends the next chunk of a room; a room that already failed raises its failure."""
    def mark_layer_ready(self, rooms: Sequence[int], layer: int) -> None: ...
    def set_queue_position(self, room: int, position: int) -> None: ...
    def abort(self, room: int) -> None: ...
    def poll(self, room: int) -> int: ...
    def failure(self, room: int) -> Optional[RoomFailed]: ...
    def releasable(self, room: int) -> bool: ...
    def wait(self, room: int, timeout: float) -> int: ...
    def forget(self, room: int) -> None: ...
    def counters(self) -> dict: ...
    def shutdown(self) -> None: ...
