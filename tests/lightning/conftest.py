"""Spawns that several test files share: each runs once per session, when the first test that needs it runs.

A file that uses one names it in a module fixture of its own (``outcomes = training_outcomes``), so its tests read
as if the spawn were the file's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.lightning import lifecycle_cases, training_cases


@pytest.fixture(scope="session")
def training_outcomes(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], training_cases.Outcome]:
    """Unfreezing, exceptions, an idle rank and fp16 with batch norm: see tests/lightning/training_cases.py."""
    return training_cases.outcomes(tmp_path_factory)


@pytest.fixture(scope="session")
def lifecycle_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[tuple[Any, ...], list[dict[str, Any]]]]:
    """The precision plugin, configure_optimizers, Trainer reuse, load_from_checkpoint: see lifecycle_cases.py."""
    return lifecycle_cases.runs(tmp_path_factory)
