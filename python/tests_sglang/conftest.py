"""Each rank runs in its own process, forked from one server that imported torch and SGLang
once (rank_imports), started here so that its imports run beside pytest's own collection: a
fresh interpreter per rank (KVFERRY_TEST_MP=spawn, as SGLang's launcher starts them) imports
them again, which takes seconds here and minutes in the emulated RDMA guest."""

import multiprocessing
import os

import cluster

if cluster.MP_CONTEXT == "forkserver":
    from multiprocessing import forkserver

    # Python 3.11's forkserver does not take this process's sys.path: it finds this
    # directory's modules through PYTHONPATH, set only while it starts.
    saved = os.environ.get("PYTHONPATH")
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, saved) if p)

    multiprocessing.set_forkserver_preload(["rank_imports"])
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
