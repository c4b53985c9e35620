"""Clean exits: N consecutive 2-rank ``Trainer.fit`` runs; every process must exit with status 0 and no rank may
abort in interpreter teardown ("terminate called without an active exception").

Run on demand, from the repository root::

    python benchmarks/clean_exits.py --runs 100 --out benchmarks/out/clean_exits.json
    python benchmarks/clean_exits.py --runs 100 --strategy ddp_spawn     # Lightning's DDP, for comparison
    python benchmarks/clean_exits.py --runs 30 --start-method popen      # Lightning's script launcher
    python benchmarks/clean_exits.py --runs 30 --start-method popen --after-fit gather
    python benchmarks/clean_exits.py --runs 30 --start-method popen --after-fit gather --strategy ddp
    python benchmarks/clean_exits.py --runs 10 --torchrun --after-fit gather  # ranks started by torchrun

Each run is a fresh interpreter (a script in a temporary directory) that fits a small two-layer model for 3
steps on 2 CPU ranks (``ZeroStrategy(stage=..., start_method=...)``, default stage 3 and ``"spawn"``). Every
rank's stderr is searched for an abort, and every rank's exit status is checked:

- ``spawn``/``fork``: torch's process launcher raises in the main process when a rank ends with a signal or a
  non-zero status, so the main process's status covers the ranks.
- ``popen``: the script is rank 0 and Lightning starts it again (``subprocess.Popen``) as rank 1, which nobody waits
  for: it may outlive rank 0. This process makes itself the child subreaper (Linux), so rank 1 becomes its child
  when rank 0 ends, and its status is read here (a status rank 0 reaped itself is printed by the script).
- ``--torchrun``: ``torch.distributed.run`` waits for both ranks and fails when one does.

``--after-fit gather`` (popen, torchrun: ranks that run the script) reads the full weights after ``fit``, as a
script that saves them does: ``gathered_params()`` for ZeroStrategy, an all-reduce of a copy of each parameter for
another strategy. Collectives right before the interpreter ends are what made ranks abort (see [Note: groups alive
at exit] in lightning_zero/core/comm/groups.py); without them the window is rarely hit.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FIT = """
import sys
import lightning.pytorch as pl, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning_zero import ZeroStrategy

class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

if __name__ == "__main__":
    strategy = {strategy}
    data = TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = Model()
    trainer.fit(model, DataLoader(data, batch_size=4))
    {after_fit}
    for proc in getattr(trainer.strategy.launcher, "procs", []):  # popen: the statuses rank 0 reaped itself
        if getattr(proc, "returncode", None) is not None:  # (spawn/fork: processes torch's launcher waited for)
            print(f"CHILD_STATUS {proc.returncode}", file=sys.stderr)
"""

AFTER_FIT = {
    "none": "pass",
    "zero": "with trainer.strategy.gathered_params(): state = {k: v.clone() for k, v in model.state_dict().items()}",
    "other": "state = [torch.distributed.all_reduce(p.detach().clone()) for p in model.parameters()]",
}
ABORTS = ("terminate called", "Aborted", "core dumped", "Segmentation fault")
_PR_SET_CHILD_SUBREAPER = 36


def _adopt_orphans() -> None:
    """Make this process the child subreaper: a rank whose parent (rank 0) ended becomes this process's child."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed: --start-method popen needs Linux")


def _orphan_statuses(deadline_s: float) -> list[int]:
    """Exit statuses of the ranks that outlived their parent (signals as negative numbers, as subprocess has
    them); a rank still running after ``deadline_s`` fails the benchmark."""
    statuses, end = [], time.monotonic() + deadline_s
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return statuses
        if pid == 0:
            if time.monotonic() > end:
                raise TimeoutError(f"a rank outlived its launcher by {deadline_s} s (a hang at exit)")
            time.sleep(0.05)
            continue
        statuses.append(os.waitstatus_to_exitcode(status))


def _run_once(command: list[str]) -> tuple[list[int], str]:
    """Exit statuses of every rank process of one run (the main process's first) and their shared stderr."""
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    statuses = [done.returncode, *_orphan_statuses(60)]
    statuses += [int(line.split()[1]) for line in done.stderr.splitlines() if line.startswith("CHILD_STATUS ")]
    return statuses, done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--strategy", default="zero", help="'zero' (ZeroStrategy) or a Lightning strategy name")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--start-method", default="spawn", choices=["spawn", "fork", "popen"])
    parser.add_argument("--torchrun", action="store_true", help="ranks started by torch.distributed.run (popen)")
    parser.add_argument("--after-fit", choices=["none", "gather"], default="none", help="collectives after fit")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.torchrun:  # the ranks exist already: Lightning's script launcher only joins them
        args.start_method = "popen"
    strategy = (
        f"ZeroStrategy(stage={args.stage}, start_method={args.start_method!r})"
        if args.strategy == "zero"
        else repr(args.strategy)
    )
    if args.after_fit == "gather" and not (args.torchrun or args.start_method == "popen"):
        parser.error("--after-fit gather needs ranks that run the script: --start-method popen or --torchrun")
    after_fit = AFTER_FIT["none" if args.after_fit == "none" else "zero" if args.strategy == "zero" else "other"]
    # A file, not `python -c`: spawned ranks import the main module to unpickle the model's class.
    script = Path(tempfile.mkdtemp(prefix="lz-exits-")) / "fit.py"
    script.write_text(FIT.replace("{strategy}", strategy).replace("{after_fit}", after_fit))
    command = [sys.executable, str(script)]
    if args.torchrun:
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    _adopt_orphans()
    failures, seconds, processes = [], [], 0
    for run in range(args.runs):
        start = time.monotonic()
        statuses, stderr = _run_once(command)
        seconds.append(time.monotonic() - start)
        processes += len(statuses)
        aborted = [word for word in ABORTS if word in stderr]
        if any(statuses) or aborted:
            failure = {"run": run, "statuses": statuses, "aborted": aborted, "stderr": stderr[-2000:]}
            failures.append(failure)
            print(f"run {run}: statuses {statuses} {aborted}", flush=True)
    result = {
        "strategy": strategy,
        "launcher": "torchrun" if args.torchrun else args.start_method,
        "after_fit": args.after_fit,
        "processes_checked": processes,
        "runs": args.runs,
        "failures": len(failures),
        "seconds_per_run": sum(seconds) / len(seconds),
        "failed_runs": failures,
    }
    print(
        f"{strategy} ({result['launcher']}, after fit: {args.after_fit}): {args.runs} runs, {len(failures)} failed, "
        f"{processes} process statuses checked, {result['seconds_per_run']:.1f} s per run"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
