"""``metadata.json`` of a sharded checkpoint: what was saved, by whom, and the checks a load makes first.

The format is described in docs/checkpoints.md. Every check raises the same error on every rank (each rank
reads the same files), naming what is wrong and what to do.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

from lightning_zero.checkpoint.dcp_layout import is_dcp_checkpoint

FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
LIGHTNING_FILE = "lightning.pt"
COMPLETE_FILE = "COMPLETE"  # in a save's directory once every rank's file is written (see sharded.py)
FILES_KEY = "files"  # per file of the checkpoint: {"bytes", "crc32"}
CHECKSUM_KEY = "checksum"  # CRC-32 of the rest of metadata.json
_CHUNK = 8 * 2**20

# [Note: checksums of a sharded checkpoint]
# Every file a save writes (rank_{r}.pt, lightning.pt) is listed in metadata.json with its size and CRC-32,
# computed by its writer from the CRC-32 that torch.save computed of each record as it wrote it (see [Note: the
# CRC-32 of a saved file from its zip records] in checksums.py); metadata.json carries the CRC-32
# of its own other contents. Opening a checkpoint checks the metadata's checksum, that exactly the listed rank
# files are there, every file's size, and the CRC-32 of every file (the ranks of a run share that work, each
# reading about 1/N of the checkpoint, and agree on the outcome). A truncated, changed or foreign file fails on
# every rank with a CheckpointError naming it, before anything is loaded. torch.load alone would not notice:
# flipped bytes in a tensor's data load silently. Checkpoints saved before checksums (no "files") skip them.


def rank_file(rank: int) -> str:
    return f"rank_{rank}.pt"


class CheckpointError(RuntimeError):
    """A sharded checkpoint that cannot be loaded: incomplete, corrupt, of another model or format."""


def build_metadata(
    *,
    version: str,
    world_size: int,
    stage: int,
    partition: str,
    precision: str,
    tensors: dict[str, dict[str, Any]],
    state_dict_keys: list[list[str]],
    optimizers: list[list[list[str]]],
    optimizer_states: bool = True,
    files: dict[str, dict[str, int]] | None = None,
) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "lightning_zero_version": version,
        "world_size": world_size,
        "stage": stage,
        "partition": partition,
        "precision": precision,
        "tensors": tensors,
        "state_dict_keys": state_dict_keys,
        "optimizers": [{"param_groups": groups} for groups in optimizers],
        "optimizer_states": optimizer_states,  # False for save_checkpoint(weights_only=True)
        FILES_KEY: files or {},
    }


def write_metadata(directory: Path, metadata: dict[str, Any]) -> None:
    (directory / METADATA_FILE).write_text(json.dumps({**metadata, CHECKSUM_KEY: _crc_of(metadata)}, indent=1))


def _crc_of(metadata: dict[str, Any]) -> int:
    rest = {k: v for k, v in metadata.items() if k != CHECKSUM_KEY}
    return zlib.crc32(json.dumps(rest, sort_keys=True).encode())


def file_digest(file: Path) -> dict[str, int]:
    """A file's size and CRC-32 (see [Note: checksums of a sharded checkpoint])."""
    crc, size = 0, 0
    with open(file, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"bytes": size, "crc32": crc}


