"""The kv_transfer_params a prefill returns and a decode reads: keys, room ids, and their checks."""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass
from typing import Any, Optional

from kvferry._addrs import socket_addr as _socket_addr

# The package's name, in every module: what vLLM's log shows and embedders filter on.
logger = logging.getLogger("kvferry.vllm")


# Keys of the kv_transfer_params the prefill returns (and the decode reads).
_ROOM = "kvferry_room"
_ADDRS = "kvferry_addrs"
_SHAPE = "kvferry_shape"
_DONE = "kvferry_consumed"
_PUSH = "kvferry_push"
_PROMPT = "kvferry_prompt"
#: Set on a prefill request whose prompt's last token was left to the decode.
_CUT = "kvferry_cut"
#: The prefill's pipeline stages: ``kvferry_addrs`` names PP x TP listeners, stage-major.
_PP = "kvferry_pp"
#: Room ids a router draws for push mode carry this bit; a prefill's own (pull) ids do not.
PUSH_BIT = 1 << 62

#: A pull room id's low 32 bits: a counter, then its tag (see ``_room_tag``).
_COUNTER_BITS = 20
_TAG_BITS = 12


def _room_tag(key: bytes, count: int) -> int:
    """The tag of a pull room's counter: only this engine's scheduler and worker know it."""
    mac = hmac.new(key, count.to_bytes(4, "little"), hashlib.sha256).digest()
    return int.from_bytes(mac[:2], "little") & ((1 << _TAG_BITS) - 1)


#: Addresses one room's params may name: a prefill's TP ranks, rank ``r``'s listener at index
#: ``r``.
_MAX_ADDRS = 64


@dataclass(frozen=True)
class _Pulled:
    """The kvferry part of a decode request's ``kv_transfer_params``, checked: a room id
    kvferry can carry and the prefill's listener addresses."""

    room: int
    addrs: list[str]


def _params_of(request) -> Optional[dict]:
    """A request's ``kv_transfer_params`` if they are a mapping; anything else is as none
    (a router's garbage never reaches a ``.get``)."""
    params = request.kv_transfer_params
    if params is not None and not isinstance(params, dict):
        logger.error("kvferry: request %s: kv_transfer_params are not a mapping (%s); ignored",
                     request.request_id, type(params).__name__)
        return None
    return params


def _room_id(value: Any) -> Optional[int]:
    """``value`` if it is a room id kvferry can carry (an integer in 1..2^64-1), else None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 64:
        return None
    return value


def _pulled(params: Any) -> tuple[Optional[_Pulled], Optional[str]]:
    """Parses the room and addresses of ``params`` once, where they enter: the value, or
    why it cannot be loaded from (never an exception, whatever a router sent)."""
    if not isinstance(params, dict):
        return None, f"kv_transfer_params are not a mapping ({type(params).__name__})"
    room, addrs = _room_id(params.get(_ROOM)), params.get(_ADDRS)
    if room is None:
        return None, f"{_ROOM}={params.get(_ROOM)!r} is not a room id (an integer in 1..2^64-1)"
    if bool(room & PUSH_BIT) != bool(params.get(_PUSH)):
        # A prefill's own ids never carry the push bit and a router's push ids always do: a
        # pull for a push id would wait out the prefill's lease for a push that never comes.
        kind = "push" if params.get(_PUSH) else "pull"
        return None, f"{_ROOM}={room} is not a {kind} room id (bit 62 is set only in push rooms)"
    if (not isinstance(addrs, (list, tuple)) or not 0 < len(addrs) <= _MAX_ADDRS
            or not all(_socket_addr(a) for a in addrs)):
        return None, f"{_ROOM}={room}: {_ADDRS}={addrs!r} is not a list of 1..{_MAX_ADDRS} ip:port strings"
    return _Pulled(room=room, addrs=list(addrs)), None


def _stages(params: dict) -> int:
    """The prefill's pipeline stages its params name (1 when they name none)."""
    pp = params.get(_PP, 1)
    return pp if isinstance(pp, int) and not isinstance(pp, bool) and pp > 0 else 1


def _stages_refusal(params: dict, pulled: "_Pulled") -> Optional[str]:
    """Why ``kvferry_pp`` does not split the room's listeners into equal stages, or None."""
    pp = params.get(_PP, 1)
    if isinstance(pp, bool) or not isinstance(pp, int) or not 0 < pp <= len(pulled.addrs):
        return f"{_PP}={pp!r} is not a stage count (1..{len(pulled.addrs)})"
    if len(pulled.addrs) % pp:
        return f"{_PP}={pp} does not split {len(pulled.addrs)} listeners in {_ADDRS} into equal stages"
    return None


def _prompt_of(request, backoff: int = 0) -> Optional[int]:
    """The prompt digest of ``request``'s prompt token ids (all but the last ``backoff``):
    both sides name it, so a room handed to another prompt's request is refused
    (``prompt_mismatch``) instead of loaded. None (nothing checked) for a prompt given
    without token ids."""
    tokens = request.prompt_token_ids
    if tokens is None:
        return None
    if backoff and len(tokens) > backoff:
        tokens = tokens[:-backoff]
    import kvferry

    try:
        return kvferry.prompt_digest(tokens)
    except (kvferry.KvferryError, OverflowError, TypeError) as e:
        logger.warning("kvferry: request %s: its prompt has no digest (%s); its room is not bound to it",
                       request.request_id, e)
        return None


def _mixed(prompt: Optional[int], label: bytes, what: bytes) -> Optional[int]:
    """A prompt digest mixed with ``what`` under ``label``: a room bound to it is refused
    (``prompt_mismatch``) by a side whose ``what`` differs. None stays None."""
    if prompt is None:
        return None
    mixed = hashlib.sha256(label + prompt.to_bytes(8, "little") + what)
    return int.from_bytes(mixed.digest()[:8], "little")


def _rank_bound(prompt: Optional[int], rank: int) -> Optional[int]:
    """The digest a room of prefill rank ``rank`` is bound to: the prompt's and the rank's,
    so that a decode rank handed another rank's listener (a router that reordered
    ``kvferry_addrs``) is refused (``prompt_mismatch``) instead of loading other heads."""
    return _mixed(prompt, b"kvferry/vllm rank", rank.to_bytes(4, "little"))
