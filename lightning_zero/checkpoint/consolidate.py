"""``consolidate(sharded_dir, out_file)``: a sharded checkpoint as one ordinary Lightning checkpoint, streamed.

The output is what ``torch.save`` would write for ``{**lightning_state, "state_dict": ..., "optimizer_states":
...}`` (the module's own keys, the optimizers' ordinary ``state_dict`` form), so ``torch.load`` and
``LightningModule.load_from_checkpoint`` read it without lightning_zero. It is written without ever holding
the whole state: the pickle refers to each tensor's storage by a key (as ``torch.save`` does) and is written
first, from the shapes in the metadata; then each full tensor is assembled from the rank files, written as
its storage record and freed. The rank files are opened with ``mmap`` and closed again after each tensor, so
at most about one tensor (plus the pages read for it) is in memory beyond the output file's buffers.
"""

from __future__ import annotations

import os
import pickle
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_zero.checkpoint.metadata import CheckpointError
from lightning_zero.checkpoint.sharded import ShardedCheckpoint

_PICKLE_PROTOCOL = 2  # what torch.save uses


class _LazyStorage:
    """Stands for a storage that is written later: ``(section, name)`` of the checkpoint, or a real storage."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int, source: Any) -> None:
        self.key, self.dtype, self.numel, self.source = key, dtype, numel, source


class _LazyTensor:
    """Pickles exactly like a contiguous CPU tensor on ``storage`` (see ``torch.Tensor.__reduce_ex__``)."""

    def __init__(self, storage: _LazyStorage, shape: list[int]) -> None:
        self.storage, self.shape = storage, tuple(shape)

    def __reduce_ex__(self, protocol: int) -> Any:
        stride, running = [], 1
        for size in reversed(self.shape):
            stride.insert(0, running)
            running *= size
        args = (self.storage, 0, self.shape, tuple(stride), False, OrderedDict())
        return torch._utils._rebuild_tensor_v2, args


class _Pickler(pickle.Pickler):
    def __init__(self, file: Any, storages: list[_LazyStorage]) -> None:
        super().__init__(file, protocol=_PICKLE_PROTOCOL)
        self.storages = storages
        self.real: dict[int, _LazyStorage] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):  # a real tensor in Lightning's state (e.g. a best score)
            storage = self.real.get(id(obj._untyped_storage))
            if storage is None:
                storage = _LazyStorage(str(len(self.storages)), obj.dtype, obj._size(), obj)
                self.real[id(obj._untyped_storage)] = storage
                self.storages.append(storage)
            obj = storage
        if isinstance(obj, _LazyStorage):
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


def consolidate(
    sharded_dir: str | os.PathLike,
    out_file: str | os.PathLike,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Write the sharded checkpoint ``sharded_dir`` as one ordinary Lightning checkpoint file ``out_file``.

    Args:
        sharded_dir: the directory ``trainer.save_checkpoint`` wrote with ``state_dict_type="sharded"``.
        out_file: the file to write (written under a temporary name, then renamed).
        progress: called as ``progress(bytes_written, total_bytes)`` after each tensor.

    Raises:
        CheckpointError: if the checkpoint is incomplete, corrupt or of an unsupported format version, or if
            ``out_file`` is a directory.
        ValueError: if ``out_file`` lies inside ``sharded_dir`` (symlinks resolved), where writing it could replace
            a shard of the checkpoint being read; nothing is written then.
    """
    if Path(out_file).is_dir():
        raise CheckpointError(
            f"'{out_file}' is a directory: consolidate writes one ordinary checkpoint file. Pass a file path, e.g. "
            f"'{Path(out_file).with_suffix('.ckpt')}'; to load a sharded directory into a model without a file, use "
            "lightning_zero.load_from_checkpoint(Model, directory)."
        )
    checkpoint = ShardedCheckpoint(sharded_dir)
    checkpoint.release()
    check_outside(out_file, {Path(sharded_dir), checkpoint.path})
    storages: list[_LazyStorage] = []
    output = {**checkpoint.lightning_state()}
    output["state_dict"] = _state_dict(checkpoint, storages)
    if _count(checkpoint):  # saved with weights_only=True: no key, as in Lightning's own weights-only checkpoints
        output["optimizer_states"] = [_optimizer(checkpoint, index, storages) for index in range(_count(checkpoint))]
    out_file = Path(out_file)
    tmp = out_file.with_name(f"{out_file.name}.tmp-{os.getpid()}")
    prefix = out_file.stem or "archive"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        buffer = _BytesWriter()
        _Pickler(buffer, storages).dump(output)
        archive.writestr(f"{prefix}/data.pkl", bytes(buffer.data))
        del buffer
        archive.writestr(f"{prefix}/byteorder", sys.byteorder)
        total = sum(storage.numel * storage.dtype.itemsize for storage in storages)
        written = 0
        for storage in storages:
            with archive.open(f"{prefix}/data/{storage.key}", "w", force_zip64=True) as record:
                tensor = _materialize(checkpoint, storage)
                record.write(memoryview(tensor.view(torch.uint8).numpy()))
                written += tensor.numel() * tensor.element_size()
                del tensor
                checkpoint.release()
            if progress is not None:
                progress(written, total)
        archive.writestr(f"{prefix}/version", "3\n")
    tmp.replace(out_file)


