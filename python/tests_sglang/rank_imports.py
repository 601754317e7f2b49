"""What every rank's process imports, in the order a rank imports it (kvferry installed into
SGLang first): the forkserver of conftest.py imports it once for all of them. SGLang's
argument hooks are imported by name when a rank publishes its arguments: all of them here."""

import importlib
import pkgutil

import kvferry.sglang

kvferry.sglang.install()

import torch  # noqa: E402,F401
import sglang.srt.disaggregation.base.conn  # noqa: E402,F401
import sglang.srt.disaggregation.common.conn  # noqa: E402,F401
import sglang.srt.disaggregation.utils  # noqa: E402,F401
import sglang.srt.distributed.utils  # noqa: E402,F401
import sglang.srt.runtime_context  # noqa: E402,F401
import sglang.srt.server_args  # noqa: E402,F401
import sglang.srt.arg_groups  # noqa: E402
import kvferry.sglang.conn  # noqa: E402,F401

for _hook in pkgutil.iter_modules(sglang.srt.arg_groups.__path__):
    importlib.import_module(f"sglang.srt.arg_groups.{_hook.name}")

import cluster  # noqa: E402,F401
import roles  # noqa: E402,F401
