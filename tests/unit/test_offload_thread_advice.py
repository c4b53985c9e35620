"""The warning about an offloaded optimizer stepping on one CPU thread: given only where the rank has cores to spare."""

from __future__ import annotations

import pytest

from lightning_zero.core.store.checks import single_thread_advice


@pytest.mark.parametrize(
    ("threads", "cores", "ranks_here", "expected"),
    [
        (1, 16, 2, "OMP_NUM_THREADS=8"),  # torchrun's OMP_NUM_THREADS=1 on a host with cores to spare
        (1, 2, 2, None),  # one core per rank: a single thread is all it has (2 ranks on a 2-core machine)
        (1, 3, 2, None),
        (1, 4, 1, "OMP_NUM_THREADS=4"),
        (4, 16, 2, None),  # already threaded
    ],
)
def test_single_thread_advice(threads: int, cores: int, ranks_here: int, expected: str | None) -> None:
    advice = single_thread_advice(threads, cores, ranks_here)
    if expected is None:
        assert advice is None
    else:
        assert advice is not None
        assert expected in advice
        assert f"{cores} cores for {ranks_here} rank(s)" in advice
