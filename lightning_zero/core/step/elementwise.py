"""Is an optimizer element-wise? A probe at setup, so that ``partition="flat"`` never trains a wrong model.

[Note: the element-wise probe]
Flat sharding gives each rank's optimizer 1-D pieces of flattened parameters. That is exact only for an optimizer
whose update of an element depends on that element alone (SGD, Adam, AdamW, Adagrad, RMSprop, ...). One whose
update depends on the whole tensor (Adafactor's row and column factors, a per-tensor trust ratio as in LAMB or
LARS, Shampoo's preconditioners, Muon's orthogonalisation) or on every parameter (a global norm, L-BFGS) would
train silently wrong on pieces. :func:`check_elementwise` steps a copy of each of the optimizer's param groups
(its class and hyper-parameters, fresh state, no hooks) twice on a small matrix: once whole, and once split into
1-D pieces held by separate copies, as ranks hold them, with the split crossing a row. An element-wise optimizer
gives the same values (up to the last bits of differently vectorised loops); any other differs by far more, or
cannot step a 1-D piece at all. Every rank probes alike and raises alike, before the first collective that
depends on it.

``partition="parameter"`` gives each rank whole tensors, but not all of them: :func:`check_per_tensor` steps two
matrices together in one copy, and each alone in a copy of its own, as owners hold them. An optimizer whose update
of a tensor depends on that tensor alone (Muon, Adafactor, LAMB, and every element-wise one) gives the same
values; one that combines its tensors (a global norm, L-BFGS) does not, and is refused under either partition.
"""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict, defaultdict
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils._pytree import tree_leaves

SHAPE = (6, 8)
SPLITS = (11, 29)  # piece boundaries in the flattened matrix: uneven, inside rows
STEPS = 3
PROBE_LR = 1e-2
RELATIVE_TOLERANCE = 1e-4  # of the largest update: last-bit differences are ~1e-7, Adafactor's are ~1e-2


class NotElementwiseError(ValueError):
    """The optimizer's update of an element depends on more than that element."""


def check_elementwise(optimizer: Optimizer, index: int) -> None:
    """Raise :class:`NotElementwiseError` (a ``ValueError``) unless every param group of ``optimizer`` (the
    ``index``-th) steps pieces of a tensor as it steps the whole. See [Note: the element-wise probe]."""
    for group_index, hyper in _distinct_groups(optimizer):
        reason = _probe(optimizer, hyper)
        if reason is not None:
            name = type(optimizer).__name__
            per_tensor = _probe_per_tensor(optimizer, hyper) is None
            advice = (
                f"Use ZeroStrategy(partition='parameter') for {name} (each tensor stepped whole by one rank), or an "
                if per_tensor
                else "It combines its tensors too, so partition='parameter' cannot train it either. Use an "
            )
            raise NotElementwiseError(
                f"optimizer {index} ({name}), param group {group_index}, is not element-wise: {reason}. "
                "ZeroStrategy(partition='flat') gives each rank 1-D pieces of flattened parameters, on which it "
                f"would train a different model than on whole tensors. {advice}element-wise optimizer (SGD, Adam, "
                "AdamW, Adagrad, RMSprop, ...)."
            )


def check_per_tensor(optimizer: Optimizer, index: int) -> None:
    """Raise :class:`NotElementwiseError` (a ``ValueError``) unless every param group of ``optimizer`` steps each
    of its tensors as if it held that tensor alone (``partition="parameter"``). See [Note: the element-wise probe]."""
    for group_index, hyper in _distinct_groups(optimizer):
        reason = _probe_per_tensor(optimizer, hyper)
        if reason is not None:
            raise NotElementwiseError(
                f"optimizer {index} ({type(optimizer).__name__}), param group {group_index}, combines its tensors: "
                f"{reason}. ZeroStrategy(partition='parameter') gives each rank whole tensors but not all of them, so "
                "it would train a different model. Use an optimizer whose update of a tensor depends on that tensor "
                "alone (Muon, Adafactor, SGD, Adam, AdamW, ...)."
            )


def _distinct_groups(optimizer: Optimizer) -> list[tuple[int, dict[str, Any]]]:
    """``(index, hyper-parameters)`` of the param groups, one per distinct set of hyper-parameters."""
    found, seen = [], set()
    for group_index, group in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        key = repr(sorted(hyper.items(), key=lambda item: item[0]))
        if key not in seen:
            seen.add(key)
            found.append((group_index, hyper))
    return found


def _probe_per_tensor(optimizer: Optimizer, hyper: dict[str, Any]) -> str | None:
    """Why the optimizer's update of a tensor depends on its other tensors, or ``None``."""
    generator = torch.Generator().manual_seed(1)
    starts = [torch.randn(SHAPE, generator=generator), torch.randn(SHAPE[::-1], generator=generator)]
    scales = (1.0, 30.0)  # tensors of very different gradient size, so a shared statistic shows
    grads = [[torch.randn(s.shape, generator=generator) * c for s, c in zip(starts, scales, strict=True)]]
    grads = grads * STEPS
    try:
        together = _run(optimizer, hyper, starts, grads)
        alone = [_run(optimizer, hyper, [start], [[g[i]] for g in grads])[0] for i, start in enumerate(starts)]
    except Exception as error:  # e.g. one that needs every parameter in one call (and so cannot be sharded)
        return f"it cannot step two {SHAPE[0]}x{SHAPE[1]} matrices apart ({type(error).__name__}: {error})"
    for start, both, one in zip(starts, together, alone, strict=True):
        update = (both - start).abs().max()
        difference = (both - one).abs().max()
        if difference > RELATIVE_TOLERANCE * update:
            return (
                f"stepped on two matrices held by separate copies it moved them up to {float(difference / update):.1%} "
                "of its largest update away from the same steps on both together"
            )
    return None


