"""What the scheduler half tells the worker half each step, and the records of each room."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class _Send:
    """A finished prefill request whose blocks wait for its decode."""

    room: int
    blocks: list[int]
    deadline: float
    #: The prompt digest of the tokens the blocks hold.
    prompt: Optional[int] = None


@dataclass
class _PushStep:
    """A push-mode prefill request in one step: its room, the blocks of the prompt computed
    by the end of this step (in prompt order), how many the prompt has in all."""

    room: int
    computed: list[int]
    total: int
    prompt: Optional[int] = None


@dataclass
class _Pushed:
    """A push-mode room on the prefill worker."""

    req_id: str
    total: int
    prompt: Optional[int] = None
    #: Blocks complete once the current step's forward pass ends.
    computed: list[int] = field(default_factory=list)
    #: Blocks complete now (every layer written): what may go out whole.
    safe: list[int] = field(default_factory=list)
    granted: Optional[int] = None
    opened: bool = False
    sent: int = 0
    failed: bool = False


@dataclass
class _Recv:
    """A decode request whose blocks a prefill fills."""

    room: int
    addrs: list[str]
    blocks: list[int]
    refused: Optional[str] = None
    #: The prompt digest of the tokens this request wants the KV of.
    prompt: Optional[int] = None
    logged: bool = False
    opened: bool = False
    #: When the room opened here (``time.monotonic()``), for its transfer time.
    opened_at: Optional[float] = None
    #: The prefill's pipeline stages (``addrs`` holds stages x its TP, stage-major).
    stages: int = 1


@dataclass
class KvferryMetadata(KVConnectorMetadata):
    """What one scheduler step tells the workers."""

    sends: dict[str, _Send] = field(default_factory=dict)
    recvs: dict[str, _Recv] = field(default_factory=dict)
    #: Decode requests that ended (abort, error) while their room was open.
    aborts: set[str] = field(default_factory=set)
    #: Decode: rooms of pulled prompts this decode will never load (request ended first,
    #: block shape refused), with the reason: each is opened without pages and failed with
    #: it (counted under it), so its prefill frees the blocks at once instead of at the end
    #: of its lease.
    releases: list[tuple[int, list[str], int, str]] = field(default_factory=list)
    #: Push-mode prefill requests scheduled this step.
    pushes: dict[str, _PushStep] = field(default_factory=dict)
    #: Push-mode prefill requests that ended without their prompt computed (abort).
    push_aborts: set[int] = field(default_factory=set)
    #: Push-mode rooms whose prefill request vLLM preempted this step (its blocks are
    #: already free in the scheduler and are overwritten from this step on).
    push_preempted: set[int] = field(default_factory=set)