def read_metadata(directory: str | Path) -> dict[str, Any]:
    """Read and check ``metadata.json`` and that every rank file is there."""
    directory = Path(directory)
    where = f"checkpoint '{directory}'"
    if directory.is_file():
        raise CheckpointError(
            f"{where} is a file, not a sharded checkpoint directory: it is an ordinary checkpoint. Open it with "
            "Model.load_from_checkpoint(path) (or lightning_zero.load_from_checkpoint(Model, path)), resume with "
            "trainer.fit(model, ckpt_path=path), or read it with torch.load."
        )
    if not directory.is_dir():
        raise CheckpointError(f"{where} is not a directory: pass the directory that a sharded save wrote.")
    path = directory / METADATA_FILE
    if not path.is_file() and is_dcp_checkpoint(directory):
        raise CheckpointError(
            f"{where} is a torch.distributed.checkpoint (DCP) directory, not a lightning_zero sharded checkpoint: "
            "resume from it with trainer.fit(model, ckpt_path=...) under ZeroStrategy, or read it with "
            "torch.distributed.checkpoint.load."
        )
    if not path.is_file():
        raise CheckpointError(
            f"{where} has no {METADATA_FILE}: it is not a lightning_zero sharded checkpoint, or its save did not "
            "finish. Pass a complete checkpoint directory."
        )
    try:
        metadata = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{where}: {METADATA_FILE} is corrupt ({error}). Use another checkpoint.") from error
    checksum = metadata.pop(CHECKSUM_KEY, None) if isinstance(metadata, dict) else None  # absent: saved before it
    if checksum is not None and checksum != _crc_of(metadata):
        raise CheckpointError(
            f"{where}: {METADATA_FILE} is damaged (its checksum does not match its contents): restore it from a copy "
            "or use another checkpoint."
        )
    version = metadata.get("format_version") if isinstance(metadata, dict) else None
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{where} has format version {version!r}, this lightning_zero reads version {FORMAT_VERSION}. Load it "
            f"with the lightning_zero version that wrote it ({metadata.get('lightning_zero_version', 'unknown')}) "
            "and save a full checkpoint (state_dict_type='full') or consolidate it."
        )
    world_size = metadata["world_size"]
    missing = [rank for rank in range(world_size) if not (directory / rank_file(rank)).is_file()]
    if missing:
        raise CheckpointError(
            f"{where} is incomplete: metadata lists {world_size} ranks, shard files for ranks {missing} are missing."
        )
    listed = {rank_file(rank) for rank in range(world_size)}
    extra = sorted(p.name for p in directory.glob("rank_*.pt") if p.name not in listed)
    if extra:
        raise CheckpointError(
            f"{where} has shard files {extra} that its metadata does not list (it lists {world_size} ranks): files of "
            "another save were copied in. Remove them, or restore the checkpoint from a copy."
        )
    return metadata


def check_same_model(
    metadata: dict[str, Any], current: dict[str, dict[str, Any]], where: str, strict: bool = True
) -> list[str]:
    """The names of ``current`` to load from the checkpoint. Raise unless the tensors in both have the same shapes
    and dtypes (floating-point dtypes may differ: a run resumed in another precision casts on load), and, with
    ``strict``, unless both hold the same names; name the missing and unexpected ones. Without ``strict`` (as
    ``load_state_dict(strict=False)``) a tensor only one of them has is skipped."""
    saved = metadata["tensors"]
    fix = "Load it into the model that saved it, or build this model with the same architecture."
    skip = "strict=False (a LightningModule's strict_loading = False) skips the tensors only one of them has."
    missing = [name for name in current if name not in saved]
    extra = [name for name in saved if name not in current]
    if strict and (missing or extra):
        first = f"it has no tensor {missing[0]!r}" if missing else f"this model has no tensor {extra[0]!r}"
        raise CheckpointError(
            f"{where} is of a different model: {first}. Missing keys (in this model, not in the checkpoint): "
            f"{_few(missing)}; unexpected keys (in the checkpoint, not in this model): {_few(extra)}. {fix} {skip}"
        )
    for name, spec in current.items():
        if name not in saved:
            continue
        for field in ("shape", "dtype"):
            theirs, mine = saved[name][field], spec[field]
            if field == "dtype" and _is_floating(theirs) and _is_floating(mine):
                continue
            if str(list(theirs) if field == "shape" else theirs) != str(list(mine) if field == "shape" else mine):
                raise CheckpointError(
                    f"{where} is of a different model: tensor {name!r} has {field} {theirs} there, {mine} here. {fix}"
                )
    return [name for name in current if name in saved]


def _few(names: list[str], shown: int = 10) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"[{', '.join(repr(name) for name in names[:shown])}]{more}"


def _is_floating(dtype: str) -> bool:
    return dtype in ("float64", "float32", "bfloat16", "float16")


def check_same_optimizers(metadata: dict[str, Any], current: list[list[list[str]]], where: str) -> None:
    saved = [opt["param_groups"] for opt in metadata["optimizers"]]
    if saved != current:
        raise CheckpointError(
            f"{where} was saved with optimizers whose param groups hold {saved}, configure_optimizers() here gives "
            f"{current}. Return the same optimizers and param groups as the run that saved it."
        )
