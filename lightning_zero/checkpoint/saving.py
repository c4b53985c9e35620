"""Save a directory of per-rank shards, committed by an atomic rename; find and remove such directories.


Layout of ``path/`` (see docs/checkpoints.md)::

    metadata.json   rank 0: format version, world size, stage, per-tensor shape/dtype/ranges, optimizers
    lightning.pt    rank 0: the caller's extra state (Lightning's loops, callbacks, schedulers, ...)
    rank_{r}.pt     rank r: the elements it owns of every tensor and of the optimizer state (with hybrid sharding
                    ``r`` is the rank in the shard group, and only the first shard group writes: the other groups
                    hold the same shards; see [Note: hybrid sharding])

[Note: committing a sharded save]
Every rank writes (and fsyncs) its file into ``path.tmp-<id>``; rank 0 adds metadata.json last. The ranks then
agree that every file was written (an all-gather of each rank's error, which is also the barrier): if any rank
failed, the new directory is removed and every rank raises a ``CheckpointError`` naming the ranks and their errors,
within seconds, and ``path`` is unchanged. Otherwise rank 0 marks the directory complete, moves an old ``path``
aside, renames the new directory to ``path``, deletes the old one and any leftovers of earlier interrupted saves,
and the ranks agree once more on that. A crash at any moment leaves a loadable checkpoint: before the rename, the
old ``path``; between moving it aside and the rename, both copies, and loading ``path`` finds the newest complete
one (:func:`committed_path`) and says so.

[Note: a written rank file leaves the page cache]
No rank file stays in the page cache once it is on the disk. Rank files are written past it (see [Note: rank
files are written past the page cache] in ``direct_file.py``); the files an asynchronous save's snapshot wrote into
it (offloaded state, copied on the training thread) have their pages dropped after the fsync
(``POSIX_FADV_DONTNEED``). Left cached, every save of a run that keeps its checkpoints needs page cache the kernel
has not handed out lately, and getting it was the write's main cost: on a VM, 1 GiB into a new kept file took 2.4 s
of CPU (2.2 s of it system time), 0.5 s with the pages of the previous file dropped (benchmarks/save_cpu.py,
docs/benchmarks.md). A background save takes that CPU from training. A load right after a save reads the file
from the disk.

[Note: symbolic links to checkpoints]
``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` a symbolic link to the newest checkpoint directory. A
link is never followed to write or delete: a save whose path is a link replaces the link (the checkpoint it
pointed to stays as it was), and removing a link removes the link only. Reading follows it, as any path.
"""

from __future__ import annotations

import glob
import os
import shutil
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_zero.checkpoint import state as named
from lightning_zero.checkpoint.checksums import saved_file_digest
from lightning_zero.checkpoint.direct_file import DirectFile
from lightning_zero.checkpoint.metadata import (
    COMPLETE_FILE,
    LIGHTNING_FILE,
    METADATA_FILE,
    CheckpointError,
    build_metadata,
    rank_file,
    write_metadata,
)
from lightning_zero.core.comm import Communicator
from lightning_zero.core.named_state import NamedState


@dataclass
class PendingSave:
    """A sharded save between its snapshot (:func:`begin_save`) and its commit (:func:`finish_save`).

    ``files`` maps the file names this rank still has to write to their contents (snapshots with an asynchronous
    save, views of the live state otherwise); ``digests`` holds those already written."""

    path: Path
    tmp: Path
    token: str
    files: dict[str, Any] = field(default_factory=dict)
    digests: dict[str, dict[str, int]] = field(default_factory=dict)
    metadata: dict[str, Any] | None = None  # rank 0: build_metadata's arguments but the files
    failure: str | None = None
    snapshot_bytes: int = 0  # bytes of the copies this save made or refilled
    allocated_bytes: int = 0  # of those, the bytes of copies this save made (not refilled)
    staged: list[Tensor] = field(default_factory=list)  # those copies, in the order of the files' tensors

    def release(self) -> None:
        self.files.clear()


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
    with state.saving():  # offloaded state streamed from the swap file, not copied into memory
        pending = begin_save(state, path, extra, version, precision, optimizers, partition, snapshot=False)
        finish_save(pending, state.world)


