"""Optimizer state between its sharded form (one entry per piece) and the ordinary per-parameter form.

Element-wise state (Adam's ``exp_avg``, SGD's ``momentum_buffer``, Adagrad's ``sum``) has the shape
of its parameter, so a piece keeps the matching slice of it; scalar state (``step``) is copied. Any
other shape means the optimizer is not element-wise and cannot be sharded flat.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_zero.core.comm import Communicator
from lightning_zero.core.flat_buffer import FlatParamBuffer
from lightning_zero.core.layout import Piece


def is_scalar_state(value: Any) -> bool:
    return not isinstance(value, Tensor) or value.dim() == 0


def shard_param_state(state: Mapping[str, Any], piece: Piece, shape: tuple[int, ...], name: str) -> dict[str, Any]:
    """The part of one parameter's optimizer state that belongs to ``piece``."""
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


def gather_param_states(
    buffer: FlatParamBuffer, piece_states: list[Mapping[str, Any]], comm: Communicator
) -> list[dict[str, Any]]:
    """Assemble every parameter's full optimizer state of one buffer from all ranks' pieces (collective).

    ``piece_states`` holds this rank's state for each of ``buffer.pieces`` (an empty dict where there is
    none). Returns one dict per parameter of the buffer, empty when no rank has state for it.
    """
    # Which parameters have state, their element-wise keys and scalar state: small objects from every rank.
    local = {
        "tensor_keys": {k: str(v.dtype) for s in piece_states for k, v in s.items() if not is_scalar_state(v)},
        "scalars": {
            piece.slot: {k: v for k, v in s.items() if is_scalar_state(v)}
            for piece, s in zip(buffer.pieces, piece_states, strict=True)
            if s
        },
    }
    everyone = comm.all_gather_object(local)
    full: dict[int, dict[str, Any]] = {}
    for entry in everyone:
        for slot, values in entry["scalars"].items():
            full.setdefault(slot, dict(values))
    dtypes = {key: dtype for entry in everyone for key, dtype in entry["tensor_keys"].items()}
    for key in sorted(dtypes):
        dtype = getattr(torch, dtypes[key].removeprefix("torch."))
        shard = torch.zeros(buffer.layout.shard_numel, dtype=dtype, device=buffer.data.device)
        for piece, state in zip(buffer.pieces, piece_states, strict=True):
            if key in state:
                FlatParamBuffer.shard_view(shard, piece).copy_(state[key])
        flat = torch.empty(buffer.layout.padded_numel, dtype=shard.dtype, device=shard.device)
        comm.all_gather(flat, shard)
        for slot, view in enumerate(buffer.param_views(flat)):
            if slot in full:
                full[slot][key] = view.clone()
    return [full.get(slot, {}) for slot in range(len(buffer.params))]
