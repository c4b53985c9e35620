"""Training loops that run the same steps under DDP, under ZeroEngine and as one reordered local process."""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.options import EngineOptions
from lightning_zero.core.stage3.activation_checkpointing import apply_activation_checkpointing
from tests.distributed.models import Block, TinyLM, batch, loss_fn

STEPS = 5


@dataclass(frozen=True)
class Case:
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    optimizer: str = "adamw"
    two_groups: bool = False
    accumulate: int = 1
    clip_norm: float | None = None
    clip_value: float | None = None
    unused_on_rank1: bool = False
    zero_grad_every: int = 1  # optimizer steps between zero_grad calls (torch accumulates in between)
    checkpoint: bool | str = False  # activation checkpointing of every Linear and Block (ZeRO runs only); "reentrant"


CASES = {
    "plain": Case(),
    "accumulate": Case(accumulate=3),
    "clip_norm": Case(clip_norm=0.05),
    "clip_value": Case(clip_value=0.01),
    "tied": Case(model_kwargs={"tied": True}),
    "frozen": Case(model_kwargs={"frozen": True}),
    "unused": Case(model_kwargs={"unused": True}),
    "unused_on_one_rank": Case(unused_on_rank1=True),
    "two_groups": Case(two_groups=True),
    "sgd_momentum": Case(optimizer="sgd"),
    "adam": Case(optimizer="adam"),
    "adagrad": Case(optimizer="adagrad"),
    "no_zero_grad_between_steps": Case(optimizer="sgd", zero_grad_every=2, accumulate=2),
    "nested_units": Case(model_kwargs={"nested": True}),
    "unit_used_twice": Case(model_kwargs={"reuse": True}),
    "activation_checkpointing": Case(model_kwargs={"nested": True, "reuse": True}, checkpoint=True),
    "reentrant_checkpointing": Case(model_kwargs={"nested": True}, accumulate=2, checkpoint="reentrant"),
}


# Stage 3 gathers each unit collectively, so every rank must run the same units: a unit skipped on one
# rank only (data-dependent control flow) is not supported, as in FSDP.
STAGES = {name: (1, 2) if name == "unused_on_one_rank" else (1, 2, 3) for name in CASES}


def make_optimizers(model: nn.Module, case: Case) -> list[Optimizer]:
    """The case's optimizers: one, or for ``"muon"`` Muon over the hidden matrices and AdamW over the rest (the
    embedding, the head, biases), as Muon is meant to be used."""
    if case.optimizer in ("muon", "muon_fp32"):
        hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith(("emb", "head"))]
        rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
        muon_class = torch.optim.Muon if case.optimizer == "muon" else MuonFP32
        return [muon_class(hidden, lr=0.02, weight_decay=0.01), torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.05)]
    return [make_optimizer(model, case)]


class MuonFP32(torch.optim.Optimizer):
    """Muon with its Newton-Schulz orthogonalisation in fp32 (torch's runs it in bf16): a user optimizer whose
    update of each matrix depends on the whole matrix."""

    def __init__(self, params: Any, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                buffer = state.setdefault("momentum_buffer", torch.zeros_like(param))
                buffer.lerp_(param.grad, 1 - group["momentum"])
                update = param.grad.lerp(buffer, group["momentum"])
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(orthogonalise(update), alpha=-group["lr"] * max(1, param.shape[0] / param.shape[1]) ** 0.5)


def orthogonalise(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Newton-Schulz iteration towards the nearest semi-orthogonal matrix, in fp32."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = matrix / (matrix.norm() + 1e-7)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def make_optimizer(model: nn.Module, case: Case) -> Optimizer:
    if case.two_groups:
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}]
    else:
        groups = [{"params": list(model.parameters())}]
    if case.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05)
    if case.optimizer == "adam":
        return torch.optim.Adam(groups, lr=1e-2)
    if case.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    if case.optimizer == "adagrad":
        return torch.optim.Adagrad(groups, lr=0.05)
    if case.optimizer == "adafactor":
        return torch.optim.Adafactor(groups, lr=1e-2, weight_decay=0.05)
    raise ValueError(case.optimizer)


def relative_difference(reference: nn.Module, other: nn.Module) -> float:
    """Largest per-tensor max|a - b| / max|a| over the parameters."""
    worst = 0.0
    for (_, a), (_, b) in zip(reference.named_parameters(), other.named_parameters(), strict=True):
        scale = a.detach().abs().max().clamp_min(1e-12)
        worst = max(worst, ((a.detach() - b.detach()).abs().max() / scale).item())
    return worst


def _micro_batches(step: int, rank: int, case: Case):
    for micro in range(case.accumulate):
        yield micro, batch(seed=1000 * step + 10 * micro + rank)


