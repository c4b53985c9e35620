"""examples/fabric_gpt.py trains on 2 CPU processes at stage 3, saves sharded ``step-N`` checkpoints, and a run resumed
from one (under torchrun) continues at the saved step with the losses the first run had there."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--steps=6",
    "--save_every=3",
    "--log_every=1",
    "--block_size=32",
    "--n_embd=32",
    "--batch_size=4",
    "--lr=1e-2",
    "--warmup_steps=2",
]
DOC = ROOT / "docs" / "fabric.md"  # its quick start runs the commands of the test
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)", re.MULTILINE)


def _run(launcher: list[str], out_dir: Path, *extra: str) -> tuple[str, dict[int, float]]:
    command = [*launcher, "examples/fabric_gpt.py", *TINY, f"--out_dir={out_dir}", *extra]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout, {int(step): float(loss) for step, loss in STEP_LINE.findall(result.stdout)}


def test_example_trains_saves_and_resumes_where_it_stopped(tmp_path: Path) -> None:
    # Fabric's launcher starts the second process.
    _, losses = _run([sys.executable], tmp_path / "first")
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert losses[1] > 5.0  # byte-level: about ln(256) = 5.55 at the start
    assert losses[6] < losses[1] - 0.5, losses
    for step in (3, 6):
        checkpoint = tmp_path / "first" / f"step-{step:06d}"
        assert (checkpoint / "metadata.json").is_file(), checkpoint  # stage 3: a sharded directory
        assert sorted(p.name for p in checkpoint.glob("rank_*.pt")) == ["rank_0.pt", "rank_1.pt"]

    # torchrun starts both processes; the run resumes from step 3 and takes steps 4 to 6 on the same data.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    resume = tmp_path / "first" / "step-000003"
    stdout, resumed = _run(torchrun, tmp_path / "second", f"--resume={resume}")
    assert f"resumed from {resume} at step 3" in stdout
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):  # same model, optimizer, schedule and batches: the same losses (printed to 1e-6)
        assert abs(resumed[step] - losses[step]) <= 2e-6, (step, resumed[step], losses[step])
    assert (tmp_path / "second" / "step-000006" / "metadata.json").is_file()


def test_the_quick_start_of_docs_fabric_is_the_command_tested_here() -> None:
    text = DOC.read_text()
    tiny = " ".join(TINY)
    assert f"python examples/fabric_gpt.py {tiny} --out_dir=out/fabric_gpt\n" in text
    resume = "--out_dir=out/fabric_gpt_resumed --resume=out/fabric_gpt/step-000003"
    assert f"torchrun --nproc-per-node=2 examples/fabric_gpt.py {tiny} {resume}\n" in text
