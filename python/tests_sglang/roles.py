"""One SGLang rank of each role, set up as SGLang's schedulers set theirs up: a published
`ServerArgs`, real `KVArgs` over a KV pool (numpy) and SGLang's own `MetadataBuffers` as the
aux buffers, and the manager class SGLang's `get_kv_class` selects for "kvferry"."""

import socket

import numpy as np

LAYERS = 2
PAGES = 32
PAGE_BYTES = 1024  # one page of one layer's K (or V): page_size tokens x heads x dim x dtype
PAGE_SIZE = 4  # tokens per page
SLOTS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def publish(mode: str, bootstrap_port: int) -> None:
    """What SGLang's scheduler process entry does before it builds its KV manager."""
    import kvferry.sglang

    kvferry.sglang.install()
    from sglang.srt.runtime_context import SpawnRanks, publish as sglang_publish
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path="dummy",
        host="127.0.0.1",
        device="cpu",
        page_size=PAGE_SIZE,
        disaggregation_mode=mode,
        disaggregation_transfer_backend="kvferry",
        disaggregation_bootstrap_port=bootstrap_port,
    )
    sglang_publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    from sglang.srt.runtime_context import get_parallel

    # A scheduler builds its torch.distributed groups here; PP 1 needs none.
    get_parallel().override_permanently(pp_group=None)
    return args


def fill(kv: np.ndarray, seed: int) -> None:
    for b in range(kv.shape[0]):
        for p in range(kv.shape[1]):
            kv[b, p, :] = (np.arange(PAGE_BYTES) * (b + 3) + p * 7 + seed) % 251


class Rank:
    """A rank's pools, its metadata buffers and its kvferry manager."""

    def __init__(self, mode: str, bootstrap_port: int, kv_fill_seed=None):
        # install() first: names imported from SGLang before it would miss kvferry.
        self.server_args = publish(mode, bootstrap_port)
        import torch
        from sglang.srt.disaggregation.utils import (
            DisaggregationMode,
            KVClassType,
            MetadataBuffers,
            TransferBackend,
            get_kv_class,
        )

        # K and V of every layer, as MHATokenToKVPool lays them out: one buffer each.
        self.kv = np.zeros((2 * LAYERS, PAGES, PAGE_BYTES), dtype=np.uint8)
        if kv_fill_seed is not None:
            fill(self.kv, kv_fill_seed)
        self.meta = MetadataBuffers(
            SLOTS, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4
        )
        kv_args_class = get_kv_class(TransferBackend("kvferry"), KVClassType.KVARGS)
        kv_args = kv_args_class()
        kv_args.engine_rank = 0
        kv_args.pp_rank = 0
        kv_args.system_dp_rank = 0
        kv_args.rust_http_port = None
        kv_args.kv_cache_dtype_str = "auto"
        kv_args.kv_layout = None
        kv_args.prefill_start_layer = 0
        kv_args.prefill_end_layer = LAYERS
        kv_args.kv_data_ptrs = [self.kv[b].ctypes.data for b in range(2 * LAYERS)]
        kv_args.kv_data_lens = [self.kv[b].nbytes for b in range(2 * LAYERS)]
        kv_args.kv_item_lens = [PAGE_BYTES] * (2 * LAYERS)
        kv_args.num_draft_entries = 0
        kv_args.kv_layer_ids = list(range(LAYERS)) * 2
        kv_args.kv_head_num = 1
        kv_args.total_kv_head_num = 1
        kv_args.page_size = PAGE_SIZE
        (
            kv_args.aux_data_ptrs,
            kv_args.aux_data_lens,
            kv_args.aux_item_lens,
        ) = self.meta.get_buf_infos()
        kv_args.ib_device = None
        kv_args.gpu_id = 0
        kv_args.state_types = []
        kv_args.state_data_ptrs = []
        kv_args.state_data_lens = []
        kv_args.state_item_lens = []
        kv_args.state_layer_ids = []
        self.kv_args = kv_args
        manager_class = get_kv_class(TransferBackend("kvferry"), KVClassType.MANAGER)
        disagg = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
        self.manager = manager_class(kv_args, disagg, self.server_args, False)
        self.sender_class = get_kv_class(TransferBackend("kvferry"), KVClassType.SENDER)
        self.receiver_class = get_kv_class(TransferBackend("kvferry"), KVClassType.RECEIVER)

    def write_aux(self, slot: int, room: int) -> None:
        """What the prefill's forward pass leaves in the metadata row it sends."""
        self.meta.output_ids[slot].copy_(self._ids(room))
        self.meta.bootstrap_room[slot, 0] = room

    @staticmethod
    def _ids(room: int):
        import torch

        return (torch.arange(16, dtype=torch.int32) + room) % 30000

    def aux_matches(self, slot: int, room: int) -> bool:
        import torch

        return bool(torch.equal(self.meta.output_ids[slot], self._ids(room))) and int(
            self.meta.bootstrap_room[slot, 0]
        ) == room
