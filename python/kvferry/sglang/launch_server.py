"""``python -m kvferry.sglang.launch_server ARGS``: SGLang's launcher with kvferry installed.

Takes exactly SGLang's ``launch_server`` arguments; ``--disaggregation-transfer-backend
kvferry`` then selects kvferry.
"""

import runpy
import sys

from kvferry.sglang import install


def main() -> None:
    install()
    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
