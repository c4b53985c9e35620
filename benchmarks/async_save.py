"""How long a sharded save stalls training, with Lightning's ``AsyncCheckpointIO`` against the synchronous save.

Run on demand, from the repository root (about 4 minutes with the defaults)::

    python benchmarks/async_save.py --out benchmarks/out/async_save.json
    python benchmarks/async_save.py --ranks 1 --layers 6 --steps 36 --every 6 --rounds 2   # docs/benchmarks.md

``--ranks`` gloo ranks (2) fit the same model (an MLP of ``--layers`` square ``Linear(--width)`` layers, fp32 AdamW,
``ZeroStrategy(stage=--stage)``) for ``--steps`` steps, saving a sharded checkpoint after every ``--every``-th
step, once with synchronous saves and once with ``plugins=[AsyncCheckpointIO()]`` (in that order, then again in
the other order, ``--rounds`` times), and once without saves, after ``--warmup-fits`` fits without saves that are
not counted (on a VM the first fit of a run was up to 3 s slower: memory the machine had not used lately). Measured
on rank 0, per save:

* **call**: the wall time of ``trainer.save_checkpoint`` (the synchronous save writes, flushes and commits in it;
  the asynchronous one takes its snapshot in it, or waits for the previous save first);
* **stall**: what the saves added to the training loop, per save: (loop time with saves - loop time without) /
  saves, the loop time running from the start of training to the end of the last batch. For the asynchronous save
  it includes the background writes' competition with training for the CPU, memory bandwidth and the
  interpreter's lock, and a save's wait for the previous one;
* **in-fit stall**: the same, measured inside each fit from its own step times (:func:`in_fit_stall`), so that
  the drift between fits (up to 15% of a step on a VM) drops out; the fits without saves give its noise;
* **end wait**: the time from the end of the last batch to the end of ``fit`` less the run without saves' (the
  asynchronous save's wait for its last commit, once per ``fit``; 0 for the synchronous save);
* **call CPU** (printed per round): the CPU time of rank 0's process (every thread) during each call, which does
  not depend on the machine's load as wall times do: for the asynchronous save, the snapshot (and any work of the
  worker thread meanwhile, such as the previous save's write where the call waits for it).

It also prints the checkpoint's bytes per rank and the snapshot's peak bytes per rank. On a machine with as many
cores as ranks (each rank trains on one thread), the background write takes its CPU time from training; with
``--ranks 1`` on two cores a core is left for it, as the host's cores are while a GPU trains.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_zero import ZeroStrategy
from tests.helpers import run_on_ranks


class Mlp(pl.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        return self.body(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)


class SaveEvery(pl.Callback):
    """``trainer.save_checkpoint`` after every ``every``-th step; records each call's wall time."""

    def __init__(self, every: int, directory: Path) -> None:
        self.every, self.directory, self.calls_s = every, directory, []
        self.calls_cpu_s: list[float] = []  # CPU time of the process during each call (see --help)
        self.steps_s: list[float] = []  # each step from the end of the one before (and its save) to its own end
        self.started = self.last_batch_end = 0.0

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        self.steps_s.append(now - (self.last_batch_end or self.started))  # the step, less the save before it
        if self.every and trainer.global_step % self.every == 0:
            start, cpu = time.perf_counter(), time.process_time()
            trainer.save_checkpoint(self.directory / f"step{trainer.global_step}")
            self.calls_s.append(time.perf_counter() - start)
            self.calls_cpu_s.append(time.process_time() - cpu)
        self.last_batch_end = time.perf_counter()


