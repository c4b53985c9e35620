"""The CUDA path of offload, on a GPU machine: one prepared run (NOT RUN YET: no GPU was lent so far).

    python benchmarks/gpu_offload_check.py --params 1e9 --out "$OUT/gpu_offload.json"

Refuses clearly (exit 2) without CUDA. On one GPU, one NCCL rank, a GPT of ``--params`` parameters in bf16-mixed
(bf16 parameters and gradients, fp32 masters), AdamW, stage 2, it checks and reports:

- ``offload_optimizer="cpu"``: every host master is pinned (``is_pinned()``) and holds exactly its bytes (not the
  caching host allocator's power of two: host RSS growth is compared with the masters' bytes);
- the step time of no offload, ``"cpu"`` and ``"nvme"`` (``--nvme-path``), medians of ``--steps`` after
  ``--warmup``, and their ratios to no offload;
- ``torch.cuda.max_memory_allocated()`` of each against the model-state formula (no offload: 2 + 2 + 12 bytes a
  parameter; offloaded: 2 + 2 on the device), the rest being activations and communication buffers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.gpt import GPT, gpt_config_for_params
from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.mixed_precision import PrecisionPolicy
from lightning_zero.core.offload.host import HostStore
from lightning_zero.core.options import EngineOptions


def _rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def run(mode: str, args: argparse.Namespace) -> dict:
    device = torch.device("cuda", 0)
    torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    cfg = gpt_config_for_params(int(args.params), vocab_size=256, block_size=args.block_size)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    psi = sum(p.numel() for p in model.parameters())
    offload = {"none": {}, "cpu": {"offload_optimizer": "cpu"}, "nvme": {"offload_optimizer": "nvme"}}[mode]
    options = EngineOptions(stage=2, nvme_path=args.nvme_path, **offload)  # type: ignore[arg-type]
    policy = PrecisionPolicy(torch.bfloat16, torch.float32, torch.float32)
    rss_before = _rss()
    engine = ZeroEngine(model, [optimizer], options, Communicator(), device=device, precision=policy)
    masters = [s for s in engine.stores.values() if isinstance(s, HostStore)]
    master_bytes = sum(s.offloaded_nbytes for s in masters)
    host_growth = _rss() - rss_before
    x = torch.randint(0, 256, (args.batch_size, args.block_size), device=device)
    times = []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        engine.begin_iteration()
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x.flatten()).backward()
        optimizer.step()
        torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    formula = (2 + 2 + (0 if mode != "none" else 12)) * psi
    result = {
        "mode": mode,
        "params": psi,
        "step_s_median": statistics.median(times),
        "max_memory_allocated": torch.cuda.max_memory_allocated(device),
        "model_state_formula_bytes": formula,
        "masters_pinned": all(s.master.is_pinned() for s in masters) if masters else None,
        "master_bytes": master_bytes,
        "host_rss_growth_at_setup": host_growth,
        "swap_io": vars(engine.io_counts),
    }
    engine.release()
    del engine, model, optimizer
    torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e9)
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_offload_check: no CUDA device here; run it on a GPU machine.", file=sys.stderr)
        return 2
    dist.init_process_group("nccl", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    results = [run(mode, args) for mode in ("none", "cpu", "nvme")]
    base = results[0]["step_s_median"]
    for result in results:
        result["step_ratio_to_no_offload"] = result["step_s_median"] / base
        print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
