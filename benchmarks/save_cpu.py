"""What writing a rank file of a sharded checkpoint costs in CPU seconds per GiB, part by part.

Run on demand, from the repository root (about a minute with the defaults; needs ``--gib`` x 3 of free memory and
disk, and with ``--kept`` 2 x (``--reps`` + 1) x ``--gib`` of disk more)::

    python benchmarks/save_cpu.py --gib 1 --reps 7 --kept

CPU time (user + system, of this process, ``resource.getrusage``), not wall time: it does not depend on what else
the machine runs, and it is what a background save takes from training where they share cores. Work that the
kernel does in threads of its own (writing dirty pages to the disk) is not counted, nor is the disk's time. Each
part runs ``--reps`` times on a rank file of ``--gib`` GiB (fp32 tensors of 64 MiB, as an MLP's weights and two
AdamW states, plus small ones); the table gives the median and the range, per GiB. The parts:

* ``torch.save``: pickling, the CRC-32 that torch.save computes of every record, the copy into the page cache;
  ``torch.save, no CRC`` is the same with ``torch.serialization.set_crc32_options(False)``, and ``write`` the
  copy alone (``os.write`` of the tensors' bytes), so that the CRC-32 and the pickling are the differences;
* ``fsync``: flushing the file to the disk, as the writer's thread sees it;
* ``read back + CRC-32`` (``file_digest``, how the writer computed the file's CRC-32 for metadata.json before),
  split into the read (a copy out of the page cache) and ``zlib.crc32``;
* ``CRC-32 from the records`` (``saved_file_digest``, how it does now: see [Note: the CRC-32 of a saved file from
  its zip records]);
* the whole write of a rank file before (torch.save, fsync, read back) and now (``saving._write``);
* with ``--kept``, the whole writes again into files that are all kept to the end (as a run keeps its
  checkpoints), so that every write's page cache is memory the kernel has not handed out lately: on the VM these
  figures come from, that costs far more than the page cache of a file just deleted; before (no file's pages
  dropped) and now (each written file's pages dropped: [Note: a written rank file leaves the page cache]), each in
  a run of its own;
* the snapshot's copy of the state on the training thread (``--snapshot``): into new tensors (a clone: what the
  first asynchronous save did in its step), into tensors already made (a refill: every later save's), and making
  them ahead (``_allocated``, on the worker thread now).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_zero.checkpoint import saving
from lightning_zero.checkpoint.background import _allocated
from lightning_zero.checkpoint.checksums import saved_file_digest
from lightning_zero.checkpoint.metadata import _CHUNK, file_digest

_BIG = 16 * 2**20  # elements of one fp32 tensor: 64 MiB


def rank_file(gib: float) -> dict[str, Any]:
    """A rank file's contents of about ``gib`` GiB: a third parameters, two thirds AdamW state."""
    layers = max(1, round(gib * 2**30 / (3 * 4 * _BIG)))
    params = {f"{i}.weight": torch.randn(_BIG) for i in range(layers)}
    params |= {f"{i}.bias": torch.randn(4096) for i in range(layers)}
    state = {
        name: {"step": torch.tensor(10.0), "exp_avg": torch.randn_like(t), "exp_avg_sq": torch.rand_like(t)}
        for name, t in params.items()
    }
    return {"rank": 0, "world_size": 1, "params": params, "optimizers": [{"state": state, "param_groups": []}]}


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measured(fn: Callable[[], Any], before: Callable[[], Any] | None = None) -> float:
    if before is not None:
        before()
    start = _cpu()
    fn()
    return _cpu() - start


def _tensors(obj: Any) -> list[torch.Tensor]:
    return saving._tensors(obj)


def _raw_write(obj: Any, file: Path) -> None:
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for tensor in _tensors(obj):
            view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            while view:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _read_back(file: Path) -> None:
    with open(file, "rb") as handle:
        while handle.read(_CHUNK):
            pass


def _crc_only(file: Path) -> None:
    import zlib

    crc = 0
    with open(file, "rb") as handle:
        chunks = []
        while chunk := handle.read(_CHUNK):
            chunks.append(chunk)
    start = _cpu()
    for chunk in chunks:
        crc = zlib.crc32(chunk, crc)
    _crc_only.seconds = _cpu() - start  # type: ignore[attr-defined]


def _old_write(file: Path, obj: Any) -> None:
    torch.save(obj, file)
    saving._sync(file)
    file_digest(file)


def _without_crc(obj: Any, file: Path) -> None:
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(obj, file)
    finally:
        torch.serialization.set_crc32_options(True)


