"""kvferry as a transfer backend of SGLang's prefill/decode disaggregation (SGLang 0.5.23).

``install()`` registers ``kvferry`` in the running SGLang, so
``--disaggregation-transfer-backend kvferry`` selects it without patching SGLang's files.
SGLang calls it in every process it starts (main, schedulers, detokenizer) through its
``sglang.srt.plugins`` entry point, which this package declares; ``python -m
kvferry.sglang.launch_server ...`` calls it first and then SGLang's launcher.

Importing this package does not import SGLang; ``install()`` and ``kvferry.sglang.conn`` do.
"""

from __future__ import annotations

import enum
import logging

BACKEND = "kvferry"
SGLANG_VERSION = "0.5.23"

logger = logging.getLogger(__name__)

_installed = False


def _add_enum_member(cls: type, name: str, value: str) -> enum.Enum:
    """Adds ``name = value`` to an existing Enum, so ``cls(value)`` and ``cls.name`` work
    everywhere SGLang already holds ``cls``."""
    if value in cls._value2member_map_:
        return cls._value2member_map_[value]
    member = object.__new__(cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = cls
    member.__init__(value)
    cls._member_names_.append(name)
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    type.__setattr__(cls, name, member)
    return member


def _get_kv_class(original, transfer_backend, class_type):
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

    if transfer_backend != TransferBackend(BACKEND) or class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    from kvferry.sglang import conn

    return {
        KVClassType.MANAGER: conn.KvferryKVManager,
        KVClassType.SENDER: conn.KvferryKVSender,
        KVClassType.RECEIVER: conn.KvferryKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.KvferryKVBootstrapServer,
    }[class_type]


def install() -> None:
    """Registers ``kvferry`` as a transfer backend of the running SGLang (idempotent)."""
    global _installed
    if _installed:
        return
    import sglang
    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if sglang.__version__ != SGLANG_VERSION:
        logger.warning(
            "kvferry's SGLang backend is built and tested against SGLang %s, this is %s",
            SGLANG_VERSION,
            sglang.__version__,
        )
    _add_enum_member(utils.TransferBackend, BACKEND.upper(), BACKEND)
    if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([BACKEND])
    # SGLang's hook registry rebinds get_kv_class in every module that imported it.
    HookRegistry.register(
        "sglang.srt.disaggregation.utils.get_kv_class", _get_kv_class, HookType.AROUND
    )
    HookRegistry.apply_hooks()
    _installed = True
    logger.info("kvferry registered as SGLang transfer backend %r", BACKEND)


__all__ = ["BACKEND", "SGLANG_VERSION", "install"]
