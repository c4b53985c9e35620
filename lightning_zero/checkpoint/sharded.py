"""Read a directory of per-rank shards (see checkpoint/saving.py for its layout and how a save commits):
verified, at any world size and stage, lazily where it can.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_zero.checkpoint import state as named
from lightning_zero.checkpoint.metadata import (
    FILES_KEY,
    LIGHTNING_FILE,
    CheckpointError,
    check_same_model,
    check_same_optimizers,
    file_digest,
    rank_file,
    read_metadata,
)
from lightning_zero.checkpoint.saving import committed_path
from lightning_zero.checkpoint.state_view import LazyTensor, is_unread
from lightning_zero.core.comm import Communicator
from lightning_zero.core.named_state import NamedState


class ShardedCheckpoint:
    """A sharded checkpoint opened for reading: metadata checked, every file's size and checksum verified (see
    [Note: checksums of a sharded checkpoint]), rank files opened lazily with ``mmap``.

    Args:
        path: the checkpoint directory.
        check_all_files: open every rank file now, so that a corrupt one fails before anything is loaded.
        comm: the ranks that open the checkpoint together: each verifies the checksums of its share of the files
            and all agree on the outcome (collective); ``None``: this process verifies every file.
    """

    def __init__(self, path: str | Path, check_all_files: bool = True, comm: Communicator | None = None) -> None:
        self.path = committed_path(path)
        self.where = f"checkpoint '{self.path}'"
        self.metadata = read_metadata(self.path)
        self.tensors: dict[str, dict[str, Any]] = self.metadata["tensors"]
        self._files: dict[int, dict[str, Any]] = {}
        # Set in a view that a load hook renamed (see as_left_by_hook): tensors by the names in the files, the name
        # in the files of each renamed tensor, and the parameter values the hook gave.
        self._saved = self.tensors
        self._saved_names: dict[str, str] = {}
        self._given: dict[str, Tensor] = {}
        self._verify(comm)
        if check_all_files:  # every rank checks every file, so a corrupt one fails on every rank alike
            for rank in range(self.metadata["world_size"]):
                self.rank_data(rank)

    def _verify(self, comm: Communicator | None) -> None:
        """Every file's size (here) and CRC-32 (this rank's share of the files, agreed with ``comm``)."""
        expected: dict[str, dict[str, int]] = self.metadata.get(FILES_KEY, {})  # absent: saved before checksums
        errors = []
        for index, (name, digest) in enumerate(sorted(expected.items())):
            file = self.path / name
            size = file.stat().st_size if file.is_file() else -1
            if size != digest["bytes"]:
                found = "is missing" if size < 0 else f"has {size} bytes"
                errors.append(f"{name} {found}, the save wrote {digest['bytes']} bytes (truncated or replaced)")
            elif comm is None or index % comm.world_size == comm.rank:
                crc = file_digest(file)["crc32"]
                if crc != digest["crc32"]:
                    errors.append(
                        f"{name} has checksum {crc:08x}, the save wrote {digest['crc32']:08x} (its bytes changed, "
                        "or it is a file of another checkpoint)"
                    )
        if comm is not None:
            errors = sorted({error for theirs in comm.all_gather_object(errors) for error in theirs})
        if errors:
            raise CheckpointError(
                f"{self.where} is damaged: {'; '.join(errors)}. Restore the files from a copy or use another "
                "checkpoint: a model is never loaded from files that differ from what was saved."
            )

    def rank_data(self, rank: int) -> dict[str, Any]:
        if rank not in self._files:
            file = self.path / rank_file(rank)
            try:
                data = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            except Exception as error:
                raise CheckpointError(
                    f"{self.where}: shard file {file.name} is truncated or corrupt ({type(error).__name__}: "
                    f"{str(error).splitlines()[0] if str(error) else ''}). Restore it or use another checkpoint."
                ) from error
            if not isinstance(data, dict) or data.get("rank") != rank or "params" not in data:
                raise CheckpointError(
                    f"{self.where}: shard file {file.name} does not hold rank {rank}'s shards. Restore it or use "
                    "another checkpoint."
                )
            self._files[rank] = data
        return self._files[rank]

    def release(self) -> None:
        """Close the rank files (their pages leave memory); they are opened again when next needed."""
        self._files.clear()

    def lightning_state(self) -> dict[str, Any]:
        file = self.path / LIGHTNING_FILE
        try:
            return torch.load(file, map_location="cpu", weights_only=False)
        except Exception as error:
            raise CheckpointError(
                f"{self.where}: {LIGHTNING_FILE} is missing or corrupt ({type(error).__name__}). Use another "
                "checkpoint."
            ) from error

    def read(self, section: Any, name: str, start: int, end: int) -> Tensor:
        """Elements ``[start, end)`` of flattened tensor ``name`` (``section``: "params" or (optimizer, key))."""
        if section == "params" and name in self._given:
            return self._given[name].reshape(-1)[start:end]
        spec = self._saved[self._saved_names.get(name, name)]
        out = torch.empty(end - start, dtype=getattr(torch, spec["dtype"]))
        filled = 0
        for rank, lo, hi in spec["ranges"]:
            begin, stop = max(lo, start), min(hi, end)
            if begin >= stop:
                continue
            source = self._source(rank, section, name)
            if source.dtype != out.dtype and section != "params":
                out = out.to(source.dtype)
            out[begin - start : stop - start].copy_(source[begin - lo : stop - lo])
            filled += stop - begin
        if filled != end - start:
            raise CheckpointError(
                f"{self.where}: elements [{start}, {end}) of {name!r} are not all in the shard files "
                f"({section}). Restore the checkpoint or use another one."
            )
        return out

    def read_whole(self, section: tuple[int, str], name: str) -> Tensor:
        """Optimizer state saved whole by the rank that owned parameter ``name`` (see [Note: owner layout])."""
        ranges = self._saved[self._saved_names.get(name, name)]["ranges"]
        if len(ranges) != 1:
            raise CheckpointError(
                f"{self.where}: optimizer state {section[1]!r} of {name!r} was saved whole, but the parameter has "
                f"{len(ranges)} owners there. Restore the checkpoint or use another one."
            )
        return self._source(ranges[0][0], section, name)

    def _source(self, rank: int, section: Any, name: str) -> Tensor:
        data = self.rank_data(rank)
        saved = self._saved_names.get(name, name)
        try:
            if section == "params":
                return data["params"][saved]
            index, key = section
            return data["optimizers"][index]["state"][saved][key]
        except (KeyError, IndexError) as error:
            raise CheckpointError(
                f"{self.where}: shard file {rank_file(rank)} lacks {section} of {name!r}. Restore it or use "
                "another checkpoint."
            ) from error

    def optimizer_scalars(self, index: int) -> dict[str, dict[str, Any]]:
        """Per parameter name with state: its scalar state and element-wise keys, from the first owner's file."""
        scalars: dict[str, dict[str, Any]] = {}
        for groups in self.metadata["optimizers"][index]["param_groups"]:
            for name in groups:
                saved_name = self._saved_names.get(name, name)
                ranges = self._saved[saved_name]["ranges"]
                if not ranges:
                    continue
                saved = self.rank_data(ranges[0][0])["optimizers"][index]
                state = saved["state"].get(saved_name)
                if state:
                    scalars[name] = named.scalar_states({name: state}, saved.get("whole"))[name]
        return scalars

    def full_state_dict(self) -> dict[str, Tensor]:
        """The plain module's ``state_dict``, every tensor in full (for a module that no engine shards)."""
        full: dict[str, Tensor] = {}
        for _, name in self.metadata["state_dict_keys"]:
            if name not in full:
                full[name] = self.read_full(name)
        return {key: full[name] for key, name in self.metadata["state_dict_keys"]}

    def read_full(self, name: str) -> Tensor:
        """Tensor ``name`` in full, in its saved shape and dtype."""
        spec = self.tensors[name]
        numel = math.prod(spec["shape"])
        if not numel:
            return torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]))
        return self.read("params", name, 0, numel).view(spec["shape"])

    def lazy_state_dict(self) -> dict[str, Tensor]:
        """The plain module's ``state_dict`` keys, each with a :class:`LazyTensor` read from the shard files when
        first used (tied keys share one): what a load hook sees (see [Note: the state_dict of sharded checkpoint
        hooks])."""
        lazy = {
            name: LazyTensor(name, spec["shape"], getattr(torch, spec["dtype"]), partial(self.read_full, name), self)
            for name, spec in self.tensors.items()
        }
        return {key: lazy[name] for key, name in self.metadata["state_dict_keys"]}

    def as_left_by_hook(self, state_dict: Any, keys: list[list[str]]) -> ShardedCheckpoint:
        """This checkpoint as ``state_dict``, what a load hook left of :meth:`lazy_state_dict`, says to load it into
        a module whose ``state_dict`` keys are ``keys`` (``[key, tensor name]``): itself where the hook changed
        nothing, else a view with the tensors renamed and the values given (see [Note: the state_dict of sharded
        checkpoint hooks])."""
        if self._left_unchanged(state_dict):
            return self
        where = f"{self.where} (its state_dict as on_load_checkpoint left it)"
        if not isinstance(state_dict, Mapping):
            raise CheckpointError(f"{where}: checkpoint['state_dict'] is a {type(state_dict).__name__}, not a mapping.")
        chosen = _chosen_values(state_dict, keys, where)
        module_keys = {key for key, _ in keys}
        unexpected = {key: value for key, value in state_dict.items() if key not in module_keys}
        view = copy.copy(self)
        view.where = where
        view._saved_names, view._given = {}, {}
        tensors = {}
        for name, value in {**chosen, **unexpected}.items():
            if not isinstance(value, Tensor):
                raise CheckpointError(f"{where}: the value of {name!r} is a {type(value).__name__}, not a tensor.")
            ours = isinstance(value, LazyTensor) and value.origin is self
            if ours:
                view._saved_names[name] = value.saved_name  # its optimizer state follows it, read or not
            elif name in self._saved:
                view._saved_names[name] = name  # a value given under a saved name: that name's optimizer state
            if ours and not value.was_read:
                tensors[name] = self._saved[value.saved_name]
                continue
            given = value.value() if isinstance(value, LazyTensor) else value.detach()
            view._given[name] = given
            tensors[name] = {"shape": list(given.shape), "dtype": str(given.dtype).removeprefix("torch."), "ranges": []}
        view.tensors = tensors
        view.metadata = {
            **self.metadata,
            "tensors": tensors,
            "state_dict_keys": [[key, name] for key, name in keys if name in tensors],
            "optimizers": [
                {**saved, "param_groups": view._module_names(saved["param_groups"])}
                for saved in self.metadata["optimizers"]
            ],
        }
        return view

    def _left_unchanged(self, state_dict: Any) -> bool:
        keys = self.metadata["state_dict_keys"]
        return (
            isinstance(state_dict, Mapping)
            and len(state_dict) == len(keys)
            and all(is_unread(state_dict.get(key), self, name) for key, name in keys)
        )

    def _module_names(self, groups: list[list[str]]) -> list[list[str]]:
        """Saved param groups' names as the module names them in a renamed view; a saved parameter whose name now
        means another saved tensor, and that no name means, gets a name that matches no module's."""
        module_name = {}
        for name, saved in self._saved_names.items():
            module_name.setdefault(saved, name)
        renamed = []
        for group in groups:
            names = []
            for saved in group:
                if saved in module_name:
                    names.append(module_name[saved])
                elif self._saved_names.get(saved, saved) == saved:
                    names.append(saved)
                else:
                    names.append(f"{saved} (saved; not in this model)")
            renamed.append(names)
        return renamed

    def param_groups(self, index: int) -> list[dict[str, Any]]:
        return self.rank_data(0)["optimizers"][index]["param_groups"]


