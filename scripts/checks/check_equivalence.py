"""Check that one optimizer step of the loop follows the gradient of the full-batch mean loss, and that the
fork keeps the promises the step relies on (the logic: accumulation/checker/, importable from a fork's tests).

    python scripts/checks/check_equivalence.py [--config FILE] [section.key=value ...] [--inject-bug BUG] [--step S]
    torchrun --standalone --nproc_per_node=N scripts/checks/check_equivalence.py [same arguments]

Exit status: 0 PASS, 1 FAIL, 2 bad config or data (one line on stderr).
"""

import os
import sys

from accumulation.checker import main
from accumulation.parallel.distributed import run_and_exit

if __name__ == "__main__":
    # Run as a script, Python puts this file's folder on sys.path, not the folder it is launched from, where a
    # fork's module named in the config may sit (train.py, launched from its own folder, finds it there).
    sys.path.insert(1, os.getcwd())
    run_and_exit(main, sys.argv[1:])
