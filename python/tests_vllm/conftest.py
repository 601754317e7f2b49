"""The prefill engine is forked from one server that imported torch, vLLM's scheduler and
kvferry's connector once: testing/engine_processes.py says why."""

import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(here), "testing"))

import engine_processes  # noqa: E402

engine_processes.start_forkserver(
    here,
    [
        "harness",
        "ranks",
        "test_connector",
        "kvferry.vllm",
        "vllm.distributed.kv_transfer.kv_connector.v1.base",
        "vllm.v1.core.sched.scheduler",
        "vllm.v1.kv_cache_interface",
        "vllm.v1.structured_output",
        "vllm.v1.request",
        "vllm.v1.outputs",
        "vllm.config",
    ],
)
