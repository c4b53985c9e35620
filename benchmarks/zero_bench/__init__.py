"""The parts of ``benchmarks/bench_zero.py``, one concern each; ``bench_zero.py`` itself is the command line.

- ``names``: the systems' names and what they encode (precision, offload, partition), and the device helpers.
- ``systems``: how each compared system is built and stepped (DDP, torch's ZeroRedundancyOptimizer, FSDP2, the
  engine at stages 1-3, an earlier commit's engine).
- ``launch``: the ranks, started by the repository's one launcher (``tests/helpers.py``).
- ``measure``: the data, the bodies of the timing and RSS ranks, CPU load, RSS and disk bandwidth.
- ``report``: statistics, the ZeRO paper's formula, the markdown tables and the environment record.

Importing the package puts the repository root on ``sys.path`` (for ``examples.gpt`` and ``tests.helpers``,
also in the spawned ranks, which import the modules their functions come from).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