def begin_save(
    state: NamedState,
    path: str | Path,
    extra: dict[str, Any],
    version: str,
    precision: str,
    optimizers: bool,
    partition: str,
    snapshot: bool,
    staging: list[Tensor] | None = None,
) -> PendingSave:
    """The part of a save that reads the training state (collective: the ranks agree on a name for the new
    directory). With ``snapshot`` what the files will hold is copied, so that :func:`finish_save` may run while
    training goes on: see [Note: asynchronous sharded saves]. ``staging``: a previous snapshot's copies
    (``PendingSave.staged``) or copies made ahead (:func:`snapshot_copies`), refilled where they have the shape and
    dtype of one of this one's tensors."""
    comm, shard = state.world, state.comm  # every rank agrees; the shard group's ranks write (one replica)
    path = Path(path)
    token = comm.all_gather_object(uuid.uuid4().hex[:12] if comm.rank == 0 else None)[0]
    pending = PendingSave(path, path.with_name(f"{path.name}.tmp-{token}"), token)
    try:
        pending.tmp.mkdir(parents=True, exist_ok=True)
        if state.writes:  # a snapshot copies the live state once, into its own copies (a swap file's: see below)
            views = snapshot and not state.rests_on_disk
            rank_state = named.collect_rank_state(state, shard.rank, optimizers, views=views)
            pending.files[rank_file(shard.rank)] = {"rank": shard.rank, "world_size": shard.world_size, **rank_state}
            del rank_state
        if comm.rank == 0:
            pending.files[LIGHTNING_FILE] = extra
            pending.metadata = {
                "version": version,
                "world_size": shard.world_size,
                "stage": state.stage,
                "partition": partition,
                "precision": precision,
                "tensors": named.tensor_specs(state),
                "state_dict_keys": state.state_dict_keys(),
                "optimizers": state.optimizer_param_names() if optimizers else [],
                "optimizer_states": optimizers,
            }
        if snapshot:
            _snapshot(pending, state.rests_on_disk, staging or [])
    except Exception as error:  # agreed in finish_save, then raised on every rank
        pending.failure = f"{type(error).__name__}: {error}"
        pending.release()
    return pending


def _snapshot(pending: PendingSave, rests_on_disk: bool, staging: list[Tensor]) -> None:
    """Make ``pending`` independent of the training state: state that rests in the swap file is written now (into
    the page cache: the file is flushed to the disk later), the rest copied into host memory: into ``staging``,
    earlier copies, where one has a tensor's shape and dtype (a copy into memory already mapped costs a third of a
    clone's time, measured on 1 GiB: 0.10 s against 0.29 s), else into new tensors. The rank files' tensors are
    views of the live state here (on the device where it is): each is copied once, straight into host memory."""
    if rests_on_disk:
        for name, contents in list(pending.files.items()):
            pending.digests[name] = _write(pending.tmp / name, contents, sync=False)
            del pending.files[name]
        return
    # The rank files are refilled; Lightning's state (rank 0's) is small and gains tensors between saves.
    shards = {name: contents for name, contents in pending.files.items() if name != LIGHTNING_FILE}
    free: dict[tuple[tuple[int, ...], torch.dtype], list[Tensor]] = {}
    for copy in reversed(staging):  # taken from the end: in the order of the earlier snapshot's tensors
        free.setdefault(_key(copy), []).append(copy)

    def copy(tensor: Tensor) -> Tensor:
        taken = free.get(_key(tensor))
        if taken:
            target = taken.pop()
        else:
            target = torch.empty(tensor.shape, dtype=tensor.dtype)
            pending.allocated_bytes += target.untyped_storage().nbytes()
        return target.copy_(tensor.detach())

    shards = apply_to_collection(shards, Tensor, copy)
    pending.staged = _tensors(shards)  # the copies left unused in ``free`` are released with it
    if LIGHTNING_FILE in pending.files:
        shards[LIGHTNING_FILE] = apply_to_collection(pending.files[LIGHTNING_FILE], Tensor, _clone)
    pending.files = shards
    seen: set[int] = set()
    for tensor in _tensors(pending.files):
        if tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            pending.snapshot_bytes += tensor.untyped_storage().nbytes()


