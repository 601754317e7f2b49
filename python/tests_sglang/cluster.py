"""SGLang ranks of any parallel layout (attention TP, DP attention, PP prefill, MLA), one
process each, set up and driven the way SGLang's schedulers set up and drive their KV
managers: a published ``ServerArgs`` for the rank's place in the world, real ``KVArgs`` over
numpy KV pools laid out as SGLang's pools are (every K layer, then every V layer; each page
``page_size`` token rows of the rank's heads), SGLang's ``MetadataBuffers`` as aux, and the
classes ``get_kv_class`` selects for "kvferry".

Every prefill rank fills its pool with ``value(...)`` of the global (layer, K/V, page, token,
head, byte) it holds, so a decode rank can check every byte of every granted page against
what the model's prefill held, whichever ranks sent it.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import shutil
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
from engine_processes import assert_data_path, mp_context  # noqa: F401 (the suite calls both here)

LAYERS = 3
KV_HEADS = 4
HEAD_DIM = 8  # bytes of one head of one token (uint8 "dtype")
LATENT = 24  # MLA: bytes of one token's latent KV
PAGE_SIZE = 4  # tokens per page
PAGES = 24
SLOTS = 8
DEADLINE_S = 30
# State pools, laid out as SGLang's are: Mamba's per-layer conv and temporal state of one
# slot per request (its pool size + 1 slots), the sliding-window KV (its own, smaller page
# pool, K and V per layer), the DSA indexer's keys (one buffer per layer over the KV pages).
MAMBA_SLOTS = SLOTS + 1
SWA_PAGES = 12
DSA_ROW = 20  # bytes of one token's indexer key
# A GDN layer's state over the whole model ("gdn", SGLang's "mamba" type with its slicing
# descriptors): per slot, conv channels of query, key and value, each GDN_ROWS bytes (SGLang's
# [dim, kernel - 1]), then a temporal buffer of GDN_HEADS heads of GDN_HEAD bytes. A rank
# holds its attention TP share of each sub-block and of the heads.
GDN_QK, GDN_V, GDN_ROWS, GDN_HEADS, GDN_HEAD = 8, 16, 3, 4, 12


def session_paths(manager) -> list:
    """The data path of each session of a rank's kvferry node (none before it started)."""
    return [] if manager.node is None else manager.node.session_paths()


def value(layer, plane, page, token, head, byte):
    """The byte the model's prefill holds at this place (any rank holding it has it)."""
    return (layer * 53 + plane * 29 + page * 7 + token * 3 + head * 11 + byte) % 251


def state_value(pool, buffer, item, byte):
    """The byte the prefill holds at this place of a state pool (every rank holding it)."""
    return (pool * 61 + buffer * 17 + item * 13 + byte * 5 + 1) % 251


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir(layers=LAYERS, kv_heads=KV_HEADS) -> str:
    """A model directory with only a config.json: what kvferry's backend reads for the
    model's layer and KV head counts where ``KVArgs`` lacks them."""
    d = tempfile.mkdtemp(prefix="kvferry-model-")
    # Gone when the test process ends (the ranks reading it end before).
    atexit.register(shutil.rmtree, d, True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "num_hidden_layers": layers,
                "num_attention_heads": kv_heads,
                "num_key_value_heads": kv_heads,
                "hidden_size": kv_heads * HEAD_DIM,
                "intermediate_size": 64,
                "vocab_size": 128,
            },
            f,
        )
    return d


@dataclass
class Spec:
    """One rank: its role and its place in its server's world."""

    role: str
    world_rank: int
    tp: int = 1
    pp: int = 1
    dp: int = 1  # DP attention: attention TP is tp / dp
    mla: bool = False
    model: str = ""
    kv_heads: Optional[int] = None  # KVArgs' total head count, None: from the model config
    states: tuple = ()  # SGLang state types this rank's pools carry ("mamba", "swa", "dsa")
    env: Dict[str, str] = field(default_factory=dict)


