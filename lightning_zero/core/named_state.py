"""An engine's state by name: the narrow API through which checkpoints and full state dicts read and write it.

Every tensor of the module's ``state_dict`` gets one name (tied parameters share their first name). A parameter
held in a flat buffer is a :class:`ShardedTensor`: the ranges ``[start, end)`` of its flattened elements that
each rank owns (see [Note: flat layout]), this rank's values of them and a way to load them. Any other tensor (a
module buffer, a parameter no buffer holds, e.g. a frozen one at stages 1 and 2) is an *unmanaged* tensor, owned
whole by rank 0. Optimizer state follows the parameters: each rank holds the element-wise state of exactly its
ranges, plus the scalar state (``step``). Nothing here knows about files or Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.core.layout.flat_buffer import FlatParamBuffer
from lightning_zero.core.layout.optim_state import gather_param_states, is_scalar_state, param_shaped, shard_param_state
from lightning_zero.core.layout.resting import engine_access
from lightning_zero.core.shards import BufferGroup, ShardedModel
from lightning_zero.core.store.stores import MasterStore

# read(start, end) -> 1D tensor of elements [start, end) of one flattened tensor
Read = Callable[[int, int], Tensor]
# The names of each param group's parameters, kept in a full checkpoint's optimizer state (torch ignores the key),
# so that param groups added after setup (add_param_group, BaseFinetuning) come back on resume.
PARAM_NAMES_KEY = "lightning_zero_param_names"


@dataclass(frozen=True)
class ShardedTensor:
    """One parameter held in a flat buffer, as saved and loaded.

    Attributes:
        name: its (first) name in the module.
        shape: its full shape.
        dtype: the dtype of the values saved (the fp32 master's where there is one).
        ranges: ``(rank, start, end)`` of the flattened elements each rank owns, non-empty ones, by rank.
        start, end: this rank's range (empty when it owns none).
        whole: each rank owns whole tensors (``partition="parameter"``, see [Note: owner layout]).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    ranges: tuple[tuple[int, int, int], ...]
    start: int
    end: int
    _group: BufferGroup
    _slot: int

    @property
    def _buffer(self) -> FlatParamBuffer:
        return self._group.buffer

    @property
    def whole(self) -> bool:
        return self._buffer.layout.whole_tensors

    def owned(self) -> Tensor:
        """A view of this rank's elements, in :attr:`dtype` (clone it to keep it)."""
        return self._buffer.owned(self._group.best_values(), self._slot)

    @property
    def state_device(self) -> torch.device:
        """Where the optimizer keeps this parameter's state (the host for offloaded stores)."""
        store = self._group.store
        if store is None:
            return self._buffer.data.device
        return torch.device("cpu") if store.offloaded else store.step_view(self._slot).device

    def load(self, read: Read) -> None:
        """Set this rank's elements (and, at stages 1 and 2, where every rank holds every element, the rest) from
        ``read``; values are cast to the dtypes held, so a checkpoint moves between precisions."""
        store = self._group.store
        with torch.no_grad():
            if self.end > self.start:
                owned = read(self.start, self.end)
                (store or self._buffer).load_owned(self._slot, owned)
            if self._buffer.may_change_at_rest:
                numel = self._buffer.layout.slots[self._slot].numel
                self._buffer.load_full(self._slot, read(0, numel))  # type: ignore[attr-defined]


class NamedState:
    """The checkpoint-facing view of one model. See the module docstring."""

    def __init__(self, model: ShardedModel, order: Sequence[int] | None = None) -> None:
        self._model = model
        # Optimizer ``index`` here is the model's ``order[index]`` (a checkpoint that holds them in another order).
        order = range(len(model.optimizers)) if order is None else order
        self._optimizers = [model.optimizers[i] for i in order]
        self._steps = [model.steps[i] for i in order]
        self.comm = model.comm  # the ranks that hold the shards (the shard group)
        self.world = model.topology.world  # every rank (agreements)
        self.writes = model.topology.writes  # whether this rank writes checkpoint files (one replica does)
        self.stage = model.stage
        self.rests_on_disk = model.offload.swap is not None  # some state lives in a swap file (offload to "nvme")

    def tensors(self) -> list[ShardedTensor]:
        """Every parameter held in a flat buffer, in the module's ``state_dict`` order."""
        model = self._model
        found = []
        for group in model.groups:
            buffer = group.buffer
            ranges: dict[int, list[tuple[int, int, int]]] = {slot: [] for slot in range(len(buffer.params))}
            for rank in range(buffer.layout.world_size):
                for piece in buffer.layout.pieces(rank):
                    ranges[piece.slot].append((rank, piece.start, piece.end))
            dtype = group.best_values().dtype
            for slot, param in enumerate(buffer.params):
                piece = buffer.pieces[slot]
                found.append(
                    ShardedTensor(
                        model.names[param],
                        buffer.layout.slots[slot].shape,
                        dtype,
                        tuple(ranges[slot]),
                        piece.start,
                        piece.end,
                        group,
                        slot,
                    )
                )
        order = {name: index for index, (_, name) in reversed(list(enumerate(self.state_dict_keys())))}
        return sorted(found, key=lambda tensor: order[tensor.name])

    def unmanaged(self) -> dict[str, Tensor]:
        """State-dict tensors that no flat buffer holds, by (first) name, owned whole by rank 0."""
        model = self._model
        seen = {id(p) for b in model.buffers for p in b.params}
        extras: dict[str, Tensor] = {}
        for key, value in model.module.state_dict(keep_vars=True).items():
            if isinstance(value, Tensor) and id(value) not in seen:
                seen.add(id(value))
                extras[key] = value
        return extras

    def state_dict_keys(self) -> list[list[str]]:
        """``[key, tensor name]`` for every tensor key of the module's ``state_dict``, in order (tied keys repeat)."""
        name_of = {id(p): name for p, name in self._model.names.items()}
        return [
            [key, name_of.get(id(value), key)]
            for key, value in self._model.module.state_dict(keep_vars=True).items()
            if isinstance(value, Tensor)
        ]

    def optimizer_param_names(self) -> list[list[list[str]]]:
        """Per optimizer, per param group, the names of its parameters."""
        names = self._model.names
        return [[[names[p] for p in group["params"]] for group in o.param_groups] for o in self._optimizers]

    def optimizer_hyperparameters(self, index: int) -> list[dict[str, Any]]:
        """Optimizer ``index``'s param groups without their parameters."""
        optimizer = self._optimizers[index]
        return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]

    def saving(self) -> AbstractContextManager[None]:
        """Around a save: offloaded state is read for it without a copy in memory where it can be (read-only)."""
        return self._model.saving()

    def optimizer_shard_state(self, index: int) -> dict[str, dict[str, Any]]:
        """Optimizer ``index``'s state by parameter name: this rank's pieces of the element-wise state, flattened
        (whole-tensor owners hold it in the parameter's shape), and any other state as it is (see
        :meth:`whole_state_keys`)."""
        model = self._model
        optimizer = self._optimizers[index]
        managed = [entry.param for entry in self._steps[index].entries]
        states = model.optimizer_state(optimizer)  # paged-out state read back (see core/store/disk.py)
        return {
            model.names[p]: {k: v.reshape(-1) if param_shaped(v, p.shape) else v for k, v in states[id(p)].items()}
            for p in managed
            if states.get(id(p))
        }

    def whole_state_keys(self, index: int, states: Mapping[str, dict[str, Any]]) -> dict[str, list[str]]:
        """Per parameter name, the keys of optimizer ``index``'s ``states`` (:meth:`optimizer_shard_state`'s: state
        paged from NVMe rests in the swap file, the optimizer holding placeholders) that are neither scalar nor
        element-wise (Adafactor's row and column factors): only whole-tensor owners have such state, saved whole
        by the owner."""
        model = self._model
        found = {}
        for entry in self._steps[index].entries:
            if not entry.store.buffer.layout.whole_tensors:
                continue  # flat pieces: element-wise state only (see [Note: the element-wise probe])
            state = states.get(model.names[entry.param]) or {}
            shape = entry.param.shape
            keys = sorted(k for k, v in state.items() if not is_scalar_state(v) and not param_shaped(v, shape))
            if keys:
                found[model.names[entry.param]] = keys
        return found

    def load_optimizer_shard_state(
        self, index: int, hyperparameters: list[dict[str, Any]], states: Mapping[str, dict[str, Any]]
    ) -> None:
        """Set optimizer ``index``'s hyper-parameters and its state by parameter name (this rank's pieces)."""
        model = self._model
        optimizer = self._optimizers[index]
        check_same_optimizer_type(optimizer, hyperparameters)
        for group, hyper in zip(optimizer.param_groups, hyperparameters, strict=True):
            group.update(hyper)
        optimizer.state.clear()
        by_name = {model.names[p]: p for g in optimizer.param_groups for p in g["params"]}
        whole = {id(e.param) for e in self._steps[index].entries if e.store.buffer.layout.whole_tensors}
        for name, state in states.items():
            param = by_name[name]
            if id(param) in whole:  # the owner steps the parameter in its own shape (see [Note: owner layout])
                state = {k: v.view(param.shape) if param_shaped(v, param.shape) else v for k, v in state.items()}
            optimizer.state[param] = state
        model.absorb_optimizer_state(optimizer)

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The full shape of parameter ``name``."""
        return next(tuple(p.shape) for p, n in self._model.names.items() if n == name)

    def owned_range(self, name: str) -> tuple[int, int] | None:
        """This rank's ``[start, end)`` of parameter ``name``; ``None`` when no flat buffer holds it."""
        for tensor in self.tensors():
            if tensor.name == name:
                return tensor.start, tensor.end
        return None


