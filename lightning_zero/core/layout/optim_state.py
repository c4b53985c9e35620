"""Optimizer state between its sharded form (one entry per piece) and the ordinary per-parameter form.

Element-wise state (Adam's ``exp_avg``, SGD's ``momentum_buffer``, Adagrad's ``sum``) has the shape
of its parameter, so a piece keeps the matching slice of it; scalar state (``step``) is copied. Any
other shape means the optimizer is not element-wise and cannot be sharded flat.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_zero.core.comm import Communicator
from lightning_zero.core.layout.flat_buffer import FlatParamBuffer
from lightning_zero.core.layout.pieces import Piece


def is_scalar_state(value: Any) -> bool:
    return not isinstance(value, Tensor) or value.dim() == 0


def shard_param_state(
    state: Mapping[str, Any], piece: Piece, shape: tuple[int, ...], name: str, whole: bool = False
) -> dict[str, Any]:
    """The part of one parameter's optimizer state that belongs to ``piece``. With ``whole`` (whole-tensor owners,
    see [Note: owner layout]) the owner keeps all of it, in its own shapes, and any other rank none."""
    if whole:
        if piece.numel == 0 and math.prod(shape):
            return {}
        return {
            k: (v.detach().clone().reshape(shape) if param_shaped(v, shape) else _copy(v)) for k, v in state.items()
        }
    sharded: dict[str, Any] = {}
    for key, value in state.items():
        if is_scalar_state(value):
            sharded[key] = value.clone() if isinstance(value, Tensor) else value
        elif tuple(value.shape) == shape:
            sharded[key] = value.detach().reshape(-1)[piece.start : piece.end].clone()
        else:
            raise ValueError(
                f"optimizer state {key!r} of parameter {name!r} has shape {tuple(value.shape)}, not the parameter's "
                f"{shape}: the optimizer is not element-wise, so partition='flat' cannot shard it. Use an "
                "element-wise optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, ...)."
            )
    return sharded


def param_shaped(value: Any, shape: tuple[int, ...]) -> bool:
    """Element-wise state of a parameter of ``shape``, whole (in that shape) or flattened (as checkpoints hold it)."""
    return not is_scalar_state(value) and (tuple(value.shape) == shape or value.shape == (math.prod(shape),))


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value


def _elementwise_test(buffer: FlatParamBuffer) -> Callable[[int, Any], bool]:
    """Whether a state value of parameter ``slot`` is element-wise (sharded like the parameter)."""
    shapes = [slot.shape for slot in buffer.layout.slots]
    whole = buffer.layout.whole_tensors
    return lambda slot, value: not is_scalar_state(value) and (not whole or param_shaped(value, shapes[slot]))


def _summary(
    piece_states: list[Mapping[str, Any]], elementwise: Callable[[int, Any], bool], whole: bool
) -> dict[str, Any]:
    return {
        "tensor_keys": {k: str(v.dtype) for i, s in enumerate(piece_states) for k, v in s.items() if elementwise(i, v)},
        "keys": {i: sorted(k for k, v in s.items() if elementwise(i, v)) for i, s in enumerate(piece_states) if s},
        "scalars": {i: {k: v for k, v in s.items() if is_scalar_state(v)} for i, s in enumerate(piece_states) if s},
        "whole": {
            i: {k: v.detach().cpu() for k, v in s.items() if not is_scalar_state(v) and not elementwise(i, v)}
            for i, s in enumerate(piece_states)
            if s and whole
        },
    }


def gather_param_states(
    buffer: FlatParamBuffer, piece_states: list[Mapping[str, Any]], comm: Communicator
) -> list[dict[str, Any]]:
    """Assemble every parameter's full optimizer state of one buffer from all ranks' pieces (collective).

    ``piece_states`` holds this rank's state for each of ``buffer.pieces`` (an empty dict where there is
    none). Returns one dict per parameter of the buffer, empty when no rank has state for it.
    """
    # Which parameters have state, their element-wise keys and scalar state: small objects from every rank. With
    # whole-tensor owners, state that is not parameter-shaped (Adafactor's factors) travels whole, from its owner.
    elementwise = _elementwise_test(buffer)
    local = _summary(piece_states, elementwise, buffer.layout.whole_tensors)
    everyone = comm.all_gather_object(local)
    full: dict[int, dict[str, Any]] = {}
    keys: dict[int, set[str]] = {}
    for entry in everyone:
        for slot, values in entry["scalars"].items():
            full.setdefault(slot, dict(values))
        for slot, names in entry["keys"].items():
            keys.setdefault(slot, set()).update(names)
        for slot, values in entry["whole"].items():
            full[slot].update({k: v.to(buffer.data.device) for k, v in values.items()})
    dtypes = {key: dtype for entry in everyone for key, dtype in entry["tensor_keys"].items()}
    for key in sorted(dtypes):
        dtype = getattr(torch, dtypes[key].removeprefix("torch."))
        shard = torch.zeros(buffer.shard_numel, dtype=dtype, device=buffer.data.device)
        for slot, (piece, state) in enumerate(zip(buffer.pieces, piece_states, strict=True)):
            if key in state and elementwise(slot, state[key]):
                FlatParamBuffer.shard_view(shard, piece).copy_(state[key].reshape(-1))
        flat = torch.empty(buffer.layout.padded_numel, dtype=shard.dtype, device=shard.device)
        comm.all_gather(flat, shard, sizes=buffer.layout.uneven_sizes)
        for slot, view in enumerate(buffer.param_views(flat)):
            if slot in full and key in keys.get(slot, ()):
                full[slot][key] = view.clone()
    return [full.get(slot, {}) for slot in range(len(buffer.params))]
