"""Stage 3 with activation checkpointing around blocks whose layers are gather units: the gathered bytes at the step's
peak, from the engine's ledger (exact, not RSS), without checkpointing, with torch's non-reentrant checkpoint (as
``activation_checkpointing`` applies it) and with a reentrant one (as Hugging Face's gradient checkpointing calls it).

Run on demand, from the repository root::

    python benchmarks/recompute_memory.py [--layers 8] [--width 256]

The example GPT (``examples/gpt.py``, its tied embedding in the root unit), every ``nn.Linear`` a unit
(``wrap_policy={nn.Linear}``), each ``Block`` checkpointed or not, fp32 AdamW, 2 gloo ranks, 3 steps of an announced
backward (as Lightning's). Printed (rank 0): ``memory_report().step_peak``'s gathered bytes and total, the largest
unit and the whole model, in MiB. A recompute that held its units to the end of backward gathers the whole model.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.utils.checkpoint
from torch import nn
from zero_bench.launch import on_ranks  # importing zero_bench puts the repository root on sys.path

from examples.gpt import GPT, Block, GPTConfig
from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.options import EngineOptions
from lightning_zero.core.stage3.activation_checkpointing import apply_activation_checkpointing

MIB = 2**20


def measure(rank: int, world_size: int, args: argparse.Namespace, checkpoint: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=4, block_size=64))
    if checkpoint == "non-reentrant":
        apply_activation_checkpointing(model, {Block})
    elif checkpoint == "reentrant":
        for block in model.modules():
            if isinstance(block, Block):
                block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [optimizer], EngineOptions(stage=3, wrap_policy={nn.Linear}), Communicator())
    for step in range(3):
        optimizer.zero_grad()
        tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(step + rank))
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
        engine.scale_loss(loss).backward()
        engine.finish_backward()
        optimizer.step()
    peak = engine.memory_report().step_peak
    assert peak is not None
    return {
        "gathered": peak.by_kind["gathered"] / MIB,
        "peak": peak.total / MIB,
        "largest_unit": max(b.data.numel() * b.data.element_size() for u in engine.model.units for b in u.buffers)
        / MIB,
        "model": sum(p.numel() * p.element_size() for p in model.parameters()) / MIB,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args(argv)
    args.world_size, args.threads, args.device = 2, 1, "cpu"
    print("| activation checkpointing | gathered at the step peak | step peak | largest unit | whole model |")
    print("|---|---:|---:|---:|---:|")
    for checkpoint in ("off", "non-reentrant", "reentrant"):
        result = on_ranks(measure, args, checkpoint)[0]
        print(
            f"| {checkpoint} | {result['gathered']:.2f} | {result['peak']:.2f} | "
            f"{result['largest_unit']:.2f} | {result['model']:.2f} |"
        )


if __name__ == "__main__":
    main()
