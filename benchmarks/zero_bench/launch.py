"""The benchmark's ranks, started by the repository's one launcher (see [Note: where the launcher lives] in
``tests/helpers.py``) with the run's thread count and device, and a deadline long enough for a 25M-parameter run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from tests.helpers import run_on_ranks

from .names import device_type

RANK_TIMEOUT_S = 1800  # per run of ranks, and the collectives' timeout in them


def on_ranks(fn: Callable[..., Any], args: argparse.Namespace, *extra: Any, env: dict[str, str] | None = None) -> list:
    """``fn(rank, world_size, args, *extra)`` on ``args.world_size`` fresh ranks with ``args.threads`` threads each,
    ``env`` added to their environment; the world group is gloo's (``--device cpu``) or NCCL's (``cuda``, rank
    ``r`` on ``cuda:r``). Each rank's result, in rank order."""
    return run_on_ranks(
        fn,
        args.world_size,
        args,
        *extra,
        threads=args.threads,
        env=env,
        device_type=device_type(args),
        timeout_s=RANK_TIMEOUT_S,
    )