# Entries that LR schedulers add to param groups (OneCycleLR, CyclicLR, ...), not an optimizer's hyper-parameters.
_SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "base_lr", "base_momentum", "max_momentum"})


def check_same_optimizer_type(optimizer: Optimizer, saved_groups: Sequence[Mapping[str, Any]]) -> None:
    """Refuse optimizer state saved by another type of optimizer (AdamW's loaded into SGD), on every rank alike: the
    saved groups hold hyper-parameters this optimizer does not know and lack some of its own. (A group only
    missing some, saved by an older torch, or holding a scheduler's entries, loads.)"""
    saved = {key for group in saved_groups for key in group} - {"params", "param_names"} - _SCHEDULER_KEYS
    known = set(optimizer.defaults).union(*(group.keys() for group in optimizer.param_groups))
    foreign, missing = sorted(saved - known), sorted(set(optimizer.defaults) - saved)
    if foreign and missing:
        kind = type(optimizer).__qualname__
        raise ValueError(
            f"the checkpoint's optimizer state comes from another optimizer type: its param groups hold {foreign}, "
            f"which {kind} does not have, and lack {kind}'s {missing}. Resume with the optimizer that saved it, or "
            "start from the checkpoint's weights alone with a fresh optimizer (Trainer: lightning_zero."
            "load_from_checkpoint(Model, path), then fit without ckpt_path; Fabric: fabric.load(path, {'model': "
            "model}))."
        )


