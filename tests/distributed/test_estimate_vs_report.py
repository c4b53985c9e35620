"""estimate_memory() of a meta-device model agrees with memory_report() of the same model on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero import estimate_memory
from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.mixed_precision import PrecisionPolicy
from lightning_zero.core.options import EngineOptions
from tests.helpers import run_on_ranks

STAGES = (1, 2, 3)
WORLD_SIZE = 2
PRECISIONS = {
    "32-true": None,
    "bf16-mixed": PrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, master_dtype=torch.float32),
}
FIELDS = ("params", "gradients", "optimizer_states", "total")


def _model() -> nn.Module:
    # 100,450 parameters in 4 tensors: padding (< 2 elements) and `step` scalars (4 bytes per piece) are
    # below 0.01% of any field.
    return nn.Sequential(nn.Linear(200, 250), nn.Tanh(), nn.Linear(250, 200))


def _reports_after_one_step(rank: int, world_size: int) -> dict[tuple[str, int], dict[str, int]]:
    reports = {}
    for precision, policy in PRECISIONS.items():
        for stage in STAGES:
            torch.manual_seed(0)
            model = _model()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            engine = ZeroEngine(model, [optimizer], EngineOptions(stage=stage), Communicator(), precision=policy)
            inputs = torch.randn(8, 200, generator=torch.Generator().manual_seed(rank))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=policy is not None):
                loss = model(inputs).float().square().mean()
            loss.backward()
            engine.prepare_step(optimizer)
            optimizer.step()
            reports[precision, stage] = engine.memory_report().as_dict()
            engine.remove_hooks()
    return reports


@pytest.fixture(scope="module")
def ranks() -> list[dict[tuple[str, int], dict[str, int]]]:
    return run_on_ranks(_reports_after_one_step, WORLD_SIZE)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"stage{s}")
def test_estimate_is_within_5_percent_of_the_measured_report(
    ranks: list[dict[tuple[str, int], dict[str, int]]], stage: int, precision: str
) -> None:
    with torch.device("meta"):
        model = _model()
    estimate = estimate_memory(model, stage=stage, world_size=WORLD_SIZE, precision=precision, optimizer="adamw")
    expected = estimate.as_dict()
    for rank, reports in enumerate(ranks):
        measured = reports[precision, stage]
        for name in FIELDS:
            assert abs(measured[name] - expected[name]) <= 0.05 * expected[name], (rank, name, measured, expected)
        assert measured["offloaded"] == expected["offloaded"] == 0
