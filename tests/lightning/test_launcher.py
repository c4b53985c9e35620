"""Lightning's own launcher starts the ranks: ``Trainer(devices=2, strategy=ZeroStrategy(start_method=...))``.

No ``run_on_ranks`` here: the test process is the launcher's main process, as in a notebook or a script.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from lightning_zero import ZeroStrategy
from tests.helpers import free_port, run_on_ranks
from tests.lightning.models import RecordingTwoLayer, make_loader, make_trainer, max_rel_diff, state_of

WORLD_SIZE = 2
STEPS = 4
TIMEOUT_S = 120


@contextlib.contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    """Fail instead of hanging the whole suite if the launched ranks never finish."""

    def on_alarm(signum: int, frame: object) -> None:
        raise TimeoutError(f"the launched ranks did not finish within {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _launch_fit(model: pl.LightningModule, strategy: ZeroStrategy, tmp_path: Path, **trainer_kwargs: Any) -> pl.Trainer:
    """``trainer.fit`` with Lightning's launcher starting the ranks; a hang fails, and no rank outlives the test."""
    trainer = make_trainer(WORLD_SIZE, strategy, max_steps=STEPS, default_root_dir=str(tmp_path), **trainer_kwargs)
    try:
        with _deadline(TIMEOUT_S):
            trainer.fit(model, make_loader("two_layer"))
    finally:
        for proc in getattr(strategy.launcher, "procs", []):
            if proc.is_alive():
                proc.kill()
    return trainer


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_lightning_launcher_trains_on_two_ranks(
    start_method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The launcher publishes MASTER_PORT in this process's environment; monkeypatch takes it back afterwards.
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    model = RecordingTwoLayer(str(tmp_path))
    initial = state_of(model)
    trainer = _launch_fit(model, ZeroStrategy(stage=2, start_method=start_method), tmp_path)

    assert trainer.state.fn == TrainerFn.FITTING
    assert trainer.state.status == TrainerStatus.FINISHED
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]
    for rank, record in enumerate(ranks):
        assert record["global_rank"] == rank
        assert record["world_size"] == WORLD_SIZE
        assert record["global_step"] == STEPS
        assert max(max_rel_diff(ranks[0]["state"], record["state"]).values()) == 0.0, f"rank {rank} differs"
    # The launcher hands rank 0's trained weights back to the model in this process.
    assert max(max_rel_diff(ranks[0]["state"], state_of(model)).values()) == 0.0
    assert min(max_rel_diff(initial, state_of(model)).values()) > 1e-4, "training did not change the weights"


class RecordingMasters(RecordingTwoLayer):
    """Writes the full weights a rank holds at the end of training, gathered with the fp32 masters (stage 3 keeps
    only shards in the module, bf16-mixed only rounded parameters)."""

    def on_train_end(self) -> None:
        state = self.trainer.strategy._engine.full_state_dict(keep=True)  # collective: every rank is here
        torch.save({"state": state}, f"{self.out_dir}/rank{self.global_rank}.pt")


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_launcher_returns_the_fp32_masters_of_a_stage3_bf16_run(
    start_method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lightning's launcher sends module.state_dict() back: at stage 3 freed shards (a crash in the main process
    # before), in 16-bit runs the rounded parameters. ZeroStrategy's sends the gathered fp32 masters.
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    model = RecordingMasters(str(tmp_path))
    trainer = _launch_fit(model, ZeroStrategy(stage=3, start_method=start_method), tmp_path, precision="bf16-mixed")

    assert trainer.state.status == TrainerStatus.FINISHED
    masters = torch.load(tmp_path / "rank0.pt", weights_only=False)["state"]
    returned = state_of(model)
    assert all(value.dtype == torch.float32 for value in returned.values())
    assert max(max_rel_diff(masters, returned).values()) == 0.0
    # fp32 values that bf16 cannot hold: the masters, not the rounded parameters, came back.
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in returned.values())


def _wrapped_run_destroys_the_group(rank: int, world_size: int) -> dict[str, bool]:
    import queue

    import torch.distributed as dist

    from lightning_zero.launcher import ZeroMultiProcessingLauncher

    strategy = ZeroStrategy(stage=2)
    strategy.parallel_devices = [torch.device("cpu")]
    launcher = ZeroMultiProcessingLauncher(strategy, start_method="spawn")
    before = dist.is_initialized()
    launcher._wrapping_function(0, None, lambda: "done", (), {}, queue.Queue())
    return {"before": before, "after": dist.is_initialized()}


def test_a_rank_that_finished_destroys_its_process_group_before_exit() -> None:
    """Lightning's spawn/fork worker returns with the gloo group alive; a rank exiting so may abort in interpreter
    teardown ("terminate called without an active exception"). The launcher's worker destroys it first."""
    (result,) = run_on_ranks(_wrapped_run_destroys_the_group, 1)
    assert result == {"before": True, "after": False}
