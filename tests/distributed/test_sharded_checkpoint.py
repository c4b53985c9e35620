"""Sharded checkpoints at the engine level (no Lightning): save, reload at another stage, errors, consolidation.

One spawn of 3 gloo ranks trains a tiny model (uneven sizes, a frozen layer, a module buffer) at stage 3,
saves it, reloads it into engines of stages 1 and 2, and checks the errors of damaged copies on every rank.
It also saves a "big" checkpoint (many equal 1 MiB tensors) that the consolidation tests then read in a
fresh interpreter: peak memory and loading without lightning_zero.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.helpers import run_on_ranks

WORLD_SIZE = 3
BIG_LAYERS, BIG_WIDTH = 24, 512  # 24 weights of 1 MiB: parameters and two AdamW states are 72 MiB


class Small(nn.Module):
    def __init__(self, hidden: int = 11) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(7, hidden)
        self.frozen = nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)
        self.b = nn.Linear(hidden, 3)
        self.register_buffer("scale", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.frozen(torch.tanh(self.a(x))))) * self.scale


def _engine(model: nn.Module, stage: int, lr: float = 1e-2) -> Any:
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    policy = {nn.Linear} if stage == 3 else None
    config = EngineOptions(stage=stage, bucket_cap_mb=0.0002, wrap_policy=policy)
    return ZeroEngine(model, [optimizer], config, Communicator())


def _train(engine: Any, steps: int, rank: int) -> None:
    optimizer = engine.optimizers[0]
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, engine.module.a.in_features if hasattr(engine.module, "a") else BIG_WIDTH, generator=gen)
        optimizer.zero_grad()
        engine.module(x).pow(2).mean().backward()
        optimizer.step()


def _full_state(engine: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:

    with engine.gathered():
        params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return params, engine.full_optimizer_state_dict(engine.optimizers[0])


def _error_of(fn: Any) -> str:
    try:
        fn()
    except Exception as error:  # the message is what the test checks
        return f"{type(error).__name__}: {error}"
    return "no error"


def _damage(directory: Path, name: str, how: Any) -> Path:
    copy = directory / name
    if dist.get_rank() == 0:
        shutil.copytree(directory / "small", copy)
        how(copy)
    dist.barrier()
    return copy


def _truncate(path: Path) -> None:
    file = path / "rank_1.pt"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _bump_version(path: Path) -> None:
    """A checkpoint of a future format (its metadata's checksum is right: a future version wrote it)."""
    from lightning_zero.checkpoint.metadata import write_metadata

    metadata = json.loads((path / "metadata.json").read_text())
    metadata["format_version"] = 99
    write_metadata(path, {k: v for k, v in metadata.items() if k != "checksum"})


def _flip_byte(file: Path, where: float = 0.5) -> None:
    data = bytearray(file.read_bytes())
    data[int(len(data) * where)] ^= 0x01
    file.write_bytes(bytes(data))


def _flip_a_range(path: Path) -> None:
    """One number of the metadata changed (still valid JSON, another layout), its checksum left as it was."""
    metadata = json.loads((path / "metadata.json").read_text())
    ranges = next(spec["ranges"] for spec in metadata["tensors"].values() if len(spec["ranges"]) > 1)
    ranges[0][2] += 1
    ranges[1][1] += 1
    (path / "metadata.json").write_text(json.dumps(metadata, indent=1))


def _foreign_rank_file(path: Path) -> None:
    shutil.copy(path.parent / "small_stage1" / "rank_1.pt", path / "rank_1.pt")


def _on_ranks(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    from lightning_zero.checkpoint import ShardedCheckpoint, load_sharded_optimizers, load_sharded_params, save_sharded
    from lightning_zero.core.comm import Communicator

    root = Path(directory)
    out: dict[str, Any] = {}
    engine = _engine(Small(), stage=3)
    _train(engine, 3, rank)
    (root / "small.tmp-crashed").mkdir(exist_ok=True)  # what a save killed before its commit leaves
    save_sharded(engine.named_state(), root / "small", {"note": "first"}, "test")
    _train(engine, 1, rank)
    save_sharded(engine.named_state(), root / "small", {"note": "second"}, "test")  # replaces the first, atomically
    out["saved"] = _full_state(engine)
    loaded = {}
    for stage in (1, 2, 3):
        loaded[stage] = _engine(Small(hidden=11), stage=stage, lr=0.5)
        checkpoint = ShardedCheckpoint(root / "small")
        load_sharded_params(loaded[stage].named_state(), checkpoint)
        load_sharded_optimizers(loaded[stage].named_state(), checkpoint)
        out[f"stage{stage}"] = _full_state(loaded[stage])
        out["note"] = checkpoint.lightning_state()["note"]
    # Back from stage 1 (where the frozen layer is not in a flat buffer and rank 0 saves it whole) to stage 3.
    save_sharded(loaded[1].named_state(), root / "small_stage1", {}, "test")
    again = _engine(Small(hidden=11), stage=3, lr=0.5)
    load_sharded_params(again.named_state(), ShardedCheckpoint(root / "small_stage1"))
    load_sharded_optimizers(again.named_state(), ShardedCheckpoint(root / "small_stage1"))
    out["stage1-to-stage3"] = _full_state(again)
    missing = _damage(root, "missing", lambda p: (p / "rank_2.pt").unlink())
    out["missing"] = _error_of(lambda: ShardedCheckpoint(missing))
    out["truncated"] = _error_of(lambda: ShardedCheckpoint(_damage(root, "truncated", _truncate)))
    out["version"] = _error_of(lambda: ShardedCheckpoint(_damage(root, "version", _bump_version)))
    flipped = _damage(root, "flipped_rank", lambda p: _flip_byte(p / "rank_1.pt"))
    out["flipped_rank"] = _error_of(lambda: ShardedCheckpoint(flipped))
    # The ranks of a run share the checksums (each reads about a third here) and agree on the outcome.
    out["flipped_rank_shared"] = _error_of(lambda: ShardedCheckpoint(flipped, comm=Communicator()))
    out["flipped_metadata"] = _error_of(lambda: ShardedCheckpoint(_damage(root, "flipped_metadata", _flip_a_range)))
    extra = _damage(root, "extra_rank", lambda p: shutil.copy(p / "rank_0.pt", p / "rank_3.pt"))
    out["extra_rank"] = _error_of(lambda: ShardedCheckpoint(extra))
    out["foreign_file"] = _error_of(lambda: ShardedCheckpoint(_damage(root, "foreign_file", _foreign_rank_file)))
    no_lightning = _damage(root, "no_lightning", lambda p: (p / "lightning.pt").unlink())
    out["no_lightning"] = _error_of(lambda: ShardedCheckpoint(no_lightning))
    out["flipped_lightning"] = _error_of(
        lambda: ShardedCheckpoint(_damage(root, "flipped_lightning", lambda p: _flip_byte(p / "lightning.pt", 0.9)))
    )
    other = _engine(Small(hidden=12), stage=1)
    out["other_model"] = _error_of(lambda: load_sharded_params(other.named_state(), ShardedCheckpoint(root / "small")))
    big = nn.Sequential(*(nn.Linear(BIG_WIDTH, BIG_WIDTH, bias=False) for _ in range(BIG_LAYERS)))
    big_engine = _engine(big, stage=3)
    _train(big_engine, 1, rank)
    save_sharded(big_engine.named_state(), root / "big", {"hyper_parameters": {}}, "test")
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("engine_ckpt")
    per_rank = run_on_ranks(_on_ranks, WORLD_SIZE, str(directory))
    return {"dir": directory, "per_rank": per_rank}


def test_save_replaces_the_old_checkpoint_and_leaves_no_temporaries(results: dict[str, Any]) -> None:
    root = results["dir"]
    names = {p.name for p in (root / "small").iterdir()}
    assert names == {"metadata.json", "lightning.pt", "rank_0.pt", "rank_1.pt", "rank_2.pt"}
    assert not [p.name for p in root.iterdir() if ".old-" in p.name or (".tmp-" in p.name and "crashed" not in p.name)]
    assert all(r["note"] == "second" for r in results["per_rank"])


def test_the_listed_checksums_are_those_of_the_files(results: dict[str, Any]) -> None:
    """Each writer lists its file's CRC-32 from torch.save's records (not read back): it is the file's."""
    from lightning_zero.checkpoint.metadata import file_digest

    for name in ("small", "small_stage1", "big"):
        listed = json.loads((results["dir"] / name / "metadata.json").read_text())["files"]
        assert sorted(listed) == ["lightning.pt", "rank_0.pt", "rank_1.pt", "rank_2.pt"]
        for file, digest in listed.items():
            assert file_digest(results["dir"] / name / file) == digest, f"{name}/{file}"


@pytest.mark.parametrize("loaded", ["stage1", "stage2", "stage3", "stage1-to-stage3"])
def test_stage3_checkpoint_loads_exactly_at_every_stage(results: dict[str, Any], loaded: str) -> None:
    for rank, result in enumerate(results["per_rank"]):
        (params, optim), (loaded_params, loaded_optim) = result["saved"], result[loaded]
        for key, value in params.items():
            assert torch.equal(value, loaded_params[key]), f"rank {rank}: {key}"
        assert [g["lr"] for g in loaded_optim["param_groups"]] == [g["lr"] for g in optim["param_groups"]]
        assert sorted(loaded_optim["state"]) == sorted(optim["state"])
        for index, state in optim["state"].items():
            for key, value in state.items():
                assert torch.equal(value, loaded_optim["state"][index][key]), f"rank {rank}: param {index} {key}"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing", "is incomplete: metadata lists 3 ranks, shard files for ranks [2] are missing."),
        ("truncated", "is damaged: rank_1.pt has "),
        ("flipped_rank", "is damaged: rank_1.pt has checksum "),
        ("flipped_rank_shared", "is damaged: rank_1.pt has checksum "),
        ("flipped_metadata", "metadata.json is damaged (its checksum does not match its contents)"),
        ("extra_rank", "has shard files ['rank_3.pt'] that its metadata does not list (it lists 3 ranks)"),
        ("foreign_file", "is damaged: rank_1.pt has "),
        ("no_lightning", "is damaged: lightning.pt is missing"),
        ("flipped_lightning", "is damaged: lightning.pt has checksum "),
        ("version", "has format version 99, this lightning_zero reads version 1"),
        ("other_model", "is of a different model: tensor 'a.weight' has shape [11, 7] there, [12, 7] here."),
    ],
)
def test_damaged_checkpoint_raises_a_clear_error_on_every_rank(
    results: dict[str, Any], case: str, expected: str
) -> None:
    for rank, result in enumerate(results["per_rank"]):
        assert expected in result[case], f"rank {rank}: {result[case]}"
        assert result[case].startswith("CheckpointError: checkpoint '")
        assert result[case] == results["per_rank"][0][case]  # the same error on every rank


