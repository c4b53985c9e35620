"""Save and load a directory of per-rank shards; the save is committed by an atomic rename.

Layout of ``path/`` (see docs/checkpoints.md)::

    metadata.json   rank 0: format version, world size, stage, per-tensor shape/dtype/ranges, optimizers
    lightning.pt    rank 0: the caller's extra state (Lightning's loops, callbacks, schedulers, ...)
    rank_{r}.pt     rank r: the elements it owns of every tensor and of the optimizer state

[Note: committing a sharded save]
Every rank writes (and fsyncs) its file into ``path.tmp-<id>``; rank 0 adds metadata.json last. The ranks then
agree that every file was written (an all-gather of each rank's error, which is also the barrier): if any rank
failed, the new directory is removed and every rank raises a ``CheckpointError`` naming the ranks and their errors,
within seconds, and ``path`` is unchanged. Otherwise rank 0 marks the directory complete, moves an old ``path``
aside, renames the new directory to ``path``, deletes the old one and any leftovers of earlier interrupted saves,
and the ranks agree once more on that. A crash at any moment leaves a loadable checkpoint: before the rename, the
old ``path``; between moving it aside and the rename, both copies, and loading ``path`` finds the newest complete
one (:func:`committed_path`) and says so.

[Note: symbolic links to checkpoints]
``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` a symbolic link to the newest checkpoint directory. A
link is never followed to write or delete: a save whose path is a link replaces the link (the checkpoint it
pointed to stays as it was), and removing a link removes the link only. Reading follows it, as any path.
"""

from __future__ import annotations

import copy
import glob
import math
import os
import shutil
import uuid
import warnings
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_zero.checkpoint import state as named
from lightning_zero.checkpoint.metadata import (
    COMPLETE_FILE,
    FILES_KEY,
    LIGHTNING_FILE,
    METADATA_FILE,
    CheckpointError,
    build_metadata,
    check_same_model,
    check_same_optimizers,
    file_digest,
    rank_file,
    read_metadata,
    write_metadata,
)
from lightning_zero.checkpoint.state_view import LazyTensor, is_unread
from lightning_zero.core.comm import Communicator
from lightning_zero.core.named_state import NamedState


def save_sharded(
    state: NamedState,
    path: str | Path,
    extra: dict[str, Any],
    version: str,
    precision: str = "32-true",
    optimizers: bool = True,
    partition: str = "flat",
) -> None:
    """Write an engine's shards (optimizer state too with ``optimizers``) and rank 0's ``extra`` to the directory
    ``path`` (collective). All or nothing, on every rank: see [Note: committing a sharded save]."""
    comm = state.comm
    path = Path(path)
    token = comm.all_gather_object(uuid.uuid4().hex[:12] if comm.rank == 0 else None)[0]
    tmp = path.with_name(f"{path.name}.tmp-{token}")
    failure = None
    digests: dict[str, dict[str, int]] = {}
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        with state.saving():  # offloaded state streamed from the swap file, not copied into memory
            rank_state = named.collect_rank_state(state, comm.rank, optimizers)
            mine = {"rank": comm.rank, "world_size": comm.world_size, **rank_state}
            digests[rank_file(comm.rank)] = _write(tmp / rank_file(comm.rank), mine)
            del rank_state, mine
        if comm.rank == 0:
            digests[LIGHTNING_FILE] = _write(tmp / LIGHTNING_FILE, extra)
    except Exception as error:  # agreed below, then raised on every rank
        failure = f"{type(error).__name__}: {error}"
    outcomes = comm.all_gather_object((failure, digests))  # every rank's file is on disk, or who failed
    _agree([failure for failure, _ in outcomes], f"writing the sharded checkpoint '{path}'", path, tmp, comm)
    failure = None
    if comm.rank == 0:
        try:
            metadata = build_metadata(
                version=version,
                world_size=comm.world_size,
                stage=state.stage,
                partition=partition,
                precision=precision,
                tensors=named.tensor_specs(state),
                state_dict_keys=state.state_dict_keys(),
                optimizers=state.optimizer_param_names() if optimizers else [],
                optimizer_states=optimizers,
                files={name: digest for _, theirs in outcomes for name, digest in theirs.items()},
            )
            write_metadata(tmp, metadata)  # last: a directory without it is never taken for a checkpoint
            _sync(tmp / METADATA_FILE)
            (tmp / COMPLETE_FILE).touch()  # every rank's shard is on disk: this directory is a checkpoint
            _sync(tmp)
            _commit(tmp, path, token)
            (path / COMPLETE_FILE).unlink()  # only a directory not renamed yet needs to say it is complete
            _remove_leftovers(path)
        except Exception as error:
            failure = f"{type(error).__name__}: {error}"
    what = f"committing the sharded checkpoint '{path}' (renaming '{tmp.name}')"
    _agree(comm.all_gather_object(failure), what, path, None, comm)


