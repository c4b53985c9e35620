"""ZeroPrecision answers what code written for Lightning's ``MixedPrecision`` asks of a plugin (its ``device``).

The cases run in the spawns that several files share (tests/lightning/lifecycle_cases.py).
"""

from __future__ import annotations

from typing import Any

import pytest
from lightning.pytorch.plugins.precision import MixedPrecision

from tests.lightning.lifecycle_cases import PRECISIONS, case_results


@pytest.fixture(scope="module")
def runs(lifecycle_runs: dict[Any, Any]) -> dict[Any, Any]:
    """``runs[world_size][case key]``: every rank's result, from the spawns this file shares."""
    return lifecycle_runs


@pytest.mark.parametrize("precision", PRECISIONS)
def test_zero_precision_has_a_device_string_like_mixed_precision(runs: dict[Any, Any], precision: str) -> None:
    """Code written for Lightning's MixedPrecision reads ``trainer.precision_plugin.device`` (a string)."""
    assert isinstance(MixedPrecision("bf16-mixed", "cpu").device, str)  # what such code expects
    for rank, result in enumerate(case_results(runs, 2, "device", precision)):
        assert "device_error" not in result, f"rank {rank}: {result.get('device_error')}"
        assert result["same_plugin"], f"rank {rank}: trainer.precision_plugin is not the strategy's"
        assert result["device"] == "cpu", f"rank {rank}: device {result['device']!r}"
        assert isinstance(result["device"], str), f"rank {rank}: device {result['device']!r} is not a str"