def full_checkpoint(checkpoint: ShardedCheckpoint) -> dict[str, Any]:
    """What :func:`consolidate` writes, in memory: the checkpoint's Lightning state with ``state_dict`` and
    ``optimizer_states`` in the module's and the optimizers' ordinary form, every tensor in full."""
    storages: list[_LazyStorage] = []
    output = {**checkpoint.lightning_state(), "state_dict": _state_dict(checkpoint, storages)}
    if _count(checkpoint):
        output["optimizer_states"] = [_optimizer(checkpoint, index, storages) for index in range(_count(checkpoint))]
    tensors = {storage.key: _materialize(checkpoint, storage) for storage in storages}
    checkpoint.release()

    def real(value: Any) -> Any:
        if isinstance(value, _LazyTensor):
            return tensors[value.storage.key].view(value.shape)  # tied keys share one tensor
        if isinstance(value, dict):
            return type(value)((key, real(item)) for key, item in value.items())
        if isinstance(value, list):
            return [real(item) for item in value]
        return value

    output["state_dict"] = real(output["state_dict"])
    if "optimizer_states" in output:
        output["optimizer_states"] = real(output["optimizer_states"])
    return output


def check_outside(out_file: str | os.PathLike, sources: set[Path], suffix: str = ".ckpt") -> None:
    """Refuse an output (file or directory) inside the checkpoint: its temporary name and rename would land among
    the shards (and replace one of the same name). Both where the name points (symlinks followed) and where the
    rename happens (its directory resolved) are checked, against the directory as given and as opened."""
    out = Path(out_file)
    landing = {out.resolve(), out.parent.resolve() / out.name}
    for source in sorted({path.resolve() for path in sources}):
        inside = [path for path in landing if path == source or source in path.parents]
        if inside:
            raise ValueError(
                f"the output '{out_file}' is inside the sharded checkpoint '{source}' it reads; writing "
                "it there could replace a shard and would damage the checkpoint. Write the output outside "
                f"that directory, e.g. '{source.parent / (source.name + suffix)}'."
            )


class _BytesWriter:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: bytes) -> int:
        self.data += chunk
        return len(chunk)


def _count(checkpoint: ShardedCheckpoint) -> int:
    return len(checkpoint.metadata["optimizers"])


def _lazy(checkpoint: ShardedCheckpoint, storages: list[_LazyStorage], source: Any, name: str) -> _LazyTensor:
    spec = checkpoint.tensors[name]
    numel = 1
    for size in spec["shape"]:
        numel *= size
    storage = _LazyStorage(str(len(storages)), getattr(torch, spec["dtype"]), numel, (source, name))
    storages.append(storage)
    return _LazyTensor(storage, spec["shape"])


def _state_dict(checkpoint: ShardedCheckpoint, storages: list[_LazyStorage]) -> OrderedDict[str, Any]:
    by_name: dict[str, _LazyTensor] = {}
    state_dict: OrderedDict[str, Any] = OrderedDict()
    for key, name in checkpoint.metadata["state_dict_keys"]:
        if name not in by_name:  # tied keys share one storage, as in the module
            by_name[name] = _lazy(checkpoint, storages, "params", name)
        state_dict[key] = by_name[name]
    return state_dict


def _optimizer(checkpoint: ShardedCheckpoint, index: int, storages: list[_LazyStorage]) -> dict[str, Any]:
    """The ordinary ``Optimizer.state_dict()`` form: state by parameter index, param groups with indices."""
    groups = checkpoint.metadata["optimizers"][index]["param_groups"]
    names = [name for group in groups for name in group]
    scalars = checkpoint.optimizer_scalars(index)
    state: dict[int, dict[str, Any]] = {}
    for position, name in enumerate(names):
        if name not in scalars:
            continue
        entry = dict(scalars[name])
        for key in entry.pop("__tensor_keys__"):
            entry[key] = _lazy(checkpoint, storages, (index, key), name)
        for key in entry.pop("__whole_keys__", []):  # saved whole by the owner (Adafactor's factors): small
            entry[key] = checkpoint.read_whole((index, key), name).clone()
        state[position] = entry
    param_groups, start = [], 0
    for hyper, group in zip(checkpoint.param_groups(index), groups, strict=True):
        param_groups.append({**hyper, "params": list(range(start, start + len(group)))})
        start += len(group)
    checkpoint.release()
    return {"state": state, "param_groups": param_groups}


def _materialize(checkpoint: ShardedCheckpoint, storage: _LazyStorage) -> Tensor:
    if isinstance(storage.source, torch.storage.TypedStorage):
        return torch.empty(0, dtype=storage.dtype).set_(storage.source._untyped_storage)
    section, name = storage.source
    return checkpoint.read(section, name, 0, storage.numel).contiguous()