def _probe(optimizer: Optimizer, hyper: dict[str, Any]) -> str | None:
    """Why the optimizer is not element-wise, or ``None``."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(SHAPE, generator=generator)
    # Gradients of varied magnitude per row and column, so per-row or per-column statistics are not all alike.
    scale = torch.logspace(-2, 1, SHAPE[0])[:, None] * torch.logspace(0, -1.5, SHAPE[1])[None, :]
    grads = [torch.randn(SHAPE, generator=generator) * scale for _ in range(STEPS)]
    try:
        whole = _run(optimizer, hyper, [start], [[g] for g in grads])[0].reshape(-1)
    except Exception as error:  # e.g. sparse gradients only: it cannot train flat shards either
        return f"it cannot step a dense {SHAPE[0]}x{SHAPE[1]} matrix ({type(error).__name__}: {error})"
    bounds = [0, *SPLITS, start.numel()]
    pieces = [start.reshape(-1)[a:b] for a, b in itertools.pairwise(bounds)]
    split_grads = [[g.reshape(-1)[a:b] for a, b in itertools.pairwise(bounds)] for g in grads]
    try:
        stepped = [
            _run(optimizer, hyper, [piece], [[per_step[i]] for per_step in split_grads])[0]
            for i, piece in enumerate(pieces)
        ]
    except Exception as error:
        return f"it cannot step a 1-D piece of a {len(SHAPE)}-D parameter ({type(error).__name__}: {error})"
    split = torch.cat(stepped)
    update = (whole - start.reshape(-1)).abs().max()
    difference = (whole - split).abs().max()
    if difference > RELATIVE_TOLERANCE * update:
        return (
            f"stepped on pieces of a {SHAPE[0]}x{SHAPE[1]} matrix it moved the parameters up to "
            f"{float(difference / update):.1%} of its largest update away from the same steps on the whole matrix"
        )
    return None


def _run(optimizer: Optimizer, hyper: dict[str, Any], values: list[Tensor], grads: list[list[Tensor]]) -> list[Tensor]:
    """``len(grads)`` steps of a fresh copy of ``optimizer`` over new parameters holding ``values``."""
    params = [torch.nn.Parameter(v.detach().clone()) for v in values]
    probe = _fresh_copy(optimizer, params, hyper)
    for step_grads in grads:

        def closure(step_grads: list[Tensor] = step_grads) -> Tensor:
            """The gradients of a linear loss (L-BFGS evaluates it several times a step)."""
            for param, grad in zip(params, step_grads, strict=True):
                param.grad = grad.detach().clone()
            return torch.zeros(())

        closure()
        # The class's step, not an instance attribute that an LR scheduler wrapped around the real optimizer.
        type(optimizer).step(probe, closure)
    return [p.detach() for p in params]


def _fresh_copy(optimizer: Optimizer, params: list[torch.nn.Parameter], hyper: dict[str, Any]) -> Optimizer:
    """The optimizer's class and attributes over ``params``, with empty state and none of its hooks.

    Every attribute the optimizer set is kept (``copy.copy`` would keep only what ``Optimizer.__getstate__`` lists,
    dropping a custom optimizer's own): plain data (numbers, strings, tensors, their lists and dicts) copied deeply,
    so the probe's steps change none of it; one that lists the optimizer's parameters (L-BFGS's ``_params``) lists
    the probe's instead, and one that holds them in another way is left out: the probe never reaches the model's
    parameters. Other objects (a bound method an LR scheduler wrapped, what a framework attached) are shared."""
    real = {id(p) for group in optimizer.param_groups for p in group["params"]}
    probe = object.__new__(type(optimizer))
    for name, value in vars(optimizer).items():
        leaves = tree_leaves(value)
        if name.startswith("_optimizer_") and name.endswith("_hooks"):
            value = OrderedDict()
        elif name in ("state", "param_groups"):
            continue
        elif any(isinstance(leaf, Tensor) and id(leaf) in real for leaf in leaves):
            if not (isinstance(value, list | tuple) and all(id(v) in real for v in value)):
                continue
            value = list(params)
        elif all(leaf is None or isinstance(leaf, bool | int | float | complex | str | Tensor) for leaf in leaves):
            value = copy.deepcopy(value)
        setattr(probe, name, value)
    probe.state = defaultdict(dict)
    group = dict(hyper)
    if isinstance(group.get("lr"), float | int) and not isinstance(group.get("lr"), bool):
        group["lr"] = PROBE_LR  # a group with lr 0 (frozen by a schedule) still tells
    probe.param_groups = [{**group, "params": params}]
    return probe