def train_ddp(model: nn.Module, case: Case, rank: int, return_optimizer: bool = False) -> Any:
    """Train ``model`` in place under DDP; return it, or the optimizer's state dict."""
    model.skip_b = case.unused_on_rank1 and rank == 1
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    optimizers = make_optimizers(model, case)
    for step in range(STEPS):
        if step % case.zero_grad_every == 0:
            for optimizer in optimizers:
                optimizer.zero_grad()
        for micro, (tokens, targets) in _micro_batches(step, rank, case):
            context = ddp.no_sync() if micro < case.accumulate - 1 else nullcontext()
            with context:
                (loss_fn(ddp, tokens, targets) / case.accumulate).backward()
        _clip(optimizers, case)
        for optimizer in optimizers:
            optimizer.step()
    return optimizers[0].state_dict() if return_optimizer else model


def _clip(optimizers: list[Optimizer], case: Case) -> None:
    """The case's clipping of each optimizer's parameters (by norm, by value, or none), as torch does it."""
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if case.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, case.clip_norm)
        if case.clip_value is not None:
            torch.nn.utils.clip_grad_value_(params, case.clip_value)


def train_zero(model: nn.Module, case: Case, rank: int, stage: int, comm: Communicator, **options: Any) -> ZeroEngine:
    """Train ``model`` in place under ZeroEngine (``options``: further EngineOptions, e.g. offload)."""
    model.skip_b = case.unused_on_rank1 and rank == 1
    optimizers = make_optimizers(model, case)
    # A tiny bucket cap gives several buckets, so ordering and partial buckets are exercised; at stage 3
    # every Linear and Block is a gather unit (a Block nests its Linear's unit; the tied head weight then
    # lives in the root unit with the embedding).
    policy = {nn.Linear, Block} if stage == 3 else None
    if case.checkpoint == "reentrant":
        checkpoint_reentrant(model, (nn.Linear, Block))
    elif case.checkpoint:
        apply_activation_checkpointing(model, {nn.Linear, Block})
    engine_options = EngineOptions(stage=stage, bucket_cap_mb=0.0005, wrap_policy=policy, **options)
    engine = ZeroEngine(model, optimizers, engine_options, comm)
    for step in range(STEPS):
        if step % case.zero_grad_every == 0:
            for optimizer in optimizers:
                optimizer.zero_grad()
        for micro, (tokens, targets) in _micro_batches(step, rank, case):
            context = engine.backward.no_sync() if micro < case.accumulate - 1 else nullcontext()
            with context:
                (loss_fn(model, tokens, targets) / case.accumulate).backward()
        for optimizer in optimizers:
            clip_with_engine(engine, optimizer, case)
            optimizer.step()
    engine.backward.remove_hooks()
    return engine


class ReentrantCheckpoint(nn.Module):
    """Calls the module it wraps inside ``torch.utils.checkpoint(..., use_reentrant=True)``, as Hugging Face's
    gradient checkpointing calls a layer: the module's hooks run inside the checkpoint."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.module.__call__, *args, use_reentrant=True)


def checkpoint_reentrant(model: nn.Module, classes: tuple[type[nn.Module], ...]) -> None:
    """Wrap every submodule of ``classes`` in a :class:`ReentrantCheckpoint` (nested ones too: a Block and its Linear);
    the parameters keep their order."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, classes):
                setattr(parent, name, ReentrantCheckpoint(child))


def clip_with_engine(engine: ZeroEngine, optimizer: Optimizer, case: Case) -> None:
    """The case's clipping (by norm, by value, or none) through the engine, on the shards."""
    if case.clip_norm is not None:
        engine.step_of(optimizer).clip_grad_norm_(case.clip_norm)
    if case.clip_value is not None:
        engine.step_of(optimizer).clip_grad_value_(case.clip_value)


def train_reordered(model: nn.Module, case: Case, world_size: int) -> nn.Module:
    """One process computes every rank's loss sample by sample, so gradients are summed in another order."""
    optimizers = make_optimizers(model, case)
    for step in range(STEPS):
        if step % case.zero_grad_every == 0:
            for optimizer in optimizers:
                optimizer.zero_grad()
        for rank in reversed(range(world_size)):
            model.skip_b = case.unused_on_rank1 and rank == 1
            for _, (tokens, targets) in _micro_batches(step, rank, case):
                size = len(tokens)
                for i in reversed(range(size)):
                    sample_loss = loss_fn(model, tokens[i : i + 1], targets[i : i + 1])
                    (sample_loss / (size * case.accumulate * world_size)).backward()
        _clip(optimizers, case)
        for optimizer in optimizers:
            optimizer.step()
    return model


def run_all_cases(rank: int, world_size: int) -> dict[str, float]:
    """Per case: ZeRO-1 and ZeRO-2 vs DDP, and the reordered-DDP spread that calibrates the tolerance."""
    comm = Communicator()
    results: dict[str, float] = {}
    for name, case in CASES.items():
        torch.manual_seed(0)
        initial = TinyLM(**case.model_kwargs)
        reference = train_ddp(copy.deepcopy(initial), case, rank)
        results[f"spread/{name}"] = relative_difference(
            reference, train_reordered(copy.deepcopy(initial), case, world_size)
        )
        for stage in STAGES[name]:
            model = copy.deepcopy(initial)
            engine = train_zero(model, case, rank, stage, comm)
            with engine.gathered():  # stage 3 holds only shards at rest
                results[f"stage{stage}/{name}"] = relative_difference(reference, model)
    return results
