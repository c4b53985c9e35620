"""Optimizers set up after the engine (``ZeroEngine(..., optimizers_later=True)`` then ``add_optimizer``, what
Fabric's ``setup_module`` then ``setup_optimizers`` does) train exactly like optimizers given at construction, at
stages 1-3, in fp32 and bf16-mixed (the stage-3 units already have their fp32 masters), with two optimizers added one
after the other; adding one twice is refused."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.mixed_precision import PrecisionPolicy
from lightning_zero.core.options import EngineOptions
from tests.distributed.models import TinyLM, batch, loss_fn
from tests.distributed.parity import relative_difference
from tests.helpers import run_on_ranks

BF16 = PrecisionPolicy(torch.bfloat16, torch.float32, torch.float32)


def _optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Two optimizers over disjoint parameters: the embedding's, and the rest."""
    embedding = [p for name, p in model.named_parameters() if name.startswith("emb.")]
    rest = [p for name, p in model.named_parameters() if not name.startswith("emb.")]
    return [torch.optim.AdamW(rest, lr=1e-2), torch.optim.SGD(embedding, lr=0.1, momentum=0.9)]


def _train(model: nn.Module, optimizers: list[torch.optim.Optimizer], rank: int) -> None:
    for step in range(4):
        for optimizer in optimizers:
            optimizer.zero_grad()
        tokens, targets = batch(seed=10 * step + rank)
        loss_fn(model, tokens, targets).backward()
        for optimizer in optimizers:
            optimizer.step()


def _compare(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in (1, 2, 3):
        options = EngineOptions(stage=stage, wrap_policy={nn.Linear} if stage == 3 else None, bucket_cap_mb=0.001)
        for name, policy in (("fp32", None), ("bf16", BF16)):
            torch.manual_seed(0)
            initial = TinyLM()
            given = copy.deepcopy(initial)
            given_optimizers = _optimizers(given)
            at_setup = ZeroEngine(given, given_optimizers, options, Communicator(), precision=policy)
            _train(given, given_optimizers, rank)
            later = copy.deepcopy(initial)
            engine = ZeroEngine(later, [], options, Communicator(), precision=policy, optimizers_later=True)
            later_optimizers = _optimizers(later)  # made from the module's parameters after setup
            for optimizer in later_optimizers:
                engine.add_optimizer(optimizer)
            _train(later, later_optimizers, rank)
            with at_setup.gathered(), engine.gathered():
                out[f"{stage}/{name}"] = relative_difference(given, later)
            try:
                engine.add_optimizer(later_optimizers[0])
            except ValueError as error:
                out[f"{stage}/{name}/twice"] = str(error)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_compare, 2)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_optimizers_added_later_train_exactly_like_optimizers_given_at_setup(
    results: list[dict[str, Any]], stage: int, precision: str
) -> None:
    for rank, out in enumerate(results):
        assert out[f"{stage}/{precision}"] == 0.0, f"rank {rank}: {out[f'{stage}/{precision}']:.2e}"
        assert "managed by this ZeroEngine already" in out[f"{stage}/{precision}/twice"]