def _chosen_values(state_dict: Mapping[str, Any], keys: list[list[str]], where: str) -> dict[str, Any]:
    """Per tensor name of the module, the value ``state_dict`` has under its keys (a tied tensor's keys must agree)."""
    chosen: dict[str, Any] = {}
    first_key: dict[str, str] = {}
    for key, name in keys:
        if key not in state_dict:
            continue
        value = state_dict[key]
        if name in chosen and not _same(value, chosen[name]):
            raise CheckpointError(
                f"{where}: keys {first_key[name]!r} and {key!r} name one tensor of this model (tied), but hold "
                "different values. Give both keys the same tensor."
            )
        chosen.setdefault(name, value)
        first_key.setdefault(name, key)
    return chosen


def _same(value: Any, other: Any) -> bool:
    """One object, or tensors of equal shape, dtype and values (reading a LazyTensor's)."""
    if value is other:
        return True
    if not (isinstance(value, Tensor) and isinstance(other, Tensor)):
        return False
    return value.shape == other.shape and value.dtype == other.dtype and torch.equal(value, other)


def load_sharded_params(state: NamedState, checkpoint: ShardedCheckpoint, strict: bool = True) -> None:
    """Load the checkpoint's tensors into ``state``'s; ``strict=False`` skips those only one side has, as
    ``load_state_dict(strict=False)`` does (they keep their values); shapes must match either way."""
    names = check_same_model(checkpoint.metadata, named.tensor_specs(state), checkpoint.where, strict)
    named.load_params(state, checkpoint.read, names)


def load_sharded_optimizers(state: NamedState, checkpoint: ShardedCheckpoint) -> None:
    check_same_optimizers(checkpoint.metadata, state.optimizer_param_names(), checkpoint.where)
    for index in range(len(state.optimizer_param_names())):
        named.load_optimizer(
            state,
            index,
            checkpoint.param_groups(index),
            checkpoint.optimizer_scalars(index),
            checkpoint.read,
            checkpoint.read_whole,
            checkpoint.where,
        )
