"""The kept peers of an engine's decode node, by prefill address."""

from __future__ import annotations

import threading
from typing import Dict, Hashable, Sequence, Set


class KeptPeers:
    """Each prefill an engine sends this decode to, named once (kvferry's core keeps it
    connected) and named again after the core let it go (unused for
    ``KVFERRY_PEER_IDLE_TIMEOUT_MS``): the cache never holds a peer the node no longer
    knows, so prefills scaled away leave nothing behind."""

    def __init__(self, node) -> None:
        self._node = node
        self._peers: Dict[Hashable, int] = {}
        # Peers that had their first contact: ``reach`` on them returns at once.
        self._contacted: Set[int] = set()
        self._lock = threading.Lock()

    def get(self, addrs: Sequence[str], reach: bool = True) -> int:
        """The peer of the prefill at ``addrs`` (its kvferry listener per shard)."""
        key = tuple(addrs)
        with self._lock:
            peer = self._peers.get(key)
            if peer is not None and self._node.knows_peer(peer):
                return peer
            # A new name: drop every peer the core let go since the last one.
            for k in [k for k, p in self._peers.items() if not self._node.knows_peer(p)]:
                self._contacted.discard(self._peers.pop(k))
            peer = self._node.connect_persistent(list(addrs), reach=reach)
            self._peers[key] = peer
            if reach:
                self._contacted.add(peer)
            return peer

    def reach(self, peer: int) -> None:
        """Waits for ``peer``'s first contact (kvferry's ``reach``) and remembers it had one."""
        self._node.reach(peer)
        with self._lock:
            self._contacted.add(peer)

    def contacted(self, addrs: Sequence[str]) -> bool:
        """Whether the peer named for ``addrs`` is still known and had its first contact, so
        that a room toward it opens without waiting (never waits itself)."""
        with self._lock:
            peer = self._peers.get(tuple(addrs))
            return peer is not None and peer in self._contacted and self._node.knows_peer(peer)

    def named(self) -> list:
        """The addresses of every peer named and not yet dropped, in naming order."""
        with self._lock:
            return list(self._peers)

    def __len__(self) -> int:
        with self._lock:
            return len(self._peers)
