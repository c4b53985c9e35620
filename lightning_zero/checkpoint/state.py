"""What a sharded checkpoint saves and loads of an engine, through the engine's narrow named-state API.

A parameter held in a flat buffer is saved by each rank as the elements it owns (its ranges, see
``core/named_state.py``); any other tensor (a module buffer, a parameter that no buffer holds, e.g. a frozen one
at stages 1 and 2) is saved whole by rank 0. Optimizer state follows the parameters: each rank saves the
element-wise state of exactly its ranges, plus the scalar state (``step``). Nothing here writes files: the
functions take plain data and a ``read`` callable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import Tensor

from lightning_zero.checkpoint.metadata import CheckpointError
from lightning_zero.core.layout.optim_state import is_scalar_state
from lightning_zero.core.named_state import NamedState

# read(section, name, start, end) -> 1D tensor of elements [start, end) of the flattened tensor ``name``;
# ``section`` is "params" or (optimizer index, state key).
Reader = Callable[[Any, str, int, int], Tensor]
# read_whole((optimizer index, state key), name) -> optimizer state saved whole by the parameter's owner
WholeReader = Callable[[tuple[int, str], str], Tensor]


def tensor_specs(state: NamedState) -> dict[str, dict[str, Any]]:
    """Per tensor name: shape, dtype and ``ranges`` ``[[rank, start, end], ...]`` (non-empty, by rank)."""
    specs = {t.name: _spec(t.shape, t.dtype, [list(r) for r in t.ranges]) for t in state.tensors()}
    for name, tensor in state.unmanaged().items():
        specs[name] = _spec(tuple(tensor.shape), tensor.dtype, [[0, 0, tensor.numel()]] if tensor.numel() else [])
    order = {name: index for index, (_, name) in reversed(list(enumerate(state.state_dict_keys())))}
    return dict(sorted(specs.items(), key=lambda item: order[item[0]]))


def _spec(shape: tuple[int, ...], dtype: torch.dtype, ranges: list[list[int]]) -> dict[str, Any]:
    return {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "ranges": ranges}


def collect_rank_state(state: NamedState, rank: int, optimizers: bool = True, views: bool = False) -> dict[str, Any]:
    """This rank's owned ranges of every parameter and (with ``optimizers``) of its optimizer state, as CPU tensors
    to save (see :func:`for_saving`: no copy of a storage they cover, such as a host master or a stage-3 shard);
    with ``views``, as views of the live state wherever it is (for a snapshot, which copies each into memory of
    its own)."""
    prepare = _as_they_are if views else for_saving
    params = {t.name: t.owned() for t in state.tensors() if t.end > t.start}
    if rank == 0:
        params.update({name: t.reshape(-1) for name, t in state.unmanaged().items()})
    optimizer_states = []
    for index in range(len(state.optimizer_param_names()) if optimizers else 0):
        held = state.optimizer_shard_state(index)
        tensors = {(name, k): v for name, values in held.items() for k, v in values.items() if isinstance(v, Tensor)}
        kept = prepare(tensors)
        saved = {name: {k: kept.get((name, k), v) for k, v in values.items()} for name, values in held.items()}
        hyper = state.optimizer_hyperparameters(index)
        optimizer_states.append({"state": saved, "param_groups": hyper, "whole": state.whole_state_keys(index, held)})
    return {"params": prepare(params), "optimizers": optimizer_states}


def _as_they_are(tensors: dict[Any, Tensor]) -> dict[Any, Tensor]:
    return {key: tensor.detach() for key, tensor in tensors.items()}


# Bytes of a storage that its saved views may leave out and still be saved as views: a flat buffer's padding (at
# most one element per rank) and the page rounding of a swap-file region.
_SLACK = 8192


def for_saving(tensors: dict[Any, Tensor]) -> dict[Any, Tensor]:
    """``tensors`` on the CPU, ready for ``torch.save``, which writes each storage once, whole. Tensors that
    together cover (nearly) all of their storage are kept as they are; any other is cloned, so that a view of a
    larger buffer (a stage-1/2 parameter's piece of the full flat buffer) does not drag the buffer into the file."""
    cpu = {key: tensor.detach().cpu() for key, tensor in tensors.items()}
    covered: dict[int, int] = {}
    for tensor in cpu.values():
        key = tensor.untyped_storage().data_ptr()
        covered[key] = covered.get(key, 0) + tensor.numel() * tensor.element_size()
    kept = {}
    for key, tensor in cpu.items():
        storage = tensor.untyped_storage()
        whole = storage.nbytes() - covered[storage.data_ptr()] <= _SLACK and tensor.is_contiguous()
        kept[key] = tensor if whole else tensor.clone()
    return kept


def load_params(state: NamedState, read: Reader, names: Collection[str] | None = None) -> None:
    """Fill the parameters (stage 3: this rank's shard; before: every parameter), their master copies and the
    other tensors; only those called ``names`` where given (the others keep their values). Values are cast to the
    dtypes held here, so a checkpoint moves between precisions."""
    wanted = None if names is None else set(names)
    for tensor in state.tensors():
        if wanted is None or tensor.name in wanted:
            tensor.load(lambda start, end, name=tensor.name: read("params", name, start, end))
    with torch.no_grad():
        for name, tensor in state.unmanaged().items():
            if tensor.numel() and (wanted is None or name in wanted):
                tensor.data.copy_(read("params", name, 0, tensor.numel()).view_as(tensor))


def load_optimizer(
    state: NamedState,
    index: int,
    hyperparameters: list[dict[str, Any]],
    scalars: dict[str, dict[str, Any]],
    read: Reader,
    read_whole: WholeReader | None = None,
    where: str = "the checkpoint",
) -> None:
    """Load optimizer ``index``: its param groups' ``hyperparameters``, ``scalars`` (per name: scalar state, the
    element-wise keys under ``"__tensor_keys__"`` and those saved whole under ``"__whole_keys__"``), element-wise
    state through ``read`` and whole state through ``read_whole``."""
    owned = {t.name: t for t in state.tensors()}
    in_optimizer = {name for group in state.optimizer_param_names()[index] for name in group}
    states: dict[str, dict[str, Any]] = {}
    for name, values in scalars.items():
        if name not in in_optimizer:
            continue
        tensor = owned.get(name)
        if tensor is not None and tensor.whole and tensor.end == tensor.start:
            continue  # another rank owns the parameter whole, and its state (see [Note: owner layout])
        loaded = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in values.items()}
        for key in loaded.pop("__whole_keys__", []):
            if tensor is None or not tensor.whole or read_whole is None:
                raise CheckpointError(
                    f"{where}: optimizer {index}'s state {key!r} of {name!r} is not element-wise (it was saved whole "
                    "by the rank that owned the parameter, e.g. Adafactor's factors), so it cannot be split into "
                    "flat pieces. Resume with ZeroStrategy(partition='parameter'), at any world size and stage."
                )
            loaded[key] = read_whole((index, key), name).to(tensor.state_device)
        for key in loaded.pop("__tensor_keys__"):
            if tensor is not None:
                loaded[key] = read((index, key), name, tensor.start, tensor.end).to(tensor.state_device)
            else:  # a parameter no buffer holds yet (frozen now, in the optimizer): its state in full form
                shape = state.shape_of(name)
                loaded[key] = read((index, key), name, 0, math.prod(shape)).view(shape)
        states[name] = loaded
    state.load_optimizer_shard_state(index, hyperparameters, states)


def scalar_states(
    states: dict[str, dict[str, Any]], whole: dict[str, list[str]] | None = None
) -> dict[str, dict[str, Any]]:
    """Per name, the scalar state plus the element-wise keys under ``"__tensor_keys__"`` and the keys saved whole
    (``whole``) under ``"__whole_keys__"`` (a rank file's summary)."""
    out = {}
    for name, values in states.items():
        kept_whole = (whole or {}).get(name, [])
        out[name] = {k: v for k, v in values.items() if is_scalar_state(v)}
        out[name]["__tensor_keys__"] = sorted(
            k for k, v in values.items() if not is_scalar_state(v) and k not in kept_whole
        )
        out[name]["__whole_keys__"] = sorted(kept_whole)
    return out