def _snapshot_parts(live: list[torch.Tensor]) -> dict[str, float]:
    copies: list[torch.Tensor] = []
    parts = {"snapshot: clone (new copies)": measured(lambda: copies.extend(t.clone() for t in live))}
    parts["snapshot: refill"] = measured(lambda: [c.copy_(t) for c, t in zip(copies, live, strict=True)])
    copies.clear()
    specs = [(tuple(t.shape), t.dtype) for t in live]
    parts["snapshot: copies made ahead (_allocated)"] = measured(lambda: copies.extend(_allocated(specs)))
    return parts


def _write_parts(obj: Any, directory: Path) -> dict[str, float]:
    file, other = directory / "rank_0.pt", directory / "raw.bin"

    def fresh() -> None:
        for path in (file, other):
            path.unlink(missing_ok=True)

    parts = {
        "torch.save": measured(lambda: torch.save(obj, file), fresh),
        "fsync": measured(lambda: saving._sync(file)),
        "read back + CRC-32 (file_digest)": measured(lambda: file_digest(file)),
        "read back alone": measured(lambda: _read_back(file)),
        "CRC-32 from the records": measured(lambda: saved_file_digest(file)),
        "torch.save, no CRC": measured(lambda: _without_crc(obj, file), fresh),
        "write (os.write of the bytes)": measured(lambda: _raw_write(obj, other), fresh),
        "whole write before (save, fsync, read back)": measured(lambda: _old_write(file, obj), fresh),
        "whole write now (saving._write)": measured(lambda: saving._write(file, obj), fresh),
    }
    _crc_only(file)
    parts["zlib.crc32 alone"] = _crc_only.seconds  # type: ignore[attr-defined]
    fresh()
    return parts


def _kept_before(obj: Any, directory: Path, rep: int) -> dict[str, float]:
    """Writes into new files while the earlier ones stay (as a run keeps its checkpoints), as the writer did before:
    the page cache grows, so each write takes memory the kernel has not handed out lately."""
    return {"whole write before, files kept": measured(lambda: _old_write(directory / f"before{rep}.pt", obj))}


def _kept_now(obj: Any, directory: Path, rep: int) -> dict[str, float]:
    """The same with ``saving._write``, in a run of its own: each write drops its file's pages from the page cache,
    which the next write takes again."""
    return {"whole write now, files kept": measured(lambda: saving._write(directory / f"now{rep}.pt", obj))}


def _print(seconds: dict[str, list[float]]) -> None:
    print("| part | CPU s per GiB (median) | min-max |")
    print("|---|---|---|")
    for name, values in seconds.items():
        print(f"| {name} | {statistics.median(values):.3f} | {min(values):.3f}-{max(values):.3f} |")
    median = {name: statistics.median(values) for name, values in seconds.items()}
    derived = {
        "CRC-32 in torch.save (torch.save - no CRC)": median["torch.save"] - median["torch.save, no CRC"],
        "pickling and headers (no CRC - write)": median["torch.save, no CRC"] - median["write (os.write of the bytes)"],
        "read back and CRC-32 no longer made (before - now)": median["whole write before (save, fsync, read back)"]
        - median["whole write now (saving._write)"],
    }
    for name, value in derived.items():
        print(f"| {name} | {value:.3f} | |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="size of the rank file")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="reps run first and not counted")
    parser.add_argument("--dir", default=None, help="where the files are written (default: the system's tmp)")
    parser.add_argument("--no-snapshot", dest="snapshot", action="store_false", help="skip the snapshot's parts")
    parser.add_argument("--kept", action="store_true", help="also write files that are kept (2 x reps x --gib)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one thread copies, as the writer does (and so process time is one thread's)
    obj = rank_file(args.gib)
    size = sum(t.untyped_storage().nbytes() for t in _tensors(obj))
    gib = size / 2**30
    seconds: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        runs = [lambda rep: _write_parts(obj, Path(directory))]
        if args.snapshot:  # after the writes: it frees memory that they would reuse
            runs.append(lambda rep: _snapshot_parts(_tensors(obj)))
        if args.kept:
            runs.append(lambda rep: _kept_before(obj, Path(directory), rep))
            runs.append(lambda rep: _kept_now(obj, Path(directory), rep))
        for run in runs:
            for rep in range(args.warmup + args.reps):
                for name, value in run(rep).items():
                    if rep >= args.warmup:  # the first writes touch memory the machine never used (slower, by far)
                        seconds.setdefault(name, []).append(value / gib)
    reps = f"{args.reps} reps (+{args.warmup})"
    print(f"rank file: {gib:.2f} GiB in {len(_tensors(obj))} tensors, {reps}, torch {torch.__version__}")
    _print(seconds)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "bytes": size, "seconds_per_gib": seconds}, indent=1))


if __name__ == "__main__":
    main()
