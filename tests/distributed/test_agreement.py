"""Ranks that disagree on the model or the options fail on every rank with the difference, not a hang."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.options import EngineOptions
from tests.helpers import run_on_ranks

SCENARIOS = {
    "agree": None,
    "shape": "rank 0 has '0.weight' ((8, 4)",
    "requires_grad": "rank 0 has '0.bias'",
    "options": "rank 0 has 'bucket_cap_mb' 25",
}


def _build(rank: int, what: str, comm: Communicator) -> str:
    hidden = 8 + rank if what == "shape" else 8
    model = nn.Sequential(nn.Linear(4, hidden), nn.Linear(hidden, 2))
    if what == "requires_grad" and rank == 1:
        model[0].bias.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = EngineOptions(stage=2, bucket_cap_mb=25 if what != "options" or rank == 0 else 5)
    try:
        ZeroEngine(model, [optimizer], config, comm)
    except RuntimeError as error:
        return str(error)
    return "no error"


def _build_all(rank: int, world_size: int) -> dict[str, str]:
    # A failed agreement raises on every rank at the same point, so the group stays usable afterwards.
    comm = Communicator()
    return {what: _build(rank, what, comm) for what in SCENARIOS}


@pytest.fixture(scope="module")
def messages() -> list[dict[str, str]]:
    return run_on_ranks(_build_all, 3)


@pytest.mark.parametrize("what", [w for w in SCENARIOS if SCENARIOS[w]])
def test_disagreement_raises_on_every_rank(messages: list[dict[str, str]], what: str) -> None:
    for rank, per_rank in enumerate(messages):
        message = per_rank[what]
        assert "ranks disagree" in message, f"rank {rank}: {message}"
        assert SCENARIOS[what] in message, f"rank {rank}: {message}"
        assert "rank 1 has" in message
        assert "on every rank" in message or "every rank" in message


def test_agreeing_ranks_pass(messages: list[dict[str, str]]) -> None:
    assert [per_rank["agree"] for per_rank in messages] == ["no error"] * 3
