"""Every rank is forked from one server that imported what a rank imports (rank_imports):
testing/engine_processes.py says why."""

import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(here), "testing"))

import engine_processes  # noqa: E402

engine_processes.start_forkserver(here, ["rank_imports"])
