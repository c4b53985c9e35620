"""The GPT of ``examples/gpt.py`` trained with a plain Lightning Fabric loop and ``ZeroFabricStrategy`` (litgpt-style).

Install the package first (``pip install -e .`` from the repository root), then:

CPU, 2 processes (gloo), ZeRO-3 (Fabric's launcher starts the second process)::

    python examples/fabric_gpt.py --steps 40 --out_dir out/fabric_gpt

Resume from a checkpoint it wrote (``auto``: the newest ``step-*`` under ``--out_dir``)::

    python examples/fabric_gpt.py --steps 60 --out_dir out/fabric_gpt --resume out/fabric_gpt/step-000040

Under torchrun (``--devices`` is the number of processes per node)::

    torchrun --nproc-per-node=2 examples/fabric_gpt.py --steps 40

One GPU node with 8 GPUs, bf16 mixed precision::

    python examples/fabric_gpt.py --accelerator gpu --devices 8 --precision bf16-mixed

docs/fabric.md explains each call.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python examples/fabric_gpt.py` puts examples/ on the path, not the repository
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from examples.gpt import GPT, ByteDataModule, GPTConfig, warmup_cosine  # noqa: E402
from lightning_zero import ZeroFabricPrecision, ZeroFabricStrategy  # noqa: E402

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--stage", type=int, choices=(1, 2, 3), default=3, help="ZeRO stage")
    add("--accelerator", default="cpu", help="cpu, gpu, cuda, ... (as Fabric's)")
    add("--devices", type=int, default=2, help="processes per node")
    add("--num_nodes", type=int, default=1)
    add("--precision", choices=PRECISIONS, default="32-true")
    add("--state_dict_type", choices=("sharded", "full"), default="sharded", help="checkpoint format")
    add("--steps", type=int, default=100, help="optimizer steps to reach (counted from 0, also when resuming)")
    add("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    add("--batch_size", type=int, default=8, help="micro-batch size per process")
    add("--block_size", type=int, default=64)
    add("--n_layer", type=int, default=2)
    add("--n_head", type=int, default=2)
    add("--n_embd", type=int, default=64)
    add("--lr", type=float, default=3e-3)
    add("--weight_decay", type=float, default=0.1)
    add("--warmup_steps", type=int, default=10)
    add("--max_norm", type=float, default=1.0, help="gradient clipping by the global norm")
    add("--log_every", type=int, default=10, help="print the loss every N steps (rank 0)")
    add("--save_every", type=int, default=50, help="save out_dir/step-N every N steps, and at the last step")
    add("--out_dir", type=Path, default=Path("out/fabric_gpt"))
    add("--resume", default=None, help="a step-N checkpoint to resume from, or 'auto': the newest in --out_dir")
    add("--data_path", default=None, help="a text file (default: examples/data/tiny_corpus.txt)")
    add("--seed", type=int, default=1234)
    return parser.parse_args(argv)


def make_fabric(args: argparse.Namespace) -> Fabric:
    strategy = ZeroFabricStrategy(stage=args.stage, state_dict_type=args.state_dict_type)
    if args.precision == "16-mixed":  # Fabric's flag would turn fp16 into bf16 on the CPU; the plugin keeps fp16
        precision: dict[str, Any] = {"plugins": [ZeroFabricPrecision("16-mixed")]}
    else:
        precision = {"precision": args.precision}
    return Fabric(
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy=strategy, **precision
    )


def optimizer_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups as nanoGPT's: weight decay on the matrices only (the set-up parameters keep their shapes, also
    at stage 3 where each rank holds a shard of their data)."""
    params = list(model.parameters())  # the tied lm_head weight appears once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def batches(loader: DataLoader, skip: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Micro-batches without end, the first ``skip`` dropped: a resumed run sees the batches the first run would
    have seen next (Fabric's loader shuffles each pass anew, counting its passes)."""

    def forever() -> Iterator[tuple[Tensor, Tensor]]:
        while True:
            yield from loader

    return islice(forever(), skip, None)


def resolve_resume(fabric: Fabric, resume: str | None, out_dir: Path) -> Path | None:
    if resume != "auto":
        return None if resume is None else Path(resume)
    found = sorted(out_dir.glob("step-*"))
    if not found:
        fabric.print(f"--resume auto: no step-* checkpoint in {out_dir}; starting from scratch")
    return found[-1] if found else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    fabric = make_fabric(args)
    fabric.launch()  # starts the other processes (or joins torchrun's) and the process group
    fabric.seed_everything(args.seed)

    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    with fabric.init_module():  # stage 3: on the meta device; setup_module creates it sharded
        model = GPT(config)
    model = fabric.setup_module(model)
    optimizer = torch.optim.AdamW(optimizer_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    optimizer = fabric.setup_optimizers(optimizer)
    schedule = partial(warmup_cosine, warmup=max(1, args.warmup_steps), total=args.steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    data = ByteDataModule(args.data_path, block_size=args.block_size, batch_size=args.batch_size, seed=args.seed)
    data.setup()
    loader = fabric.setup_dataloaders(data.train_dataloader())  # a distributed sampler: each rank its share

    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iter_num": 0}
    resume = resolve_resume(fabric, args.resume, args.out_dir)
    if resume is not None:
        fabric.load(resume, state)  # fills model, optimizer and scheduler; sets state["iter_num"]
        fabric.print(f"resumed from {resume} at step {state['iter_num']}")
    train(fabric, args, state, batches(loader, skip=state["iter_num"] * args.accumulate))
    fabric.print(f"rank 0 memory: {fabric.strategy.memory_report().as_dict()}")


def train(fabric: Fabric, args: argparse.Namespace, state: dict[str, Any], data: Iterator[Any]) -> None:
    model, optimizer, scheduler = state["model"], state["optimizer"], state["scheduler"]
    model.train()
    started = time.perf_counter()
    while state["iter_num"] < args.steps:
        loss_sum = torch.zeros((), device=fabric.device)
        for micro in range(args.accumulate):
            x, y = next(data)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                logits = model(x)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
                fabric.backward(loss / args.accumulate)
            loss_sum += loss.detach()
        fabric.clip_gradients(model, optimizer, max_norm=args.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["iter_num"] += 1
        step = state["iter_num"]
        if step % args.log_every == 0 or step == args.steps:
            loss_mean = fabric.all_reduce(loss_sum / args.accumulate, reduce_op="mean")  # over every rank
            elapsed = time.perf_counter() - started
            fabric.print(f"step {step} loss {float(loss_mean):.6f} lr {scheduler.get_last_lr()[0]:.2e} {elapsed:.1f}s")
        if step % args.save_every == 0 or step == args.steps:
            path = args.out_dir / f"step-{step:06d}"
            fabric.save(path, state)
            fabric.print(f"saved {path}")


if __name__ == "__main__":
    main()
