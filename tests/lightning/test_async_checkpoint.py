"""Asynchronous sharded saves (``Trainer(plugins=[AsyncCheckpointIO()])``, see [Note: asynchronous sharded saves]),
on 2 gloo ranks, in two spawns.

The first spawn is a job that dies: both ranks are SIGKILLed while the background write of its second checkpoint is
half done. The second runs everything else: at stages 1-3 and with offload to the CPU and to a swap file, a fit of
8 steps with ``ModelCheckpoint(every_n_train_steps=2, save_top_k=2, save_last="link")`` saving in the background, then
a resume from each kept checkpoint, which must end bit-equal to the uninterrupted run (and that run equal to one
without checkpoints); a background write failing on one rank (its disk full); and the resume from what the killed
job left.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from lightning_zero import ZeroMonitor
from lightning_zero.checkpoint import saving
from lightning_zero.checkpoint.metadata import METADATA_FILE
from tests.helpers import run_on_ranks
from tests.lightning.models import TiedLM, make_loader, make_trainer, result_of, state_of

WORLD_SIZE = 2
STEPS = 8
SAMPLES = 16  # 16 samples / 2 ranks / batch 4: 2 steps an epoch, so every save ends an epoch (exact resumes)
CONFIGS: dict[str, dict[str, Any]] = {
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage3": {"stage": 3},
    "stage3_cpu": {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
    "stage2_nvme": {"stage": 2, "offload_optimizer": "nvme"},
}


def _killed_mid_write(after_saves: int) -> Any:
    """``_write`` for a job that dies while a background write of a rank file is half done (save ``after_saves + 1``):
    the file gets half its bytes, then the process is SIGKILLed, as on a node failure."""
    original, calls = saving._write, [0]

    def write(file: Path, obj: Any, sync: bool = True) -> dict[str, int]:
        if file.name.startswith("rank_"):
            calls[0] += 1
            if calls[0] > after_saves:
                torch.save(obj, file)
                os.truncate(file, file.stat().st_size // 2)
                os.kill(os.getpid(), signal.SIGKILL)
        return original(file, obj, sync)

    return write


def _slow_writes(delay_s: float) -> Any:
    """``_write`` that starts ``delay_s`` late: the training thread goes on meanwhile, so a save that wrote the live
    state instead of its snapshot would write a later step's values."""
    original = saving._write

    def write(file: Path, obj: Any, sync: bool = True) -> dict[str, int]:
        time.sleep(delay_s)
        return original(file, obj, sync)

    return write


