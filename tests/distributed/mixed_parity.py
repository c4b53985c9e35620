"""Mixed-precision training under ZeroEngine and under a plain reference that applies the same maths.

The reference is DDP's algorithm written out for 16-bit training with fp32 masters (the ZeRO paper's mixed
precision): a 16-bit copy of the model runs forward under autocast and backward (autograd accumulates 16-bit
gradients), each gradient is averaged across ranks in fp32 and rounded to 16 bits, the optimizer updates fp32
masters from the unscaled fp32 gradients, and the masters are rounded into the model.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.mixed_precision import PrecisionPolicy
from lightning_zero.core.options import EngineOptions
from tests.distributed.models import Block, TinyLM, loss_fn
from tests.distributed.parity import CASES, Case, _micro_batches, clip_with_engine, make_optimizer, train_ddp

STEPS = 5
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LOSS_SCALE = {"bf16": None, "fp16": 1024.0}  # fp16 needs its loss scaled (a fixed one: no overflow here)
MIXED_CASES = ("plain", "accumulate", "clip_norm", "clip_value", "tied", "frozen", "unused", "two_groups", "adam")


def _autocast(dtype: torch.dtype):
    return torch.autocast("cpu", dtype=dtype, cache_enabled=False)


def _scaled(loss: Tensor, case: Case, scale: float | None) -> Tensor:
    loss = loss / case.accumulate
    return loss * scale if scale is not None else loss


def train_reference(
    initial: nn.Module,
    case: Case,
    rank: int,
    dtype: torch.dtype,
    scale: float | None,
    reduce_each_micro_batch: bool,
    reversed_sum: bool = False,
) -> nn.Module:
    """The same maths without sharding; returns the module of fp32 masters.

    ``reduce_each_micro_batch`` follows stages 2 and 3, which reduce every backward pass and add the rounded
    average into the held gradient; stage 1 (and DDP) accumulate locally and reduce once. ``reversed_sum`` adds
    the ranks' fp32 gradients in reverse rank order: the same maths, rounded differently (the spread).
    """
    masters = copy.deepcopy(initial)
    model = copy.deepcopy(initial).to(dtype)
    optimizer = make_optimizer(masters, case)
    pairs = list(zip(model.parameters(), masters.parameters(), strict=True))
    for step in range(STEPS):
        optimizer.zero_grad()
        held: dict[int, Tensor] = {}
        for micro, (tokens, targets) in _micro_batches(step, rank, case):
            with _autocast(dtype):
                loss = loss_fn(model, tokens, targets)
            _scaled(loss, case, scale).backward()
            if reduce_each_micro_batch or micro == case.accumulate - 1:
                _reduce_into(held, [param for param, _ in pairs], dtype, reversed_sum)
        for index, (_, master) in enumerate(pairs):
            if index in held:
                master.grad = held[index].float() / scale if scale is not None else held[index].float()
        if case.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(masters.parameters(), case.clip_norm)
        if case.clip_value is not None:
            torch.nn.utils.clip_grad_value_(masters.parameters(), case.clip_value)
        optimizer.step()
        with torch.no_grad():
            for param, master in pairs:
                param.copy_(master)
    return masters


def _reduce_into(held: dict[int, Tensor], params: list[nn.Parameter], dtype: torch.dtype, reversed_sum: bool) -> None:
    """Average the local gradients in fp32 across ranks and add the result, rounded, into ``held``."""
    for index, param in enumerate(params):
        used = torch.tensor([param.grad is not None], dtype=torch.uint8)
        dist.all_reduce(used, op=dist.ReduceOp.MAX)
        if not used.item():
            continue
        local = param.grad if param.grad is not None else torch.zeros_like(param)
        averaged = local.float() / dist.get_world_size()
        if reversed_sum:
            parts = [torch.empty_like(averaged) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, averaged)
            averaged = parts[-1].clone()
            for part in reversed(parts[:-1]):
                averaged += part
        else:
            dist.all_reduce(averaged)
        held[index] = (held[index].float() + averaged).to(dtype) if index in held else averaged.to(dtype)
        param.grad = None


def train_zero(
    initial: nn.Module,
    case: Case,
    stage: int,
    comm: Communicator,
    dtype: torch.dtype,
    scale: float | None,
    **options: object,
) -> dict[str, Tensor]:
    """Train under ZeroEngine with 16-bit parameters and fp32 masters (``options``: further EngineOptions, e.g.
    offload); returns the full state (masters)."""
    model = copy.deepcopy(initial)
    optimizer = make_optimizer(model, case)
    policy = {nn.Linear, Block} if stage == 3 else None
    config = EngineOptions(stage=stage, bucket_cap_mb=0.0005, wrap_policy=policy, **options)  # type: ignore[arg-type]
    precision = PrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, master_dtype=torch.float32)
    engine = ZeroEngine(model, [optimizer], config, comm, precision=precision)
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro, (tokens, targets) in _micro_batches(step, comm.rank, case):
            context = engine.backward.no_sync() if micro < case.accumulate - 1 else nullcontext()
            with context:
                with _autocast(dtype):
                    loss = loss_fn(model, tokens, targets)
                _scaled(loss, case, scale).backward()
        finite = engine.step_of(optimizer).prepare(scale)
        assert finite
        clip_with_engine(engine, optimizer, case)
        optimizer.step()
    engine.backward.remove_hooks()
    return engine.full_state_dict(keep=True)


def _difference(reference: dict[str, Tensor], other: dict[str, Tensor], names: list[str]) -> float:
    worst = 0.0
    for name in names:
        a, b = reference[name].float(), other[name].float()
        worst = max(worst, ((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item())
    return worst


def run_mixed_cases(rank: int, world_size: int, cases: tuple[str, ...] = MIXED_CASES) -> dict[str, float]:
    """Per dtype, case and stage: ZeRO vs the reference; and the reference vs fp32 DDP (what precision changes)."""
    comm = Communicator()
    results: dict[str, float] = {}
    for dtype_name, dtype in DTYPES.items():
        scale = LOSS_SCALE[dtype_name]
        for name in cases:
            case = CASES[name]
            torch.manual_seed(0)
            initial = TinyLM(**case.model_kwargs)
            trainable = [n for n, p in initial.named_parameters() if p.requires_grad]
            fp32 = train_ddp(copy.deepcopy(initial), case, rank).state_dict()
            for stage in (1, 2, 3):
                reference = train_reference(initial, case, rank, dtype, scale, stage >= 2).state_dict()
                state = train_zero(initial, case, stage, comm, dtype, scale)
                results[f"{dtype_name}/stage{stage}/{name}"] = _difference(reference, state, trainable)
            reordered = train_reference(initial, case, rank, dtype, scale, True, reversed_sum=True).state_dict()
            results[f"{dtype_name}/spread/{name}"] = _difference(reference, reordered, trainable)
            results[f"{dtype_name}/precision_effect/{name}"] = _difference(fp32, reference, trainable)
    return results
