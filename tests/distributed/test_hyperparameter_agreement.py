"""Ranks agree on every optimizer's hyper-parameters at each step: a scheduler stepped on one rank only raises
the same error on every rank, naming the optimizer, the group and both values, instead of training apart."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.distributed.models import TinyLM, batch, loss_fn
from tests.helpers import run_on_ranks


def _scheduler_on_rank_1_only(rank: int, world_size: int, stage: int, partition: str) -> dict[str, Any]:
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    torch.manual_seed(0)
    model = TinyLM()
    first = torch.optim.AdamW(model.a.parameters(), lr=1e-2)
    second = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("a.")], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(second, step_size=1, gamma=0.5)
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
    results = run_on_ranks(_scheduler_on_rank_1_only, 2, stage, partition)
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} trained on with another learning rate"
        assert result["steps"] == 1, result  # the first step agreed; the second is refused before it changes anything
        assert "optimizer 1 (SGD) param group 0" in result["error"], result["error"]
        assert "rank 0 has lr=0.1" in result["error"], result["error"]
        assert "rank 1 has lr=0.05" in result["error"], result["error"]
    assert results[0]["error"] == results[1]["error"]
