"""The repository's launcher (``tests/helpers.py``), shared by the tests and the benchmarks: what each rank gets,
and that a rank that fails, dies or hangs fails the call with the rank named, in seconds rather than at a timeout."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers import run_on_ranks

PROBE = "LIGHTNING_ZERO_LAUNCH_PROBE"


def _report(rank: int, world_size: int, scale: float) -> dict[str, Any]:
    return {
        "env": {key: os.environ.get(key) for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", PROBE)},
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
        "group_size": dist.get_world_size(),
        "tensor": torch.full((2,), scale * rank),
    }


def test_each_rank_gets_the_torchrun_environment_the_extra_variables_and_the_threads() -> None:
    results = run_on_ranks(_report, 2, 1.5, threads=2, env={PROBE: "on"})
    for rank, result in enumerate(results):  # in rank order
        assert result["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", PROBE: "on"}
        assert result["threads"] == 2
        assert (result["backend"], result["group_size"]) == ("gloo", 2)
        assert torch.equal(result["tensor"], torch.full((2,), 1.5 * rank))
    assert PROBE not in os.environ  # the extra variables were the children's only


def _rank_one_raises(rank: int, world_size: int) -> str:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    return "done"


def _rank_one_dies(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()  # waits for the dead rank


def _rank_one_hangs(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(600)


def test_an_exception_on_one_rank_fails_the_call_with_its_traceback() -> None:
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed") as failure:
        run_on_ranks(_rank_one_raises, 2, init_group=False)
    assert 'raise ValueError("rank 1 refuses")' in str(failure.value)


@pytest.mark.parametrize(
    ("fn", "init_group", "timeout_s", "expected"),
    [(_rank_one_dies, True, 120, "died with exit code 3"), (_rank_one_hangs, False, 3, "no answer within 3 s")],
)
def test_a_rank_that_dies_or_hangs_fails_the_call_in_seconds(
    fn: Any, init_group: bool, timeout_s: float, expected: str
) -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"rank 1(: | of 2 failed:\n){expected}"):
        run_on_ranks(fn, 2, init_group=init_group, timeout_s=timeout_s)
    assert time.monotonic() - start < 60  # dead: at once, not at the group's timeout; hung: at timeout_s


def test_an_unknown_device_type_is_refused_before_any_rank_starts() -> None:
    with pytest.raises(ValueError, match=r"device_type='tpu': expected one of \['cpu', 'cuda'\]"):
        run_on_ranks(_report, 2, 1.0, device_type="tpu")
