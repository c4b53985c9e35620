"""A rank whose backward reaches no trainable parameter, through the ``Trainer`` on 2 and 3 gloo ranks, stages 1-3.

Its loss is built from something else: it neither hangs the others nor changes the maths, but counts as a zero
gradient, as DDP's ``0 * out.sum()`` does.

The cases run in the training spawns that several files share (tests/lightning/training_cases.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.lightning.models import max_rel_diff, result_of
from tests.lightning.training_cases import IDLE_STEPS, STAGES, WORLD_SIZES, Outcome, assert_runs_match


@pytest.fixture(scope="module")
def outcomes(training_outcomes: Callable[[int], Outcome]) -> Callable[[int], Outcome]:
    """``outcomes(world_size)[case name]``: every rank's result, from the training spawns this file shares."""
    return training_outcomes


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("idle_micro", [0, 1], ids=["idle_first_micro_batch", "idle_second_micro_batch"])
def test_rank_whose_loss_reaches_no_parameter_trains_like_ddp(
    outcomes: Callable[[int], Outcome], world_size: int, stage: int, idle_micro: int
) -> None:
    """Rank 1's backward on one micro-batch of steps 1 and 3 reaches no trainable parameter: no hang, and the result
    is DDP's where that loss is ``0 * out.sum()`` (a zero gradient, averaged over all ranks)."""
    assert_runs_match(
        outcomes(world_size), f"idle/{idle_micro}/ddp_oracle", f"idle/{idle_micro}/zero{stage}", IDLE_STEPS
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_idle_steps_change_ddps_result(outcomes: Callable[[int], Outcome], world_size: int) -> None:
    """Rank 1's zero gradient in the idle micro-batches changes the averaged gradient, so matching the oracle is a
    real check of how the strategy counts a rank without gradients."""
    outcome = outcomes(world_size)
    never = result_of(outcome["idle/ddp_never_idle"][0])["state"]
    for micro in (0, 1):
        diffs = max_rel_diff(never, result_of(outcome[f"idle/{micro}/ddp_oracle"][0])["state"])
        assert max(diffs.values()) > 1e-3, f"idle micro-batch {micro} leaves DDP's parameters as they were"
