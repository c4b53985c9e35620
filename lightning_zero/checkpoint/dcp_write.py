"""``convert(sharded_dir, out_dir, to="dcp")``: a sharded checkpoint as a ``torch.distributed.checkpoint`` directory.

The state dict handed to ``torch.distributed.checkpoint.save`` holds meta-device stand-ins of the tensors; the
planner reads each one from the rank files only when the writer asks for it (:meth:`_LazySavePlanner.resolve_data`).
The writer puts every entry in its own file (``FileSystemWriter(single_file_per_rank=False)``): DCP's single-file
writer keeps every tensor of a file referenced until the file is complete, one file per entry keeps at most one
tensor in memory. Keys and aliases: see [Note: the DCP layout].
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from lightning_zero.checkpoint.consolidate import check_outside
from lightning_zero.checkpoint.dcp_layout import (
    LIGHTNING_META_FILE,
    LIGHTNING_MODEL,
    TORCH_MODEL,
    TORCH_OPTIM,
    lightning_optimizer,
)
from lightning_zero.checkpoint.metadata import CheckpointError
from lightning_zero.checkpoint.sharded import ShardedCheckpoint


def write_dcp(
    sharded_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Write the sharded checkpoint ``sharded_dir`` as the DCP directory ``out_dir`` (see :func:`convert`)."""
    out = Path(out_dir)
    if out.is_file() or (out.is_dir() and any(out.iterdir())):
        raise CheckpointError(
            f"'{out_dir}' exists and is not an empty directory: convert writes a new DCP directory there. Remove it "
            "or pass another path."
        )
    checkpoint = ShardedCheckpoint(sharded_dir)
    checkpoint.release()
    check_outside(out, {Path(sharded_dir), checkpoint.path}, suffix="-dcp")
    state, sources = _state_dict(checkpoint)
    total = sum(t.numel() * t.element_size() for t, _ in sources.values())
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        planner = _LazySavePlanner(checkpoint, sources, total, progress)
        writer = _AliasingWriter(tmp, planner)
        dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
        torch.save(checkpoint.lightning_state(), tmp / LIGHTNING_META_FILE)
        if out.is_dir():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# By ``id`` of a meta-device stand-in: the stand-in and where its values are, ``(section, tensor name)``.
_Sources = dict[int, tuple[Tensor, tuple[Any, str]]]


def _state_dict(checkpoint: ShardedCheckpoint) -> tuple[dict[str, Any], _Sources]:
    """The nested state dict to save (both layouts, sharing stand-ins) and the stand-ins' sources."""
    sources: _Sources = {}
    stand_ins: dict[tuple[Any, str], Tensor] = {}

    def stand_in(section: Any, name: str, dtype: torch.dtype) -> Tensor:
        if (section, name) not in stand_ins:
            tensor = torch.empty(checkpoint.tensors[name]["shape"], dtype=dtype, device="meta")
            stand_ins[section, name] = tensor
            sources[id(tensor)] = tensor, (section, name)
        return stand_ins[section, name]

    model = {
        key: stand_in("params", name, getattr(torch, checkpoint.tensors[name]["dtype"]))
        for key, name in checkpoint.metadata["state_dict_keys"]
    }
    state: dict[str, Any] = {TORCH_MODEL: model, LIGHTNING_MODEL: dict(model)}
    with_states = checkpoint.metadata.get("optimizer_states", True)  # False: saved with weights_only=True
    count = len(checkpoint.metadata["optimizers"]) if with_states else 0
    optimizers = [_optimizer(checkpoint, index, stand_in) for index in range(count)]
    if optimizers:
        state[TORCH_OPTIM] = {
            "state": {name: values for optimizer in optimizers for name, values in optimizer["state"].items()},
            "param_groups": [group for optimizer in optimizers for group in optimizer["param_groups"]],
        }
        state.update({lightning_optimizer(index): optimizer for index, optimizer in enumerate(optimizers)})
    checkpoint.release()
    return state, sources


def _optimizer(
    checkpoint: ShardedCheckpoint, index: int, stand_in: Callable[[Any, str, torch.dtype], Tensor]
) -> dict[str, Any]:
    """Optimizer ``index`` as ``get_optimizer_state_dict`` gives it: state and param groups by parameter name."""
    groups = checkpoint.metadata["optimizers"][index]["param_groups"]
    state: dict[str, dict[str, Any]] = {}
    for name, scalars in checkpoint.optimizer_scalars(index).items():
        entry = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in scalars.items()}
        for key in entry.pop("__tensor_keys__"):
            numel = math.prod(checkpoint.tensors[name]["shape"])
            dtype = checkpoint.read((index, key), name, 0, 1).dtype if numel else torch.float32
            entry[key] = stand_in((index, key), name, dtype)
        for key in entry.pop("__whole_keys__", []):  # saved whole by the owner (Adafactor's factors): small
            entry[key] = checkpoint.read_whole((index, key), name).clone()
        state[name] = entry
        checkpoint.release()
    hyper = checkpoint.param_groups(index)
    param_groups = [{**h, "params": list(names)} for h, names in zip(hyper, groups, strict=True)]
    return {"state": state, "param_groups": param_groups}


class _LazySavePlanner(DefaultSavePlanner):
    """Reads each stand-in's tensor from the rank files when the writer asks for it, and writes a tensor that
    several keys hold (both layouts, tied weights) once: the other keys become aliases of the first."""

    def __init__(
        self,
        checkpoint: ShardedCheckpoint,
        sources: _Sources,
        total: int,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        super().__init__()
        self.checkpoint, self.sources, self.total, self.progress = checkpoint, sources, total, progress
        self.aliases: dict[str, str] = {}
        self.written = 0

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        first: dict[int, str] = {}
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                fqn = item.index.fqn
                primary = first.setdefault(id(self.state_dict[fqn]), fqn)
                if primary != fqn:
                    self.aliases[fqn] = primary
        return plan

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        return dataclasses.replace(plan, items=[i for i in plan.items if i.index.fqn not in self.aliases])

    def resolve_data(self, write_item: WriteItem) -> Any:
        obj = self.lookup_object(write_item.index)
        if not (isinstance(obj, Tensor) and id(obj) in self.sources):
            return super().resolve_data(write_item)
        section, name = self.sources[id(obj)][1]
        tensor = self.checkpoint.read(section, name, 0, obj.numel()).to(obj.dtype).view(obj.shape)
        self.checkpoint.release()
        self.written += tensor.numel() * tensor.element_size()
        if self.progress is not None:
            self.progress(self.written, self.total)
        return tensor


class _AliasingWriter(FileSystemWriter):
    """One file per entry (memory: one tensor), and the planner's aliases pointing at their primary's bytes."""

    def __init__(self, path: Path, planner: _LazySavePlanner) -> None:
        super().__init__(path, single_file_per_rank=False, thread_count=1, overwrite=False)
        self.planner = planner

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        by_fqn: dict[str, list[WriteResult]] = {}
        for result in (r for rank in results for r in rank):
            by_fqn.setdefault(result.index.fqn, []).append(result)
        aliased = [
            dataclasses.replace(result, index=dataclasses.replace(result.index, fqn=alias))
            for alias, primary in self.planner.aliases.items()
            for result in by_fqn[primary]
        ]
        super().finish(metadata, [*results, aliased])
