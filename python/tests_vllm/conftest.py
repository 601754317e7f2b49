"""The prefill engine runs in its own process, forked from one server that imported torch
and vLLM once, started here so that its imports run beside pytest's own collection: a fresh
interpreter (KVFERRY_TEST_MP=spawn) imports them again for every test, which takes seconds
here and minutes in the emulated RDMA guest."""

import multiprocessing
import os

import harness

if harness.MP_CONTEXT == "forkserver":
    from multiprocessing import forkserver

    # Python 3.11's forkserver does not take this process's sys.path: it finds this
    # directory's modules through PYTHONPATH, set only while it starts.
    saved = os.environ.get("PYTHONPATH")
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, saved) if p)

    multiprocessing.set_forkserver_preload(
        [
            "harness",
            "test_connector",
            "kvferry.vllm",
            "vllm.distributed.kv_transfer.kv_connector.v1.base",
            "vllm.v1.core.sched.scheduler",
            "vllm.v1.kv_cache_interface",
            "vllm.v1.structured_output",
            "vllm.v1.request",
            "vllm.v1.outputs",
            "vllm.config",
        ]
    )
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
