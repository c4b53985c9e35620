"""Step time of a compiled GPT against the eager one, under DDP and ZeroStrategy stages 1-3 (docs/compile.md).

The model is ``examples/gpt.py``'s ``GPT``, built in ``__init__`` (every run starts from the same weights) and
compiled in ``configure_model`` as docs/compile.md recommends: ``torch.compile(block)`` for each block (``blocks``)
or ``model.compile()`` of the whole GPT (``model``). Each run is one ``Trainer.fit`` of ``--steps`` optimizer steps on
2 gloo ranks (one thread each) with AdamW; a callback times each training batch (forward, backward, reductions and
the step) on every rank, and a step's time is the slowest rank's. The first ``--warmup`` steps (compilation) are
left out of min/median and reported apart. Also reported per compiled run: the graphs dynamo compiled after the
warm-up steps and its guard failures (recompilations; both must be 0), and the largest relative difference of the
final parameters from the eager run of the same system (inductor reorders floating-point sums) and from DDP's run
with the same compiled model (what ZeRO must match). Run on demand::

    PYTHONPATH=. python benchmarks/compile_step.py --modes eager,blocks,model --rounds 2 \
        --json benchmarks/out/compile_step.json                         # inductor; docs/compile.md's table
    PYTHONPATH=. python benchmarks/compile_step.py --systems zero3 --backend aot_eager --steps 5

Inductor's first compile of a process builds C++ (about a minute on 2 busy cores); its cache
(``TORCHINDUCTOR_CACHE_DIR``, by default under /tmp) makes later compiles quick, so the warm-up column depends on what
ran before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # for `tests.helpers` and `examples.gpt` (also in the spawned ranks)
    sys.path.insert(0, str(REPO))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from examples.gpt import GPT, GPTConfig  # noqa: E402
from tests.helpers import run_on_ranks  # noqa: E402

SYSTEMS = ("ddp", "zero1", "zero2", "zero3")
MODES = ("eager", "blocks", "model")


class CompiledGPT(pl.LightningModule):
    def __init__(self, cfg: GPTConfig, mode: str, backend: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT(cfg)
        self.mode, self.backend = mode, backend
        self.compiled = False

    def configure_model(self) -> None:
        if self.compiled or self.mode == "eager":
            return
        self.compiled = True
        if self.mode == "blocks":
            for i, block in enumerate(self.gpt.blocks):
                self.gpt.blocks[i] = torch.compile(block, backend=self.backend)
        else:
            self.gpt.compile(backend=self.backend)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.gpt(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)


class StepTimer(pl.Callback):
    """Seconds of each training batch, and dynamo's compiled-graph count after each."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.graphs: list[int] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)
        from torch._dynamo.utils import counters

        self.graphs.append(counters["stats"]["unique_graphs"])


def _strategy(system: str) -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeroStrategy

    return DDPStrategy() if system == "ddp" else ZeroStrategy(stage=int(system.removeprefix("zero")))


def _fit(world_size: int, args: argparse.Namespace, system: str, mode: str) -> dict[str, Any]:
    from torch._dynamo.utils import counters, guard_failures

    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = args.optimize_ddp
    counters.clear()
    cfg = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = CompiledGPT(cfg, mode, args.backend)
    timer = StepTimer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=_strategy(system),
        max_steps=args.warmup + args.steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    generator = torch.Generator().manual_seed(1)
    samples = world_size * args.batch_size * (args.warmup + args.steps)
    tokens = torch.randint(0, cfg.vocab_size, (samples, args.block_size + 1), generator=generator)
    trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch_size))
    strategy = trainer.strategy
    gathered = strategy.gathered_params() if hasattr(strategy, "gathered_params") else _nothing()
    with gathered:
        state = {k.replace("_orig_mod.", ""): v.detach().clone() for k, v in model.gpt.state_dict().items()}
    return {
        "times": timer.times,
        "late_graphs": timer.graphs[-1] - timer.graphs[args.warmup - 1],
        "graphs": timer.graphs[-1],
        "guard_failures": sum(len(reasons) for reasons in guard_failures.values()),
        "state": state,
    }


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[Any, Any]:
    """Every (system, mode) run, ``--rounds`` times in turn (so that the load of the machine spreads over all)."""
    warnings.filterwarnings("ignore")
    out: dict[Any, Any] = {}
    for _ in range(args.rounds):
        for system in args.systems:
            for mode in args.modes:
                run = _fit(world_size, args, system, mode)
                out.setdefault((system, mode), []).append(run)
    return out


def _rel_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)).item() for k in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS), type=lambda s: s.split(","))
    parser.add_argument("--modes", default="eager,blocks,model", type=lambda s: s.split(","), help=f"of {MODES}")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps (compilation)")
    parser.add_argument("--rounds", type=int, default=1, help="fits of each (system, mode), taken in turn")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--no-optimize-ddp",
        dest="optimize_ddp",
        action="store_false",
        help="keep dynamo from splitting a graph compiled under DDP at its buckets (torch._dynamo.config.optimize_ddp)",
    )
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    start = time.perf_counter()
    ranks = run_on_ranks(_rank, 2, args, timeout_s=3600)
    rows = []
    for system in args.systems:
        for mode in args.modes:
            runs = [run for r in ranks for run in r[system, mode]]
            steps, timed = [], []
            for round_runs in zip(*(r[system, mode] for r in ranks), strict=True):  # each round, every rank
                times = [max(t) for t in zip(*(run["times"] for run in round_runs), strict=True)]  # slowest rank
                steps.append(times)
                timed += times[args.warmup :]
            row = {
                "system": system,
                "mode": mode,
                "min_ms": 1e3 * min(timed),
                "median_ms": 1e3 * statistics.median(timed),
                "warmup_s": max(sum(times[: args.warmup]) for times in steps),
                "graphs": max(run["graphs"] for run in runs),
                "late_graphs": max(run["late_graphs"] for run in runs),
                "guard_failures": max(run["guard_failures"] for run in runs),
            }
            if mode != "eager" and "eager" in args.modes:
                row["vs_eager_rel"] = max(
                    _rel_diff(r[system, "eager"][-1]["state"], r[system, mode][-1]["state"]) for r in ranks
                )
            if system != "ddp" and "ddp" in args.systems:
                row["vs_ddp_rel"] = max(
                    _rel_diff(r["ddp", mode][-1]["state"], r[system, mode][-1]["state"]) for r in ranks
                )
            rows.append(row)
    print(
        f"\n{args.backend}, GPT n_layer={args.n_layer} n_embd={args.n_embd} block={args.block_size} "
        f"batch={args.batch_size}, 2 gloo ranks x 1 thread; {args.rounds} x {args.steps} timed steps (after "
        f"{args.warmup} warm-up steps each)"
    )
    print(
        f"{'system':7} {'mode':7} {'min ms':>8} {'median ms':>10} {'max warm-up s':>13} {'graphs':>7} {'late':>5} "
        f"{'guard fail':>10} {'vs eager':>9}"
    )
    for r in rows:
        vs = f"{r['vs_eager_rel']:.1e}" if "vs_eager_rel" in r else "-"
        vs_ddp = f"{r['vs_ddp_rel']:.1e}" if "vs_ddp_rel" in r else "-"
        print(
            f"{r['system']:7} {r['mode']:7} {r['min_ms']:8.1f} {r['median_ms']:10.1f} {r['warmup_s']:13.1f} "
            f"{r['graphs']:7d} {r['late_graphs']:5d} {r['guard_failures']:10d} {vs:>9} {vs_ddp:>9}"
        )
    print(f"({time.perf_counter() - start:.0f} s in all)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
