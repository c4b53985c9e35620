"""A Fabric step moves what the engine's step moves (tests/distributed/test_memory_and_comm.py's formulas): the
iteration that a training forward begins gathers each stage-3 unit once for forward and once for backward, the root
once, never the root a second time because the iteration began after its gather."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.distributed.models import TinyLM, batch, loss_fn
from tests.helpers import run_on_ranks


def _steps(rank: int, world_size: int) -> list[dict[str, Any]]:
    from lightning.fabric import Fabric

    from lightning_zero import ZeroFabricStrategy

    fabric = Fabric(
        accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy(stage=3, wrap_policy={nn.Linear})
    )
    fabric.launch()
    torch.manual_seed(0)
    model = TinyLM()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    engine = fabric.strategy.session.engine
    padded = sum(b.layout.padded_numel for b in engine.model.buffers)
    root_padded = sum(b.layout.padded_numel for b in engine.model.units[-1].buffers)
    out = []
    for step in range(3):
        tokens, targets = batch(seed=10 * step + rank)
        fabric.backward(loss_fn(model, tokens, targets))
        optimizer.step()
        optimizer.zero_grad()
        out.append({"by_op": dict(fabric.strategy.comm_report().by_op), "padded": padded, "root": root_padded})
    return out


def test_a_fabric_step_gathers_each_unit_twice_and_the_root_once() -> None:
    for rank, steps in enumerate(run_on_ranks(_steps, 2)):
        for step in steps:
            assert step["root"] > 0  # the embedding and the head live in the root unit
            assert step["by_op"]["all_gather"] == 4 * (2 * step["padded"] - step["root"]), (rank, step)
            assert step["by_op"]["reduce_scatter"] == 4 * step["padded"], (rank, step)