def snapshot_copies(state: NamedState) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The shape and dtype of every copy that a snapshot of this rank's file, with optimizer state, would hold now
    (none where the rank writes no file, or where its state rests in the swap file: such a snapshot is written
    into the page cache). Local: no collective."""
    if not state.writes or state.rests_on_disk:
        return []
    return [_key(tensor) for tensor in _tensors(named.collect_rank_state(state, state.comm.rank, views=True))]


def _key(tensor: Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    return tuple(tensor.shape), tensor.dtype


def _clone(tensor: Tensor) -> Tensor:
    return tensor.detach().clone()


def _tensors(obj: Any) -> list[Tensor]:
    found: list[Tensor] = []
    apply_to_collection(obj, Tensor, found.append)
    return found


def finish_save(pending: PendingSave, comm: Communicator) -> None:
    """Write what :func:`begin_save` left, agree that every rank's files are on disk, and commit (collective over
    ``comm``, which may be a group of its own: see [Note: asynchronous sharded saves])."""
    path, tmp = pending.path, pending.tmp
    try:
        for name, contents in list(pending.files.items()):
            pending.digests[name] = _write(tmp / name, contents)
            del pending.files[name]
        for name in pending.digests:
            _sync(tmp / name, drop=True)  # written into the page cache by a snapshot: on the disk now
    except Exception as error:  # agreed below, then raised on every rank
        pending.failure = pending.failure or f"{type(error).__name__}: {error}"
    pending.release()
    outcomes = comm.all_gather_object((pending.failure, pending.digests))  # every rank's file is on disk, or who failed
    _agree([failure for failure, _ in outcomes], f"writing the sharded checkpoint '{path}'", path, tmp, comm)
    failure = None
    if comm.rank == 0:
        try:
            assert pending.metadata is not None
            files = {name: digest for _, theirs in outcomes for name, digest in theirs.items()}
            write_metadata(tmp, build_metadata(**pending.metadata, files=files))  # last: see the note
            _sync(tmp / METADATA_FILE)
            (tmp / COMPLETE_FILE).touch()  # every rank's shard is on disk: this directory is a checkpoint
            _sync(tmp)
            _commit(tmp, path, pending.token)
            (path / COMPLETE_FILE).unlink()  # only a directory not renamed yet needs to say it is complete
            _remove_leftovers(path)
        except Exception as error:
            failure = f"{type(error).__name__}: {error}"
    what = f"committing the sharded checkpoint '{path}' (renaming '{tmp.name}')"
    _agree(comm.all_gather_object(failure), what, path, None, comm)


def _write(file: Path, obj: Any, sync: bool = True) -> dict[str, int]:
    """``torch.save`` ``obj`` to ``file``: with ``sync`` on the disk past the page cache (see [Note: rank files are
    written past the page cache]), without into the page cache. Returns its size and CRC-32 (see [Note: checksums
    of a sharded checkpoint]), from the CRC-32 that torch.save computed of its records as it wrote them: the data
    is not read back (see [Note: the CRC-32 of a saved file from its zip records])."""
    if sync:
        with DirectFile(file) as handle:
            torch.save(obj, handle)
    else:
        torch.save(obj, file)
    return saved_file_digest(file)


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


def _sync(path: Path, drop: bool = False) -> None:
    """Flush a file's (or a directory's entries') data to the disk; with ``drop``, then let the kernel drop the
    file's pages from the page cache (see [Note: a written rank file leaves the page cache])."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if drop and hasattr(os, "posix_fadvise"):  # advice only: where it is missing or ignored, nothing changes
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
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