def fit(rank: int, world_size: int, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Mlp(args.width, args.layers)
    data = TensorDataset(torch.randn(args.steps * world_size * args.batch, args.width))
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        saver = SaveEvery(0 if mode == "none" else args.every, Path(directory))
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=ZeroStrategy(stage=args.stage),
            plugins=[AsyncCheckpointIO()] if mode == "async" else None,
            max_steps=args.steps,
            callbacks=[saver],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        start = time.perf_counter()
        trainer.fit(model, DataLoader(data, batch_size=args.batch))
        ended = time.perf_counter()
        fit_s = ended - start
        saved = sorted(Path(directory).glob("step*/rank_*.pt"))
        return {
            "fit_s": fit_s,
            "loop_s": saver.last_batch_end - saver.started,
            "end_s": ended - saver.last_batch_end,
            "calls_s": saver.calls_s,
            "calls_cpu_s": saver.calls_cpu_s,
            "steps_s": saver.steps_s,
            "rank_file_bytes": saved[0].stat().st_size if saved else 0,
            "snapshot_bytes": trainer.strategy.session.background.peak_snapshot_bytes,
        }


def in_fit_stall(steps_s: list[float], calls_s: list[float], every: int) -> tuple[float, float]:
    """The stall per save measured inside one fit, and its baseline: each save's call plus what the ``every`` steps
    after it took over ``every`` baseline steps, the baseline being the mean of the later half of those periods
    (by then the previous write had finished: it takes less than a step here). Means, not medians, as step times
    are skewed. Saves whose period is cut by the end of the fit are left out; a fit without saves (no calls) is
    measured at the steps where it would have saved, with calls of 0 (what it gives is the measure's noise)."""
    periods = [
        steps_s[g : g + every] for g in range(every, len(steps_s) - every + 1, every)
    ]  # the steps after each save (0-based: the save came after step g)
    baseline = statistics.mean(step for period in periods for step in period[every // 2 :])
    stalls = [(calls_s[i] if calls_s else 0.0) + sum(period) - every * baseline for i, period in enumerate(periods)]
    return statistics.mean(stalls), baseline


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks (1: a core is left for the writes)")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=11)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--warmup-fits", type=int, default=1, help="fits without saves run first, not counted")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: the system's tmp)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {"none": [], "sync": [], "async": []}
    for _ in range(args.warmup_fits):  # not counted: the first fit touches memory the machine has not used lately
        run_on_ranks(fit, args.ranks, args, "none", timeout_s=1800)
    for index in range(args.rounds):
        order = ["sync", "async"] if index % 2 == 0 else ["async", "sync"]
        for mode in ["none", *order]:
            result = run_on_ranks(fit, args.ranks, args, mode, timeout_s=1800)[0]
            runs[mode].append(result)
            calls = [round(c, 3) for c in result["calls_s"]]
            cpu = [round(c, 3) for c in result["calls_cpu_s"]]
            loop, end = result["loop_s"], result["end_s"]
            print(f"round {index} {mode}: fit {result['fit_s']:.2f} s (loop {loop:.2f}, end {end:.2f}), calls {calls}")
            print(f"  CPU s of rank 0's process during each call: {cpu}")
            stall, baseline = in_fit_stall(result["steps_s"], result["calls_s"], args.every)
            print(f"  in-fit stall per save {stall:.3f} s over a step of {baseline:.3f} s")
    base = statistics.median(r["loop_s"] for r in runs["none"])
    base_end = statistics.median(r["end_s"] for r in runs["none"])
    table = [
        "| save | call s (median, min-max) | stall s per save | in-fit stall s | end wait s | file MiB per rank "
        "| snapshot MiB |"
    ]
    table.append("|---|---|---|---|---|---|---|")
    summary = {}
    for mode in ("sync", "async"):
        calls = [c for r in runs[mode] for c in r["calls_s"]]
        stall = statistics.median((r["loop_s"] - base) / len(r["calls_s"]) for r in runs[mode])
        end = statistics.median(r["end_s"] for r in runs[mode]) - base_end
        in_fit = statistics.median(in_fit_stall(r["steps_s"], r["calls_s"], args.every)[0] for r in runs[mode])
        summary[mode] = {
            "call_median_s": statistics.median(calls),
            "stall_s": stall,
            "in_fit_stall_s": in_fit,
            "end_wait_s": end,
        }
        table.append(
            f"| {mode} | {statistics.median(calls):.2f} ({min(calls):.2f}-{max(calls):.2f}) | {stall:.2f} | "
            f"{in_fit:.2f} | "
            f"{end:.2f} | {runs[mode][0]['rank_file_bytes'] / 2**20:.0f} | "
            f"{runs[mode][0]['snapshot_bytes'] / 2**20:.0f} |"
        )
    ratio = summary["async"]["stall_s"] / summary["sync"]["stall_s"]
    in_fit_ratio = summary["async"]["in_fit_stall_s"] / summary["sync"]["in_fit_stall_s"]
    noise = statistics.median(in_fit_stall(r["steps_s"], [], args.every)[0] for r in runs["none"])
    print("\n".join(table))
    print(f"loop without saves: {base:.2f} s; async stall / sync stall = {ratio:.3f}")
    print(f"in-fit: async / sync = {in_fit_ratio:.3f}; the same measure in the fits without saves: {noise:.3f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
