"""The training spawns that test_unfreezing.py, test_exception_retry.py, test_idle_rank.py and test_fp16_batch_norm.py
share (tests/lightning/training_cases.py): every case finished on every rank.

Those files compare some cases on rank 0 only (DDP's never-idle run, the runs that save after add_param_group), so
a case that raised on another rank alone would pass unseen. No case of these spawns is expected to raise (the
exception cases catch their failure and retry). No spawn of its own: it reads the session fixture.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.lightning.models import assert_every_case_finished
from tests.lightning.training_cases import WORLD_SIZES, Outcome


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_case_finished_on_every_rank(training_outcomes: Callable[[int], Outcome], world_size: int) -> None:
    assert_every_case_finished(training_outcomes(world_size))