class RankState:
    """Inside a rank's process: SGLang's context, the pools, the manager."""

    def __init__(self, spec: Spec, bootstrap_port: int):
        os.environ.update(spec.env)
        import kvferry.sglang

        kvferry.sglang.install()
        import torch
        from sglang.srt.disaggregation.utils import (
            DisaggregationMode,
            KVClassType,
            MetadataBuffers,
            TransferBackend,
            get_kv_class,
        )
        from sglang.srt.distributed.utils import get_pp_indices
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
        from sglang.srt.server_args import ServerArgs

        extra = dict(tp_size=spec.tp, pp_size=spec.pp)
        if spec.dp > 1:
            extra.update(dp_size=spec.dp, enable_dp_attention=True)
        self.server_args = ServerArgs(
            model_path=spec.model or "dummy",
            host="127.0.0.1",
            device="cpu",
            page_size=PAGE_SIZE,
            disaggregation_mode=spec.role,
            disaggregation_transfer_backend="kvferry",
            disaggregation_bootstrap_port=bootstrap_port,
            **extra,
        )
        publish(
            self.server_args,
            role="scheduler",
            ranks=SpawnRanks(world_rank=spec.world_rank, gpu_id=0),
        )
        par = get_parallel()
        par.override_permanently(pp_group=self._pp_group(spec, par) if spec.pp > 1 else None)
        self.spec = spec
        self.attn_tp, self.attn_dp_rank = par.attn_tp_size, par.attn_dp_rank
        self.pp_rank = par.pp_rank if spec.role == "prefill" else 0
        start, end = (
            get_pp_indices(LAYERS, self.pp_rank, spec.pp) if spec.role == "prefill" else (0, LAYERS)
        )
        self.layers = list(range(start, end))
        local = par.tp_rank % self.attn_tp
        self.attn_rank = local
        if spec.mla:
            self.heads = (0, 1)
            row = LATENT
        else:
            per_rank = max(1, KV_HEADS // self.attn_tp)
            replicas = max(1, self.attn_tp // KV_HEADS)
            self.heads = ((local // replicas) * per_rank, per_rank)
            row = per_rank * HEAD_DIM
        self.row = row
        self.page_bytes = PAGE_SIZE * row
        planes = 1 if spec.mla else 2
        self.kv = np.zeros((planes * len(self.layers), PAGES, self.page_bytes), dtype=np.uint8)
        self.meta = MetadataBuffers(
            SLOTS, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4
        )
        kv_args = get_kv_class(TransferBackend("kvferry"), KVClassType.KVARGS)()
        kv_args.engine_rank = par.tp_rank if spec.role == "prefill" else par.tp_rank % self.attn_tp
        kv_args.pp_rank = self.pp_rank
        kv_args.system_dp_rank = 0
        kv_args.rust_http_port = None
        kv_args.kv_cache_dtype_str = "auto"
        kv_args.kv_layout = None
        kv_args.prefill_start_layer = start
        kv_args.prefill_end_layer = end
        kv_args.kv_data_ptrs = [self.kv[b].ctypes.data for b in range(self.kv.shape[0])]
        kv_args.kv_data_lens = [self.kv[b].nbytes for b in range(self.kv.shape[0])]
        kv_args.kv_item_lens = [self.page_bytes] * self.kv.shape[0]
        kv_args.num_draft_entries = 0
        kv_args.kv_layer_ids = []
        if not spec.mla and spec.kv_heads is not None:
            kv_args.kv_head_num = max(1, spec.kv_heads // self.attn_tp)
            kv_args.total_kv_head_num = spec.kv_heads
        kv_args.page_size = PAGE_SIZE
        kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = (
            self.meta.get_buf_infos()
        )
        kv_args.ib_device = None
        kv_args.gpu_id = 0
        self.states = [self._state_pool(kind) for kind in spec.states]
        kv_args.state_types = ["mamba" if kind == "gdn" else kind for kind in spec.states]
        kv_args.state_data_ptrs = [[b.ctypes.data for b in pool] for pool in self.states]
        kv_args.state_data_lens = [[b.nbytes for b in pool] for pool in self.states]
        kv_args.state_item_lens = [[b.shape[1] for b in pool] for pool in self.states]
        kv_args.state_layer_ids = [[] for _ in self.states]
        # SGLang's slicing descriptors (only the GDN pool's are known here).
        layers = len(self.layers)
        gdn = [kind == "gdn" for kind in spec.states]
        qk, v, h = GDN_QK // self.attn_tp, GDN_V // self.attn_tp, GDN_HEADS // self.attn_tp
        kv_args.state_dim_per_tensor = [[2 * qk + v] * layers + [h] * layers if g else [] for g in gdn]
        kv_args.state_slice_outer_counts = [[1] * (2 * layers) if g else [] for g in gdn]
        kv_args.state_conv_shard_groups = [
            [[GDN_QK, GDN_QK, GDN_V]] * layers + [None] * layers if g else [] for g in gdn
        ]
        if spec.role == "prefill":
            self.fill()
        manager = get_kv_class(TransferBackend("kvferry"), KVClassType.MANAGER)
        mode = DisaggregationMode.PREFILL if spec.role == "prefill" else DisaggregationMode.DECODE
        self.manager = manager(kv_args, mode, self.server_args, spec.mla)
        self.sender = get_kv_class(TransferBackend("kvferry"), KVClassType.SENDER)
        self.receiver = get_kv_class(TransferBackend("kvferry"), KVClassType.RECEIVER)
        self.addr = f"127.0.0.1:{bootstrap_port}"

    @staticmethod
    def _pp_group(spec: Spec, par):
        """The rank's pipeline group, as SGLang's scheduler builds it (torch.distributed; gloo
        on CPU): what SGLang's PP consensus store broadcasts its address over."""
        import torch.distributed as dist

        world = spec.tp * spec.pp
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{spec.env['_PP_PORT']}",
            world_size=world,
            rank=spec.world_rank,
        )
        tp = spec.tp
        mine = None
        for t in range(tp):
            ranks = [t + k * tp for k in range(spec.pp)]
            group = dist.new_group(ranks)
            if spec.world_rank in ranks:
                mine = (group, ranks)

        class Group:
            def broadcast_object(self, obj, src=0):
                box = [obj]
                dist.broadcast_object_list(box, src=mine[1][src], group=mine[0])
                return box[0]

        return Group()

    def _state_pool(self, kind: str) -> List[np.ndarray]:
        """One state component's buffers, each ``[items, item bytes]``."""
        layers = len(self.layers)
        if kind == "gdn":
            qk, v, h = GDN_QK // self.attn_tp, GDN_V // self.attn_tp, GDN_HEADS // self.attn_tp
            shapes = [(MAMBA_SLOTS, (2 * qk + v) * GDN_ROWS)] * layers + [(MAMBA_SLOTS, h * GDN_HEAD)] * layers
        elif kind == "mamba":
            shapes = [(MAMBA_SLOTS, 40)] * layers + [(MAMBA_SLOTS, 96)] * layers
        elif kind == "swa":
            shapes = [(SWA_PAGES, self.page_bytes)] * (2 * layers)
        elif kind == "dsa":
            shapes = [(PAGES, PAGE_SIZE * DSA_ROW)] * layers
        else:
            shapes = [(4, 8)]  # a type kvferry does not move: refused at start
        return [np.zeros(shape, dtype=np.uint8) for shape in shapes]

    def expected_item(self, pool: int, buffer: int, item: int) -> np.ndarray:
        width = self.states[pool][buffer].shape[1]
        if self.spec.states[pool] == "gdn":
            return self._gdn_item(pool, buffer, item)
        if self.spec.states[pool] == "swa" and not self.spec.mla:
            # Token rows of this rank's heads, named by the model's head numbers, so that
            # ranks of any attention TP size hold parts of the same window pages.
            first, count = self.heads
            t, k, b = np.meshgrid(np.arange(PAGE_SIZE), np.arange(count), np.arange(HEAD_DIM), indexing="ij")
            at = (t * KV_HEADS + first + k) * HEAD_DIM + b
            return state_value(pool, buffer, item, at.reshape(-1)).astype(np.uint8)
        return state_value(pool, buffer, item, np.arange(width)).astype(np.uint8)

    def _gdn_item(self, pool: int, buffer: int, item: int) -> np.ndarray:
        """This rank's share of a GDN buffer's item: its query, key and value channels (the
        model's channel numbers), or its heads, of the model's state (named by model layer,
        so every TP size holds parts of the same bytes)."""
        layers = len(self.layers)
        layer = self.layers[buffer % layers]
        qk, v, h = GDN_QK // self.attn_tp, GDN_V // self.attn_tp, GDN_HEADS // self.attn_tp
        r = self.attn_rank
        if buffer < layers:
            channels = np.concatenate([np.arange(r * qk, (r + 1) * qk), GDN_QK + np.arange(r * qk, (r + 1) * qk),
                                       2 * GDN_QK + np.arange(r * v, (r + 1) * v)])
            at = (channels[:, None] * GDN_ROWS + np.arange(GDN_ROWS)[None, :]).reshape(-1)
            return state_value(pool, layer, item, at).astype(np.uint8)
        at = (np.arange(r * h, (r + 1) * h)[:, None] * GDN_HEAD + np.arange(GDN_HEAD)[None, :]).reshape(-1)
        return state_value(pool, 100 + layer, item, at).astype(np.uint8)

    def state_mismatch(self, src: List[List[int]], dst: List[List[int]]) -> Optional[str]:
        """Where this decode rank's granted state items differ from what the prefill held."""
        for pool, (ss, ds) in enumerate(zip(src, dst)):
            for buffer, b in enumerate(self.states[pool]):
                for s, d in zip(ss, ds):
                    if not np.array_equal(b[d], self.expected_item(pool, buffer, s)):
                        return f"state pool {pool} buffer {buffer} item {d} (prefill item {s})"
        return None

    def planes(self):
        return 1 if self.spec.mla else 2

    def expected_page(self, buffer: int, src_page: int) -> np.ndarray:
        """What buffer ``buffer`` of this rank holds for the prefill's page ``src_page``."""
        held = len(self.layers)
        plane, layer = buffer // held, self.layers[buffer % held]
        first, count = self.heads
        width = LATENT if self.spec.mla else HEAD_DIM
        t, k, b = np.meshgrid(
            np.arange(PAGE_SIZE), np.arange(count), np.arange(width), indexing="ij"
        )
        return value(layer, plane, src_page, t, first + k, b).astype(np.uint8).reshape(-1)

    def fill(self):
        for buffer in range(self.kv.shape[0]):
            for page in range(PAGES):
                self.kv[buffer, page] = self.expected_page(buffer, page)
        for pool, bufs in enumerate(self.states):
            for buffer, b in enumerate(bufs):
                for item in range(b.shape[0]):
                    b[item] = self.expected_item(pool, buffer, item)

    def mismatch(self, src: List[int], dst: List[int]) -> Optional[str]:
        """Where this decode rank's granted pages differ from what the prefill held."""
        for buffer in range(self.kv.shape[0]):
            for s, d in zip(src, dst):
                want = self.expected_page(buffer, s)
                got = self.kv[buffer, d]
                if not np.array_equal(got, want):
                    at = int(np.nonzero(got != want)[0][0])
                    return (
                        f"buffer {buffer} page {d} (prefill page {s}) byte {at}: "
                        f"{got[at]} != {want[at]}"
                    )
        return None

    def write_aux(self, slot: int, room: int) -> None:
        import torch

        self.meta.output_ids[slot].copy_((torch.arange(16, dtype=torch.int32) + room) % 30000)
        self.meta.bootstrap_room[slot, 0] = room

    def aux_matches(self, slot: int, room: int) -> bool:
        import torch

        want = (torch.arange(16, dtype=torch.int32) + room) % 30000
        return bool(torch.equal(self.meta.output_ids[slot], want)) and int(
            self.meta.bootstrap_room[slot, 0]
        ) == room


def poll_until(room_obj, states, deadline=DEADLINE_S):
    end = time.monotonic() + deadline
    status = room_obj.poll()
    while status not in states:
        if time.monotonic() > end:
            return status
        time.sleep(0.005)
        status = room_obj.poll()
    return status


def sglang_state_indices(spec: Spec, items: Optional[List[List[int]]]):
    """Per-pool item lists as SGLang's schedulers hand them over: Mamba's one slot as a list
    holding an array, paged components as an array."""
    if items is None:
        return None
    return [
        [np.array(i, dtype=np.int64)] if kind in ("mamba", "gdn") else np.array(i, dtype=np.int32)
        for kind, i in zip(spec.states, items)
    ]


def _send(state: RankState, cmd: dict) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError

    room, src, chunks, aux = cmd["room"], cmd["src"], cmd["chunks"], cmd["aux"]
    sender = state.sender(state.manager, state.addr, room)
    status = poll_until(sender, (KVPoll.WaitingForInput, KVPoll.Failed, KVPoll.Success))
    if status == KVPoll.WaitingForInput:
        sender.init(len(src), aux)
        state.write_aux(aux, room)
        at = 0
        for k, n in enumerate(chunks):
            last = k + 1 == len(chunks)
            states = sglang_state_indices(state.spec, cmd.get("state_src")) if last else None
            sender.send(np.array(src[at : at + n], dtype=np.int32), states)
            at += n
            if cmd.get("die_after_first_chunk"):
                os.kill(os.getpid(), signal.SIGKILL)
        status = poll_until(sender, (KVPoll.Success, KVPoll.Failed))
    reason = None
    if status == KVPoll.Failed:
        try:
            sender.failure_exception()
        except KVTransferError as e:
            reason = str(e)
    else:
        sender.clear()
    return dict(room=room, status=int(status), reason=reason, paths=session_paths(state.manager))


def _receive(state: RankState, cmd: dict) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError

    room, src, dst, aux = cmd["room"], cmd["src"], cmd["dst"], cmd["aux"]
    prefix = cmd.get("prefix_pages", 0)
    mgr = state.manager
    end = time.monotonic() + DEADLINE_S
    while not mgr.try_ensure_parallel_info(state.addr):
        if time.monotonic() > end:
            return dict(room=room, status=int(KVPoll.Failed), reason="no parallel info")
        time.sleep(0.05)
    # The decode's cached prefix: pages it already holds, marked to prove none is rewritten.
    state.kv[:, dst[:prefix], :] = 0xA5
    receiver = state.receiver(mgr, state.addr, room)
    receiver.init(cmd.get("prefill_dp_rank", 0))
    status = poll_until(receiver, (KVPoll.WaitingForInput, KVPoll.Failed))
    if status == KVPoll.WaitingForInput:
        receiver.send_metadata(
            np.array(dst[prefix:], dtype=np.int32),
            aux,
            state_indices=sglang_state_indices(state.spec, cmd.get("state_dst")),
            decode_prefix_len=prefix * PAGE_SIZE,
        )
        status = poll_until(receiver, (KVPoll.Success, KVPoll.Failed))
    out = dict(
        room=room, status=int(status), reason=None, mismatch=None,
        paths=session_paths(state.manager),
    )
    if status == KVPoll.Success:
        out["mismatch"] = state.mismatch(src[prefix:], dst[prefix:])
        if out["mismatch"] is None and prefix and not (state.kv[:, dst[:prefix], :] == 0xA5).all():
            out["mismatch"] = "a prefix page the decode held was written"
        if not state.aux_matches(aux, room):
            out["mismatch"] = (out["mismatch"] or "") + " aux row differs"
        if cmd.get("state_dst") and out["mismatch"] is None:
            out["mismatch"] = state.state_mismatch(cmd["state_src"], cmd["state_dst"])
            if cmd.get("flip_state") and out["mismatch"] is None:
                # The check itself: one byte of one landed item changed, and it must see it.
                state.states[-1][0][cmd["state_dst"][-1][0], 0] ^= 1
                out["flip_caught"] = (
                    state.state_mismatch(cmd["state_src"], cmd["state_dst"]) is not None
                )
        if cmd.get("swap_heads") and out["mismatch"] is None:
            # The check itself: swap two heads of one token row and it must see it.
            page = dst[prefix]
            row = state.kv[0, page, : state.row].copy()
            state.kv[0, page, :HEAD_DIM], state.kv[0, page, HEAD_DIM : 2 * HEAD_DIM] = (
                row[HEAD_DIM : 2 * HEAD_DIM],
                row[:HEAD_DIM],
            )
            out["swap_caught"] = state.mismatch(src[prefix:], dst[prefix:]) is not None
        receiver.clear()
    else:
        try:
            receiver.failure_exception()
        except KVTransferError as e:
            out["reason"] = str(e)
        end = time.monotonic() + DEADLINE_S
        while not mgr.is_abort_release_safe(room, 0) and time.monotonic() < end:
            time.sleep(0.01)
        out["releasable"] = mgr.is_abort_release_safe(room, 0)
    return out


def serve(spec: Spec, bootstrap_port: int, commands, results) -> None:
    """A rank's process: starts the bootstrap server if asked, then runs commands."""
    server = None
    try:
        if spec.env.get("_BOOTSTRAP_SERVER") == "1":
            import kvferry.sglang

            kvferry.sglang.install()
            from sglang.srt.disaggregation.utils import (
                KVClassType,
                TransferBackend,
                get_kv_class,
            )

            server_class = get_kv_class(TransferBackend("kvferry"), KVClassType.BOOTSTRAP_SERVER)
            server = server_class(host="127.0.0.1", port=bootstrap_port)
        state = RankState(spec, bootstrap_port)
        results.put(("ready", spec.world_rank))
        while True:
            cmd = commands.get()
            if cmd is None:
                break
            run = _send if spec.role == "prefill" else _receive
            results.put(("done", run(state, cmd)))
        state.manager.teardown()
    except Exception:  # noqa: BLE001 - reported to the test
        results.put(("error", traceback.format_exc()))
    finally:
        if server is not None:
            server.close()


class Cluster:
    """The processes of one layout: prefill ranks and decode ranks."""

    def __init__(self, prefill: List[Spec], decode: List[Spec], start_timeout=180):
        ctx = mp_context()
        self.port = free_port()
        self.procs = []
        prefill[0].env = dict(prefill[0].env, _BOOTSTRAP_SERVER="1")
        pp_port = str(free_port())
        for spec in prefill:
            spec.env = dict(spec.env, _PP_PORT=pp_port)
        for spec in prefill + decode:
            commands, results = ctx.Queue(), ctx.Queue()
            proc = ctx.Process(target=serve, args=(spec, self.port, commands, results))
            proc.start()
            self.procs.append((spec, proc, commands, results))
        try:
            end = time.monotonic() + start_timeout
            for spec, proc, _c, results in self.procs:
                while results.empty():
                    assert proc.is_alive(), f"{spec.role} rank {spec.world_rank} died while starting"
                    assert time.monotonic() < end, f"{spec.role} rank {spec.world_rank} did not start"
                    time.sleep(0.05)
                tag, what = results.get()
                assert tag == "ready", what
        except BaseException:
            # A rank refused to start: the others would wait for commands forever (and the
            # test process, joining them at exit, with them).
            self.kill()
            raise

    def ranks(self, role: str):
        return [p for p in self.procs if p[0].role == role]

    def run(self, commands: Dict[int, dict]) -> Dict[int, dict]:
        """Sends ``commands[i]`` to process i (in prefill-then-decode order), returns results."""
        for i, cmd in commands.items():
            self.procs[i][2].put(cmd)
        out = {}
        for i in commands:
            spec, proc, _c, results = self.procs[i]
            end = time.monotonic() + 2 * DEADLINE_S
            while results.empty():
                if not proc.is_alive():
                    out[i] = dict(died=True)
                    break
                assert time.monotonic() < end, f"{spec.role} rank {spec.world_rank} hangs"
                time.sleep(0.02)
            else:
                tag, what = results.get()
                assert tag == "done", what
                out[i] = what
        return out

    def kill(self):
        for _s, proc, _c, _r in self.procs:
            if proc.is_alive():
                proc.kill()
        for _s, proc, _c, _r in self.procs:
            proc.join(timeout=15)

    def close(self):
        for _s, proc, commands, _r in self.procs:
            if proc.is_alive():
                commands.put(None)
        for _s, proc, _c, _r in self.procs:
            proc.join(timeout=15)
            if proc.is_alive():
                proc.kill()