def _file_bytes(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_consolidate_refuses_an_output_inside_the_checkpoint_and_writes_nothing(
    results: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An output among the shards (a shard's own name, any new file, a subdirectory, through a symlink or ``..``)
    would be renamed into the checkpoint being read and could replace a shard: it is refused before any write."""
    import lightning_zero
    from lightning_zero.cli import main

    checkpoint = tmp_path / "small"
    shutil.copytree(results["dir"] / "small", checkpoint)
    (checkpoint / "sub").mkdir()
    (tmp_path / "link").symlink_to(checkpoint, target_is_directory=True)
    before = _file_bytes(checkpoint)
    outputs = [
        checkpoint / "rank_0.pt",
        checkpoint / "consolidated.ckpt",
        checkpoint / "sub" / "out.ckpt",
        tmp_path / "link" / "rank_1.pt",
        tmp_path / "elsewhere" / ".." / "small" / "metadata.json",
    ]
    for out in outputs:
        with pytest.raises(ValueError, match=r"is inside the sharded checkpoint .* it reads; writing it there"):
            lightning_zero.consolidate(checkpoint, out)
        assert main(["consolidate", str(checkpoint), str(out)]) == 1
        assert "is inside the sharded checkpoint" in capsys.readouterr().err
        assert main(["consolidate", str(tmp_path / "link"), str(out)]) == 1  # the source named through the link
        assert _file_bytes(checkpoint) == before, out
    assert main(["consolidate", str(checkpoint), str(tmp_path / "small.ckpt")]) == 0  # beside it: fine, and intact
    assert torch.load(tmp_path / "small.ckpt", weights_only=False)["state_dict"]


CONSOLIDATE = """
import json, resource, sys, torch
from lightning_zero.checkpoint import ShardedCheckpoint, consolidate
ShardedCheckpoint(sys.argv[1]).lightning_state()  # imports and first touches happen before the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
consolidate(sys.argv[1], sys.argv[2])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"before_kib": before, "after_kib": after}))
"""

LOAD_PLAIN = """
import sys, torch
checkpoint = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
assert "lightning_zero" not in sys.modules
model = torch.nn.Sequential(*(torch.nn.Linear({w}, {w}, bias=False) for _ in range({n})))
model.load_state_dict(checkpoint["state_dict"])
optimizer = torch.optim.AdamW(model.parameters())
optimizer.load_state_dict(checkpoint["optimizer_states"][0])
print(sum(float(p.double().sum()) for p in model.parameters()), len(optimizer.state))
"""


def test_consolidation_memory_is_bounded_by_about_one_tensor(results: dict[str, Any]) -> None:
    root = results["dir"]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = root / "big.ckpt"
    run = subprocess.run(
        [sys.executable, "-c", CONSOLIDATE, str(root / "big"), str(out)], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr
    peak = json.loads(run.stdout.splitlines()[-1])
    growth_mib = (peak["after_kib"] - peak["before_kib"]) / 1024
    checkpoint_mib = sum(f.stat().st_size for f in (root / "big").iterdir()) / 2**20
    tensor_mib = BIG_WIDTH * BIG_WIDTH * 4 / 2**20
    assert checkpoint_mib > 60 * tensor_mib
    assert growth_mib < 8 * tensor_mib, f"consolidation grew the peak RSS by {growth_mib:.1f} MiB"
    code = LOAD_PLAIN.format(w=BIG_WIDTH, n=BIG_LAYERS)
    loaded = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split()[-1] == str(BIG_LAYERS)


# Saves once, then dies by SIGKILL halfway through writing its shard file of a second save to the same path.
KILLED_DURING_SAVE = """
import io, os, signal, sys, torch
import torch.distributed as dist
from tests.distributed.test_sharded_checkpoint import Small, _engine, _train
from lightning_zero.checkpoint import save_sharded

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
engine = _engine(Small(), stage=1)
_train(engine, 2, 0)
save_sharded(engine.named_state(), sys.argv[1], {"note": "first"}, "test")
torch.save({k: v.clone() for k, v in engine.module.state_dict().items()}, sys.argv[1] + ".expected")
_train(engine, 1, 0)
real_save = torch.save

