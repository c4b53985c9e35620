"""A rank SIGKILLed in the middle of a 2-rank ZeRO-3 fit: the run ends (non-zero, no process left behind, within
seconds), and resuming from the last epoch's sharded checkpoint ends with parameters bit-equal to the
uninterrupted run's (same world size and stage)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "lightning" / "kill_resume.py"


def _processes_running(argument: str) -> list[int]:
    """Processes whose command line holds ``argument`` (from /proc: no external tool needed)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if argument.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:  # the process ended meanwhile
            continue
    return found


def _run(out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), *extra], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    return result, time.monotonic() - start


def test_kill_then_resume_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    uninterrupted, _ = _run(tmp_path / "whole")
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]

    killed, _ = _run(tmp_path / "killed", "--kill-at", "6")  # in the second epoch (4 steps each)
    assert killed.returncode != 0
    assert "RankLostError" in killed.stderr, killed.stderr[-3000:]
    assert not (tmp_path / "killed" / "final.pt").exists()
    assert not _processes_running(str(tmp_path / "killed")), "a rank was left behind"

    checkpoint = tmp_path / "killed" / "epoch0.ckpt"
    assert checkpoint.is_dir()  # sharded, saved the epoch before the kill
    resumed, _ = _run(tmp_path / "killed", "--resume", str(checkpoint))
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    whole = torch.load(tmp_path / "whole" / "final.pt", weights_only=True)
    again = torch.load(tmp_path / "killed" / "final.pt", weights_only=True)
    assert whole["global_step"] == again["global_step"] == 12
    for key, value in whole["state"].items():
        assert torch.equal(value, again["state"][key]), key
