"""Clean exits: N consecutive 2-rank ``Trainer.fit`` runs with spawned ranks; every process must exit with status 0
and no rank may abort in interpreter teardown ("terminate called without an active exception").

Run on demand, from the repository root::

    python benchmarks/clean_exits.py --runs 100 --out benchmarks/out/clean_exits.json
    python benchmarks/clean_exits.py --runs 100 --strategy ddp_spawn     # Lightning's DDP, for comparison

Each run is a fresh interpreter (a script in a temporary directory) that fits a small two-layer model for 3
steps on 2 CPU ranks (``ZeroStrategy(stage=..., start_method=...)``, default stage 3 and ``"spawn"``). torch's
process launcher raises in the main process when a rank ends with a signal or a non-zero status, so the main
process's status covers the ranks; its stderr is searched for an abort as well.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FIT = """
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
    trainer.fit(Model(), DataLoader(data, batch_size=4))
"""

ABORTS = ("terminate called", "Aborted", "core dumped", "Segmentation fault")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--strategy", default="zero", help="'zero' (ZeroStrategy) or a Lightning strategy name")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--start-method", default="spawn", choices=["spawn", "fork", "popen"])
    parser.add_argument("--out")
    args = parser.parse_args()
    strategy = (
        f"ZeroStrategy(stage={args.stage}, start_method={args.start_method!r})"
        if args.strategy == "zero"
        else repr(args.strategy)
    )
    # A file, not `python -c`: spawned ranks import the main module to unpickle the model's class.
    script = Path(tempfile.mkdtemp(prefix="lz-exits-")) / "fit.py"
    script.write_text(FIT.replace("{strategy}", strategy))
    failures, seconds = [], []
    for run in range(args.runs):
        start = time.monotonic()
        done = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=300)
        seconds.append(time.monotonic() - start)
        aborted = [word for word in ABORTS if word in done.stderr]
        if done.returncode != 0 or aborted:
            failure = {"run": run, "returncode": done.returncode, "aborted": aborted, "stderr": done.stderr[-2000:]}
            failures.append(failure)
            print(f"run {run}: status {done.returncode} {aborted}", flush=True)
    result = {
        "strategy": strategy,
        "runs": args.runs,
        "failures": len(failures),
        "seconds_per_run": sum(seconds) / len(seconds),
        "failed_runs": failures,
    }
    print(f"{strategy}: {args.runs} runs, {len(failures)} failed, {result['seconds_per_run']:.1f} s per run")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
