"""Reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``) at every stage: the
checkpoint's backward is a graph task of its own inside the backward. See [Note: reentrant activation checkpointing
at stage 3]; the parity with DDP is the ``reentrant_checkpointing`` case of tests/distributed/parity.py and a factor
of tests/lightning/test_feature_matrix.py."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.options import EngineOptions
from lightning_zero.core.stage3.reachability import reached_leaves
from tests.helpers import run_on_ranks

STEPS = 3


class SharedInAndOut(nn.Module):
    """``shared`` runs inside a reentrant checkpoint and again outside it, nearer the loss: the outer graph's
    gradient of it arrives first, the checkpoint's backward adds another later."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.shared = nn.Linear(16, 16)
        self.reentrant = reentrant

    def forward(self, x: Tensor) -> Tensor:
        hidden = torch.tanh(self.first(x))
        if self.reentrant:
            hidden = torch.utils.checkpoint.checkpoint(self.shared.__call__, hidden, use_reentrant=True)
        else:
            hidden = self.shared(hidden)
        return self.shared(torch.tanh(hidden))


def _train(rank: int, stage: int, reentrant: bool, overlap: bool) -> list[Tensor] | str:
    torch.manual_seed(0)
    model = SharedInAndOut(reentrant)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = EngineOptions(stage=stage, overlap_comm=overlap, bucket_cap_mb=0.0005, wrap_policy={nn.Linear})
    engine = ZeroEngine(model, [optimizer], options, Communicator())
    try:
        for step in range(STEPS):
            optimizer.zero_grad()
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            engine.scale_loss(model(x).square().mean()).backward()
            engine.finish_backward()
            optimizer.step()
    except RuntimeError as error:
        return str(error)
    with engine.gathered():
        return [p.detach().clone() for p in model.parameters()]


def _runs(rank: int, world_size: int) -> dict[Any, Any]:
    return {
        (stage, reentrant, overlap): _train(rank, stage, reentrant, overlap)
        for stage in (1, 2, 3)
        for reentrant, overlap in ((False, True), (True, False), (True, True))  # last: it raises
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[Any, Any]]:
    return run_on_ranks(_runs, 2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_parameter_used_inside_and_outside_a_reentrant_checkpoint(runs: list[dict[Any, Any]], stage: int) -> None:
    """Reduced at the end of backward (``overlap_comm=False``) it trains as without the checkpoint; with the
    reduction overlapped its bucket is already reduced when the checkpoint's gradient comes, and every rank raises
    naming both ways out (it once raised "reentrant checkpointing is not supported")."""
    for per_rank in runs:
        plain = per_rank[(stage, False, True)]
        for a, b in zip(per_rank[(stage, True, False)], plain, strict=True):
            assert torch.equal(a, b)
        error = per_rank[(stage, True, True)]
        for part in ("second gradient", "reentrant activation checkpoint", "use_reentrant=False", "overlap_comm=False"):
            assert part in error, error


def test_what_a_reentrant_checkpoint_reaches() -> None:
    """The outer graph reaches a checkpointed module's parameters through the checkpoint's node only: the walk
    counts them (the module behind a bound method, a partial, or the module itself), and every leaf where the
    checkpointed function is a closure."""
    inner, outer = nn.Linear(3, 3), nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    for function in (inner, inner.__call__, functools.partial(inner.forward)):
        loss = outer(torch.utils.checkpoint.checkpoint(function, x, use_reentrant=True)).sum()
        reached = reached_leaves([loss.grad_fn])
        assert all(id(p) in reached for p in (*inner.parameters(), *outer.parameters(), x))
        assert id(object()) not in reached
    loss = outer(torch.utils.checkpoint.checkpoint(lambda t: inner(t), x, use_reentrant=True)).sum()
    assert id(object()) in reached_leaves([loss.grad_fn])
