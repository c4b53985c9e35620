"""Lightning's own launcher starts the ranks: ``Trainer(devices=2, strategy=ZeroStrategy(start_method=...))``.

No ``run_on_ranks`` here: the test process is the launcher's main process, as in a notebook or a script.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from lightning_zero import ZeroStrategy
from tests.helpers import free_port
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


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_lightning_launcher_trains_on_two_ranks(
    start_method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The launcher publishes MASTER_PORT in this process's environment; monkeypatch takes it back afterwards.
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    model = RecordingTwoLayer(str(tmp_path))
    initial = state_of(model)
    strategy = ZeroStrategy(stage=2, start_method=start_method)
    trainer = make_trainer(WORLD_SIZE, strategy, max_steps=STEPS, default_root_dir=str(tmp_path))
    try:
        with _deadline(TIMEOUT_S):
            trainer.fit(model, make_loader("two_layer"))
    finally:
        for proc in getattr(strategy.launcher, "procs", []):
            if proc.is_alive():
                proc.kill()

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
