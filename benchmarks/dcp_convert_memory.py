"""Peak memory of ``lightning_zero.convert(dir, out, to="dcp")`` against the checkpoint's size (docs/checkpoints.md,
"DCP bridge").

Two gloo ranks train a stack of ``--layers`` bias-free ``Linear(--width, --width)`` at stage 3 for one AdamW step and
save a sharded checkpoint (parameters plus two AdamW states: 3 x layers x width^2 x 4 bytes). Then, each in a fresh
process, with the imports done before the baseline: the peak RSS growth (VmHWM reset through
/proc/self/clear_refs, minus VmRSS before) of ``convert``, of ``consolidate`` (the
same streaming, to one file), and of the naive way (every tensor in memory, then ``dcp.save``). The converted
directory is loaded back into a plain model with ``dcp.load`` and compared with the checkpoint.

    python benchmarks/dcp_convert_memory.py --layers 16 --width 1024   # 192 MiB of tensors
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from tests.helpers import run_on_ranks

MEASURE = """
import gc, json, sys, torch
from pathlib import Path
import torch.distributed.checkpoint as dcp
from lightning_zero.checkpoint import ShardedCheckpoint, consolidate, convert, full_checkpoint
def status(field):  # KiB
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))
how, source, out = sys.argv[1:4]
ShardedCheckpoint(source).lightning_state()  # imports and first touches happen before the baseline
gc.collect()
before = status("VmRSS:")
Path("/proc/self/clear_refs").write_text("5")  # the high-water RSS starts again here, not at the imports' peak
if how == "convert":
    convert(source, out, to="dcp")
elif how == "consolidate":
    consolidate(source, out)
else:  # naive: the whole state in memory, then one dcp.save
    full = full_checkpoint(ShardedCheckpoint(source))
    dcp.save({"model": full["state_dict"], "optim": full["optimizer_states"][0]}, checkpoint_id=out, no_dist=True)
print(json.dumps({"growth_mib": (status("VmHWM:") - before) / 1024}))
"""

CHECK = """
import sys, torch
import torch.distributed.checkpoint as dcp
from lightning_zero.checkpoint import ShardedCheckpoint, full_checkpoint
source, out, layers, width = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
state = {"model": model.state_dict()}
dcp.load(state, checkpoint_id=out, no_dist=True)
expected = ShardedCheckpoint(source).full_state_dict()
assert all(torch.equal(state["model"][k], v) for k, v in expected.items()), "converted tensors differ"
print("loaded back: equal")
"""


def _save(rank: int, world_size: int, layers: int, width: int, path: str) -> None:
    from lightning_zero.checkpoint import save_sharded
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [optimizer], EngineOptions(stage=3, wrap_policy={nn.Linear}), Communicator())
    optimizer = engine.optimizers[0]
    optimizer.zero_grad()
    engine.module(torch.randn(4, width, generator=torch.Generator().manual_seed(rank))).pow(2).mean().backward()
    optimizer.step()
    save_sharded(engine.named_state(), path, {"hyper_parameters": {}}, "bench")


def _measure(how: str, source: Path, out: Path) -> dict[str, Any]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed tensors go back to the system
    run = subprocess.run([sys.executable, "-c", MEASURE, how, str(source), str(out)], capture_output=True, env=env)
    if run.returncode:
        raise RuntimeError(run.stderr.decode())
    return json.loads(run.stdout.decode().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        source = root / "sharded"
        run_on_ranks(_save, 2, args.layers, args.width, str(source))
        size_mib = sum(f.stat().st_size for f in source.iterdir()) / 2**20
        tensor_mib = args.width * args.width * 4 / 2**20
        print(f"checkpoint: {size_mib:.1f} MiB on disk, largest tensor {tensor_mib:.1f} MiB")
        for how in ("convert", "consolidate", "naive"):
            out = root / how
            growth = _measure(how, source, out)["growth_mib"]
            print(f"{how:12s} peak RSS growth {growth:7.1f} MiB ({100 * growth / size_mib:.1f}% of the checkpoint)")
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        check = [sys.executable, "-c", CHECK, str(source), str(root / "convert"), str(args.layers), str(args.width)]
        print(subprocess.run(check, capture_output=True, text=True, env=env, check=True).stdout.strip())


if __name__ == "__main__":
    main()