class StagingSeen(pl.Callback):
    """The addresses of the snapshot copies a rank holds, at each step start after a save (refilled: the same)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, ...]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        staging = trainer.strategy.session.background._staging
        if staging and (not self.seen or self.seen[-1] != tuple(t.data_ptr() for t in staging)):
            self.seen.append(tuple(t.data_ptr() for t in staging))


def _strategy(config: dict[str, Any], nvme: Path) -> Any:
    from lightning_zero import ZeroStrategy

    kwargs = dict(config)
    if "nvme" in kwargs.values():
        nvme.mkdir(parents=True, exist_ok=True)
        kwargs["nvme_path"] = str(nvme)
    return ZeroStrategy(**kwargs)


def _fit(world_size: int, config: dict[str, Any], directory: Path, ckpt_path: str | None = None, **extra: Any) -> Any:
    callbacks = list(extra.pop("callbacks", []))
    plugins = []
    if extra.pop("checkpoints", True):
        every = {"every_n_train_steps": 2, "save_top_k": 2, "monitor": "step", "mode": "max"}
        callbacks.append(ModelCheckpoint(directory, save_last="link", **every))
        plugins.append(AsyncCheckpointIO())
    model = TiedLM(param_groups=True)
    trainer = make_trainer(
        world_size,
        _strategy(config, directory / "swap"),
        max_steps=STEPS,
        callbacks=callbacks,
        plugins=plugins,
        enable_checkpointing=bool(plugins),
    )
    trainer.fit(model, make_loader("tied", SAMPLES), ckpt_path=ckpt_path)
    trainer.strategy.barrier()  # rank 0 removed what ModelCheckpoint removes once fit returned there
    with trainer.strategy.gathered_params():
        return trainer, state_of(model)


def killed_job(rank: int, world_size: int, directory: str) -> None:
    saving._write = _killed_mid_write(after_saves=1)  # type: ignore[assignment]  # dies in step 4's save
    _fit(world_size, CONFIGS["stage3"], Path(directory))


def _cases(rank: int, world_size: int, root: str, killed: str) -> dict[str, Any]:
    root_dir = Path(root)
    out: dict[str, Any] = {"final": {}, "plain": {}, "kept": {}, "resumed": {}, "snapshot": {}, "logged_snapshot": {}}
    out["staging"], out["allocated"] = {}, {}
    for name, config in CONFIGS.items():
        directory = root_dir / name
        original, saving._write = saving._write, _slow_writes(0.1)  # type: ignore[assignment]
        try:
            staging = StagingSeen()
            trainer, out["final"][name] = _fit(world_size, config, directory, callbacks=[ZeroMonitor(), staging])
        finally:
            saving._write = original  # type: ignore[assignment]
        out["staging"][name] = staging.seen
        out["snapshot"][name] = trainer.strategy.session.background.peak_snapshot_bytes
        out["allocated"][name] = trainer.strategy.session.background.allocated_in_saves
        out["logged_snapshot"][name] = trainer.callback_metrics["zero/checkpoint_snapshot_bytes"].item()
        out["kept"][name] = sorted(p.name for p in directory.iterdir() if p.name != "swap")
        for kept in out["kept"][name]:
            if kept != "last.ckpt" and not kept.startswith(f"epoch={STEPS // 2 - 1}"):
                again = root_dir / f"{name}_resumed"
                out["resumed"][(name, kept)] = _fit(world_size, config, again, str(directory / kept))[1]
        if name == "stage3":
            out["plain"][name] = _fit(world_size, config, directory, checkpoints=False)[1]
    previous = Path(killed) / "epoch=0-step=2.ckpt"
    out["after_kill"] = _fit(world_size, CONFIGS["stage3"], root_dir / "after_kill", str(previous))[1]
    out["full_disk"] = _full_disk(rank, world_size, root_dir / "full_disk")
    return out


def _full_disk(rank: int, world_size: int, directory: Path) -> dict[str, Any]:
    """Rank 1's second background write fails as on a full disk: every rank must raise at the same step."""
    original, calls = saving._write, [0]

    def full(file: Path, obj: Any, sync: bool = True) -> dict[str, int]:
        if rank == 1 and file.name.startswith("rank_"):
            calls[0] += 1
            if calls[0] == 2:
                raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return original(file, obj, sync)

    saving._write = full  # type: ignore[assignment]
    trainer = None

    class Steps(pl.Callback):
        def on_train_batch_start(self, trainer_: pl.Trainer, *args: Any) -> None:
            nonlocal trainer
            trainer = trainer_

    try:
        _fit(world_size, CONFIGS["stage2"], directory, callbacks=[Steps()])
    except Exception as error:
        assert trainer is not None
        return {"error": f"{type(error).__name__}: {error}", "step": trainer.global_step, "kept": os.listdir(directory)}
    finally:
        saving._write = original  # type: ignore[assignment]
    return {"error": None}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    killed = tmp_path_factory.mktemp("killed")
    with pytest.raises(RuntimeError, match=r"died|exit|signal"):
        run_on_ranks(killed_job, WORLD_SIZE, str(killed), timeout_s=120)
    left = sorted(os.listdir(killed))
    root = tmp_path_factory.mktemp("async")
    per_rank = run_on_ranks(_cases, WORLD_SIZE, str(root), str(killed), timeout_s=600)
    return {"rank0": result_of(per_rank[0]), "ranks": per_rank, "killed_left": left, "killed": killed}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kept_checkpoints_are_complete_and_resume_bit_equal(runs: dict[str, Any], name: str) -> None:
    rank0 = runs["rank0"]
    kept = rank0["kept"][name]
    assert kept == ["epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"], kept  # save_top_k=2 removed 2 and 4
    resumed = {k: v for (n, k), v in rank0["resumed"].items() if n == name}
    assert list(resumed) == ["epoch=2-step=6.ckpt"]
    for state in resumed.values():
        for key, tensor in rank0["final"][name].items():
            assert torch.equal(state[key], tensor), f"{name}: {key} differs after resuming"
    assert rank0["snapshot"][name] > 0 if name != "stage2_nvme" else rank0["snapshot"][name] == 0
    assert rank0["logged_snapshot"][name] == rank0["snapshot"][name]  # what ZeroMonitor logs
    # Every save refilled the copies made ahead at step 2's start (nvme: written to the page cache, no copies): no
    # save allocated any in its step.
    assert len(rank0["staging"][name]) == (1 if name != "stage2_nvme" else 0), rank0["staging"][name]
    assert rank0["allocated"][name] == 0


def test_saving_in_the_background_leaves_training_unchanged(runs: dict[str, Any]) -> None:
    final, plain = runs["rank0"]["final"]["stage3"], runs["rank0"]["plain"]["stage3"]
    assert all(torch.equal(final[key], plain[key]) for key in plain)


def test_a_failed_background_write_raises_on_every_rank_at_the_same_step(runs: dict[str, Any]) -> None:
    outcomes = [ranks["full_disk"] for ranks in runs["ranks"]]
    for outcome in outcomes:
        assert outcome["error"] is not None
        assert "CheckpointError" in outcome["error"]
        assert "rank 1" in outcome["error"]
        assert "No space left on device" in outcome["error"]
        assert "rank_1.pt" in outcome["error"]
    assert outcomes[0]["step"] == outcomes[1]["step"]
    assert "epoch=0-step=2.ckpt" in outcomes[0]["kept"]  # the save before it stays
    assert not any(".tmp-" in name for name in outcomes[0]["kept"])  # the failed one left nothing


def test_a_job_killed_during_a_background_write_resumes_from_the_previous_checkpoint(runs: dict[str, Any]) -> None:
    left = runs["killed_left"]
    assert "epoch=0-step=2.ckpt" in left
    assert (runs["killed"] / "epoch=0-step=2.ckpt" / METADATA_FILE).is_file()
    assert "epoch=1-step=4.ckpt" not in left
    assert any(".tmp-" in name for name in left)  # the half-written one, never committed
    final = runs["rank0"]["final"]["stage3"]
    after = runs["rank0"]["after_kill"]
    assert all(torch.equal(after[key], final[key]) for key in final)
