"""Soak: the example GPT at ZeRO-3 for 1,000 steps on 2 gloo ranks; resident memory, bytes moved and the number of
hooks per step, and the slope of RSS after warm-up (issue: long runs stay flat).

Run on demand, from the repository root::

    python benchmarks/soak.py --steps 1000 --out benchmarks/out/soak.json
    python benchmarks/soak.py --steps 1000 --fits 3 --out benchmarks/out/soak_fits.json   # three fits, one engine
    python benchmarks/soak.py --steps 200 --lightning-fits 3 --variant mmap64k   # one Trainer, three trainer.fit

Each rank drives :class:`~lightning_zero.core.engine.ZeroEngine` in a plain loop (the loop Lightning's glue runs:
``begin_iteration``, ``scale_loss``, backward, ``finish_backward``, step, ``reshard_all``) on the example GPT
(``examples/gpt.py``, default 4 layers x 128 wide, bytes of the tiny corpus). After every step it records its RSS
(``/proc/self/statm``), the step's bytes moved (``engine.last_step_comm``), the stage-3 scheduler's live gradient
hooks and the module's forward hooks. The slope is a least-squares line through RSS after ``--warmup`` steps,
in KiB per 1,000 steps; it is reported with and without ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc otherwise keeps
freed blocks resident, see docs/benchmarks.md). ``--fits N`` runs N "fits" of ``--steps`` each on one engine,
with ``remove_hooks``/``register_hooks`` between them as the strategy's teardown and next setup do.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def slope_kib_per_1000(values: list[int]) -> float:
    """Least-squares slope of ``values`` (bytes, one per step) in KiB per 1,000 steps."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values))
    den = sum((x - mean_x) ** 2 for x in range(n))
    return num / den * 1000 / 1024


