"""An engine's tensors by name, as flat element ranges: what a sharded checkpoint saves and loads.

Every tensor of the module's ``state_dict`` gets one name (tied parameters share their first name). A
parameter held in a flat buffer is described by the ranges ``[start, end)`` of its flattened elements that
each rank owns (see [Note: flat layout]); any other tensor (a module buffer, a parameter that no buffer
holds, e.g. a frozen one at stages 1 and 2) is owned whole by rank 0. Optimizer state follows the
parameters: each rank has the element-wise state of exactly its ranges, plus the scalar state (``step``).

:func:`full_optimizer_state_dict` / :func:`load_full_optimizer_state_dict` convert an optimizer's sharded state
to and from the ordinary (unsharded) torch form of a full checkpoint.

Nothing here reads or writes files: :func:`tensor_specs`, :func:`collect_rank_state` and
:func:`load_params` / :func:`load_optimizer` take plain data and a ``read`` callable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.flat_buffer import FlatParamBuffer
from lightning_zero.core.optim_state import gather_param_states, is_scalar_state, shard_param_state

# read(section, name, start, end) -> 1D tensor of elements [start, end) of the flattened tensor ``name``;
# ``section`` is "params" or (optimizer index, state key).
Reader = Callable[[Any, str, int, int], Tensor]


def _extras(engine: ZeroEngine) -> dict[str, Tensor]:
    """State-dict tensors that no flat buffer holds, by name (first name of a tied tensor only)."""
    managed = {id(p) for b in engine.buffers for p in b.params}
    seen: set[int] = set(managed)
    extras: dict[str, Tensor] = {}
    for key, value in engine.module.state_dict(keep_vars=True).items():
        if isinstance(value, Tensor) and id(value) not in seen:
            seen.add(id(value))
            extras[key] = value
    return extras


def tensor_specs(engine: ZeroEngine) -> dict[str, dict[str, Any]]:
    """Per tensor name: shape, dtype and ``ranges`` ``[[rank, start, end], ...]`` (non-empty, by rank)."""
    specs: dict[str, dict[str, Any]] = {}
    for buffer in engine.buffers:
        ranges: dict[int, list[list[int]]] = {slot: [] for slot in range(len(buffer.params))}
        for rank in range(buffer.layout.world_size):
            for piece in buffer.layout.pieces(rank):
                ranges[piece.slot].append([rank, piece.start, piece.end])
        dtype = buffer.master.dtype if buffer.master is not None else buffer.data.dtype  # masters are saved
        for slot, param in enumerate(buffer.params):
            specs[engine.names[param]] = _spec(buffer.layout.slots[slot].shape, dtype, ranges[slot])
    for name, tensor in _extras(engine).items():
        specs[name] = _spec(tuple(tensor.shape), tensor.dtype, [[0, 0, tensor.numel()]] if tensor.numel() else [])
    order = {name: index for index, (_, name) in reversed(list(enumerate(state_dict_keys(engine))))}
    return dict(sorted(specs.items(), key=lambda item: order[item[0]]))


def _spec(shape: tuple[int, ...], dtype: torch.dtype, ranges: list[list[int]]) -> dict[str, Any]:
    return {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "ranges": ranges}


def state_dict_keys(engine: ZeroEngine) -> list[list[str]]:
    """``[key, tensor name]`` for every tensor key of the module's ``state_dict``, in order (tied keys repeat)."""
    name_of = {id(p): name for p, name in engine.names.items()}
    keys = []
    for key, value in engine.module.state_dict(keep_vars=True).items():
        if isinstance(value, Tensor):
            keys.append([key, name_of.get(id(value), key)])
    return keys


def optimizer_groups(engine: ZeroEngine) -> list[list[list[str]]]:
    """Per optimizer, per param group, the names of its parameters."""
    return [[[engine.names[p] for p in group] for group in b.groups] for b in engine.bindings]


def collect_rank_state(engine: ZeroEngine, optimizers: bool = True) -> dict[str, Any]:
    """This rank's owned ranges of every parameter and (with ``optimizers``) of its optimizer state, as new
    tensors (no views)."""
    params: dict[str, Tensor] = {}
    optimizer_states = []
    for buffer in engine.buffers:
        source = buffer.master if buffer.master is not None else buffer.shard
        for piece in buffer.pieces:
            if piece.numel:
                view = FlatParamBuffer.shard_view(source, piece)
                params[engine.names[buffer.params[piece.slot]]] = view.detach().cpu().clone()
    if engine.comm.rank == 0:
        params.update({name: t.detach().cpu().reshape(-1).clone() for name, t in _extras(engine).items()})
    for binding in engine.bindings if optimizers else []:
        state: dict[str, dict[str, Any]] = {}
        for bucket in binding.buckets:
            buffer = bucket.buffer
            for piece, piece_param in zip(buffer.pieces, buffer.piece_params, strict=True):
                saved = binding.optimizer.state.get(piece_param)
                if saved:
                    state[engine.names[buffer.params[piece.slot]]] = {
                        k: (v.detach().cpu().clone() if isinstance(v, Tensor) else v) for k, v in saved.items()
                    }
        groups = [{k: v for k, v in g.items() if k != "params"} for g in binding.optimizer.param_groups]
        optimizer_states.append({"state": state, "param_groups": groups})
    return {"params": params, "optimizers": optimizer_states}


