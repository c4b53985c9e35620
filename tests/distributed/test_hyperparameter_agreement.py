"""Ranks agree on every optimizer's hyper-parameters at each step: a scheduler stepped on one rank only raises
the same error on every rank, naming the optimizer, the group and every differing key with both values, instead of
training apart."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from tests.distributed.models import TinyLM, batch, loss_fn
from tests.helpers import run_on_ranks


def _scheduler_on_rank_1_only(rank: int, world_size: int, stage: int, partition: str, built: str) -> dict[str, Any]:
    """A StepLR of the second optimizer stepped on rank 1 only; with ``built="on rank 1"`` it also exists there only
    and takes a warm-up step before training (so ``initial_lr`` and ``lr`` differ at the first step)."""
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    torch.manual_seed(0)
    model = TinyLM()
    first = torch.optim.AdamW(model.a.parameters(), lr=1e-2)
    second = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("a.")], lr=0.1)
    if built == "on every rank" or rank == 1:
        scheduler = torch.optim.lr_scheduler.StepLR(second, step_size=1, gamma=0.5)
    if built == "on rank 1" and rank == 1:
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": the warm-up is the point
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step()
    policy = {nn.Linear} if stage == 3 else None
    options = EngineOptions(stage=stage, wrap_policy=policy, partition=partition)
    engine = ZeroEngine(model, [first, second], options, Communicator())
    steps = 0
    try:
        for step in range(4):
            tokens, targets = batch(seed=10 * step + rank)
            for optimizer in (first, second):
                optimizer.zero_grad()
            loss_fn(model, tokens, targets).backward()
            first.step()
            second.step()
            steps += 1
            if rank == 1:
                scheduler.step()
    except RuntimeError as error:
        return {"error": str(error), "steps": steps, "lr": second.param_groups[0]["lr"]}
    engine.release()
    return {"error": None, "steps": steps}


@pytest.mark.parametrize(("stage", "partition"), [(1, "flat"), (3, "flat"), (2, "parameter"), (3, "parameter")])
def test_a_scheduler_stepped_on_one_rank_raises_on_every_rank(stage: int, partition: str) -> None:
    results = run_on_ranks(_scheduler_on_rank_1_only, 2, stage, partition, "on every rank")
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} trained on with another learning rate"
        assert result["steps"] == 1, result  # the first step agreed; the second is refused before it changes anything
        assert "optimizer 1 (SGD): param group 0" in result["error"], result["error"]
        assert "rank 0 has lr=0.1" in result["error"], result["error"]
        assert "rank 1 has lr=0.05" in result["error"], result["error"]
        assert "initial_lr" not in result["error"], result["error"]  # equal on both ranks: not a difference
    assert results[0]["error"] == results[1]["error"]


def test_a_scheduler_built_on_one_rank_names_the_learning_rate_not_only_initial_lr() -> None:
    """The scheduler adds ``initial_lr`` on its rank only; the error names it and ``lr``, the value that matters."""
    results = run_on_ranks(_scheduler_on_rank_1_only, 2, 2, "flat", "on rank 1")
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} trained on with another learning rate"
        assert result["steps"] == 0, result
        for expected in ("rank 0 has initial_lr=<missing>", "rank 1 has initial_lr=0.1", "rank 0 has lr=0.1"):
            assert expected in result["error"], result["error"]
        assert "rank 1 has lr=0.05" in result["error"], result["error"]
    assert results[0]["error"] == results[1]["error"]
