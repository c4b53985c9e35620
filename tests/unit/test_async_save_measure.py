"""benchmarks/async_save.py's in-fit stall without running a fit: on step times made up here, it gives back the
stall put into them, and about nothing where no save was made."""

from __future__ import annotations

import random
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.unit.bench_scripts import benchmark_script


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with benchmark_script("async_save") as module:
        yield module


def _steps(count: int, every: int, step_s: float, after_save_s: float, rng: random.Random | None = None) -> list:
    """Step times of a fit saving after every ``every``-th step, the first step after a save ``after_save_s``
    slower, each with noise from ``rng`` where given."""
    steps = []
    for number in range(1, count + 1):
        slower = after_save_s if number > every and (number - 1) % every == 0 else 0.0
        steps.append(step_s + slower + (rng.uniform(-0.05, 0.05) if rng else 0.0))
    return steps


@pytest.mark.parametrize("every", [3, 6])
def test_the_stall_put_into_the_steps_comes_back_with_each_call(bench: ModuleType, every: int) -> None:
    steps = _steps(6 * every, every, step_s=1.3, after_save_s=0.4)
    calls = [0.1] * 6
    stall, baseline = bench.in_fit_stall(steps, calls, every)
    assert baseline == pytest.approx(1.3)
    assert stall == pytest.approx(0.5)  # the call and the slower step after it


def test_a_fit_without_saves_measures_about_nothing(bench: ModuleType) -> None:
    plain = _steps(36, 6, step_s=1.3, after_save_s=0.0, rng=random.Random(0))
    assert abs(bench.in_fit_stall(plain, [], 6)[0]) < 0.1


def test_slow_steps_spread_over_every_phase_are_no_stall(bench: ModuleType) -> None:
    """Step times are skewed (a few slow ones): spread evenly over the phases of the periods they measure nothing,
    where a median baseline would have counted them (0.42 s a save here)."""
    every = 5
    steps = [1.3] * 35  # periods after the saves at steps 5, 10, ..., 30
    for period in range(every):  # one slow step at each phase
        steps[every * (period + 1) + period] += 0.5
    assert bench.in_fit_stall(steps, [], every)[0] == pytest.approx(0.0, abs=1e-9)