def load_params(engine: ZeroEngine, specs: dict[str, dict[str, Any]], read: Reader) -> None:
    """Fill the parameters (stage 3: this rank's shard; before: every parameter), their master copies and the
    other tensors. Values are cast to the dtypes held here, so a checkpoint moves between precisions."""
    with torch.no_grad():
        for buffer in engine.buffers:
            for slot, param in enumerate(buffer.params):
                name, piece = engine.names[param], buffer.pieces[slot]
                owned = read("params", name, piece.start, piece.end) if piece.numel else None
                if buffer.master is not None and owned is not None:
                    FlatParamBuffer.shard_view(buffer.master, piece).copy_(owned)
                if buffer.keep_full:  # stages 1 and 2: every rank holds every parameter
                    param.data.copy_(read("params", name, 0, param.numel()).view_as(param))
                elif owned is not None:
                    FlatParamBuffer.shard_view(buffer.shard, piece).copy_(owned)
        for name, tensor in _extras(engine).items():
            if tensor.numel():
                tensor.data.copy_(read("params", name, 0, tensor.numel()).view_as(tensor))


def load_optimizer(
    engine: ZeroEngine, index: int, saved: dict[str, Any], scalars: dict[str, dict[str, Any]], read: Reader
) -> None:
    """Load optimizer ``index``: ``saved["param_groups"]`` hyper-parameters, ``scalars`` (per name: scalar
    state and the element-wise keys under ``"__tensor_keys__"``), element-wise state through ``read``."""
    binding = engine.bindings[index]
    optimizer = binding.optimizer
    for group, hyper in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        group.update(hyper)
    optimizer.state.clear()
    for bucket in binding.buckets:
        buffer = bucket.buffer
        for piece, piece_param in zip(buffer.pieces, buffer.piece_params, strict=True):
            name = engine.names[buffer.params[piece.slot]]
            if name not in scalars:
                continue
            state = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in scalars[name].items()}
            keys = state.pop("__tensor_keys__")
            for key in keys:
                state[key] = read((index, key), name, piece.start, piece.end).to(piece_param.device)
            optimizer.state[piece_param] = state


def scalar_states(state: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per name, the scalar state plus the element-wise keys under ``"__tensor_keys__"`` (a rank file's summary)."""
    out = {}
    for name, values in state.items():
        out[name] = {k: v for k, v in values.items() if is_scalar_state(v)}
        out[name]["__tensor_keys__"] = sorted(k for k, v in values.items() if not is_scalar_state(v))
    return out


def full_optimizer_state_dict(engine: ZeroEngine, optimizer: Optimizer) -> dict[str, Any]:
    """The state dict ``optimizer`` would have without sharding (collective; every rank gets it)."""
    binding = engine.binding(optimizer)
    full_state: dict[nn.Parameter, dict[str, Any]] = {}
    for bucket in binding.buckets:
        pieces = [dict(optimizer.state.get(p, {})) for p in bucket.buffer.piece_params]
        for param, state in zip(
            bucket.buffer.params, gather_param_states(bucket.buffer, pieces, engine.comm), strict=True
        ):
            if state:
                full_state[param] = state
    index = {p: i for i, p in enumerate(p for group in binding.groups for p in group)}
    groups = []
    for group, params in zip(optimizer.param_groups, binding.groups, strict=True):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [index[p] for p in params]})
    return {"state": {index[p]: s for p, s in full_state.items()}, "param_groups": groups}


def load_full_optimizer_state_dict(engine: ZeroEngine, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Load an ordinary (unsharded) optimizer state dict into ``optimizer``'s pieces."""
    binding = engine.binding(optimizer)
    saved_groups = state_dict["param_groups"]
    if [len(g["params"]) for g in saved_groups] != [len(g) for g in binding.groups]:
        raise ValueError(
            f"the checkpoint's optimizer has param groups of sizes {[len(g['params']) for g in saved_groups]}, "
            f"this one {[len(g) for g in binding.groups]}: the model or configure_optimizers() differs."
        )
    by_index = dict(enumerate(p for group in binding.groups for p in group))
    saved_state = {by_index[int(i)]: s for i, s in state_dict["state"].items()}
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
    optimizer.state.clear()
    for bucket in binding.buckets:
        buffer = bucket.buffer
        for piece, piece_param in zip(buffer.pieces, buffer.piece_params, strict=True):
            param = buffer.params[piece.slot]
            if param in saved_state:
                shape = buffer.layout.slots[piece.slot].shape
                state = shard_param_state(saved_state[param], piece, shape, engine.names[param])
                optimizer.state[piece_param] = {k: _to_device(v, piece_param.device) for k, v in state.items()}


def _to_device(value: Any, device: torch.device) -> Any:
    """Element-wise state goes to the parameter's device; scalars stay where the optimizer keeps them."""
    return value if is_scalar_state(value) else value.to(device)
