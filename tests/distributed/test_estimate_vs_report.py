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
FIELDS = ("params", "gradients", "optimizer_states", "total", "offloaded")
# name: (offload_optimizer, offload_params); parameters only at stage 3
OFFLOADS = {
    "none": (False, False),
    "cpu": ("cpu", False),
    "nvme": ("nvme", False),
    "cpu+params": ("cpu", "cpu"),
    "nvme+params": ("nvme", "nvme"),
}
CASES = [(offload, stage) for offload in OFFLOADS for stage in STAGES if stage == 3 or "params" not in offload]


def _model() -> nn.Module:
    # 100,450 parameters in 4 tensors: padding (< 2 elements) and `step` scalars (4 bytes per piece) are
    # below 0.01% of any field.
    return nn.Sequential(nn.Linear(200, 250), nn.Tanh(), nn.Linear(250, 200))


def _reports_after_one_step(rank: int, world_size: int) -> dict[tuple[str, str, int], dict[str, int]]:
    import tempfile

    reports = {}
    for precision, policy in PRECISIONS.items():
        for offload, stage in CASES:
            torch.manual_seed(0)
            model = _model()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            target, params = OFFLOADS[offload]
            options = EngineOptions(
                stage=stage, offload_optimizer=target, offload_params=params, nvme_path=tempfile.gettempdir()
            )
            engine = ZeroEngine(model, [optimizer], options, Communicator(), precision=policy)
            inputs = torch.randn(8, 200, generator=torch.Generator().manual_seed(rank))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=policy is not None):
                loss = model(inputs).float().square().mean()
            loss.backward()
            engine.prepare_step(optimizer)
            optimizer.step()
            reports[precision, offload, stage] = engine.memory_report().as_dict()
            engine.release()
    return reports


@pytest.fixture(scope="module")
def ranks() -> list[dict[tuple[str, str, int], dict[str, int]]]:
    return run_on_ranks(_reports_after_one_step, WORLD_SIZE)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(("offload", "stage"), CASES, ids=[f"{o}-stage{s}" for o, s in CASES])
def test_estimate_is_within_5_percent_of_the_measured_report(
    ranks: list[dict[tuple[str, str, int], dict[str, int]]], offload: str, stage: int, precision: str
) -> None:
    """Offload moves the master and optimizer state (and stage-3 parameter shards) into ``offloaded``; a field
    estimated 0 must measure 0."""
    with torch.device("meta"):
        model = _model()
    target, params = OFFLOADS[offload]
    estimate = estimate_memory(
        model,
        stage=stage,
        world_size=WORLD_SIZE,
        precision=precision,
        optimizer="adamw",
        offload_optimizer=target,
        offload_params=params,
    )
    expected = estimate.as_dict()
    for rank, reports in enumerate(ranks):
        measured = reports[precision, offload, stage]
        for name in FIELDS:
            assert abs(measured[name] - expected[name]) <= 0.05 * expected[name], (rank, name, measured, expected)
