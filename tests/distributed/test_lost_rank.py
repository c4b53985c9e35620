"""A rank that is killed, or stops, mid-training: the other rank raises within seconds (lost) or right after the
process group's timeout (hung), with an error that says so and names the collective it was in (see [Note: lost and
hung ranks]), and exits non-zero; no process is left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import free_port

TRAIN = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    rank, port, fault, stage = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=6)
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [optimizer], EngineOptions(stage=stage), Communicator())
    started = None
    try:
        for step in range(4):
            if step == 2 and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            if step == 2:
                started = time.monotonic()
            optimizer.zero_grad()
            model(torch.randn(8, 64)).square().mean().backward()
            engine.finish_backward()
            optimizer.step()
    except Exception as error:
        print(json.dumps({"type": type(error).__name__, "message": str(error), "seconds": time.monotonic() - started}))
        sys.exit(1)
    print(json.dumps({"type": None}))
    """
)


@pytest.mark.parametrize(("fault", "stage"), [("kill", 2), ("kill", 3), ("stop", 3)])
def test_the_surviving_rank_raises_a_clear_error_and_exits(fault: str, stage: int) -> None:
    repo = Path(__file__).resolve().parents[2]
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(repo)}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", TRAIN, str(rank), port, fault, str(stage)],
            cwd=repo,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        out, err = ranks[0].communicate(timeout=120)
    finally:
        time.sleep(0.1)
        for process in ranks:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)
    assert ranks[0].returncode == 1, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    if fault == "kill":
        assert result["type"] == "RankLostError", result
        assert re.search(r"lost another rank during an? (all-reduce|all-gather|reduce-scatter) of", result["message"])
        assert result["seconds"] < 5, result  # not the 6 s timeout
    else:
        assert result["type"] == "RankTimeoutError", result
        assert "longer than the process group's timeout" in result["message"], result
        assert 5 < result["seconds"] < 30, result
    assert "rank 0 " in result["message"], result
    assert " bytes " in result["message"], result  # names the collective and its size
