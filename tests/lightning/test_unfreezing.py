"""Parameters frozen at setup and unfrozen later, through the ``Trainer`` on 2 and 3 real gloo ranks, at stages 1-3.

Lightning's ``BaseFinetuning``, a direct ``add_param_group``, or ``requires_grad_(True)`` on parameters already in
the optimizer train like DDP given the same updates: a DDP run that froze them only after DDP wrapped the model, so
that DDP reduces their gradients once they train again. Checkpoints written after the unfreeze resume.

The cases run in the training spawns that several files share (tests/lightning/training_cases.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lightning_zero.checkpoint import ShardedCheckpoint
from tests.lightning.models import max_rel_diff, result_of
from tests.lightning.training_cases import (
    CKPT_TYPES,
    STAGES,
    STEPS,
    UNFREEZE_VARIANTS,
    WORLD_SIZES,
    Outcome,
    assert_close,
    assert_runs_match,
)
from tests.lightning.training_models import Finetunable, Unfreeze


@pytest.fixture(scope="module")
def outcomes(training_outcomes: Callable[[int], Outcome]) -> Callable[[int], Outcome]:
    """``outcomes(world_size)[case name]``: every rank's result, from the training spawns this file shares."""
    return training_outcomes


def _backbone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value for key, value in state.items() if key.startswith("backbone.")}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_finetuning_callback_trains_like_ddp_given_the_same_updates(
    outcomes: Callable[[int], Outcome], world_size: int, stage: int
) -> None:
    """``BaseFinetuning`` (frozen in ``setup``, added at epoch 1 with ``initial_denom_lr``) equals DDP freezing the
    backbone only in ``on_fit_start``: the unfrozen backbone's gradients are averaged over the ranks."""
    outcome = outcomes(world_size)
    for ckpt_type in CKPT_TYPES if world_size == 2 else ("sharded",):
        assert_runs_match(outcome, "finetune/ddp_oracle", f"finetune/zero{stage}/{ckpt_type}", STEPS)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ddp_does_not_reduce_parameters_unfrozen_after_wrapping(
    outcomes: Callable[[int], Outcome], world_size: int
) -> None:
    """Why the oracle freezes late: DDP with ``BaseFinetuning`` never reduces the backbone, so its ranks drift apart,
    while the late-freezing oracle keeps them equal and does train the backbone after epoch 1."""
    outcome = outcomes(world_size)
    drifting = [result_of(result)["state"] for result in outcome["finetune/ddp_callback"]]
    apart = max_rel_diff(_backbone(drifting[0]), _backbone(drifting[1]))
    assert max(apart.values()) > 1e-3, f"DDP + BaseFinetuning kept the backbone equal on ranks 0 and 1: {apart}"
    oracle = [result_of(result)["state"] for result in outcome["finetune/ddp_oracle"]]
    for rank, state in enumerate(oracle[1:], start=1):
        assert max(max_rel_diff(oracle[0], state).values()) == 0.0, f"oracle rank {rank} differs from rank 0"
    trained = max_rel_diff(_backbone(Finetunable().state_dict()), _backbone(oracle[0]))
    assert min(trained.values()) > 1e-3, f"the oracle's backbone barely trained after the unfreeze: {trained}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("variant", list(UNFREEZE_VARIANTS))
def test_unfreezing_without_the_callback_trains_like_ddp_given_the_same_updates(
    outcomes: Callable[[int], Outcome], world_size: int, stage: int, variant: str
) -> None:
    """``add_param_group``: the backbone, frozen in ``setup``, is unfrozen and added as a group with its own lr and
    weight decay at epoch 2. ``requires_grad``: the optimizer holds the frozen backbone from the start, and
    ``requires_grad_(True)`` at epoch 1 is all it takes, as under DDP."""
    assert_runs_match(outcomes(world_size), f"{variant}/ddp_oracle", f"{variant}/zero{stage}", STEPS)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("ckpt_type", CKPT_TYPES)
def test_checkpoint_after_unfreezing_resumes(outcomes: Callable[[int], Outcome], stage: int, ckpt_type: str) -> None:
    """A checkpoint written at the end of epoch 1, after ``BaseFinetuning`` added the backbone's param group, resumes
    (same stage and type) to the parameters of the uninterrupted run."""
    outcome = outcomes(2)
    for saved in outcome[f"finetune/zero{stage}/{ckpt_type}"]:
        assert "error" not in saved, f"the run that saved the checkpoint failed:\n{saved['error']}"
    assert_runs_match(outcome, f"finetune/zero{stage}/{ckpt_type}", f"resume/zero{stage}/{ckpt_type}", STEPS)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("ckpt_type", CKPT_TYPES)
def test_checkpoint_after_add_param_group_holds_the_new_group(
    outcomes: Callable[[int], Outcome], stage: int, ckpt_type: str
) -> None:
    """``trainer.save_checkpoint`` after a direct ``add_param_group`` writes the trained parameters and the optimizer's
    two param groups, the added one with its own lr and weight decay."""
    result = result_of(outcomes(2)[f"save/add_param_group/zero{stage}/{ckpt_type}"][0])
    path = result["saved"][1]
    if ckpt_type == "sharded":
        sharded = ShardedCheckpoint(path)
        saved, groups = sharded.full_state_dict(), sharded.param_groups(0)
    else:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        saved, groups = checkpoint["state_dict"], checkpoint["optimizer_states"][0]["param_groups"]
        assert len(groups[-1]["params"]) == len(list(Finetunable().backbone.parameters()))
    assert len(groups) == 2, f"{len(groups)} param groups saved"
    added = {key: groups[1][key] for key in Unfreeze.ADDED_GROUP}
    assert added == Unfreeze.ADDED_GROUP, f"the added group was saved with {added}"
    assert_close(result["state"], saved, f"checkpoint vs the run's parameters after its last step ({ckpt_type})", 0.0)
