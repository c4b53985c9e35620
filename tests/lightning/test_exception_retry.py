"""An exception caught and retried mid-step leaves training as if it had not happened (2 gloo ranks, stages 1-3).

The exception is raised inside backward (after some bucket reductions were launched), inside a stage-3 unit's
forward or inside ``optimizer.step()``; the module catches it and runs that part again.

The cases run in the training spawns that several files share (tests/lightning/training_cases.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.lightning.models import result_of
from tests.lightning.training_cases import EXCEPTION_STEPS, FAIL_AT, STAGES, Outcome, assert_runs_match


@pytest.fixture(scope="module")
def outcomes(training_outcomes: Callable[[int], Outcome]) -> Callable[[int], Outcome]:
    """``outcomes(world_size)[case name]``: every rank's result, from the training spawns this file shares."""
    return training_outcomes


@pytest.mark.parametrize("stage", STAGES)
def test_exception_in_backward_then_retry_trains_like_ddp(outcomes: Callable[[int], Outcome], stage: int) -> None:
    """Backward raises once on every rank after ``l4``, ``l3`` and ``l2`` got their gradients (so their buckets were
    reduced or in flight); after ``zero_grad`` the same batch's backward and the later steps run as without it."""
    outcome = outcomes(2)
    assert_runs_match(outcome, "exception/ddp_oracle", f"exception/backward/zero{stage}", EXCEPTION_STEPS)
    for rank, result in enumerate(outcome[f"exception/backward/zero{stage}"]):
        record = result_of(result)["model"]
        assert record["failures"] == [FAIL_AT], f"rank {rank}: failures caught {record['failures']}"
        arrived = {name.split(".")[0] for name in record["arrived"]}
        assert arrived == {"l2", "l3", "l4"}, f"rank {rank}: gradients arrived before the failure: {record['arrived']}"


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("fail", ["forward", "step"])
def test_exception_in_forward_or_step_then_retry_trains_like_ddp(
    outcomes: Callable[[int], Outcome], stage: int, fail: str
) -> None:
    """``forward``: ``l3`` raises inside its forward (at stage 3 a gather unit, gathered and with the next unit's
    prefetch started); forward and backward run again. ``step``: a step pre-hook raises before the update; ``step()``
    is called again. Either way the run equals DDP without the failure."""
    outcome = outcomes(2)
    assert_runs_match(outcome, "exception/ddp_oracle", f"exception/{fail}/zero{stage}", EXCEPTION_STEPS)
    for rank, result in enumerate(outcome[f"exception/{fail}/zero{stage}"]):
        assert result_of(result)["model"]["failures"] == [FAIL_AT], f"rank {rank}: the failure did not happen once"


@pytest.mark.parametrize("stage", STAGES)
def test_exception_in_backward_then_retry_in_bf16_changes_nothing(
    outcomes: Callable[[int], Outcome], stage: int
) -> None:
    """In ``"bf16-mixed"`` the retried step gives the fp32 masters of the same run without the failure, bit for bit:
    the retry computes the same gradients and reduces them in the same order."""
    assert_runs_match(
        outcomes(2),
        f"exception_bf16/None/zero{stage}",
        f"exception_bf16/backward/zero{stage}",
        EXCEPTION_STEPS,
        rtol=0.0,
    )
