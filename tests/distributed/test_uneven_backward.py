"""A backward that differs between ranks: rank 1's loss reaches only the first layers, or no parameter at all, while
every rank runs the same forward (stage 3's rule). Legal at every stage (the contract: "a backward that differs
between ranks ... is legal and trains like DDP"): the parameters equal DDP's given the same maths, a loss that adds
``0 * logits.sum()`` so that every parameter is reached with a zero gradient where rank 1's loss does not reach it.

At stage 3 this used to deadlock: the rank whose backward skips units issued their gathers on its way to the first
layer and waited for that gather, while the other rank waited for a gradient reduction the first would launch only
at the end of its backward (see [Note: units a backward passes over]). The process group's timeout is 60 s, so a
hang fails the test with ``RankTimeoutError``.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from tests.distributed.models import VOCAB, batch
from tests.distributed.parity import relative_difference
from tests.helpers import run_on_ranks

STEPS = 4
TOLERANCE = 1e-5  # fp32 against DDP, as in test_parity_with_ddp.py
MODES = ("first_layer", "no_parameter", "side_head")


class Probe(nn.Module):
    """Embedding -> four Linear blocks -> head; keeps the hidden state after the first block, so that a loss can
    reach only ``emb`` and ``blocks.0``, and a side head's output on the second block's (``side_out``), which a
    loss may use or not. Uneven widths, so 2 ranks need padding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 15)
        self.blocks = nn.ModuleList(nn.Linear(15, 15) for _ in range(4))
        self.side = nn.Linear(15, 7)
        self.head = nn.Linear(15, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.emb(tokens)
        for index, block in enumerate(self.blocks):
            hidden = torch.tanh(block(hidden))
            if index == 0:
                self.first = hidden
            if index == 1:
                self.side_out = self.side(hidden)
        return self.head(hidden)


def _loss(model: nn.Module, step: int, rank: int, mode: str, oracle: bool) -> Tensor:
    tokens, targets = batch(seed=100 * step + rank)
    logits = model(tokens)
    full = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    side = (model.module if isinstance(model, DistributedDataParallel) else model).side_out
    zeros = 0 * side.sum() + 0 * logits.sum() if oracle else 0  # the oracle reaches every parameter, with zeros
    if mode == "side_head":  # rank 1's backward reaches the side head's unit (between blocks 2 and 1), rank 0's never
        return full + (side.pow(2).mean() if rank == 1 else zeros)
    if rank != 1 or step % 2 == 0:  # rank 1 differs in steps 1 and 3
        return full + 0 * side.sum()
    probe = model.module if isinstance(model, DistributedDataParallel) else model
    partial = probe.first.pow(2).mean() if mode == "first_layer" else 0 * logits.detach().requires_grad_().sum()
    return partial + zeros


def _run(rank: int, world_size: int, stages: tuple[int, ...]) -> dict[str, Any]:
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    comm = Communicator()
    results: dict[str, Any] = {}
    for mode in MODES:
        torch.manual_seed(0)
        initial = Probe()
        reference = copy.deepcopy(initial)
        ddp = DistributedDataParallel(reference)
        optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.05)
        for step in range(STEPS):
            optimizer.zero_grad()
            _loss(ddp, step, rank, mode, oracle=True).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            optimizer.step()
        for stage in stages:
            for prefetch in (True, False) if stage == 3 else (True,):
                model = copy.deepcopy(initial)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
                policy = {nn.Linear} if stage == 3 else None
                options = EngineOptions(stage=stage, bucket_cap_mb=0.0005, wrap_policy=policy, overlap_comm=prefetch)
                engine = ZeroEngine(model, [optimizer], options, comm)
                for step in range(STEPS):  # as the Lightning glue drives the engine
                    engine.begin_iteration()
                    optimizer.zero_grad()
                    engine.model.scheduler.unshard_root()
                    engine.scale_loss(_loss(model, step, rank, mode, oracle=False)).backward()
                    engine.finish_backward()
                    engine.step_of(optimizer).clip_grad_norm_(0.05)
                    optimizer.step()
                    engine.model.scheduler.reshard_all()
                with engine.gathered():
                    results[f"{mode}/stage{stage}/prefetch={prefetch}"] = relative_difference(reference, model)
                engine.backward.remove_hooks()
    return results


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_run, 2, (1, 2, 3), init_group=False)


CASES = [
    f"{mode}/stage{s}/prefetch={p}" for mode in MODES for s in (1, 2, 3) for p in ((True, False) if s == 3 else (True,))
]


@pytest.mark.parametrize("case", CASES)
def test_a_backward_that_differs_between_ranks_trains_like_ddp(results: list[dict[str, Any]], case: str) -> None:
    for rank, per_rank in enumerate(results):
        assert per_rank[case] <= TOLERANCE, f"rank {rank}: {case} differs from DDP by {per_rank[case]:.2e}"
