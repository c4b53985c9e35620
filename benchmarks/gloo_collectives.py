"""Micro-benchmark: the gloo collectives behind ZeRO and DDP, single-tensor vs list forms.

``lightning_zero/core/comm/communicator.py`` calls the single-tensor collectives (``reduce_scatter_single`` /
``all_gather_single``, formerly ``reduce_scatter_tensor`` / ``all_gather_into_tensor``). On gloo,
torch implements the single-tensor reduce-scatter as a ``clone()`` of the whole input on the calling
thread, an all-reduce of the clone, and a copy of this rank's chunk in ``wait()``
(``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), while the list form
``dist.reduce_scatter(out, list(inp.chunk(n)))`` runs gloo's own reduce-scatter. This script times
both, next to DDP's all-reduce, for buffers of the size of ZeRO's buckets. Run on demand::

    python benchmarks/gloo_collectives.py [--numel 6553600] [--world-size 2] [--repeats 7]

"issue" is the time until the async call returns (work done on the calling thread, i.e. on the
backward pass in ZeRO), "total" until ``wait()`` returns; medians over the repeats, slowest rank.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # for `tests.helpers`, the repository's launcher (also in the spawned ranks)
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.helpers import run_on_ranks  # noqa: E402

_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Works:
    """Several works waited for as one."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Median (issue, total) seconds of each collective on this rank, in the gloo group the launcher started."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    numel = args.numel - args.numel % world_size
    full = torch.randn(numel)
    shard = torch.empty(numel // world_size)
    ops = {
        "all_reduce (DDP)": lambda: dist.all_reduce(full, async_op=True),
        "reduce_scatter_single (comm.py)": lambda: _reduce_scatter_single(shard, full, async_op=True),
        "reduce_scatter, list of chunks": lambda: dist.reduce_scatter(
            shard, list(full.chunk(world_size)), async_op=True
        ),
        "reduce_scatter as one reduce per rank (the uneven path)": lambda: _Works(
            [dist.reduce(chunk, dst=r, async_op=True) for r, chunk in enumerate(full.chunk(world_size))]
        ),
        "all_gather_single (comm.py)": lambda: _all_gather_single(full, shard, async_op=True),
        "all_gather, list of chunks": lambda: dist.all_gather(list(full.chunk(world_size)), shard, async_op=True),
    }
    results = {}
    for name, op in ops.items():
        issue, total = [], []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            work = op()
            issued = time.perf_counter()
            work.wait()
            issue.append(issued - start)
            total.append(time.perf_counter() - start)
        results[name] = (statistics.median(issue), statistics.median(total))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=25 * 2**20 // 4, help="fp32 elements (default: one 25 MiB bucket)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    results = dict(enumerate(run_on_ranks(_rank, args.world_size, args, timeout_s=900)))  # one torch thread each
    mib = args.numel * 4 / 2**20
    print(f"{args.world_size} gloo ranks, 1 thread each, fp32 buffer of {args.numel:,} elements ({mib:.1f} MiB)\n")
    print("| collective | issue ms | total ms |\n|---|---|---|")
    for name in results[0]:
        issue = max(results[r][name][0] for r in results)
        total = max(results[r][name][1] for r in results)
        print(f"| {name} | {1e3 * issue:.1f} | {1e3 * total:.1f} |")


if __name__ == "__main__":
    main()
