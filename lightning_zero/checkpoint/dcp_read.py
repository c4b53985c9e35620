"""Read a ``torch.distributed.checkpoint`` (DCP) directory written by FSDP2 / Lightning's ``ModelParallelStrategy`` as
a :class:`~lightning_zero.checkpoint.ShardedCheckpoint`, so that every load path of a sharded checkpoint (resume at
any stage and world size, load hooks that rename keys, ``load_from_checkpoint``) takes it as it is.

A read of elements ``[start, end)`` of a flattened tensor asks DCP for the rows that hold them (DCP's own
resharding, ``create_read_items_for_chunk_list``): each rank reads the saved chunks that overlap its range, one
tensor at a time; nothing is gathered. Keys: see [Note: the DCP layout].
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem, SavePlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from lightning_zero.checkpoint.dcp_layout import (
    LIGHTNING_META_FILE,
    LIGHTNING_MODEL,
    TORCH_MODEL,
    TORCH_OPTIM,
    lightning_optimizer_index,
)
from lightning_zero.checkpoint.metadata import CheckpointError
from lightning_zero.checkpoint.sharded import ShardedCheckpoint

_Path = tuple[Any, ...]


class DcpCheckpoint(ShardedCheckpoint):
    """A DCP directory opened for reading (its ``.metadata`` only; tensors are read when asked for).

    The model is under ``state_dict`` (Lightning's layout) or ``model`` (torch's); the optimizers under
    ``optimizer_<n>`` or ``optim`` (one optimizer, or several merged as ``get_state_dict`` merges them).

    Raises:
        CheckpointError: if the directory's ``.metadata`` cannot be read or holds no model.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.where = f"DCP checkpoint '{self.path}'"
        self._reader = FileSystemReader(self.path)
        try:
            self._dcp: Metadata = self._reader.read_metadata()
        except Exception as error:
            raise CheckpointError(
                f"{self.where}: its .metadata cannot be read ({type(error).__name__}: {error}). Use a complete "
                "checkpoint that torch.distributed.checkpoint.save wrote."
            ) from error
        self._reader.set_up_storage_reader(self._dcp, True)
        planner_data = self._dcp.planner_data or {}
        self._fqn: dict[_Path, str] = {tuple(path): fqn for fqn, path in planner_data.items()}
        self._fqn.update({(fqn,): fqn for fqn in self._dcp.state_dict_metadata if fqn not in planner_data})
        self._model, self._optimizer_tops = self._layout()
        keys = [p[1] for p in self._fqn if len(p) == 2 and p[0] == self._model and self._is_tensor(p)]
        self.tensors = {key: self._spec(self._fqn[(self._model, key)]) for key in keys}
        self._saved, self._saved_names, self._given, self._files = self.tensors, {}, {}, {}
        self._groups = [self._param_groups(top) for top in self._optimizer_tops]
        self._scalars: dict[int, dict[str, dict[str, Any]]] = {}
        self.metadata = {
            "tensors": self.tensors,
            "state_dict_keys": [[key, key] for key in keys],
            "optimizers": [{"param_groups": [list(g["params"]) for g in groups]} for groups in self._groups],
            "optimizer_states": bool(self._optimizer_tops),
        }

    def _layout(self) -> tuple[str, list[str]]:
        tops = {path[0] for path in self._fqn}
        model = next((top for top in (LIGHTNING_MODEL, TORCH_MODEL) if top in tops), None)
        if model is None:
            raise CheckpointError(
                f"{self.where} holds no model state: its top-level keys are {sorted(tops)}, none of "
                f"'{LIGHTNING_MODEL}' (Lightning's ModelParallelStrategy) or '{TORCH_MODEL}' (dcp.save({{'model': "
                "..., 'optim': ...}})). Save the model's state dict under one of them."
            )
        lightning = sorted((i, top) for top in tops if (i := lightning_optimizer_index(top)) is not None)
        if model == LIGHTNING_MODEL and lightning:
            return model, [top for _, top in lightning]
        return model, [TORCH_OPTIM] if TORCH_OPTIM in tops else []

    def _is_tensor(self, path: _Path) -> bool:
        return isinstance(self._dcp.state_dict_metadata[self._fqn[path]], TensorStorageMetadata)

    def _spec(self, fqn: str) -> dict[str, Any]:
        md = self._dcp.state_dict_metadata[fqn]
        assert isinstance(md, TensorStorageMetadata)
        return {"shape": list(md.size), "dtype": str(md.properties.dtype).removeprefix("torch."), "ranges": []}

    def _param_groups(self, top: str) -> list[dict[str, Any]]:
        """The param groups of optimizer ``top`` (``params``: parameter names), from their pickled entries."""
        paths = [p for p in self._fqn if len(p) == 4 and p[0] == top and p[1] == "param_groups"]
        values = self._read_objects(self._fqn[p] for p in paths)
        groups: dict[int, dict[str, Any]] = {}
        for path in paths:
            groups.setdefault(int(path[2]), {})[path[3]] = values[self._fqn[path]]
        ordered = [groups[i] for i in sorted(groups)]
        if any("params" not in group for group in ordered):
            raise CheckpointError(
                f"{self.where}: the param groups of '{top}' list no 'params'. Save the optimizer's state dict as "
                "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict gives it (parameters by name)."
            )
        return ordered

    # ------------------------------------------------------------------ what ShardedCheckpoint's loads use
    def rank_data(self, rank: int) -> dict[str, Any]:
        raise CheckpointError(f"{self.where} is a DCP directory: it has no lightning_zero rank files.")

    def release(self) -> None:
        """Nothing stays open between reads."""

    def lightning_state(self) -> dict[str, Any]:
        """Lightning's non-tensor entries from ``meta.pt`` (``{}`` where the directory has none)."""
        file = self.path / LIGHTNING_META_FILE
        if not file.is_file():
            return {}
        try:
            return torch.load(file, map_location="cpu", weights_only=False)
        except Exception as error:
            raise CheckpointError(
                f"{self.where}: {LIGHTNING_META_FILE} is corrupt ({type(error).__name__}). Use another checkpoint."
            ) from error

    @property
    def has_lightning_state(self) -> bool:
        return (self.path / LIGHTNING_META_FILE).is_file()

    def read(self, section: Any, name: str, start: int, end: int) -> Tensor:
        """Elements ``[start, end)`` of flattened tensor ``name`` (``section``: "params" or (optimizer, key))."""
        if section == "params" and name in self._given:
            return self._given[name].reshape(-1)[start:end]
        return self._read_range(self._fqn_of(section, name), start, end)

    def read_whole(self, section: tuple[int, str], name: str) -> Tensor:
        fqn = self._fqn_of(section, name)
        md = self._dcp.state_dict_metadata[fqn]
        assert isinstance(md, TensorStorageMetadata)
        return self._read_range(fqn, 0, math.prod(md.size)).view(md.size)

    def _fqn_of(self, section: Any, name: str) -> str:
        saved = self._saved_names.get(name, name)
        path = (self._model, saved) if section == "params" else self._state_path(section, saved)
        if path not in self._fqn:
            raise CheckpointError(f"{self.where} has no entry {'.'.join(map(str, path))!r}.")
        return self._fqn[path]

    def _state_path(self, section: tuple[int, str], name: str) -> _Path:
        index, key = section
        return (self._optimizer_tops[index], "state", name, key)

    def optimizer_scalars(self, index: int) -> dict[str, dict[str, Any]]:
        """Per parameter name with state: its scalar state (``step``) and its element-wise and whole tensor keys."""
        if index not in self._scalars:
            self._scalars[index] = self._read_scalars(index)
        return self._scalars[index]

    def _read_scalars(self, index: int) -> dict[str, dict[str, Any]]:
        top = self._optimizer_tops[index]
        by_name: dict[str, dict[str, Any]] = {}
        for path in self._fqn:
            if len(path) == 4 and path[0] == top and path[1] == "state":
                by_name.setdefault(path[2], {})[path[3]] = self._dcp.state_dict_metadata[self._fqn[path]]
        objects = self._read_objects(
            self._fqn[(top, "state", n, k)] for n, s in by_name.items() for k, md in s.items() if _is_object(md)
        )
        out = {}
        for name, entries in by_name.items():
            numel = math.prod(self.tensors[name]["shape"]) if name in self.tensors else None
            scalars: dict[str, Any] = {"__tensor_keys__": [], "__whole_keys__": []}
            for key, md in entries.items():
                fqn = self._fqn[(top, "state", name, key)]
                if _is_object(md):
                    scalars[key] = objects[fqn]
                elif not md.size:
                    scalars[key] = self._read_range(fqn, 0, 1).view(())
                elif math.prod(md.size) == numel:
                    scalars["__tensor_keys__"].append(key)
                else:
                    scalars["__whole_keys__"].append(key)
            out[name] = scalars
        return out

    def as_left_by_hook(self, state_dict: Any, keys: list[list[str]]) -> ShardedCheckpoint:
        """As for a sharded directory; DCP saves a tied tensor under each of its keys, so where the module ties
        keys (``[key, name]`` with ``key != name``) and the hook changed nothing, each tied key's entry is checked
        equal to its tensor's (read in blocks) and the tensor is loaded once, under its name."""
        tied = [(key, name) for key, name in keys if key != name and key in self.tensors and name in self.tensors]
        if not tied or not self._left_unchanged(state_dict):
            return super().as_left_by_hook(state_dict, keys)
        for key, name in tied:
            if not self._same_values(key, name):
                raise CheckpointError(
                    f"{self.where}: this model ties {key!r} to {name!r}, but the checkpoint holds different values "
                    "under them: it was saved from a model without that tie. Load it into such a model."
                )
        return super().as_left_by_hook({**state_dict, **{key: state_dict[name] for key, name in tied}}, keys)

    def _same_values(self, key: str, name: str, block: int = 2**24) -> bool:
        a, b = self._fqn[(self._model, key)], self._fqn[(self._model, name)]
        if self.tensors[key]["shape"] != self.tensors[name]["shape"]:
            return False
        numel = math.prod(self.tensors[key]["shape"])
        return all(
            torch.equal(
                self._read_range(a, start, min(start + block, numel)),
                self._read_range(b, start, min(start + block, numel)),
            )
            for start in range(0, numel, block)
        )

    def param_groups(self, index: int) -> list[dict[str, Any]]:
        return [{k: v for k, v in group.items() if k != "params"} for group in self._groups[index]]

    # ------------------------------------------------------------------ DCP reads
    def _read_range(self, fqn: str, start: int, end: int) -> Tensor:
        """Elements ``[start, end)`` of the flattened tensor ``fqn``: the rows that hold them are read."""
        md = self._dcp.state_dict_metadata[fqn]
        assert isinstance(md, TensorStorageMetadata)
        shape = list(md.size)
        row = math.prod(shape[1:])
        if end <= start or row == 0:
            return torch.empty(max(end - start, 0), dtype=md.properties.dtype)
        first, last = (start // row, -(-end // row)) if shape else (0, 1)
        sizes = [last - first, *shape[1:]] if shape else []
        box = torch.empty(sizes, dtype=md.properties.dtype)
        offsets = [first] + [0] * (len(shape) - 1) if shape else []
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        self._run(create_read_items_for_chunk_list(fqn, md, [chunk]), _Into({fqn: box}))
        return box.reshape(-1)[start - first * row : end - first * row]

    def _read_objects(self, fqns: Iterable[str]) -> dict[str, Any]:
        """The pickled (non-tensor) entries ``fqns``."""
        wanted: dict[str, Any] = dict.fromkeys(fqns)
        if not wanted:
            return {}
        planner = _Into({})
        self._run(create_default_local_load_plan(wanted, self._dcp).items, planner)
        return planner.objects

    def _run(self, items: list[ReadItem], planner: _Into) -> None:
        try:
            self._reader.read_data(self._reader.prepare_local_plan(LoadPlan(items)), planner).wait()
        except (OSError, RuntimeError, ValueError, KeyError) as error:
            raise CheckpointError(
                f"{self.where}: reading {sorted({i.dest_index.fqn for i in items})[:3]} failed ({type(error).__name__}"
                f": {error}). The directory is incomplete or damaged: restore it or use another checkpoint."
            ) from error


def _is_object(md: Any) -> bool:
    return isinstance(md, BytesStorageMetadata)


class _Into(LoadPlanner):
    """Receives DCP reads: tensors into ``targets`` (the chunk asked for), pickled entries into ``objects``."""

    def __init__(self, targets: dict[str, Tensor]) -> None:
        self.targets = targets
        self.objects: dict[str, Any] = {}

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan([])

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan | SavePlan) -> Any:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        tensor = self.targets[read_item.dest_index.fqn]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            tensor = tensor.narrow(dim, offset, length)
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
        pass
