"""lightning_zero.grad_norm: the per-parameter gradient norms Lightning's ``grad_norm`` gives under DDP, at every
stage, where the parameters have no ``.grad`` (each rank holds its shard of the reduced gradients).

A user's trial: ``grad_norm(self, 2)`` in ``on_before_optimizer_step`` logged nothing under ZeroStrategy, silently.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import Tensor

from tests.helpers import run_on_ranks
from tests.lightning.models import TwoLayer, make_loader, make_trainer

STEPS = 3
SYSTEMS = ("zero1", "zero2", "zero3", "zero3_parameter")


class NormLogging(TwoLayer):
    """Records, before each optimizer step, the gradient norms of ``norms`` (Lightning's or lightning_zero's)."""

    def __init__(self, norms: Any, where: str = "on_before_optimizer_step") -> None:
        super().__init__(hidden=16)
        self.norms, self.where, self.seen = norms, where, []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.where == "on_before_optimizer_step":
            self.seen.append({k: float(v) for k, v in self.norms(self, 2).items()})

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if self.where == "training_step":
            self.norms(self, 2)
        return super().training_step(batch, batch_idx)


def _norms(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_zero import ZeroStrategy, grad_norm

    strategies = {
        "ddp": DDPStrategy(),
        "zero1": ZeroStrategy(stage=1),
        "zero2": ZeroStrategy(stage=2),
        "zero3": ZeroStrategy(stage=3),
        "zero3_parameter": ZeroStrategy(stage=3, partition="parameter"),
    }
    out: dict[str, Any] = {}
    for name, strategy in strategies.items():
        model = NormLogging(lightning_grad_norm if name == "ddp" else grad_norm)
        # Accumulation and clipping: the norms are of the summed gradients, before the clip.
        trainer = make_trainer(world_size, strategy, max_steps=STEPS, accumulate_grad_batches=2, gradient_clip_val=0.01)
        trainer.fit(model, make_loader("two_layer"))
        out[name] = model.seen
    try:
        misplaced = NormLogging(grad_norm, where="training_step")
        make_trainer(world_size, ZeroStrategy(stage=2), max_steps=1).fit(misplaced, make_loader("two_layer"))
        out["misplaced"] = "no error"
    except RuntimeError as error:
        out["misplaced"] = str(error)
    return out


@pytest.fixture(scope="module")
def norms() -> list[dict[str, Any]]:
    return run_on_ranks(_norms, 2)


@pytest.mark.parametrize("system", SYSTEMS)
def test_grad_norm_equals_lightnings_under_ddp(norms: list[dict[str, Any]], system: str) -> None:
    for rank, per_rank in enumerate(norms):
        reference, seen = per_rank["ddp"], per_rank[system]
        assert len(reference) == len(seen) == STEPS
        for step, (expected, got) in enumerate(zip(reference, seen, strict=True)):
            assert got.keys() == expected.keys(), (rank, step)
            assert "grad_2.0_norm/a.weight" in got
            assert "grad_2.0_norm_total" in got
            for key, value in expected.items():
                assert got[key] == pytest.approx(value, rel=1e-5), (rank, step, key)
            assert got["grad_2.0_norm_total"] > 0.01  # before the clip to 0.01


def test_grad_norm_outside_the_step_says_where_to_call_it(norms: list[dict[str, Any]]) -> None:
    for per_rank in norms:
        assert "call it in on_before_optimizer_step" in per_rank["misplaced"], per_rank["misplaced"]


def test_lightning_grad_norm_finds_no_gradient_under_zero() -> None:
    """Why the helper exists: the parameters have no .grad between backward and the step."""
    model = TwoLayer()
    assert lightning_grad_norm(model, 2) == {}
    model.a.weight.grad = torch.ones_like(model.a.weight)
    assert set(lightning_grad_norm(model, 2)) == {"grad_2.0_norm/a.weight", "grad_2.0_norm_total"}
