"""Stage 3: ranks whose forwards take different paths raise a DivergentControlFlowError on every rank, naming the
iteration, the gather and each rank's unit, within seconds (the process group's timeout is 60 s: a hang fails)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.helpers import run_on_ranks

WIDTH = 16


class Blocks(nn.Module):
    """Four equal blocks (so two of them have gathers of the same size) and a wider head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.head = nn.Linear(WIDTH, 3 * WIDTH)
        self.path: list[int] = [0, 1, 2, 3]

    def forward(self, x: Tensor) -> Tensor:
        for index in self.path:
            x = torch.tanh(self.blocks[index](x))
        return self.head(x)


PATHS = {  # per case: rank 0's path, rank 1's path
    "same": ([0, 1, 2, 3], [0, 1, 2, 3]),
    "early_exit_on_rank_1": ([0, 1, 2, 3], [0, 1]),
    "other_order_on_rank_1": ([0, 1, 2, 3], [0, 2, 1, 3]),
    "a_block_twice_on_rank_1": ([0, 1, 2, 3], [0, 1, 1, 2, 3]),
}


def _run(rank: int, world_size: int, case: str, prefetch: bool) -> dict[str, Any]:
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = Blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = EngineOptions(stage=3, wrap_policy={nn.Linear}, overlap_comm=prefetch)
    engine = ZeroEngine(model, [optimizer], options, Communicator())
    path = PATHS[case][rank]
    steps = 0
    try:
        for step in range(3):
            engine.begin_iteration()
            model.path = path if step == 2 else [0, 1, 2, 3]  # the paths differ in the third iteration
            optimizer.zero_grad()
            loss = model(torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step))).pow(2).mean()
            engine.scale_loss(loss).backward()
            engine.finish_backward()
            optimizer.step()
            engine.model.scheduler.reshard_all()
            steps += 1
    except Exception as error:  # the type and message are what the test checks
        return {"error": f"{type(error).__name__}: {error}", "steps": steps}
    agree_bytes = engine.last_step_comm.by_op.get("agree", 0)
    gathers = engine.model.scheduler.sequence.count  # the last iteration's unit gathers
    # The world's own agreements, counted under "agree" too (an all-reduce counts twice): which parameters got a
    # gradient (a byte each) with the hyper-parameters' 8 bytes riding along, and whether any changed (2 bytes).
    world = 2 * (len(list(model.parameters())) + 8) + 2 * 2
    return {"error": None, "steps": steps, "tag_bytes": agree_bytes - world, "gathers": gathers}


# Every divergent path with prefetch (the default), and one without it.
DIVERGENT = [(c, True) for c in PATHS if c != "same"] + [("other_order_on_rank_1", False)]


@pytest.mark.parametrize(("case", "prefetch"), DIVERGENT)
def test_ranks_on_different_paths_raise_the_same_error_on_every_rank(case: str, prefetch: bool) -> None:
    results = run_on_ranks(_run, 2, case, prefetch, init_group=False)
    for rank, result in enumerate(results):
        error = result["error"]
        assert error is not None, f"rank {rank} trained on with another path"
        assert error.startswith("DivergentControlFlowError: ZeroStrategy(stage=3): the ranks took different paths")
        assert "of iteration 3)" in error or "(iteration 3)" in error, error
        # Caught at a forward gather, or (blocks of equal size used in another order after prefetch gathered them in
        # the agreed one) when the backward plans differ.
        assert any(
            f"rank 0 {what}" in error for what in ("gathers unit 'blocks.", "gathers unit 'head'", "starts a")
        ), error
        assert result["steps"] == 2
    assert results[0]["error"] == results[1]["error"]


def _idle_rank(rank: int, world_size: int) -> str:
    """Rank 1's loss reaches no parameter in one iteration (its backward reaches no unit; the root, a Sequential,
    holds no parameter): legal, and it must not be taken for another path, nor wait in a tag exchange."""
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], EngineOptions(stage=3, wrap_policy={nn.Linear}), Communicator())
    for step in range(3):
        engine.begin_iteration()
        optimizer.zero_grad()
        for micro in range(2):
            out = model(torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * step + micro)))
            idle = rank == 1 and micro == 0 and step == 1
            loss = 0 * out.detach().requires_grad_().sum() if idle else out.pow(2).mean()
            engine.scale_loss(loss).backward()
            engine.finish_backward()
        optimizer.step()
        engine.model.scheduler.reshard_all()
    return "trained"


def test_a_rank_whose_loss_reaches_no_parameter_is_not_divergent() -> None:
    assert run_on_ranks(_idle_rank, 2, init_group=False) == ["trained", "trained"]


def test_the_same_path_trains_and_costs_one_small_exchange_per_gather() -> None:
    results = run_on_ranks(_run, 2, "same", True, init_group=False)
    for result in results:
        assert result["error"] is None
        assert result["steps"] == 3
        # 5 units with parameters (4 blocks, the head; the root holds none), each checked once a step, in forward
        # (backward gathers follow the plan); one tag of 3 int64 from each of the 2 ranks per checked gather and one
        # for the plan.
        assert result["gathers"] == 5
        assert result["tag_bytes"] == (result["gathers"] + 1) * 3 * 8 * 2
