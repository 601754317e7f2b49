"""What the engine suites (tests_sglang, tests_vllm) share: how an engine's processes start,
and the data path every session of theirs must take.

Each rank or engine runs in its own process, forked from one server that imported torch and
the engine once, started by the suite's conftest so that its imports run beside pytest's own
collection: a fresh interpreter per process (KVFERRY_TEST_MP=spawn, as the engines' launchers
start them) imports them again, which takes seconds here and minutes in the emulated RDMA
guest."""

import multiprocessing as mp
import os

MP_CONTEXT = os.environ.get("KVFERRY_TEST_MP", "forkserver")
# The data path every session of a room that moved must have taken: the transport this run
# asks every node for (either path under "auto").
DATA_PATH = {"rdma": "rdma", "tcp": "tcp"}.get(os.environ.get("KVFERRY_TRANSPORT", ""))


def mp_context():
    return mp.get_context(MP_CONTEXT)


def start_forkserver(test_dir: str, preload: list) -> None:
    """Starts the forkserver importing ``preload`` (modules of ``test_dir``, this directory
    or the venv), unless this run spawns fresh interpreters."""
    if MP_CONTEXT != "forkserver":
        return
    from multiprocessing import forkserver

    # Python 3.11's forkserver does not take this process's sys.path: it finds the suites'
    # modules through PYTHONPATH, set only while it starts.
    saved = os.environ.get("PYTHONPATH")
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (test_dir, here, saved) if p)
    mp.set_forkserver_preload(preload)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def assert_data_path(paths: list, received: bool) -> None:
    """A node's sessions took the path this run asked for; a decode that received KV has one
    at least (a prefill rank may have had nothing to send)."""
    assert paths or not received, "a decode that received KV has no session"
    if paths and DATA_PATH is not None:
        assert {path for _, path in paths} == {DATA_PATH}, paths