def _write(file: Path, obj: Any) -> dict[str, int]:
    """``torch.save`` ``obj`` to ``file`` and flush it to the disk; returns its size and CRC-32 (see
    [Note: checksums of a sharded checkpoint])."""
    torch.save(obj, file)
    _sync(file)
    return file_digest(file)


def _agree(failures_by_rank: list[str | None], what: str, path: Path, remove: Path | None, comm: Communicator) -> None:
    """Raise on every rank, naming the ranks and their errors, where any rank failed at ``what`` (rank 0 first
    deletes ``remove``, the new directory). ``failures_by_rank`` comes from one all-gather: the save's barrier."""
    failures = {rank: error for rank, error in enumerate(failures_by_rank) if error}
    if not failures:
        return
    if remove is not None and comm.rank == 0:
        shutil.rmtree(remove, ignore_errors=True)
    listed = "; ".join(f"rank {rank}: {error}" for rank, error in sorted(failures.items()))
    kept = "is unchanged" if path.is_dir() else "does not exist (nothing was saved there before)"
    raise CheckpointError(f"{what} failed on {len(failures)} of {comm.world_size} ranks ({listed}). '{path}' {kept}.")


def _sync(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: Path, path: Path, token: str) -> None:
    old = path.with_name(f"{path.name}.old-{token}")
    if path.is_symlink():  # replaced, not followed: see [Note: symbolic links to checkpoints]
        path.unlink()
    elif path.is_dir():
        path.rename(old)
    elif path.exists():
        path.unlink()
    tmp.rename(path)
    _sync(path.parent)
    if old.exists():
        shutil.rmtree(old)


def _remove_leftovers(path: Path) -> None:
    """Directories that interrupted saves to ``path`` left behind (``.tmp-*``, ``.old-*``): ``path`` is newer."""
    for kind in ("tmp", "old"):
        for leftover in path.parent.glob(f"{glob.escape(path.name)}.{kind}-*"):
            if leftover.is_symlink() or leftover.is_dir():
                remove_sharded(leftover)


def committed_path(path: str | Path) -> Path:
    """``path``, or, where a save to it was interrupted between moving the previous checkpoint aside and renaming
    the new one into place, the newest complete copy it left (with a warning that says so)."""
    path = Path(path)
    if path.exists():
        return path
    complete = [p for p in path.parent.glob(f"{glob.escape(path.name)}.tmp-*") if (p / COMPLETE_FILE).is_file()]
    previous = [p for p in path.parent.glob(f"{glob.escape(path.name)}.old-*") if (p / METADATA_FILE).is_file()]
    for candidates, what in ((complete, "the new checkpoint, complete on every rank"), (previous, "the previous one")):
        if candidates:
            found = max(candidates, key=lambda p: p.stat().st_mtime)
            warnings.warn(
                f"'{path}' does not exist: a save to it was interrupted while committing. Loading '{found}', {what}; "
                f"rename it to '{path.name}' to keep it.",
                stacklevel=3,
            )
            return found
    return path


def remove_sharded(path: str | Path) -> None:
    """Delete a checkpoint directory; a symbolic link is removed, never what it points to (see
    [Note: symbolic links to checkpoints])."""
    path = Path(path)
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


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
                errors.append(f"{name} {found}, the save wrote {digest['bytes']} (truncated or replaced)")
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
