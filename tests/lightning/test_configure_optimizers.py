"""What ``configure_optimizers`` may return beyond one optimizer per parameter, on 2 gloo ranks at stages 1-3.

A parameter in two optimizers trains as under DDP; no optimizer at all (``None``) fits, saves and resumes as under
DDP.

The cases run in the spawns that several files share (tests/lightning/lifecycle_cases.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.lightning.lifecycle_cases import NO_OPTIMIZER, STAGES, assert_close, assert_equal, case_results
from tests.lightning.lifecycle_models import NoOptimizer, SharedParamManual
from tests.lightning.models import max_rel_diff, state_of


@pytest.fixture(scope="module")
def runs(lifecycle_runs: dict[Any, Any]) -> dict[Any, Any]:
    """``runs[world_size][case key]``: every rank's result, from the spawns this file shares."""
    return lifecycle_runs


@pytest.mark.parametrize("stage", STAGES)
def test_parameter_in_two_optimizers_trains_like_ddp(runs: dict[Any, Any], stage: int) -> None:
    """torch and DDP let one parameter be in two optimizers; each step of either moves it, as under DDP."""
    ddp = case_results(runs, 2, "shared_param", "ddp")
    initial = state_of(SharedParamManual())
    assert max_rel_diff(initial, ddp[0]["state"])["shared.weight"] > 1e-3  # the shared weight trained
    for rank, (expected, actual) in enumerate(zip(ddp, case_results(runs, 2, "shared_param", stage), strict=True)):
        assert actual["global_step"] == expected["global_step"], f"rank {rank}"
        assert_close(expected["state"], actual["state"], f"rank {rank}: parameters after fit")


# ---------------------------------------------------------------------------------------------- no optimizer
@pytest.mark.parametrize(("stage", "ckpt"), NO_OPTIMIZER)
def test_no_optimizer_fits_saves_and_resumes(runs: dict[Any, Any], stage: int, ckpt: str) -> None:
    """configure_optimizers returning None: fit, a checkpoint and a resume from it run as under DDP (nothing trains,
    and there is no optimizer state to load)."""
    ddp = case_results(runs, 2, "no_optimizer", "ddp", "full")
    initial = state_of(NoOptimizer())
    for rank, (expected, actual) in enumerate(
        zip(ddp, case_results(runs, 2, "no_optimizer", stage, ckpt), strict=True)
    ):
        assert actual["steps"] == expected["steps"], f"rank {rank}: global steps (fit, resumed fit)"
        assert_equal(initial, actual["state"], f"rank {rank}: parameters after the resumed fit")