def save_half_then_die(obj, file, *args, **kwargs):
    payload = io.BytesIO()
    real_save(obj, payload, *args, **kwargs)
    half = payload.getvalue()[: len(payload.getvalue()) // 2]
    if isinstance(file, (str, os.PathLike)):
        with open(file, "wb") as handle:
            handle.write(half)
            handle.flush()
            os.fsync(handle.fileno())
    else:  # a file object (the rank files' DirectFile): half of it on the disk
        file.write(half)
        file.close()
    os.kill(os.getpid(), signal.SIGKILL)

torch.save = save_half_then_die
save_sharded(engine.named_state(), sys.argv[1], {"note": "second"}, "test")
"""


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    from lightning_zero.checkpoint import ShardedCheckpoint
    from tests.helpers import free_port

    path = tmp_path / "ckpt"
    repo = Path(__file__).resolve().parents[2]
    script = [sys.executable, "-c", KILLED_DURING_SAVE, str(path), str(free_port())]
    killed = subprocess.run(script, capture_output=True, text=True, cwd=repo, check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name], "the killed save left no partial directory"
    checkpoint = ShardedCheckpoint(path)  # opens and checks every file
    assert checkpoint.lightning_state()["note"] == "first"
    expected = torch.load(f"{path}.expected")
    loaded = checkpoint.full_state_dict()
    assert list(loaded) == list(expected)
    for key, value in expected.items():
        assert torch.equal(value, loaded[key]), key
