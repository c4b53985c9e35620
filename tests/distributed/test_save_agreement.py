"""A sharded save is all or nothing on every rank (see [Note: committing a sharded save]): a rank that fails while
writing makes every rank raise within seconds, naming it, with the previous checkpoint unchanged; leftovers of
interrupted saves are removed by the next save; a path whose commit was interrupted loads the complete copy."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers import run_on_ranks

WORLD_SIZE = 3


def _saved(path: str, note: str, fail_on: int | None, where: str) -> dict[str, Any]:
    """Build an engine, save ``note`` to ``path``; on rank ``fail_on`` the save fails at ``where``."""
    import torch.distributed as dist

    import lightning_zero.checkpoint.saving as sharded
    from lightning_zero.checkpoint.metadata import CheckpointError
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, [optimizer], EngineOptions(stage=3), Communicator())
    rank = dist.get_rank()
    if rank == fail_on and where == "write":
        real = torch.save

        def full_disk(obj: object, file: object, *args: object, **kwargs: object) -> None:
            if str(getattr(file, "name", file)).endswith(f"rank_{rank}.pt"):  # a path, or a file object
                raise OSError(28, "No space left on device")
            real(obj, file, *args, **kwargs)

        torch.save = full_disk
    if rank == fail_on and where == "commit":

        def failed_rename(*args: object) -> None:
            raise PermissionError(13, "Permission denied")

        sharded._commit = failed_rename
    started = time.monotonic()
    try:
        sharded.save_sharded(engine.named_state(), path, {"note": note}, "test")
    except CheckpointError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}
    return {"ok": True}


def _two_saves(rank: int, world_size: int, directory: str, fail_on: int | None, where: str) -> list[dict[str, Any]]:
    path = str(Path(directory) / "ckpt")
    first = _saved(path, "first", None, where)
    return [first, _saved(path, "second", fail_on, where)]


def _note(path: Path) -> str:
    from lightning_zero.checkpoint import ShardedCheckpoint

    return ShardedCheckpoint(path).lightning_state()["note"]


@pytest.mark.parametrize(("fail_on", "where"), [(2, "write"), (0, "commit")])
def test_a_failing_rank_fails_the_save_on_every_rank_and_keeps_the_previous_one(
    tmp_path: Path, fail_on: int, where: str
) -> None:
    results = run_on_ranks(_two_saves, WORLD_SIZE, str(tmp_path), fail_on, where)
    for rank, (first, second) in enumerate(results):
        assert first == {"ok": True}, (rank, first)
        assert f"rank {fail_on}: " in second.get("error", ""), (rank, second)
        assert ("No space left on device" if where == "write" else "Permission denied") in second["error"]
        assert "is unchanged" in second["error"], (rank, second)
        assert second["seconds"] < 30, (rank, second)  # not the collective timeout
    assert _note(tmp_path / "ckpt") == "first"
    if where == "write":  # the failed save's directory is gone
        assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def _save_over_leftovers(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    return _saved(str(Path(directory) / "ckpt"), "new", None, "")


def test_the_next_save_removes_leftovers_of_interrupted_saves(tmp_path: Path) -> None:
    for leftover in ("ckpt.tmp-deadbeef0000", "ckpt.old-deadbeef0000"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "rank_0.pt").write_bytes(b"partial")
    (tmp_path / "ckpt.keep-me").mkdir()  # not a save's leftover
    assert all(result == {"ok": True} for result in run_on_ranks(_save_over_leftovers, WORLD_SIZE, str(tmp_path)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.keep-me"]
    assert _note(tmp_path / "ckpt") == "new"


def test_a_commit_interrupted_after_moving_the_old_copy_aside_loads_the_complete_copy(tmp_path: Path) -> None:
    from lightning_zero.checkpoint.metadata import COMPLETE_FILE

    run_on_ranks(_save_over_leftovers, WORLD_SIZE, str(tmp_path))
    path = tmp_path / "ckpt"
    # The moment between `path -> path.old-<id>` and `path.tmp-<id> -> path`: both copies are on disk.
    shutil.copytree(path, tmp_path / "ckpt.tmp-000000000001")
    (tmp_path / "ckpt.tmp-000000000001" / COMPLETE_FILE).touch()
    shutil.copytree(path, tmp_path / "ckpt.tmp-000000000002")  # a save that never completed: no marker
    path.rename(tmp_path / "ckpt.old-000000000001")
    with pytest.warns(UserWarning, match=r"interrupted while committing.*ckpt\.tmp-000000000001"):
        assert _note(path) == "new"
    shutil.rmtree(tmp_path / "ckpt.tmp-000000000001")
    with pytest.warns(UserWarning, match=r"ckpt\.old-000000000001', the previous one"):
        assert _note(path) == "new"
