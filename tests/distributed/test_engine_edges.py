"""ZeroEngine in plain loops at the edges: ``module.zero_grad()``, a gradient penalty through
``torch.autograd.grad``, and backward passes in another order than their forwards at stage 3.

Every case runs in one spawn of 2 gloo ranks at stages 1-3 and returns plain values; a case that raises on every
rank alike returns its error message, so the tests can assert on it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.options import EngineOptions
from tests.distributed.models import TinyLM, batch, loss_fn
from tests.distributed.parity import relative_difference
from tests.helpers import run_on_ranks

STAGES = (1, 2, 3)
STEPS = 3
RTOL = 1e-5  # fp32 against DDP or a reordered reference; the parity tests measure their spread at 1e-7 - 4e-7


def _engine(model: nn.Module, optimizer: torch.optim.Optimizer, stage: int) -> ZeroEngine:
    policy = {nn.Linear} if stage == 3 else None  # every Linear a gather unit: several units per backward
    return ZeroEngine(
        model, [optimizer], EngineOptions(stage=stage, bucket_cap_mb=0.0005, wrap_policy=policy), Communicator()
    )


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# ---------------------------------------------------------------------------------------------- module.zero_grad
def _zero_grad_through_module(model: nn.Module, run: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    """Per step: a backward whose gradients ``model.zero_grad()`` then discards, a second backward, the step. A
    zero_grad that missed the held gradients would step on the sum of both."""
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_fn(run, *batch(100 * step + rank)).backward()
        model.zero_grad()  # what Lightning calls before each validation loop
        loss_fn(run, *batch(100 * step + 10 + rank)).backward()
        optimizer.step()


def _module_zero_grad_case(rank: int, stage: int) -> float:
    torch.manual_seed(0)
    initial = TinyLM()
    reference = copy.deepcopy(initial)
    _zero_grad_through_module(reference, DistributedDataParallel(reference), _sgd(reference), rank)
    model = copy.deepcopy(initial)
    optimizer = _sgd(model)
    engine = _engine(model, optimizer, stage)
    _zero_grad_through_module(model, model, optimizer, rank)
    with engine.gathered():
        return relative_difference(reference, model)


# ---------------------------------------------------------------------------------------------- gradient penalty
class Critic(nn.Module):
    """A WGAN-GP critic: the loss adds ``(|d out / d x| - 1)^2``, computed with ``torch.autograd.grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def loss(self, x: Tensor) -> Tensor:
        x = x.clone().requires_grad_(True)
        out = self.layers(x)
        (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)  # reaches every unit, reduces nothing
        return out.mean() + ((grad.norm(dim=1) - 1) ** 2).mean()


def _critic_batch(step: int, rank: int) -> Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(1000 * step + rank))


def _penalty_case(rank: int, world_size: int, stage: int) -> float:
    torch.manual_seed(0)
    initial = Critic()
    reference = copy.deepcopy(initial)  # one process, every rank's loss, averaged: the gradient DDP would reduce
    optimizer = _sgd(reference)
    for step in range(STEPS):
        optimizer.zero_grad()
        for other in reversed(range(world_size)):
            (reference.loss(_critic_batch(step, other)) / world_size).backward()
        optimizer.step()
    model = copy.deepcopy(initial)
    optimizer = _sgd(model)
    engine = _engine(model, optimizer, stage)
    for step in range(STEPS):
        engine.begin_iteration()
        optimizer.zero_grad()
        engine.scale_loss(model.loss(_critic_batch(step, rank))).backward()
        engine.finish_backward()
        optimizer.step()
    with engine.gathered():
        return relative_difference(reference, model)


# ---------------------------------------------------------------------------------------------- backward order
def _interleaved_case(rank: int) -> str:
    """Stage 3: forward A, forward B, backward A, backward B. Every rank must gather the same units in the same
    order, so backward B (whose units backward A's plan already issued and freed) raises; no rank hangs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    engine = _engine(model, _sgd(model), 3)
    out_a = model(torch.randn(4, 6)).sum()
    out_b = model(torch.randn(4, 6)).sum()
    out_a.backward()
    engine.finish_backward()
    try:
        out_b.backward()
    except RuntimeError as error:
        engine.begin_iteration()  # the engine is usable again
        loss = model(torch.randn(4, 6)).sum()
        loss.backward()
        return str(error)
    return "no error"


def _all_cases(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for stage in STAGES:
        results[f"module_zero_grad/{stage}"] = _module_zero_grad_case(rank, stage)
        results[f"penalty/{stage}"] = _penalty_case(rank, world_size, stage)
    results["interleaved"] = _interleaved_case(rank)
    return results


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_all_cases, 2)


@pytest.mark.parametrize("stage", STAGES)
def test_module_zero_grad_empties_the_held_gradients(results: list[dict[str, Any]], stage: int) -> None:
    """``model.zero_grad()`` discards the reduced gradients like ``optimizer.zero_grad()``: equal to DDP."""
    for rank, result in enumerate(results):
        assert result[f"module_zero_grad/{stage}"] <= RTOL, f"rank {rank}: {result[f'module_zero_grad/{stage}']}"


@pytest.mark.parametrize("stage", STAGES)
def test_gradient_penalty_through_autograd_grad(results: list[dict[str, Any]], stage: int) -> None:
    """``torch.autograd.grad(..., create_graph=True)`` before the backward reaches every stage-3 unit without
    ending the backward; the parameters equal the averaged-loss reference."""
    for rank, result in enumerate(results):
        assert result[f"penalty/{stage}"] <= RTOL, f"rank {rank}: {result[f'penalty/{stage}']}"


def test_backward_of_an_earlier_forward_raises_naming_the_unit(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        message = result["interleaved"]
        assert "is needed by this backward pass" in message, f"rank {rank}: {message}"
        assert "forward A, forward B, backward A, backward B" in message, f"rank {rank}: {message}"
