"""The worker half: a kvferry node over vLLM's KV tensors, and the rooms it sends and receives."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Optional

from kvferry.vllm._config import DEFAULT_PORT, _plus
from kvferry.vllm._layout import (
    _layer_base,
    kv_heads,
    kv_regions,
    pp_rank,
    stage_layers,
    state_pair_refusal,
    state_regions,
    state_sources,
    tp_pair_refusal,
    tp_rank,
    tp_sources,
)
from kvferry.vllm._metadata import KvferryMetadata, _Pushed, _PushStep, _Recv, _Send
from kvferry.vllm._params import _TAG_BITS, PUSH_BIT, _rank_bound, _room_tag
from kvferry.vllm._stats import KvferryStats

if TYPE_CHECKING:
    from kvferry.vllm._connector import KvferryConnector

# The package's name, in every module: what vLLM's log shows and embedders filter on.
logger = logging.getLogger("kvferry.vllm")


#: How long a prefill's worker waits for the request of a room it was asked for but does not
#: know yet (its id checks out: the room is in the step on its way), and how long it
#: remembers rooms whose lease ran out (to refuse asks for them at once).
_ASK_GRACE_S = 10.0
_EXPIRED_KEPT = 4096


class _Worker:
    """The worker half: a kvferry node over vLLM's KV tensors, the rooms it serves, and a
    thread that answers decodes' asks for rooms as they come."""

    def __init__(self, connector: KvferryConnector, kv_caches: dict):
        import kvferry
        from kvferry._peers import KeptPeers

        self._kvferry = kvferry
        spans, planes, page_bytes, pages = kv_regions(kv_caches, connector.num_blocks())
        first_entry = next(iter(kv_caches.values()))
        device = (first_entry[0] if isinstance(first_entry, (list, tuple)) else first_entry).device
        #: Bytes of one vLLM block over every layer and plane.
        self._block_bytes = page_bytes * len(spans)
        self._stats = KvferryStats()
        #: Prefill: when each room's chunk went out, and its bytes.
        self._sent_at: dict[int, tuple[float, int]] = {}
        self._producer = connector._producer
        #: This worker's TP rank and its engine's TP size: it loads from (and sends to) the
        #: peer rank of the same index.
        self._rank, self._tp = tp_rank(connector._config), connector._tp
        #: This worker's pipeline stage, and the model layers its KV holds (None: all).
        stage = pp_rank(connector._config) if connector._pp > 1 else 0
        layer_range = None
        if connector._pp > 1:
            layer_range = stage_layers(list(kv_caches))
            if layer_range is None or layer_range[1] - layer_range[0] != len(spans) // planes:
                raise ValueError(
                    f"kvferry.vllm: pipeline stage {stage}'s KV cache names no single run of "
                    f"model layers ({sorted(kv_caches)[:4]}...)"
                )
        #: This worker's listener: the engine's base port + stage x TP + rank.
        self._port = connector._port + stage * self._tp + self._rank
        extra = connector._extra
        metrics = extra.get("metrics_addr") or os.environ.get("KVFERRY_METRICS_ADDR")
        try:
            # Each worker serves its own metrics, on the given port plus its listener's
            # offset from the configured port.
            offset = self._port - int(extra.get("port", DEFAULT_PORT))
            kvferry.enable_metrics(_plus(metrics, offset) if metrics and offset else metrics)
        except kvferry.InvalidArgument:
            pass  # already enabled in this process
        layout = {
            "layers": int(connector._shape["num_layers"]) if layer_range else len(spans) // planes,
            "planes": planes,
            "page_bytes": page_bytes,
            "pages": pages,
        }
        #: The model's KV heads, and those this rank's blocks hold (None: a layout without a
        #: head split kvferry knows, served at equal TP sizes only).
        self._total_heads = int(connector._shape["num_kv_heads"])
        self._mla = connector._mla
        groups = connector._groups
        #: State blocks at the end of each room's list that move as kvferry's extra pool,
        #: split by TP rank (0: none, or whole blocks among the pages).
        self._state_n = groups.state_count if groups.split_state else 0
        extras, extra_parts = [], []
        if self._state_n:
            tensors = state_regions(kv_caches, pages, page_bytes)
            extras = [tensors]
            extra_parts = [[groups.state_specs[0].parts(self._tp, self._rank)] * len(tensors)]
        # Recurrent state whole among the pages has no head split (equal TP only).
        whole_state = groups.backoff > 0 and not self._state_n
        self._heads = None if self._mla or whole_state else kv_heads(kv_caches, pages, int(connector._shape["block_size"]),
                                                         self._total_heads, self._tp, self._rank)
        knobs = {k: int(v) for k, v in extra.items() if k.endswith("_ms")}
        self.node = kvferry.Node(
            "prefill" if self._producer else "decode",
            layout,
            spans,
            token=os.environ.get("KVFERRY_TOKEN", "").encode(),
            kv_device=device.index if device.type == "cuda" else None,
            transport=extra.get("transport"),
            rdma_device=extra.get("rdma_device"),
            heads=self._heads,
            layer_range=layer_range,
            extras=extras,
            extra_parts=extra_parts,
            **knobs,
        )
        logger.info("kvferry %s node over vLLM's KV (TP rank %d of %d): %s, heads %s, KV cache groups %s, "
                    "state %s", "prefill" if self._producer else "decode", self._rank, self._tp, layout,
                    self._heads or "whole blocks", groups.signature(),
                    f"split by TP rank over {len(extras[0])} tensors" if extras
                    else "whole blocks among the pages" if groups.backoff else "none")
        # kvferry's layer index of each vLLM layer name (layers sharing a cache share it;
        # a pipeline stage's are the model's).
        index: dict[int, int] = {}
        first = layer_range[0] if layer_range else 0
        self._layer_of = {
            name: first + index.setdefault(_layer_base(t), len(index)) for name, t in kv_caches.items()
        }
        #: How many vLLM layers write each kvferry layer (a hybrid model's groups share
        #: tensors): a push chunk's layer goes only once all of them ran.
        self._writers = collections.Counter(self._layer_of.values())
        self._written: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._peers = KeptPeers(self.node)
        # Prefill, push mode: per room, what is computed and what went to the decode.
        self._pushes: dict[int, _Pushed] = {}
        self._step_rooms: Optional[list[int]] = None
        self._marked: set[int] = set()
        self._layers = range(first, first + len(index))
        # On a GPU, save_kv_layer runs when a layer's kernels are queued, not when they ran:
        # push rooms then go whole after the forward pass, once its stream is synchronized.
        self._cuda = device if device.type == "cuda" else None
        #: Push-mode chunks sent layer by layer during a forward pass, and sent whole.
        self.chunks = {"layerwise": 0, "whole": 0}
        self._free_now: set[str] = set()
        # Prefill: rooms waiting for their decode, by room; asks that came before the room.
        self._sends: dict[int, tuple[str, _Send]] = {}
        self._asked: dict[int, tuple[Optional[int], float]] = {}
        self._sending: dict[int, str] = {}
        self._room_prefix = connector._room_prefix
        self._room_key = connector._room_key
        self._lease = connector._lease
        # Rooms whose lease ran out, newest last: an ask for one is refused at once.
        self._expired: collections.OrderedDict[int, None] = collections.OrderedDict()
        # Decode: rooms being received, by request.
        self._recvs: dict[str, _Recv] = {}
        self._aborting: set[str] = set()
        self._failed_now: set[str] = set()
        self._load_errors: set[int] = set()
        self._stop = threading.Event()
        self._openers = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kvferry-open")
        self._asks = None
        if self._producer:
            self.node.listen(f"{connector._listen_host}:{self._port}")
            self._asks = threading.Thread(target=self._answer_asks, name="kvferry-asks", daemon=True)
            self._asks.start()

    # ---- per step -------------------------------------------------------------------

    def begin_forward(self, meta: KvferryMetadata) -> None:
        """Push mode, as the forward pass starts: each granted room gets, as one layerwise
        chunk, the blocks this step completes; its layers go as they finish."""
        with self._lock:
            rooms = []
            for req_id, step in meta.pushes.items():
                pushed = self._pushed(req_id, step)
                pushed.computed = step.computed
                if self._cuda is None and self._push_more(step.room, pushed, pushed.computed, layerwise=True):
                    rooms.append(step.room)
            self._step_rooms = rooms

    def _pushed(self, req_id: str, step: _PushStep) -> "_Pushed":
        """The worker's state of a push room, made at the room's first step (granting it at
        once if its decode asked before); the caller holds the lock."""
        pushed = self._pushes.get(step.room)
        if pushed is None:
            pushed = self._pushes[step.room] = _Pushed(req_id=req_id, total=step.total, prompt=step.prompt)
            asked = self._asked.pop(step.room, None)
            if asked is not None:
                self._grant_push(step.room, asked[0])
        return pushed

    def layer_done(self, layer_name: str) -> None:
        """Push mode: a layer's forward pass ended; its part of this step's chunks may go."""
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        self._written[layer] += 1
        if self._written[layer] >= self._writers[layer]:
            self._mark(layer)

    def _mark(self, layer: int) -> None:
        rooms = self._step_rooms
        if not rooms or layer in self._marked:
            return
        self._marked.add(layer)
        try:
            self.node.mark_layer_ready(rooms, layer)
        except self._kvferry.KvferryError as e:
            logger.warning("kvferry: layer %d of rooms %s not marked ready: %s", layer, rooms, e)

    def _push_more(self, room: int, pushed: "_Pushed", blocks: list[int], layerwise: bool) -> bool:
        """Sends the blocks of ``blocks`` (a prefix of the prompt's) that the decode granted
        (the tail) and has not had yet; whether a chunk went."""
        if pushed.granted is None or pushed.failed or len(blocks) <= pushed.sent:
            return False
        # The pages the decode granted are the tail of the prompt's (the state blocks after
        # them, if split, go as extra items with the last chunk).
        pages = pushed.total - self._state_n
        first = pages - pushed.granted
        fresh = [b for i, b in enumerate(blocks[:pages]) if i >= max(first, pushed.sent)]
        pushed.sent = len(blocks)
        last = pushed.sent == pushed.total
        if not fresh and not last:
            return False
        self.chunks["layerwise" if layerwise else "whole"] += 1
        try:
            self.node.send_chunk(room, fresh, last=last, layerwise=layerwise,
                                 extras=self._state_items(blocks) if last else ())
        except self._kvferry.KvferryError as e:
            logger.error("kvferry: push room %d: chunk not sent: %s", room, e)
            pushed.failed = True
            self._abort(room)
            return False
        return layerwise

    def preempted(self, rooms: set[int]) -> None:
        """Push rooms whose prefill blocks vLLM took back: each fails, and this returns only
        once no read of those blocks can still go out (before the step overwrites them)."""
        for room in rooms:
            with self._lock:
                pushed = self._pushes.pop(room, None)
                if pushed is None:
                    continue
                pushed.failed = True
                if pushed.granted is None:
                    self._refuse(room, "vLLM preempted the prefill request")
                    continue
                self._abort(room)
            logger.warning("kvferry: push room %d: vLLM preempted the prefill request; the room fails", room)
            deadline = time.monotonic() + 60
            while not self._released(room):
                if time.monotonic() > deadline:
                    logger.error("kvferry: push room %d still not released 60 s after its abort", room)
                    break
                time.sleep(0.001)
            self._forget(room)

    def _released(self, room: int) -> bool:
        """Whether nothing of ``room`` can still be read or written (unknown rooms are)."""
        try:
            return self.node.releasable(room)
        except self._kvferry.InvalidArgument:
            return True

    def _forget(self, room: int) -> None:
        try:
            self.node.forget(room)
        except self._kvferry.KvferryError:
            pass

    def _abort(self, room: int) -> None:
        try:
            self.node.abort(room)
        except self._kvferry.KvferryError:
            pass  # it ended already

    def end_forward(self, meta: KvferryMetadata) -> None:
        """Push mode, after the forward pass (vLLM's ``wait_for_save``): this step's blocks
        are complete; every layer not reported yet is released, and what no layerwise chunk
        carried (a room granted mid-step, a step that reported no layer) goes whole now."""
        for layer in self._layers:
            self._mark(layer)
        if meta.pushes and self._cuda is not None:
            # The forward pass's kernels were only queued: the KV is written once they ran.
            import torch

            torch.cuda.current_stream(self._cuda).synchronize()
        with self._lock:
            for req_id, step in meta.pushes.items():
                pushed = self._pushed(req_id, step)
                pushed.computed = pushed.safe = step.computed
                self._push_more(step.room, pushed, pushed.safe, layerwise=False)
        self._step_rooms = None
        self._marked = set()
        self._written = collections.Counter()

    def take(self, meta: KvferryMetadata) -> None:
        """A step's requests that finished, opened or ended: rooms to serve, open or abort."""
        with self._lock:
            for room in meta.push_aborts:
                pushed = self._pushes.get(room)
                if pushed is None:
                    # Never scheduled: no block of it exists; an ask for it is refused.
                    pushed = self._pushes[room] = _Pushed(req_id="", total=0, failed=True)
                    if room in self._asked:
                        del self._asked[room]
                        self._refuse(room, "the prefill request was aborted")
                        del self._pushes[room]
                    continue
                pushed.failed = True
                if pushed.granted is not None:
                    self._abort(room)
            for req_id, send in meta.sends.items():
                pushed = self._pushes.pop(send.room, None)
                if pushed is not None and pushed.granted is not None and pushed.opened:
                    # Its sender is open: the blocks go back once no write can land.
                    self._sending[send.room] = req_id
                    continue
                if pushed is not None and pushed.failed:
                    # Aborted before any decode asked: nothing of it was sent.
                    self._refuse(send.room, "the prefill request was aborted")
                    self._free_now.add(req_id)
                    continue
                self._sends[send.room] = (req_id, send)
                asked = self._asked.pop(send.room, None)
                if asked is not None:
                    self._start_send(send.room, asked[0])
        for req_id, recv in meta.recvs.items():
            self._open_recv(req_id, recv)
        for room, addrs, stages, reason in meta.releases:
            self._submit(self._release_now, room, addrs, stages, reason)
        for req_id in meta.aborts:
            with self._lock:
                recv = self._recvs.get(req_id)
                if recv is not None and recv.refused is None:
                    # Not opened yet: the opener aborts it once it is.
                    if recv.opened:
                        self._abort(recv.room)
                    self._aborting.add(req_id)

    def _open_recv(self, req_id: str, recv: _Recv) -> None:
        """Opens a decode room: in vLLM's step where every prefill rank it names had its
        first contact (the open does not wait then, and a hand-off to another thread costs
        up to Python's 5 ms switch interval while the engine runs Python), else off the
        step, since a first contact waits up to kvferry's ``unreachable_timeout``."""
        with self._lock:
            self._recvs[req_id] = recv
            if recv.refused is not None:
                self._failed_now.add(req_id)
                return
        if self._contacted(recv):
            self._open_now(req_id, recv)
        else:
            self._submit(self._open_now, req_id, recv)

    def _contacted(self, recv: _Recv) -> bool:
        """Whether every prefill rank ``recv``'s room names had its first contact."""
        try:
            named, _, _ = self._sources(recv.addrs, recv.stages)
        except Exception:  # noqa: BLE001 - the opener reports what is wrong with them
            return False
        return all(self._peers.contacted([addr]) for addr in named)

    def _submit(self, work, *args) -> None:
        """Runs ``work`` on the opener threads; an exception it raises is logged with its
        traceback, never left unread in a future."""

        def reported(future: concurrent.futures.Future) -> None:
            e = future.exception()
            if e is not None:
                logger.error("kvferry: %s%r failed", work.__name__, args, exc_info=e)

        self._openers.submit(work, *args).add_done_callback(reported)

    def _bound(self, prompt: Optional[int], rank: int) -> Optional[int]:
        """The digest a room between this rank and prefill rank ``rank`` is bound to: the
        prompt's, and the rank's where the blocks declare no heads (with heads declared,
        kvferry refuses a request for heads the prefill rank does not hold; MLA's latent KV
        is the same on every rank)."""
        return prompt if self._heads is not None or self._mla else _rank_bound(prompt, rank)

    def _open_now(self, req_id: str, recv: _Recv) -> None:
        peers: list[int] = []
        try:
            prefill_tp = len(recv.addrs) // recv.stages
            if prefill_tp != self._tp and self._heads is None and not self._mla:
                raise ValueError(f"the prefill runs TP {prefill_tp}, this decode TP {self._tp}, and this rank's "
                                 "KV layout has no head split kvferry knows (whole blocks: equal TP only)")
            refused = state_pair_refusal(prefill_tp, self._tp) if self._state_n else None
            if refused is not None:
                raise ValueError(refused)
            named, receivers, idle = self._sources(recv.addrs, recv.stages)
            for addr in named:
                peers.append(self._peer(addr))
                self._peers.reach(peers[-1])
            self.node.open_receiver(recv.room, peers, pages=self._pages_of(recv.blocks), receivers=receivers,
                                    idle_sources=idle, prompt=self._bound(recv.prompt, self._rank),
                                    extras=self._state_items(recv.blocks))
        except Exception as e:  # noqa: BLE001 - whatever it was, the request must end
            # A load failure: vLLM recomputes the request instead of waiting for a room
            # that was never opened.
            logger.error("kvferry: request %s: room %d not opened: %s", req_id, recv.room, e)
            if peers and isinstance(e, (self._kvferry.PeerRefused, self._kvferry.PeerUnreachable)):
                # A prefill rank refused us or stayed unreachable: the room fails here with
                # that reason (and is counted under it) without waiting on the peer again,
                # and each source reached before it hears that it may free its blocks.
                for peer in peers:
                    self._fail_unopened(recv.room, peer, e.args[0])
            with self._lock:
                recv.refused = str(e)
                self._failed_now.add(req_id)
            return
        with self._lock:
            recv.opened = True
            recv.opened_at = time.monotonic()
            if req_id in self._aborting:
                self._abort(recv.room)

    def _fail_unopened(self, room: int, peer: int, reason: str) -> bool:
        """Opens ``room`` without granting a page and fails it with ``reason`` at once: the
        failure is counted under its reason, and a prefill that hears it frees the blocks
        it held for the room; it is forgotten once nothing of it can land. False if this
        decode already has the room (it was counted when it ended)."""
        try:
            self.node.open_receiver(room, [peer])
        except self._kvferry.UnknownPeer as e:
            logger.info("kvferry: room %d: its prefill was let go meanwhile (%s): nothing to release", room, e)
            return False
        except self._kvferry.InvalidArgument as e:
            logger.info("kvferry: room %d is already known here (%s): nothing to fail or release", room, e)
            return False
        self.node.fail(room, reason)
        deadline = time.monotonic() + 60
        while not self._released(room) and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.05)
        self._forget(room)
        return True

    def _release_now(self, room: int, addrs: list[str], stages: int, reason: str) -> None:
        """Tells the prefill ranks this rank pairs with that this decode will not load
        ``room`` (``reason``), so that they free the blocks they held for it."""
        for addr in self._sources(addrs, stages)[0]:
            try:
                peer = self._peer(addr)
                self._peers.reach(peer)
            except self._kvferry.KvferryError as e:
                logger.warning("kvferry: the prefill rank at %s of room %d cannot be told to free its "
                               "blocks (%s): they are freed when its lease runs out", addr, room, e)
                continue
            self._fail_unopened(room, peer, reason)

    def _sources(self, addrs: list[str], stages: int) -> tuple[list[str], int, list[int]]:
        """The listeners this rank's room names, of a room whose params name one per prefill
        worker (``stages`` x its TP, stage-major): in every stage, the ranks holding any of
        its heads; with how many decode ranks each sends to and the positions of idle
        sources. For a pair of TP sizes that is refused, every prefill worker p with
        p % TP == r, so that the decode's ranks together release each of them."""
        prefill_tp = len(addrs) // stages
        if (tp_pair_refusal(prefill_tp, self._tp, self._total_heads, self._mla) is not None
                or (self._state_n and state_pair_refusal(prefill_tp, self._tp) is not None)):
            return [a for p, a in enumerate(addrs) if p % self._tp == self._rank], 1, []
        if self._state_n and prefill_tp != self._tp:
            # Every rank holding part of this rank's share of the state writes it.
            sources, receivers, idle = state_sources(prefill_tp, self._tp, self._rank)
        else:
            sources, receivers, idle = tp_sources(prefill_tp, self._tp, self._total_heads, self._rank, self._mla)
        named = [addrs[s * prefill_tp + p] for s in range(stages) for p in sources]
        return named, receivers, [s * len(sources) + i for s in range(stages) for i in idle]

    def _peer(self, addr: str) -> int:
        """The kvferry peer of a prefill rank, named once (the core keeps it connected, and
        lets it go after ``KVFERRY_PEER_IDLE_TIMEOUT_MS`` unused)."""
        return self._peers.get([addr], reach=False)

    def progress(self) -> tuple[set[str], set[str], set[str]]:
        """Requests whose blocks are free to reuse (prefill), loaded or failed (decode)."""
        sent: set[str] = set()
        received: set[str] = set()
        failed: set[str] = set()
        kvferry = self._kvferry
        with self._lock:
            sent |= self._free_now
            self._free_now = set()
            for room, req_id in list(self._sending.items()):
                try:
                    state = self.node.poll(room)
                    if state not in (kvferry.KVPoll.Success, kvferry.KVPoll.Failed) or not self.node.releasable(room):
                        continue
                    sent_at = self._sent_at.pop(room, None)
                    if state == kvferry.KVPoll.Failed:
                        reason = self.node.failure(room)
                        logger.warning("kvferry: room %d of request %s failed: %s", room, req_id, reason)
                        self._stats.record_failure(str(reason))
                    elif sent_at is not None:
                        self._stats.record_success(sent_at[1], time.monotonic() - sent_at[0])
                except kvferry.InvalidArgument:
                    pass  # the node no longer follows it: nothing of it can be read
                del self._sending[room]
                self._forget(room)
                sent.add(req_id)
        with self._lock:
            for req_id in list(self._failed_now):
                self._failed_now.discard(req_id)
                self._aborting.discard(req_id)
                recv = self._recvs.pop(req_id, None)
                if recv is not None:
                    self._load_errors.update(recv.blocks)
                    self._stats.record_failure("not_opened")
                received.add(req_id)
                failed.add(req_id)
            opened = [(r, recv) for r, recv in self._recvs.items() if recv.opened]
        for req_id, recv in opened:
            state = self.node.poll(recv.room)
            if req_id in self._aborting:
                if state in (kvferry.KVPoll.Success, kvferry.KVPoll.Failed) and self.node.releasable(recv.room):
                    self._aborting.discard(req_id)
                    del self._recvs[req_id]
                    self.node.forget(recv.room)
                    received.add(req_id)
                continue
            if state == kvferry.KVPoll.Success:
                del self._recvs[req_id]
                self.node.forget(recv.room)
                received.add(req_id)
                with self._lock:
                    self._stats.record_success(
                        len(recv.blocks) * self._block_bytes,
                        time.monotonic() - recv.opened_at if recv.opened_at is not None else None,
                    )
            elif state == kvferry.KVPoll.Failed:
                if not recv.logged:
                    recv.logged = True
                    logger.error(
                        "kvferry: request %s failed to load its KV (room %d): %s; vLLM recomputes it",
                        req_id, recv.room, self.node.failure(recv.room),
                    )
                if self.node.releasable(recv.room):
                    reason = self.node.failure(recv.room)
                    del self._recvs[req_id]
                    self.node.forget(recv.room)
                    self._load_errors.update(recv.blocks)
                    received.add(req_id)
                    failed.add(req_id)
                    with self._lock:
                        self._stats.record_failure(str(reason))
        return sent, received, failed

    def take_stats(self) -> Optional[KvferryStats]:
        """The rooms ended since the last call, or ``None``."""
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KvferryStats()
        return stats

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- prefill: answering asks --------------------------------------------------------

    def _answer_asks(self) -> None:
        """The prefill's transport work, on its own thread so that it goes on while vLLM
        does not step an idle engine: answering asks, refusing rooms it does not hold, and
        the end of leases."""
        while not self._stop.is_set():
            try:
                got = self.node.next_announcement(0.2)
            except self._kvferry.KvferryError:
                return
            with self._lock:
                if got is not None:
                    room, _generation, pages, skip = got
                    # An idle source's ask (it wants nothing: skip None) sends every block;
                    # kvferry moves none of them and the room ends when the decode confirms.
                    self._answer(room, None if skip is None else pages)
                self._expire(time.monotonic())

    def _answer(self, room: int, pages: Optional[int]) -> None:
        """A decode asked for ``room`` (``pages``: its tail it granted; None: it asked this
        rank for nothing, as an idle source); the caller holds the lock."""
        if room in self._sends:
            self._start_send(room, pages)
        elif room in self._pushes:
            self._grant_push(room, pages)
        elif room & PUSH_BIT:
            # The router told the decode first: the prefill's step will find it.
            self._asked[room] = (pages, time.monotonic())
        elif room >> 32 != self._room_prefix:
            self._refuse(room, "the prefill that had this room restarted")
        elif room in self._expired:
            self._refuse(room, f"its lease ran out ({self._lease:.0f} s) before this decode asked")
        elif _room_tag(self._room_key, (room & 0xFFFF_FFFF) >> _TAG_BITS) != room & ((1 << _TAG_BITS) - 1):
            self._refuse(room, "this prefill never handed out that room id")
        else:
            # Handed out by this engine's scheduler: its request is in a step on its way.
            self._asked[room] = (pages, time.monotonic())

    def _expire(self, now: float) -> None:
        """Ends the leases that ran out and the asks nothing came for; the caller holds the
        lock."""
        for room, (req_id, send) in list(self._sends.items()):
            if room not in self._sending and now > send.deadline:
                logger.warning(
                    "kvferry: no decode asked for room %d of request %s within %.0f s; its blocks are freed",
                    room, req_id, self._lease,
                )
                del self._sends[room]
                self._free_now.add(req_id)
                self._expired[room] = None
                while len(self._expired) > _EXPIRED_KEPT:
                    self._expired.popitem(last=False)
        for room, (_, at) in list(self._asked.items()):
            # A push room's prefill request may wait in vLLM's queue for a while.
            if now - at > (self._lease if room & PUSH_BIT else _ASK_GRACE_S):
                # Asked for a room this prefill never had: a decode must not wait out its timeout.
                del self._asked[room]
                self._refuse(room, "no such room on this prefill")

    def _grant_push(self, room: int, pages: Optional[int]) -> None:
        """A decode asked for a push room being computed: open it and send what is done (an
        idle source's ask, ``pages`` None, as if it asked for every block)."""
        pushed = self._pushes[room]
        if pushed.granted is not None:
            return
        if pages is None:
            pages = pushed.total - self._state_n
        pushed.granted = pages
        if pushed.failed:
            self._refuse(room, "the prefill request was aborted")
            if not pushed.req_id:
                del self._pushes[room]
            return
        try:
            self.node.open_sender(room, prompt=self._bound(pushed.prompt, self._rank))
        except self._kvferry.KvferryError as e:
            logger.error("kvferry: push room %d not opened: %s", room, e)
            pushed.failed = True
            return
        pushed.opened = True
        if pages <= 0 or pages > pushed.total - self._state_n:
            logger.error("kvferry: push room %d: the decode granted %d blocks, the prompt has %d",
                         room, pages, pushed.total)
            pushed.failed = True
            self._abort(room)
            return
        # Mid-forward, this step's blocks are still being written: only earlier ones go.
        self._push_more(room, pushed, pushed.safe, layerwise=False)

    def _start_send(self, room: int, pages: Optional[int]) -> None:
        """Sends the tail of the room's blocks the decode granted (it holds the rest); every
        block for an idle source's ask (``pages`` None: kvferry moves none of them)."""
        req_id, send = self._sends.pop(room)
        blocks = self._pages_of(send.blocks)
        if pages is None:
            pages = len(blocks)
        try:
            self.node.open_sender(room, prompt=self._bound(send.prompt, self._rank))
        except self._kvferry.KvferryError as e:
            logger.error("kvferry: room %d of request %s not opened: %s", room, req_id, e)
            self._free_now.add(req_id)
            return
        self._sending[room] = req_id
        if self.node.poll(room) == self._kvferry.KVPoll.Failed:
            return  # refused as it opened (another prompt's request): freed once it is over
        try:
            if pages == 0:
                logger.info("kvferry: the decode of request %s will not load room %d; its blocks are freed",
                            req_id, room)
                self.node.abort(room)
                return
            if pages < 0 or pages > len(blocks):
                logger.error(
                    "kvferry: room %d of request %s: the decode granted %d blocks, the prefill holds %d",
                    room, req_id, pages, len(blocks),
                )
                self.node.abort(room)
                return
            self.node.send_chunk(room, blocks[-pages:], last=True, extras=self._state_items(send.blocks))
            # The caller holds the lock.
            self._sent_at[room] = (time.monotonic(), pages * self._block_bytes)
        except self._kvferry.KvferryError as e:
            logger.error("kvferry: room %d of request %s not sent: %s", room, req_id, e)
            try:
                self.node.abort(room)
            except self._kvferry.KvferryError:
                pass

    def _pages_of(self, blocks: list[int]) -> list[int]:
        """A whole room's KV pages: its list without the state blocks split by TP rank."""
        return blocks[: len(blocks) - self._state_n]

    def _state_items(self, blocks: list[int]) -> list[list[int]]:
        """A whole room's state blocks split by TP rank, as its extra pool's items (none
        where the state moves among the pages)."""
        return [blocks[len(blocks) - self._state_n:]] if self._state_n else []

    def _refuse(self, room: int, why: str) -> None:
        logger.warning("kvferry: refusing room %d: %s", room, why)
        try:
            self.node.open_sender(room)
            self.node.abort(room)
            self.node.forget(room)
        except self._kvferry.KvferryError:
            pass

    def shutdown(self) -> None:
        self._stop.set()
        if self._asks is not None:
            self._asks.join(timeout=2)
        self._openers.shutdown(wait=False, cancel_futures=True)
        self.node.shutdown()