def full_optimizer_state_dict(model: ShardedModel, optimizer: Optimizer) -> dict[str, Any]:
    """The state dict ``optimizer`` would have without sharding (collective; every rank gets it)."""
    entries = {id(e.param): e for e in model.step_of(optimizer).entries}
    held = model.optimizer_state(optimizer)
    full: dict[int, dict[str, Any]] = {}
    for group in model.trained:
        buffer = group.buffer
        mine = {
            entries[id(p)].slot: p for p in buffer.params if id(p) in entries and entries[id(p)].store.buffer is buffer
        }
        states = [held.get(id(mine[slot]), {}) if slot in mine else {} for slot in range(len(buffer.params))]
        for slot, state in enumerate(gather_param_states(buffer, states, model.comm)):
            if state and slot in mine:
                full[id(mine[slot])] = state
    params = [p for g in optimizer.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    for param in params:  # parameters no buffer holds keep their state in full form
        if id(param) not in full and optimizer.state.get(param):
            full[id(param)] = dict(optimizer.state[param])
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [index[id(p)] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    names = [[model.names[p] for p in group["params"]] for group in optimizer.param_groups]
    return {"state": {index[pid]: state for pid, state in full.items()}, "param_groups": groups, PARAM_NAMES_KEY: names}


def load_full_optimizer_state_dict(model: ShardedModel, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Load an ordinary (unsharded) optimizer state dict into ``optimizer``'s shards."""
    saved_groups = state_dict["param_groups"]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if [len(g["params"]) for g in saved_groups] != sizes:
        raise ValueError(
            f"the checkpoint's optimizer has param groups of sizes {[len(g['params']) for g in saved_groups]}, "
            f"this one {sizes}: the model or configure_optimizers() differs."
        )
    check_same_optimizer_type(optimizer, saved_groups)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
    optimizer.state.clear()
    entries = {id(e.param): e for e in model.step_of(optimizer).entries}
    for key, state in state_dict["state"].items():
        param = params[int(key)]
        entry = entries.get(id(param))
        if entry is None:
            optimizer.state[param] = {k: _to(v, param.device) for k, v in state.items()}
            continue
        buffer = entry.store.buffer
        shape = buffer.layout.slots[entry.slot].shape
        whole = buffer.layout.whole_tensors
        sliced = shard_param_state(state, buffer.pieces[entry.slot], shape, model.names[param], whole)
        if whole and not sliced:
            continue  # another rank owns the parameter whole, and its state
        home = entry.store.step_view(entry.slot).device if not entry.store.offloaded else torch.device("cpu")
        optimizer.state[param] = {k: _to(v, home) for k, v in sliced.items()}
    model.absorb_optimizer_state(optimizer)


def full_state_dict(model: ShardedModel, keep: bool) -> dict[str, Tensor]:
    """The module's ``state_dict`` with full tensors, gathered one buffer at a time (collective).

    Parameters with a master copy get its values (fp32), so the result resumes a mixed-precision run exactly. Only
    ranks with ``keep`` (e.g. the one that writes the file) collect the tensors; the others get ``{}``.
    """
    collected: dict[int, Tensor] = {}
    for group in model.groups:
        buffer = group.buffer
        full = buffer.full_values(group.best_values(), model.comm)
        if keep:
            collected.update((id(p), v.clone()) for p, v in zip(buffer.params, buffer.param_views(full), strict=True))
        del full
    if not keep:
        return {}
    state = model.module.state_dict(keep_vars=True)
    with engine_access():
        return {
            key: collected[id(value)] if id(value) in collected else value.detach().clone()
            for key, value in state.items()
        }


def load_masters(model: ShardedModel, state_dict: Mapping[str, Tensor]) -> None:
    """Give the masters the saved values themselves, not their 16-bit rounding (after ``load_state_dict``)."""
    with torch.no_grad():
        for tensor in NamedState(model).tensors():
            saved = state_dict.get(tensor.name)
            if saved is not None and tensor.end > tensor.start:
                store = tensor._group.store
                if isinstance(store, MasterStore) or (store is not None and store.paged):
                    store.load_owned(tensor._slot, saved.detach().reshape(-1)[tensor.start : tensor.end])


def _to(value: object, device: torch.device) -> object:
    """Element-wise state goes to the parameter's device; scalars stay where the optimizer keeps them."""
    return value.to(device) if isinstance(value, Tensor) and value.dim() > 0 else value


def restore_added_param_groups(
    model: ShardedModel, optimizers: Sequence[Optimizer], saved: Sequence[tuple[list[list[str]] | None, list[dict]]]
) -> bool:
    """Give each optimizer the param groups a checkpoint has beyond its own: groups added after setup by
    ``add_param_group`` or ``BaseFinetuning``, which on resume rebuilds them before the checkpoint is read.
    ``saved`` holds per optimizer the names of each group's parameters (``None`` where unknown) and its
    hyper-parameters. Returns whether any group was added (then the engine's ``begin_iteration()`` shards them)."""
    by_name = {name: param for param, name in model.names.items()}
    added = False
    for optimizer, (names, hyper) in zip(optimizers, saved, strict=True):
        current = [[model.names[p] for p in group["params"]] for group in optimizer.param_groups]
        if names is None or len(names) <= len(current) or names[: len(current)] != current:
            continue
        for group_names, group_hyper in zip(names[len(current) :], hyper[len(current) :], strict=True):
            options = {k: v for k, v in group_hyper.items() if k not in ("params", "param_names")}
            optimizer.add_param_group({**options, "params": [by_name[n] for n in group_names]})
            added = True
    return added