def rank_loop(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch import nn

    from examples.gpt import GPT, Block, GPTConfig
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    engine = ZeroEngine(model, [optimizer], EngineOptions(stage=3, wrap_policy={Block}), Communicator())
    data = torch.tensor(list((REPO / "examples" / "data" / "tiny_corpus.txt").read_bytes()), dtype=torch.long)
    generator = torch.Generator().manual_seed(rank)
    records: dict[str, list[int]] = {"rss": [], "comm": [], "grad_hooks": [], "forward_hooks": []}
    for fit in range(args.fits):
        if fit:
            engine.backward.remove_hooks()  # the strategy's teardown
            engine.backward.register_hooks()  # the next setup
        for _ in range(args.steps):
            starts = torch.randint(0, len(data) - cfg.block_size - 1, (args.batch_size,), generator=generator)
            x = torch.stack([data[s : s + cfg.block_size] for s in starts])
            y = torch.stack([data[s + 1 : s + cfg.block_size + 1] for s in starts])
            engine.begin_iteration()
            optimizer.zero_grad()
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            engine.scale_loss(loss).backward()
            engine.finish_backward()
            optimizer.step()
            engine.model.scheduler.reshard_all()
            records["rss"].append(rss_bytes())
            records["comm"].append(engine.last_step_comm.nbytes)
            assert engine.model.scheduler is not None
            records["grad_hooks"].append(len(engine.model.scheduler.grad_hooks))
            hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
            records["forward_hooks"].append(hooks)
    return {"records": records, "params": sum(p.numel() for p in model.parameters()), "loss": float(loss)}


def lightning_fits(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """``--lightning-fits N``: one ``Trainer`` (ZeroStrategy stage 3) fits the example GPT N times, ``--steps`` more
    steps each time (``trainer.fit`` again with a larger ``max_steps``); RSS after each fit (after ``gc.collect``),
    and whether the first fit's engine is still alive at the end."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from examples.gpt import ByteWindows, GPTLightningModule
    from lightning_zero import ZeroStrategy

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.rss: list[int] = []

        def on_train_batch_end(self, *unused: Any) -> None:
            self.rss.append(rss_bytes())

    pl.seed_everything(0)
    data = torch.tensor(list((REPO / "examples" / "data" / "tiny_corpus.txt").read_bytes()), dtype=torch.long)
    loader = DataLoader(ByteWindows(data, 64, stride=8), batch_size=args.batch_size)
    model = GPTLightningModule(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, warmup_steps=1)
    record = Record()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ZeroStrategy(stage=3),
        max_steps=args.steps,
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    after_fit = []
    first_engine = None
    for fit in range(args.lightning_fits):
        trainer.fit_loop.epoch_loop.max_steps = args.steps * (fit + 1)
        trainer.fit(model, loader)
        gc.collect()  # what an earlier fit left in reference cycles is not counted as kept
        after_fit.append(rss_bytes())
        if fit == 0 and trainer.strategy._engine is not None:  # no local name for it: that would keep it alive
            first_engine = weakref.ref(trainer.strategy._engine)
    alive = first_engine is not None and first_engine() is not None and first_engine() is not trainer.strategy._engine
    return {
        "after_fit_mib": [v / 2**20 for v in after_fit],
        "steps": len(record.rss),
        "last_step_mib": record.rss[-1] / 2**20,
        "first_fit_engine_alive": alive,
    }


def summarize(per_rank: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"params": per_rank[0]["params"], "final_loss": per_rank[0]["loss"], "ranks": []}
    per_fit = args.steps
    for result in per_rank:
        records = result["records"]
        rss = records["rss"]
        fits = [rss[i * per_fit : (i + 1) * per_fit] for i in range(args.fits)]
        out["ranks"].append(
            {
                "rss_mib_after_warmup": rss[args.warmup] / 2**20,
                "rss_mib_last": rss[-1] / 2**20,
                "slope_kib_per_1000_steps": slope_kib_per_1000(rss[args.warmup :]),
                "rss_mib_end_of_each_fit": [f[-1] / 2**20 for f in fits],
                "comm_bytes_per_step_distinct": sorted(set(records["comm"][1:])),
                "grad_hooks_max": max(records["grad_hooks"]),
                "grad_hooks_last": records["grad_hooks"][-1],
                "forward_hooks_distinct": sorted(set(records["forward_hooks"])),
                "rss_every_50_steps_mib": [round(v / 2**20, 2) for v in rss[::50]],
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--fits", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--variant", choices=["as-is", "mmap64k", "both"], default="both")
    parser.add_argument("--lightning-fits", type=int, default=0, help="instead: one Trainer fits N times")
    parser.add_argument("--out")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        from tests.helpers import run_on_ranks

        if args.lightning_fits:
            print(json.dumps(run_on_ranks(lightning_fits, 2, args, init_group=False)))
        else:
            print(json.dumps(summarize(run_on_ranks(rank_loop, 2, args), args)))
        return
    results = {}
    variants = ["as-is", "mmap64k"] if args.variant == "both" else [args.variant]
    for variant in variants:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        if variant == "mmap64k":
            env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        command = [sys.executable, __file__, "--child", *sys.argv[1:]]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
        if args.lightning_fits:
            for rank, r in enumerate(results[variant]):
                print(f"{variant:8s} rank {rank}: RSS after each fit {[round(v, 2) for v in r['after_fit_mib']]} MiB")
            continue
        for rank, r in enumerate(results[variant]["ranks"]):
            print(
                f"{variant:8s} rank {rank}: RSS {r['rss_mib_after_warmup']:.1f} -> {r['rss_mib_last']:.1f} MiB, slope "
                f"{r['slope_kib_per_1000_steps']:+.1f} KiB/1000 steps, end of each fit {r['rss_mib_end_of_each_fit']}, "
                f"bytes/step {r['comm_bytes_per_step_distinct']}, grad hooks max {r['grad_hooks_max']}, forward "
                f"hooks {r['forward_hooks_distinct']}"
            )
    results["args"] = vars(args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
