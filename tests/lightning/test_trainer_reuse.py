"""One ``Trainer`` for two models, on 2 gloo ranks at stages 1-3: ``validate(other, ckpt_path=...)`` after
``fit(model)``, and a second ``fit`` of another model.

The cases run in the spawns that several files share (tests/lightning/lifecycle_cases.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tests.lightning.lifecycle_cases import (
    CKPT_TYPES,
    RTOL,
    STAGES,
    STEPS,
    VAL_SAMPLES,
    VAL_SEED,
    assert_close,
    case_results,
)
from tests.lightning.lifecycle_models import HParamNet, regression_data
from tests.lightning.models import max_rel_diff, state_of


@pytest.fixture(scope="module")
def runs(lifecycle_runs: dict[Any, Any]) -> dict[Any, Any]:
    """``runs[world_size][case key]``: every rank's result, from the spawns this file shares."""
    return lifecycle_runs


def _probed_state(probed: dict[str, Any], what: str) -> dict[str, Tensor]:
    assert "ok" in probed, f"{what}: reading the parameters gave {probed}"
    return probed["ok"]


def _validation_loss(state: dict[str, Tensor]) -> float:
    """The validation loss of ``state`` over the whole validation set, computed here (every batch holds 4)."""
    model = HParamNet()
    model.load_state_dict(state)
    x, y = regression_data(VAL_SAMPLES, VAL_SEED)
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


@pytest.mark.parametrize("ckpt", CKPT_TYPES)
@pytest.mark.parametrize("stage", STAGES)
def test_validate_other_model_from_checkpoint_after_fit(runs: dict[Any, Any], stage: int, ckpt: str) -> None:
    """``trainer.validate(other, ckpt_path=path)`` after ``trainer.fit(model)`` validates ``other`` with the
    checkpoint's weights, and leaves ``model`` as fit left it (readable at rest, at stage 3 too)."""
    results = case_results(runs, 2, "validate_other", stage, ckpt)
    expected = _validation_loss(results[0]["saved"])
    for other in (_validation_loss(results[0]["fitted"]), _validation_loss(results[0]["other_initial"])):
        assert abs(other - expected) > 1e-3 * expected, "the checkpoint's loss is not told apart from the others"
    for rank, result in enumerate(results):
        loss = result["metrics"][0]["val_loss"]
        assert abs(loss - expected) <= RTOL * expected, f"rank {rank}: val_loss {loss}, the checkpoint's {expected}"
        assert_close(result["saved"], result["other_after"], f"rank {rank}: the validated model's weights")
        model_after = _probed_state(result["model_after"], f"rank {rank}: the fitted model after validate")
        assert_close(result["fitted"], model_after, f"rank {rank}: the fitted model after validate")


@pytest.mark.parametrize("strategy", ["ddp", *STAGES])
def test_second_fit_on_the_same_trainer_trains_the_new_model(runs: dict[Any, Any], strategy: Any) -> None:
    """``trainer.fit(model_b)`` after ``trainer.fit(model_a)`` trains model_b as a Trainer of its own would (DDP),
    and model_a keeps the parameters its fit left, readable at rest."""
    alone = case_results(runs, 2, "fit_twice", "ddp", True)
    assert max(max_rel_diff(state_of(HParamNet(seed=1)), alone[0]["b"]).values()) > 1e-3  # model_b trained
    results = case_results(runs, 2, "fit_twice", strategy, False)
    for rank, (expected, result) in enumerate(zip(alone, results, strict=True)):
        assert result["global_step"] == 2 * STEPS, f"rank {rank}"
        assert_close(expected["b"], result["b"], f"rank {rank}: model_b vs DDP fitting model_b alone")
        a_after = _probed_state(result["a_after"], f"rank {rank}: model_a after the second fit")
        assert_close(result["a_fitted"], a_after, f"rank {rank}: model_a after the second fit")
