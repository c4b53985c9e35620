"""metadata.json of sharded checkpoints: the checks a load makes before it reads any shard."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

import lightning_zero
from lightning_zero.checkpoint.metadata import (
    FORMAT_VERSION,
    CheckpointError,
    build_metadata,
    check_same_model,
    check_same_optimizers,
    read_metadata,
    write_metadata,
)

TENSORS = {
    "a.weight": {"shape": [4, 3], "dtype": "float32", "ranges": [[0, 0, 6], [1, 6, 12]]},
    "a.bias": {"shape": [4], "dtype": "float32", "ranges": [[1, 0, 4]]},
}


def _write(directory: Path, world_size: int = 2, ranks: tuple[int, ...] = (0, 1)) -> dict:
    directory.mkdir(exist_ok=True)
    metadata = build_metadata(
        version=lightning_zero.__version__,
        world_size=world_size,
        stage=3,
        partition="flat",
        precision="32-true",
        tensors=TENSORS,
        state_dict_keys=[["a.weight", "a.weight"], ["a.bias", "a.bias"]],
        optimizers=[[["a.weight", "a.bias"]]],
    )
    write_metadata(directory, metadata)
    for rank in ranks:
        (directory / f"rank_{rank}.pt").write_bytes(b"")
    return metadata


def test_complete_metadata_reads_back(tmp_path: Path) -> None:
    written = _write(tmp_path / "ckpt")
    assert read_metadata(tmp_path / "ckpt") == written
    assert written["format_version"] == FORMAT_VERSION


def test_metadata_changed_after_writing_is_refused(tmp_path: Path) -> None:
    _write(tmp_path / "ckpt")
    file = tmp_path / "ckpt" / "metadata.json"
    changed = json.loads(file.read_text())
    changed["stage"] = 2  # valid JSON and a valid value: only the checksum can tell
    file.write_text(json.dumps(changed))
    with pytest.raises(CheckpointError, match=r"metadata\.json is damaged"):
        read_metadata(tmp_path / "ckpt")


def test_a_rank_file_the_metadata_does_not_list_is_refused(tmp_path: Path) -> None:
    _write(tmp_path / "ckpt", world_size=2, ranks=(0, 1, 2))
    with pytest.raises(CheckpointError, match=r"has shard files \['rank_2.pt'\] that its metadata does not list"):
        read_metadata(tmp_path / "ckpt")


def test_missing_rank_files_are_listed(tmp_path: Path) -> None:
    _write(tmp_path / "ckpt", world_size=4, ranks=(0, 1, 2))
    message = f"checkpoint '{tmp_path / 'ckpt'}' is incomplete: metadata lists 4 ranks, shard files for ranks [3]"
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_metadata(tmp_path / "ckpt")


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda d: (d / "metadata.json").unlink(), "has no metadata.json"),
        (lambda d: (d / "metadata.json").write_text("{not json"), "metadata.json is corrupt"),
        (lambda d: (d / "metadata.json").write_text(json.dumps({"format_version": 7})), "has format version 7"),
    ],
    ids=["no-metadata", "corrupt-metadata", "future-version"],
)
def test_damaged_metadata_is_named(tmp_path: Path, damage: Callable[[Path], object], expected: str) -> None:
    _write(tmp_path / "ckpt")
    damage(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=expected):
        read_metadata(tmp_path / "ckpt")


def test_a_file_is_not_a_sharded_checkpoint(tmp_path: Path) -> None:
    """An ordinary checkpoint file handed where a sharded directory is expected says what to call instead."""
    (tmp_path / "model.ckpt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"is a file.*ordinary checkpoint.*lightning_zero.load_from_checkpoint"):
        read_metadata(tmp_path / "model.ckpt")
    with pytest.raises(CheckpointError, match="is not a directory"):
        read_metadata(tmp_path / "missing")


def test_a_dcp_directory_is_named_as_one(tmp_path: Path) -> None:
    """A torch.distributed.checkpoint directory (``convert``'s output, or FSDP2's) handed to ``convert`` or
    ``consolidate`` says what it is and how to use it."""
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"is a torch\.distributed\.checkpoint \(DCP\) directory.*ckpt_path"):
        read_metadata(tmp_path / "dcp")


def test_consolidate_into_a_directory_says_to_pass_a_file(tmp_path: Path) -> None:
    """consolidate writes one file: an output path that is a directory (the sharded one, say) is refused at once."""
    from lightning_zero.checkpoint import consolidate

    (tmp_path / "ckpt").mkdir()
    with pytest.raises(CheckpointError, match=r"is a directory: consolidate writes one ordinary checkpoint file"):
        consolidate(tmp_path / "ckpt", tmp_path / "ckpt")


def test_a_different_model_names_its_first_difference(tmp_path: Path) -> None:
    metadata = _write(tmp_path / "ckpt")
    same = {name: dict(spec, ranges=[]) for name, spec in TENSORS.items()}
    check_same_model(metadata, same, "ckpt")
    with pytest.raises(CheckpointError, match=r"tensor 'a.bias' has shape \[4\] there, \[5\] here"):
        check_same_model(metadata, {**same, "a.bias": {"shape": [5], "dtype": "float32"}}, "ckpt")
    with pytest.raises(CheckpointError, match=r"it has no tensor 'b\.weight'"):
        check_same_model(metadata, {**same, "b.weight": {"shape": [1], "dtype": "float32"}}, "ckpt")
    with pytest.raises(CheckpointError, match=r"this model has no tensor 'a\.bias'"):
        check_same_model(metadata, {"a.weight": same["a.weight"]}, "ckpt")
    # Another floating-point dtype is a run resumed in another precision: cast on load.
    check_same_model(metadata, {**same, "a.bias": {"shape": [4], "dtype": "bfloat16"}}, "ckpt")
    with pytest.raises(CheckpointError, match="dtype float32 there, int64 here"):
        check_same_model(metadata, {**same, "a.bias": {"shape": [4], "dtype": "int64"}}, "ckpt")
    with pytest.raises(CheckpointError, match="param groups hold"):
        check_same_optimizers(metadata, [[["a.weight"], ["a.bias"]]], "ckpt")


def test_without_strict_only_the_tensors_in_both_are_loaded_and_shapes_still_checked(tmp_path: Path) -> None:
    metadata = _write(tmp_path / "ckpt")
    same = {name: dict(spec, ranges=[]) for name, spec in TENSORS.items()}
    assert check_same_model(metadata, same, "ckpt", strict=False) == list(same)
    grown = {**same, "c.weight": {"shape": [2], "dtype": "float32"}}  # missing from the checkpoint: skipped
    assert check_same_model(metadata, grown, "ckpt", strict=False) == list(same)
    shrunk = {"a.weight": same["a.weight"]}  # the checkpoint's other tensors are unexpected: skipped
    assert check_same_model(metadata, shrunk, "ckpt", strict=False) == ["a.weight"]
    with pytest.raises(CheckpointError, match=r"tensor 'a.bias' has shape \[4\] there, \[5\] here"):
        check_same_model(metadata, {**same, "a.bias": {"shape": [5], "dtype": "float32"}}, "ckpt", strict=False)


def test_crc32_combine_is_the_crc_of_the_concatenation() -> None:
    import random
    import zlib

    from lightning_zero.checkpoint.checksums import crc32_combine

    rng = random.Random(0)
    for _ in range(50):
        first, second = rng.randbytes(rng.randrange(0, 300)), rng.randbytes(rng.choice([0, 1, 5, 4096, 70001]))
        assert crc32_combine(zlib.crc32(first), zlib.crc32(second), len(second)) == zlib.crc32(first + second)


@pytest.mark.parametrize("torch_crc", [True, False])
def test_the_digest_of_a_saved_file_from_its_records_is_the_files(tmp_path: Path, torch_crc: bool) -> None:
    """The CRC-32 that a save lists, from torch.save's records, is the file's (read whole); where torch.save did not
    compute its records' CRC-32 the file is read back."""
    import torch

    from lightning_zero.checkpoint import checksums
    from lightning_zero.checkpoint.metadata import file_digest

    objects = {
        "mixed": {
            "a": torch.randn(70000),
            "empty": torch.zeros(0),
            "half": torch.ones(3, dtype=torch.bfloat16),
            "n": 5,
        },
        "many": {f"t{i}": torch.randn(i * 9000 + 1) for i in range(30)},
        "view": [torch.arange(40000).view(200, 200)[:, :50], torch.tensor(3.0)],
    }
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(torch_crc)
    try:
        for name, obj in objects.items():
            torch.save(obj, tmp_path / f"{name}.pt")
    finally:
        torch.serialization.set_crc32_options(previous)
    for name in objects:
        file = tmp_path / f"{name}.pt"
        assert checksums.saved_file_digest(file) == file_digest(file), name
        from_records = checksums._from_records(file)
        assert (from_records == file_digest(file)) if torch_crc else from_records is None, name
    (tmp_path / "junk.pt").write_bytes(b"not a zip archive" * 100)
    assert checksums.saved_file_digest(tmp_path / "junk.pt") == file_digest(tmp_path / "junk.pt")
