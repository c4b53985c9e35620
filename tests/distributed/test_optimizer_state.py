"""The sharded optimizer state gathers into, and loads from, the ordinary torch optimizer state dict."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.options import EngineOptions
from tests.distributed.models import TinyLM
from tests.distributed.parity import CASES, make_optimizer, relative_difference, train_ddp, train_zero
from tests.helpers import run_on_ranks


def _max_state_difference(reference: dict, other: dict) -> float:
    assert sorted(reference["state"]) == sorted(other["state"])
    worst = 0.0
    for index, state in reference["state"].items():
        assert sorted(state) == sorted(other["state"][index])
        for key, value in state.items():
            scale = value.abs().max().clamp_min(1e-12)
            worst = max(worst, ((value - other["state"][index][key]).abs().max() / scale).item())
    return worst


def _gather_and_reload(rank: int, world_size: int, case_name: str) -> dict[str, float]:
    case = CASES[case_name]
    comm = Communicator()
    torch.manual_seed(0)
    initial = TinyLM(**case.model_kwargs)
    reference = copy.deepcopy(initial)
    ddp_optimizer_state = train_ddp(reference, case, rank, return_optimizer=True)
    results = {}
    for stage in (1, 2):
        model = copy.deepcopy(initial)
        engine = train_zero(model, case, rank, stage, comm)
        optimizer = engine.optimizers[0]
        full = engine.full_optimizer_state_dict(optimizer)
        results[f"stage{stage}/gathered_vs_ddp"] = _max_state_difference(ddp_optimizer_state, full)
        assert [g["lr"] for g in full["param_groups"]] == [g["lr"] for g in ddp_optimizer_state["param_groups"]]
        # Load into a fresh engine of the other stage: gathering again must give the same dict.
        other_model = copy.deepcopy(model)
        other_optimizer = make_optimizer(other_model, case)
        other = ZeroEngine(other_model, [other_optimizer], EngineOptions(stage=3 - stage, bucket_cap_mb=0.0003), comm)
        other.load_full_optimizer_state_dict(other_optimizer, full)
        results[f"stage{stage}/reloaded"] = _max_state_difference(
            full, other.full_optimizer_state_dict(other_optimizer)
        )
        results[f"stage{stage}/params"] = relative_difference(reference, model)
    return results


CHECKED = ["plain", "sgd_momentum", "two_groups", "unused", "adagrad"]


def _all_cases(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    return {name: _gather_and_reload(rank, world_size, name) for name in CHECKED}


@pytest.fixture(scope="module")
def differences() -> list[dict[str, dict[str, float]]]:
    return run_on_ranks(_all_cases, 3)


@pytest.mark.parametrize("case_name", CHECKED)
def test_full_optimizer_state_equals_ddp_and_reloads(differences: list[dict], case_name: str) -> None:
    for per_rank in differences:
        for key, difference in per_rank[case_name].items():
            assert difference <= 1e-5, f"{key}: {difference:.2e}"
