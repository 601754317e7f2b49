"""kvferry as an SGLang transfer backend: manager, sender, receiver and bootstrap server.

Each class subclasses SGLang's ``Common*`` class and keeps what SGLang owns: the bootstrap
server and its ``/route`` registry, the TP/DP rank mapping (``try_ensure_parallel_info``,
``_setup_bootstrap_infos``), the sender's chunk bookkeeping (``_prepare_send_indices``) and
``KVTransferError``. What a room does is kvferry's: the prefill rank registers the address of
its kvferry listener (a free port, or ``KVFERRY_LISTEN_PORT`` + engine rank) as its
``rank_port``, the decode rank keeps a persistent kvferry session to every prefill rank it
pulls from, and rooms, grants, chunks, retries, blacklists, aborts, timeouts and the page
quarantine all run in kvferry's core. SGLang's ZMQ status messages,
heartbeat thread and abort-ack bookkeeping are not used.

Supported: MHA/GQA and MLA pools whose K and V buffers share one page size; prefill and
decode with different attention TP sizes in either direction (MHA: each decode rank receives
exactly its heads, a head slice of every token row, from every prefill rank holding some of
them; MLA: one prefill rank sends, the others confirm); DP attention on either side;
pipeline-parallel prefill (each stage sends its layers); a decode-side prefix (only the pages
after it move); pools in host memory or in the rank's GPU (staged through kvferry's CUDA copy
engine; the CPU never reads a device pool). A decode room succeeds only when every
contributing prefill rank's part landed. State pools (Mamba state slots, sliding-window
pages, the DSA indexer pool) move with the room as kvferry extra pools: each of SGLang's
state components is one pool whose tensors are its buffers, the item indices SGLang computes
on each side paired one to one; a room succeeds only when every item of every tensor landed.
Refused when the manager starts, naming what: other state types (DSA kpool tail, QSA, ...),
state pools on a pipeline-parallel prefill, speculative draft KV, attention CP, decode PP,
KV layouts other than NHD, host-staged destinations. Peers whose state pools differ, or that
hold different attention heads while carrying state pools, are refused at their handshake
with the differing field and both values.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import Dict, List, Optional, Set

import numpy as np
import numpy.typing as npt

from sglang.srt.disaggregation.base.conn import (
    KVArgs,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
    KVTransferError,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.server_args import ServerArgs

import kvferry
from kvferry._peers import KeptPeers
from kvferry.sglang._layout import (  # noqa: F401 - callers import these from conn
    _STATE_TYPES,
    UnsupportedLayout,
    _extras_of,
    _layout_of,
    _model_shape,
    _state_items,
)
from kvferry.sglang.devices import kv_device_of

logger = logging.getLogger(__name__)

# SGLang's timeouts become kvferry's unless a KVFERRY_* variable sets them: one deadline,
# decided in one place (kvferry's core).
_TIMEOUTS = (
    ("bootstrap_timeout_ms", "KVFERRY_BOOTSTRAP_TIMEOUT_MS", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"),
    ("waiting_timeout_ms", "KVFERRY_WAITING_TIMEOUT_MS", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"),
)


def listen_port(base: Optional[str], engine_rank: int) -> int:
    """The port of a prefill rank's kvferry listener: ``KVFERRY_LISTEN_PORT`` + engine rank,
    or 0 (a free port, new at every start) when unset.

    A fixed port keeps a restarted prefill at the address decode already knows: decode's
    persistent kvferry sessions reconnect to it by themselves, and the first request after
    the restart succeeds instead of failing on SGLang's cached route.
    """
    if base is None or base == "":
        return 0
    try:
        port = int(base) + engine_rank
    except ValueError:
        raise kvferry.InvalidArgument(
            f"invalid KVFERRY_LISTEN_PORT={base!r}: not a port number"
        ) from None
    if not 0 < port < 65536:
        raise kvferry.InvalidArgument(
            f"invalid KVFERRY_LISTEN_PORT={base!r}: engine rank {engine_rank} would listen on "
            f"port {port}, outside 1..65535"
        )
    return port


def listen_host(host: Optional[str], machine_ip: str) -> str:
    """The address a prefill rank's kvferry listener binds and registers: the server's
    ``--host`` when it names one address, the machine's (``machine_ip``) when it names every
    address (``0.0.0.0``, ``::``) or none."""
    if host is None or host in ("", "0.0.0.0", "::", "[::]"):
        return machine_ip
    return host.strip("[]")


def metrics_addr(value: Optional[str], engine_rank: int) -> Optional[str]:
    """Where engine rank r serves its metrics: ``KVFERRY_METRICS_ADDR`` (``host:port``) with
    port + r, one exporter per scheduler process; None when unset."""
    if value is None or value == "":
        return None
    host, sep, port = value.rpartition(":")
    try:
        served = int(port) + engine_rank
    except ValueError:
        served = -1
    if not sep or not host or not 0 < served < 65536:
        raise kvferry.InvalidArgument(
            f"invalid KVFERRY_METRICS_ADDR={value!r}: want host:port, with port + engine rank "
            f"({engine_rank}) in 1..65535"
        )
    return f"{host}:{served}"


class KvferryKVManager(CommonKVManager):
    """One SGLang rank's kvferry node, over the KV and aux buffers of its ``KVArgs``."""

    # A failed decode room keeps its pages until kvferry says no write can land.
    supports_deferred_decode_kv_release = True
    reports_transfer_latency = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: Optional[bool] = False,
    ):
        self.node: Optional[kvferry.Node] = None
        (
            self._layout,
            self._kv_spans,
            self._heads,
            self._layer_range,
            self._extras,
            self._extra_parts,
        ) = _layout_of(
            args,
            server_args,
            bool(is_mla_backend),
            disaggregation_mode == DisaggregationMode.PREFILL,
        )
        try:
            # GPU pools are registered as device memory: a wheel that cannot reach it refuses
            # at start (UnsupportedMemory), it never reads a device address with the CPU.
            self._kv_device = kv_device_of(
                getattr(server_args, "device", None), getattr(args, "gpu_id", 0)
            )
        except ValueError as e:
            raise UnsupportedLayout(str(e)) from None
        slots, row = self._layout["slots"], self._layout["aux_bytes"]
        self._aux_rows = np.zeros((max(slots, 1), max(row, 1)), dtype=np.uint8)
        self._peers: Optional[KeptPeers] = None
        self.prefix_seen = False
        # Rooms SGLang cleared while kvferry still quarantines their pages: followed until
        # is_abort_release_safe sees them releasable.
        self._held: Set[int] = set()
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        from sglang.srt.runtime_context import get_parallel

        if getattr(get_parallel(), "enable_kv_cache_sharding", False):
            raise UnsupportedLayout(
                "kvferry backend: --enable-kv-cache-sharding (pools striped across ranks) is "
                "not supported"
            )
        if self.attn_cp_size > 1:
            raise UnsupportedLayout(
                f"kvferry backend: attention context parallelism (CP {self.attn_cp_size}) is "
                "not supported"
            )
        if self.pp_size > 1 and disaggregation_mode == DisaggregationMode.DECODE:
            raise UnsupportedLayout(
                f"kvferry backend: pipeline parallelism on decode (PP {self.pp_size}) is not "
                "supported (prefill PP is)"
            )
        if disaggregation_mode == DisaggregationMode.DECODE:
            self.node = self._start_node("decode")
            self._peers = KeptPeers(self.node)
            # SGLang's ZMQ rank socket carries nothing here; an open one would also block
            # the interpreter's exit in zmq's context teardown.
            self.server_socket.close(linger=0)

    def _start_node(self, role: str) -> kvferry.Node:
        metrics = metrics_addr(os.environ.get("KVFERRY_METRICS_ADDR"), self.kv_args.engine_rank)
        if metrics is not None:
            try:
                kvferry.enable_metrics(metrics)
            except kvferry.InvalidArgument:
                pass  # already enabled in this process
        config = {}
        for knob, ours, theirs in _TIMEOUTS:
            if ours not in os.environ:
                config[knob] = int(getattr(envs, theirs).get() * 1000)
        aux = None
        if self._layout["slots"]:
            aux = (self._aux_rows.ctypes.data, self._aux_rows.nbytes)
        node = kvferry.Node(
            role,
            self._layout,
            self._kv_spans,
            aux=aux,
            token=os.environ.get("KVFERRY_TOKEN", "").encode(),
            rank=self.kv_args.engine_rank,
            kv_device=self._kv_device,
            heads=self._heads,
            layer_range=self._layer_range,
            extras=self._extras,
            extra_parts=self._extra_parts,
            **config,
        )
        logger.info(
            "kvferry %s node for engine rank %d: %s, heads %s, layers %s, state pools %s%s",
            role,
            self.kv_args.engine_rank,
            self._layout,
            self._heads or "whole pages",
            self._layer_range or "all",
            [len(pool) for pool in self._extras] or "none",
            " (split by attention TP rank)" if self._extra_parts else "",
        )
        return node

    def register_to_bootstrap(self):
        # The rank's contact port is its kvferry listener's: decode reaches it through
        # SGLang's registry exactly as it would reach another backend's rank port.
        if self.node is None:
            self.node = self._start_node("prefill")
            port = listen_port(os.environ.get("KVFERRY_LISTEN_PORT"), self.kv_args.engine_rank)
            # Where the user said the server lives (--host), unless that is every address:
            # then the machine's own, as SGLang's rank sockets do. Decode is told this one.
            host = listen_host(getattr(self.server_args, "host", None), self.local_ip)
            try:
                bound = self.node.listen(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")[0]
            except kvferry.ConnectError as e:
                raise kvferry.ConnectError(
                    f"kvferry prefill engine rank {self.kv_args.engine_rank} cannot listen on "
                    f"{host}:{port} (--host, and KVFERRY_LISTEN_PORT + engine rank or a free "
                    f"port when unset): {e}"
                ) from e
            self.local_ip = host
            self.server_socket.close(linger=0)
            self.rank_port = int(bound.rsplit(":", 1)[1])
        super().register_to_bootstrap()

    def peer(self, rank_ip: str, rank_port: int) -> int:
        """The kvferry peer of a prefill rank, connected once and kept by kvferry's core."""
        assert self._peers is not None, "only a decode names prefill peers"
        return self._peers.get([f"{rank_ip}:{rank_port}"])

    def copy_aux(self, slot: int, into_rows: bool) -> None:
        """Moves aux slot ``slot`` between SGLang's aux buffers and kvferry's staging row."""
        row = self._aux_rows[slot].ctypes.data
        offset = 0
        for ptr, item in zip(self.kv_args.aux_data_ptrs, self.kv_args.aux_item_lens):
            theirs = ptr + slot * item
            if into_rows:
                ctypes.memmove(row + offset, theirs, item)
            else:
                ctypes.memmove(theirs, row + offset, item)
            offset += item

    def check_aux_slot(self, slot: Optional[int]) -> None:
        if slot is not None and not 0 <= slot < self._layout["slots"]:
            raise kvferry.InvalidArgument(
                f"aux slot {slot} is outside the {self._layout['slots']} aux slots"
            )

    def abort_room(self, room: int) -> None:
        """Aborts a room; one that already ended is left as it is (kvferry refuses to abort
        a concluded room, and SGLang aborts failed rooms too)."""
        try:
            self.node.abort(room)
        except kvferry.InvalidArgument:
            pass

    def release_or_hold(self, room: int) -> None:
        """Stops following a room SGLang cleared, unless its pages are still quarantined."""
        if self.is_abort_release_safe(room, 0):
            _forget(self, room)
        else:
            self._held.add(room)

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        try:
            safe = self.node.releasable(bootstrap_room)
        except kvferry.InvalidArgument:
            return True  # never opened, or released and forgotten: nothing of it can land
        if safe and bootstrap_room in self._held:
            self._held.discard(bootstrap_room)
            _forget(self, bootstrap_room)
        return safe

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        pass

    def teardown(self) -> None:
        if self.node is not None:
            self.node.shutdown()
        self._zmq_ctx.destroy(linger=0)

    def forget_prefill(self, bootstrap_addr: str) -> None:
        """Drops what SGLang cached about a prefill that went away, so the next room asks its
        bootstrap server again (a restarted prefill listens on a new kvferry port unless
        ``KVFERRY_LISTEN_PORT`` fixes it)."""
        self.prefill_info_table.pop(bootstrap_addr, None)
        with self.connection_lock:
            for key in [k for k in self.connection_pool if k.startswith(f"{bootstrap_addr}_")]:
                del self.connection_pool[key]

    def node_failure(self, room: int) -> Optional[kvferry.RoomFailed]:
        """kvferry's failure of a room, None while it has not failed (or is unknown)."""
        try:
            return self.node.failure(room)
        except kvferry.KvferryError:
            return None

    def failure_text(self, bootstrap_room: int) -> str:
        """kvferry's reason for a failed room, as SGLang logs it."""
        with self.failure_lock:
            recorded = self.failure_records.pop(bootstrap_room, None)
        if recorded is not None:
            return recorded
        try:
            failure = self.node.failure(bootstrap_room)
        except kvferry.KvferryError as e:
            return str(e)
        if failure is None:
            return "kvferry: the room did not fail"
        name, explanation = failure.args
        return f"kvferry {name}: {explanation}"


def _forget(mgr: KvferryKVManager, room: int) -> None:
    try:
        mgr.node.forget(room)
    except kvferry.KvferryError:
        pass


def _fail(obj, reason: str) -> None:
    obj.kv_mgr.record_failure(obj.bootstrap_room, reason)
    obj.kv_mgr.update_status(obj.bootstrap_room, KVPoll.Failed)
    obj.conclude_state = KVPoll.Failed


class _KvferryRoom:
    """What a kvferry room answers the same on both sides."""

    def failure_exception(self):
        self.conclude_state = KVPoll.Failed
        reason = self.kv_mgr.failure_text(self.bootstrap_room)
        self.clear()
        raise KVTransferError(self.bootstrap_room, reason)


class KvferryKVSender(_KvferryRoom, CommonKVSender):
    """A prefill room: kvferry's sender of ``bootstrap_room``, fed chunk by chunk."""

    def __init__(
        self,
        mgr: KvferryKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        self._opened = False
        # The room's state items (SGLang gives them with the last chunk).
        self._state: List[List[int]] = []
        if self.conclude_state is not None:
            return
        try:
            mgr.node.open_sender(bootstrap_room, 0)
            self._opened = True
        except kvferry.KvferryError as e:
            _fail(self, f"kvferry: cannot open room {bootstrap_room}: {e}")

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        super().init(num_kv_indices, aux_index)
        try:
            self.kv_mgr.check_aux_slot(aux_index)
        except kvferry.InvalidArgument as e:
            self._give_up(str(e))

    def _give_up(self, reason: str) -> None:
        if self._opened and self.conclude_state is None:
            self.kv_mgr.abort_room(self.bootstrap_room)
        _fail(self, reason)

    def send(
        self,
        kv_indices: npt.NDArray[np.int32],
        state_indices: Optional[List] = None,
        num_kv_tokens: Optional[int] = None,
        indices_event: Optional[object] = None,
    ):
        if self.conclude_state is not None:
            return
        kv_indices, _slice, last, skip = self._prepare_send_indices(kv_indices, state_indices)
        if state_indices is not None:
            self._state = _state_items(state_indices)
        if skip:
            return
        if self._transfer_start_time is None:
            self._transfer_start_time = time.perf_counter()
        # An early send of a cached prefix under overlap scheduling: the previous forward may
        # still be writing these pages on its stream, and kvferry reads them once queued.
        wait_event, self._early_send_wait_event = self._early_send_wait_event, None
        if wait_event is not None:
            wait_event.synchronize()
        aux = self.aux_index if last else None
        if aux is not None:
            self.kv_mgr.copy_aux(aux, into_rows=True)
        try:
            self.kv_mgr.node.send_chunk(
                self.bootstrap_room,
                np.asarray(kv_indices).tolist(),
                last=last,
                aux_slot=aux,
                extras=self._state if last else [],
            )
        except kvferry.KvferryError as e:
            self._give_up(f"kvferry: chunk of room {self.bootstrap_room} refused: {e}")
            return
        self._record_transfer_indices(kv_indices, None)

    def poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        status = self.kv_mgr.node.poll(self.bootstrap_room)
        if status in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = status
            if status == KVPoll.Success and self._transfer_start_time is not None:
                self._transfer_metric.transfer_latency_s = (
                    time.perf_counter() - self._transfer_start_time
                )
        return status

    def poll_pp_consensus(self) -> KVPoll:
        return self.poll()

    def abort(self):
        if self._opened and self.conclude_state is None:
            self.kv_mgr.abort_room(self.bootstrap_room)
        super().abort()

    def clear(self) -> None:
        super().clear()
        if self._opened:
            _forget(self.kv_mgr, self.bootstrap_room)


class KvferryKVReceiver(_KvferryRoom, CommonKVReceiver):
    """A decode room: kvferry's receiver of ``bootstrap_room`` from the mapped prefill rank."""

    def __init__(
        self,
        mgr: KvferryKVManager,
        bootstrap_addr: str,
        bootstrap_room: Optional[int] = None,
    ):
        self._opened = False
        self._granted = False
        self._aux_index: Optional[int] = None
        self._idle: List[int] = []
        super().__init__(mgr, bootstrap_addr, bootstrap_room)

    def init(self, prefill_dp_rank: int):
        if self.conclude_state == KVPoll.Failed:
            return
        self.prefill_dp_rank = prefill_dp_rank
        if not self._route():
            return
        try:
            peers = self._peers()
        except kvferry.ConnectError as e:
            # SGLang's cached route may name a prefill that restarted elsewhere (a new kvferry
            # port): ask its bootstrap server again, and go there if the route changed.
            stale = self._routes()
            self.kv_mgr.forget_prefill(self.bootstrap_addr)
            if not self.kv_mgr.try_ensure_parallel_info(self.bootstrap_addr) or not self._route():
                if self.conclude_state != KVPoll.Failed:
                    _fail(self, f"kvferry: cannot open room {self.bootstrap_room}: {e}")
                return
            if self._routes() == stale:
                _fail(self, f"kvferry: cannot open room {self.bootstrap_room}: {e}")
                return
            logger.info(
                "kvferry: room %d: prefill at %s moved from %s to %s",
                self.bootstrap_room,
                self.bootstrap_addr,
                stale,
                self._routes(),
            )
            try:
                peers = self._peers()
            except kvferry.KvferryError as e2:
                self.kv_mgr.forget_prefill(self.bootstrap_addr)
                _fail(self, f"kvferry: cannot open room {self.bootstrap_room}: {e2}")
                return
        except kvferry.KvferryError as e:
            _fail(self, f"kvferry: cannot open room {self.bootstrap_room}: {e}")
            return
        try:
            self._idle = [i for i, b in enumerate(self.bootstrap_infos) if b["is_dummy"]]
            self.kv_mgr.node.open_receiver(self.bootstrap_room, peers)
            self._opened = True
        except kvferry.KvferryError as e:
            _fail(self, f"kvferry: cannot open room {self.bootstrap_room}: {e}")
            return
        try:
            # Until send_metadata, SGLang holds the room for KV capacity: a deadline that
            # expires meanwhile is decode_saturated on both sides, not a bare timeout.
            self.kv_mgr.node.set_queue_position(self.bootstrap_room, 1)
        except kvferry.InvalidArgument:
            pass  # the room already ended (its prefill is unreachable): poll() reports why
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.WaitingForInput)

    def _route(self) -> bool:
        """SGLang's mapping of this decode rank to prefill ranks (TP, PP, DP) from the
        prefill's bootstrap info; False (the room failed) when it cannot be served."""
        info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
        if info is None:
            _fail(self, f"prefill at {self.bootstrap_addr} is not known (down, or never reached)")
            return False
        if info.attn_cp_size != 1:
            _fail(
                self,
                "kvferry backend: prefill attention context parallelism is not supported "
                f"(prefill CP {info.attn_cp_size})",
            )
            return False
        self.prefill_info = info
        self.target_tp_rank = info.target_tp_rank
        self.target_tp_ranks = info.target_tp_ranks
        self.target_cp_ranks = info.target_cp_ranks
        self.target_pp_ranks = info.target_pp_ranks
        self.required_dst_info_num = info.required_dst_info_num
        self.required_prefill_response_num = info.required_prefill_response_num
        self._setup_bootstrap_infos()
        return self.conclude_state != KVPoll.Failed and bool(self.bootstrap_infos)

    def _routes(self) -> List[str]:
        return [f"{b['rank_ip']}:{b['rank_port']}" for b in self.bootstrap_infos or []]

    def _peers(self) -> List[int]:
        """Every prefill rank SGLang maps to this decode rank takes part: its heads, its
        pipeline stage's layers, or (an MLA "dummy") only its confirmation. A kept peer that
        has been down past its window raises ConnectError: a room toward it would fail at
        once, and its prefill may be back elsewhere."""
        peers = []
        for b in self.bootstrap_infos:
            peer = self.kv_mgr.peer(b["rank_ip"], int(b["rank_port"]))
            down = self.kv_mgr.node.unreachable(peer)
            if down is not None:
                raise kvferry.ConnectError(
                    f"prefill rank at {b['rank_ip']}:{b['rank_port']} is unreachable ({down})"
                )
            peers.append(peer)
        return peers

    def _register_kv_args(self) -> bool:
        # Nothing to register: kvferry's session handshake checks the layouts.
        return self.bootstrap_infos is not None

    def send_metadata(
        self,
        kv_indices: npt.NDArray[np.int32],
        aux_index: Optional[int] = None,
        state_indices: Optional[List] = None,
        decode_prefix_len: Optional[int] = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
        device_kv_indices: Optional[npt.NDArray[np.int32]] = None,
    ):
        if not self._opened or self.conclude_state is not None:
            return
        if destination != KVTransferDestination.DEVICE:
            raise NotImplementedError("Host KV destinations are not supported")
        page_size = self.kv_mgr.kv_args.page_size or 1
        try:
            if decode_prefix_len and decode_prefix_len % page_size:
                raise kvferry.InvalidArgument(
                    f"kvferry backend: decode prefix of {decode_prefix_len} tokens is not whole "
                    f"pages of {page_size}"
                )
            self.kv_mgr.check_aux_slot(aux_index)
            # The decode's cached prefix stays where it is: only the pages after it move.
            self.kv_mgr.node.grant_pages(
                self.bootstrap_room,
                np.asarray(kv_indices).tolist(),
                aux_slot=aux_index,
                receivers=max(1, int(self.required_dst_info_num)),
                skip_pages=(decode_prefix_len or 0) // page_size,
                idle_sources=self._idle,
                extras=_state_items(state_indices),
            )
        except kvferry.KvferryError as e:
            self.kv_mgr.abort_room(self.bootstrap_room)
            if self.kv_mgr.node_failure(self.bootstrap_room) is not None:
                # The room had already failed (its prefill went away meanwhile): its own
                # reason is the one to report, as poll() and failure_exception() do.
                self.conclude_state = KVPoll.Failed
                self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                return
            _fail(self, f"kvferry: pages of room {self.bootstrap_room} refused: {e}")
            return
        if decode_prefix_len and not self.kv_mgr.prefix_seen:
            self.kv_mgr.prefix_seen = True
            logger.info(
                "kvferry: room %d leaves the %d pages this decode holds in place (first room "
                "with a decode-side prefix; later ones are not logged)",
                self.bootstrap_room,
                decode_prefix_len // page_size,
            )
        self._aux_index = aux_index
        self._granted = True
        self.init_time = time.time()

    def _poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        if not self._opened:
            return self.kv_mgr.check_status(self.bootstrap_room)
        status = self.kv_mgr.node.poll(self.bootstrap_room)
        if status == KVPoll.Success:
            if self._aux_index is not None:
                self.kv_mgr.copy_aux(self._aux_index, into_rows=False)
            self.conclude_state = status
        elif status == KVPoll.Failed:
            self.conclude_state = status
            if isinstance(self.kv_mgr.node.failure(self.bootstrap_room), kvferry.PeerFailure):
                self.kv_mgr.forget_prefill(self.bootstrap_addr)
        elif not self._granted:
            # kvferry reached the prefill rank: SGLang may allocate and send pages.
            return KVPoll.WaitingForInput
        return status

    def abort(self):
        if self._opened:
            self.kv_mgr.abort_room(self.bootstrap_room)
        if self.conclude_state != KVPoll.Failed:
            self.kv_mgr.record_failure(self.bootstrap_room, "Aborted by AbortReq.")
            self.conclude_state = KVPoll.Failed
        self.abort_notified = True

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        # kvferry tells the prefill itself (its abort and fence); this only marks the room.
        if self._opened and not self.abort_notified:
            self.kv_mgr.abort_room(self.bootstrap_room)
        self.abort_notified = True

    def _clear(self) -> None:
        super()._clear()
        if self._opened:
            # A room SGLang drops before kvferry concluded it is aborted, and it stays followed
            # while kvferry quarantines its pages, so is_abort_release_safe can still say so.
            self.kv_mgr.abort_room(self.bootstrap_room)
            self.kv_mgr.release_or_hold(self.bootstrap_room)
            self._opened = False


class KvferryKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's own bootstrap server, unchanged: it maps ranks to kvferry listeners."""


__all__ = [
    "KvferryKVBootstrapServer",
    "KvferryKVManager",
    "KvferryKVReceiver",
    "KvferryKVSender",
    "UnsupportedLayout",
]
