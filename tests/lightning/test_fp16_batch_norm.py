"""fp16 with batch norm, whose fp32 parameters have no master, through the ``Trainer`` on 2 gloo ranks, stages 1-3.

Their gradients are unscaled like the others before clipping, and an inf in them on one rank makes every rank skip
the step. The runs are compared with a reference that does the same maths without ZeRO
(``training_models.train_norm_reference``).

The cases run in the training spawns that several files share (tests/lightning/training_cases.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.lightning.models import max_rel_diff, result_of
from tests.lightning.training_cases import INJECT_STEP, NORM_STEPS, STAGES, Outcome, assert_close
from tests.lightning.training_models import NORM_CLIP, NormNet, trainable_names

# Measured on 2 ranks (6 steps): the reference against itself with its clipping norm summed in another order moves
# the fp32 parameters by 7.5e-8 and the norms by 1.2e-7 (the reversed rank sum changes nothing on 2 ranks); at loss
# scale 1, where unscaling is the identity, the strategy differs from the reference by 8.4e-8 (parameters) and
# 1.3e-7 (norms). Leaving the batch-norm gradients scaled moves the parameters by 9.7 and the norms by 163x.
NORM_RTOL = 1e-5


@pytest.fixture(scope="module")
def outcomes(training_outcomes: Callable[[int], Outcome]) -> Callable[[int], Outcome]:
    """``outcomes(world_size)[case name]``: every rank's result, from the training spawns this file shares."""
    return training_outcomes


def _params(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = trainable_names(NormNet())
    return {name: state[name] for name in names}


def _norm_reference(outcome: Outcome, name: str = "norm/reference") -> list[dict[str, Any]]:
    return [result_of(result) for result in outcome[name]]


def test_fp16_reference_spread_is_far_below_the_tolerance(outcomes: Callable[[int], Outcome]) -> None:
    """The reference against itself with its sums in another order: what rounding alone moves (NORM_RTOL's basis)."""
    outcome = outcomes(2)
    for rank, (ref, reordered) in enumerate(
        zip(_norm_reference(outcome), _norm_reference(outcome, "norm/reference_reordered"), strict=True)
    ):
        assert_close(ref["state"], reordered["state"], f"reference spread, rank {rank}", NORM_RTOL / 10)
        spread = max(abs(a - b) / a for a, b in zip(ref["norms"], reordered["norms"], strict=True))
        assert spread <= NORM_RTOL / 10, f"rank {rank}: the reference's norms spread by {spread:g}"


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_reference_does_the_strategys_maths_at_loss_scale_1(
    outcomes: Callable[[int], Outcome], stage: int
) -> None:
    """At loss scale 1 unscaling is the identity, so scaled and unscaled batch-norm gradients agree: there the
    strategy and the reference agree too, which shows the reference (data, fp16 copy, masters, clipping) is right."""
    outcome = outcomes(2)
    for rank, (ref, run) in enumerate(
        zip(_norm_reference(outcome, "norm/reference_scale1"), outcome[f"norm/scale1/zero{stage}"], strict=True)
    ):
        run = result_of(run)
        assert run["global_step"] == NORM_STEPS
        assert_close(ref["state"], _params(run["state"]), f"scale 1, rank {rank}", NORM_RTOL)


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_batch_norm_trains_like_the_same_maths_reference(outcomes: Callable[[int], Outcome], stage: int) -> None:
    """At loss scale 2^10 the fp32 parameters (masters and batch norm) equal the reference's: the batch-norm
    gradients are unscaled before the global clipping norm is taken and before the update."""
    outcome = outcomes(2)
    for rank, (ref, run) in enumerate(zip(_norm_reference(outcome), outcome[f"norm/zero/zero{stage}"], strict=True)):
        run = result_of(run)
        assert run["global_step"] == NORM_STEPS
        scaler = run["callbacks"][0]["scaler"]
        assert [entry["skipped_steps"] for entry in scaler] == [0] * NORM_STEPS, f"rank {rank}: a step was skipped"
        assert_close(ref["state"], _params(run["state"]), f"stage {stage} vs reference, rank {rank}", NORM_RTOL)


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_clipping_sees_the_unscaled_gradient_norm(outcomes: Callable[[int], Outcome], stage: int) -> None:
    """The global norm of the optimizer's gradients just before clipping (the strategy's pieces, over all ranks) is
    the reference's unscaled norm at every step, batch-norm gradients included."""
    outcome = outcomes(2)
    for rank, (ref, run) in enumerate(zip(_norm_reference(outcome), outcome[f"norm/zero/zero{stage}"], strict=True)):
        norms = result_of(run)["callbacks"][0]["norms"]
        assert len(norms) == len(ref["norms"]) == NORM_STEPS
        assert all(n > NORM_CLIP for n in ref["norms"]), "clipping should act in every step of this run"
        worst = max(abs(a - b) / a for a, b in zip(ref["norms"], norms, strict=True))
        assert worst <= NORM_RTOL, f"rank {rank}: norms {norms} vs the reference's {ref['norms']}"


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_inf_in_batch_norm_gradient_on_one_rank_skips_the_step_everywhere(
    outcomes: Callable[[int], Outcome], stage: int
) -> None:
    """An inf in rank 1's batch-norm weight gradient at step 3 is handled as one in a Linear weight's: every rank
    skips step 3 and halves the scale, and both runs end with the same finite parameters, bit for bit."""
    outcome = outcomes(2)
    clean = result_of(outcome[f"norm/zero/zero{stage}"][0])["state"]
    for rank, (linear, norm) in enumerate(
        zip(outcome[f"norm/inf_linear/zero{stage}"], outcome[f"norm/inf_norm/zero{stage}"], strict=True)
    ):
        linear, norm = result_of(linear), result_of(norm)
        history = linear["callbacks"][0]["scaler"]
        skipped = [entry["skipped_steps"] for entry in history]
        assert skipped == [0] * (INJECT_STEP - 1) + [1] * (NORM_STEPS - INJECT_STEP + 1), f"rank {rank}: {history}"
        assert norm["callbacks"][0]["scaler"] == history, f"rank {rank}: loss-scale history differs from {history}"
        assert all(bool(torch.isfinite(v).all()) for v in norm["state"].values()), f"rank {rank}: inf/NaN parameters"
        assert_close(linear["state"], norm["state"], f"inf in batch norm vs in Linear, rank {rank}", 0.0)
    skipping = max_rel_diff(_params(clean), _params(result_of(outcome[f"norm/inf_linear/zero{stage}"][0])["state"]))
    assert max(skipping.values()) > 1e-3, "skipping step 3 should change the parameters"
    assert math.isfinite(max(skipping.values()))
