"""``metadata.json`` of a sharded checkpoint: what was saved, by whom, and the checks a load makes first.

The format is described in docs/checkpoints.md. Every check raises the same error on every rank (each rank
reads the same files), naming what is wrong and what to do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
LIGHTNING_FILE = "lightning.pt"
COMPLETE_FILE = "COMPLETE"  # in a save's directory once every rank's file is written (see sharded.py)


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
    }


def write_metadata(directory: Path, metadata: dict[str, Any]) -> None:
    (directory / METADATA_FILE).write_text(json.dumps(metadata, indent=1))


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
    if not path.is_file():
        raise CheckpointError(
            f"{where} has no {METADATA_FILE}: it is not a lightning_zero sharded checkpoint, or its save did not "
            "finish. Pass a complete checkpoint directory."
        )
    try:
        metadata = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{where}: {METADATA_FILE} is corrupt ({error}). Use another checkpoint.") from error
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
    return metadata


def check_same_model(metadata: dict[str, Any], current: dict[str, dict[str, Any]], where: str) -> None:
    """Raise unless the checkpoint's tensors have the names, shapes and dtypes of ``current``; name the first
    difference. Floating-point dtypes may differ (a run resumed in another precision casts on load)."""
    saved = metadata["tensors"]
    fix = "Load it into the model that saved it, or build this model with the same architecture."
    for name, spec in current.items():
        if name not in saved:
            raise CheckpointError(f"{where} is of a different model: it has no tensor {name!r}. {fix}")
        for field in ("shape", "dtype"):
            theirs, mine = saved[name][field], spec[field]
            if field == "dtype" and _is_floating(theirs) and _is_floating(mine):
                continue
            if str(list(theirs) if field == "shape" else theirs) != str(list(mine) if field == "shape" else mine):
                raise CheckpointError(
                    f"{where} is of a different model: tensor {name!r} has {field} {theirs} there, {mine} here. {fix}"
                )
    extra = [name for name in saved if name not in current]
    if extra:
        raise CheckpointError(f"{where} is of a different model: this model has no tensor {extra[0]!r}. {fix}")


def _is_floating(dtype: str) -> bool:
    return dtype in ("float64", "float32", "bfloat16", "float16")


def check_same_optimizers(metadata: dict[str, Any], current: list[list[list[str]]], where: str) -> None:
    saved = [opt["param_groups"] for opt in metadata["optimizers"]]
    if saved != current:
        raise CheckpointError(
            f"{where} was saved with optimizers whose param groups hold {saved}, configure_optimizers() here gives "
            f"{current}. Return the same optimizers and param groups as the run that saved it."
        )
