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
    real, real_commit = torch.save, sharded._commit
    if rank == fail_on and where == "write":

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
    finally:
        torch.save, sharded._commit = real, real_commit
    return {"ok": True}


def _two_saves(directory: Path, fail_on: int | None, where: str) -> list[dict[str, Any]]:
    path = str(directory / "ckpt")
    first = _saved(path, "first", None, where)
    return [first, _saved(path, "second", fail_on, where)]


FAILURES = [(2, "write"), (0, "commit")]


def _scenarios(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Every scenario of this file in one spawn, each in its own directory under ``root``."""
    out: dict[str, Any] = {
        f"{where}-{fail_on}": _two_saves(Path(root, where), fail_on, where) for fail_on, where in FAILURES
    }
    out["leftovers"] = _saved(str(Path(root, "leftovers", "ckpt")), "new", None, "")
    out["plain"] = _saved(str(Path(root, "plain", "ckpt")), "new", None, "")
    return out


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("save_agreement")
    for directory in ("write", "commit", "leftovers", "plain"):
        (root / directory).mkdir()
    for leftover in ("ckpt.tmp-deadbeef0000", "ckpt.old-deadbeef0000"):
        (root / "leftovers" / leftover).mkdir()
        (root / "leftovers" / leftover / "rank_0.pt").write_bytes(b"partial")
    (root / "leftovers" / "ckpt.keep-me").mkdir()  # not a save's leftover
    return root, run_on_ranks(_scenarios, WORLD_SIZE, str(root))


def _note(path: Path) -> str:
    from lightning_zero.checkpoint import ShardedCheckpoint

    return ShardedCheckpoint(path).lightning_state()["note"]


@pytest.mark.parametrize(("fail_on", "where"), FAILURES)
def test_a_failing_rank_fails_the_save_on_every_rank_and_keeps_the_previous_one(
    scenarios: tuple[Path, list[dict[str, Any]]], fail_on: int, where: str
) -> None:
    root, results = scenarios
    tmp_path = root / where
    for rank, per_rank in enumerate(results):
        first, second = per_rank[f"{where}-{fail_on}"]
        assert first == {"ok": True}, (rank, first)
        assert f"rank {fail_on}: " in second.get("error", ""), (rank, second)
        assert ("No space left on device" if where == "write" else "Permission denied") in second["error"]
        assert "is unchanged" in second["error"], (rank, second)
        assert second["seconds"] < 30, (rank, second)  # not the collective timeout
    assert _note(tmp_path / "ckpt") == "first"
    if where == "write":  # the failed save's directory is gone
        assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_the_next_save_removes_leftovers_of_interrupted_saves(scenarios: tuple[Path, list[dict[str, Any]]]) -> None:
    root, results = scenarios
    tmp_path = root / "leftovers"
    assert all(per_rank["leftovers"] == {"ok": True} for per_rank in results)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.keep-me"]
    assert _note(tmp_path / "ckpt") == "new"


def test_a_commit_interrupted_after_moving_the_old_copy_aside_loads_the_complete_copy(
    scenarios: tuple[Path, list[dict[str, Any]]],
) -> None:
    from lightning_zero.checkpoint.metadata import COMPLETE_FILE

    root, results = scenarios
    assert all(per_rank["plain"] == {"ok": True} for per_rank in results)
    tmp_path = root / "plain"
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
