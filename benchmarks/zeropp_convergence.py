"""Convergence with ZeRO++'s options: the example GPT trained by flat stage 3 and by each option, loss per step.

Run on demand, from the repository root (about 10 minutes with the defaults on 2 cores)::

    python benchmarks/zeropp_convergence.py --out benchmarks/out/zeropp_convergence.json \
        --plot docs/img/zeropp_convergence.png

Four gloo ranks, numbered as 2 nodes x 2 ranks (``LOCAL_WORLD_SIZE=2`` on one machine's loopback: the options'
arithmetic depends on which ranks share a node, not on the link), train each system of
``zero_bench.hybrid.ZEROPP_SYSTEMS`` and plain flat stage 3 (``zero3``) from the same seed on the same batches (the
example's corpus, a fixed stream per rank), fp32 AdamW, ``--steps`` steps each. The loss of a step is the mean of
the 4 ranks' losses. The table gives each system's mean loss over the last ``--tail`` steps and its relative
difference to plain stage 3's (goal: within 1%); the plot draws the curves (a moving mean of ``--smooth`` steps).
``zero3_hybrid`` (hybrid sharding, the same maths summed in another order) shows how far last-bit differences
alone move the curve: a tiny model on few steps amplifies them. ``zero3_bf16`` (on request: stage 3 computing under
bf16 autocast, as ``precision="bf16-mixed"`` does) shows how far a rounding that users accept moves it.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from zero_bench.hybrid import (  # importing zero_bench puts the root on sys.path
    QG_VARIANTS,
    ZEROPP_SYSTEMS,
    build_hybrid_system,
)
from zero_bench.measure import batch_stream, model_config
from zero_bench.systems import lm_loss

from examples.gpt import DEFAULT_DATA, count_params, warmup_cosine
from tests.helpers import run_on_ranks

NODES, PER_NODE = 2, 2
# zero3_hybrid does the same maths as zero3 with the gradients summed in another order (inside each node, then
# across): its distance to zero3 is what last-bit differences alone do to a curve, the scale to read the others by.
SYSTEMS = ("zero3", "zero3_hybrid", *ZEROPP_SYSTEMS)
# zero3 computing under bf16 autocast (bf16-mixed: fp32 masters, exact reductions): how far a rounding that users
# accept moves the curve, a scale for the options' own rounding (on request)
BF16_REFERENCE = "zero3_bf16"


def train(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every system in turn on this rank; the mean loss of the ranks at each step, per system."""
    torch.set_num_threads(1)
    cfg = model_config(args)
    curves: dict[str, list[float]] = {}
    for name in args.systems:
        autocast = name == BF16_REFERENCE
        system = build_hybrid_system("zero3" if autocast else name, cfg, args)
        batches = batch_stream(args, rank)
        losses = []
        schedule = None
        if args.warmup:  # the example's: linear warmup, then cosine decay to 0.1 of the lr at the last step
            lr_lambda = partial(warmup_cosine, warmup=args.warmup, total=args.steps)
            schedule = torch.optim.lr_scheduler.LambdaLR(system.optimizer, lr_lambda)
        for _ in range(args.steps):
            x, y = next(batches)
            system.engine.begin_iteration()
            system.optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = lm_loss(system.model, x, y)
            loss.backward()
            system.engine.finish_backward()
            system.engine.step_of(system.optimizer).prepare()
            system.optimizer.step()
            if schedule is not None:
                schedule.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world_size)
        curves[name] = losses
        del system
    return {"curves": curves, "numel": count_params(cfg)}


def _moving_mean(values: list[float], width: int) -> list[float]:
    return [sum(values[max(0, i - width + 1) : i + 1]) / (i + 1 - max(0, i - width + 1)) for i in range(len(values))]


def plot(curves: dict[str, list[float]], smooth: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        axis.plot(range(1, len(losses) + 1), _moving_mean(losses, smooth), label=name, linewidth=1.2)
    axis.set_xlabel("step")
    axis.set_ylabel(f"training loss (moving mean of {smooth})")
    axis.set_title("ZeRO++ options against flat stage 3 (2 nodes x 2 ranks, fp32 AdamW)")
    axis.legend()
    axis.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, zero3 first")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tail", type=int, default=50, help="steps whose mean loss the table compares")
    parser.add_argument("--smooth", type=int, default=10, help="the plot's moving mean")
    parser.add_argument("--params", type=float, default=2e6, help="the GPT's parameter count, about")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="steps of linear warmup, then cosine decay to 0.1 x lr at the last step, as examples/gpt.py trains "
        "(its defaults: --warmup 10 --lr 3e-3); 0: a constant lr",
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--bucket-cap-mb", type=float, default=25)
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--out", default=None, help="JSON of the curves")
    parser.add_argument("--plot", default=None, help="PNG of the curves (needs matplotlib)")
    args = parser.parse_args(argv)
    args.systems = [name.strip() for name in args.systems.split(",") if name.strip()]
    known = (*SYSTEMS, *QG_VARIANTS, BF16_REFERENCE)  # on request: zero3_qwqg (all three less the secondary shard)
    if not args.systems or args.systems[0] != "zero3" or not set(args.systems) <= set(known):
        parser.error(f"--systems: zero3 first, then any of {known[1:]}; got {args.systems}")
    args.shard_size = PER_NODE  # the secondary groups: a node's ranks
    args.device = "cpu"
    result = run_on_ranks(train, NODES * PER_NODE, args, nodes=NODES, timeout_s=7200)[0]
    curves = result["curves"]
    base = sum(curves["zero3"][-args.tail :]) / args.tail
    print(f"GPT {result['numel'] / 1e6:.2f}M parameters, {args.steps} steps, 2 nodes x 2 ranks")
    print(f"| system | first loss | mean loss, last {args.tail} steps | relative to zero3 |")
    print("|---|---|---|---|")
    for name, losses in curves.items():
        tail = sum(losses[-args.tail :]) / args.tail
        print(f"| {name} | {losses[0]:.4f} | {tail:.4f} | {(tail - base) / base:+.2%} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), **result}, indent=1))
    if args.plot:
        plot(curves, args.smooth, Path(args.plot))


if __name__ == "__main__":
    main()
