"""One prepared check of lightning-zero's CUDA/NCCL path on one GPU (issue 26): run it once, read one table.

    python benchmarks/gpu_check.py --out "$OUT/gpu_check.json"            # one GPU, about 5-7 minutes
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check.json    # the same code on the CPU: gloo, a 2M GPT

Needs torch, lightning and this repository only, and no network. Without CUDA it exits 2 (unless ``--dry-run``);
once it ran it exits 0, FAILs included: each check runs in its own try/except and has a row in the table (status
``ok``, ``FAIL: ...`` or ``skipped: ...``); full tracebacks and every figure go to the JSON of ``--out``, which is
rewritten after every check, so a run cut short still leaves one. Once ``--budget-s`` seconds are spent, the checks
not started yet are skipped (a running one ends its step loop early). ``--checks`` runs a subset.

Checks, in this order (``--checks`` names):

1. ``two_ranks``: two processes on the one GPU with NCCL (subprocesses with a timeout). Recent NCCL refuses two
   ranks on one device ("Duplicate GPU detected"); the row says what happened, and the rest of the run is at world
   size 1 either way. Where two ranks work, the same processes also compare stages 1-3 with DDP at world size 2.
2. ``systems``: in this process, one NCCL rank (world size 1) on ``cuda:0``: DDP, stages 1-3 and FSDP2
   (``fully_shard`` per block and on the root), in fp32 and in bf16-mixed, on a GPT of about ``--params``
   parameters (examples/gpt.py), each from the same seed on the same batches. Per system: the median step time of
   ``--steps`` steps after ``--warmup`` (``torch.cuda.synchronize()`` around each), tokens/s, its ratio to DDP's
   and FSDP2's of the same precision, ``torch.cuda.max_memory_allocated()`` (less what was allocated before the
   system was built), its model-state bytes (ZeRO: ``engine.memory_report()``; DDP and FSDP2: the bytes of their
   parameters, gradients and AdamW states) against ``estimate_memory`` (the ZeRO paper's formulas), and its
   parameters after the run against DDP's: the largest over tensors of max|a - b| / max|b| (fp32 at world size 1:
   expect 0). bf16-mixed ZeRO (bf16 parameters, fp32 masters) is not the maths of DDP under autocast (fp32
   parameters), so those rows also give the difference from ``zero1_bf16``, the same maths (expect 0).
3. ``compile``: DDP, stage 3 (fp32) and stage 3 (bf16-mixed) with every GPT block compiled (``block.compile()``,
   inductor, as docs/compile.md recommends), on the batches of ``systems``: step time against the same system's
   eager row, parameters against DDP compiled the same way, and dynamo's graph count after the run and after one more
   step (equal: nothing recompiled after the first steps).
4. ``lightning``: ``Trainer(accelerator="gpu", devices=1, strategy=ZeroStrategy(stage=3), precision="bf16-mixed",
   gradient_clip_val=1)`` fits a few steps of examples/gpt.py's module in a subprocess (Lightning creates the NCCL
   group with its ``device_id``; stage 3 builds the model on the meta device and creates it unit by unit on the
   GPU), then times ``trainer.strategy.barrier()`` (``device_ids=[0]`` on NCCL).
5. ``lost_rank``: with two NCCL ranks (only where ``two_ranks`` worked) one stops (SIGSTOP) mid-training; the other
   must raise ``RankTimeoutError`` within about the group's ``--timeout-s``: with NCCL's defaults and with
   ``TORCH_NCCL_BLOCKING_WAIT=1``. Otherwise skipped: not possible on one GPU, with the reason measured in 1.
6. ``offload``: bf16-mixed on a GPT of about ``--offload-params`` parameters (the swap file takes 12 bytes a
   parameter): stages 2 and 3 without offload, then ``offload_optimizer="cpu"`` and ``"nvme"`` (stage 2) and
   ``offload_params="cpu"`` / ``"nvme"`` (stage 3, the optimizer in the same place). Per mode: step time, ratio to
   no offload, the parameters against no offload's, whether the host buffers are pinned (``is_pinned()`` of the
   host masters and parameter shards, and of the swap file's pages), the host RSS growth at setup against the
   offloaded bytes, the swap file's I/O, from a ``torch.profiler`` trace of one more step whether host<->device copies
   overlap compute (the share of copy time during which a compute kernel ran, and the streams of each), and a last step
   clipped at gradient norm 1 (``engine.step_of(optimizer).clip_grad_norm_``; offloaded: the norm of host gradients).

Two ranks sharing one GPU measure contention, not scaling, so the timing and memory rows are at world size 1.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gc
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

STARTED = time.time()  # before torch is imported: a subprocess reports how long its imports took
REPO = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve()
for _path in (REPO, REPO / "benchmarks"):  # `examples.gpt`, `zero_bench` (also in the subprocesses)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

CHECKS = ("two_ranks", "systems", "compile", "lightning", "lost_rank", "offload")
CORPUS = REPO / "examples" / "data" / "tiny_corpus.txt"
GIB = 2**30
NO_CUDA = (
    "gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine, "
    "or pass --dry-run to run the same code on the CPU with gloo and a tiny model."
)

# Defaults on a GPU, and with --dry-run (the CPU path, sized to finish in under 2 minutes on 2 cores).
DEFAULTS = {
    "params": (1e9, 2e6),
    "offload_params": (2.5e8, 2e6),
    "two_rank_params": (2e7, 1e6),
    "block_size": (1024, 64),
    "batch_size": (4, 2),
    "steps": (5, 2),
    "warmup": (2, 1),
    "offload_steps": (3, 1),
    "lightning_steps": (5, 3),
    "timeout_s": (10.0, 4.0),
    "compile_backend": ("inductor", "aot_eager"),  # inductor's C++ build on a CPU takes minutes
}


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options; those left unset take the GPU defaults, or the ``--dry-run`` ones (see ``DEFAULTS``)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--params", type=float, help="GPT size of the systems check (1e9; dry run 2e6)")
    parser.add_argument("--offload-params", type=float, help="GPT size of the offload check (2.5e8; dry run 2e6)")
    parser.add_argument("--two-rank-params", type=float, help="GPT size of the world-size-2 parity (2e7)")
    parser.add_argument("--block-size", type=int, help="tokens a sequence (1024; dry run 64)")
    parser.add_argument("--batch-size", type=int, help="sequences a step (4; dry run 2)")
    parser.add_argument("--steps", type=int, help="timed steps a system (5; dry run 2)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (2; dry run 1)")
    parser.add_argument("--offload-steps", type=int, help="timed steps an offload mode (3; dry run 1)")
    parser.add_argument("--lightning-steps", type=int, help="Trainer steps of the Lightning check (5; dry run 3)")
    parser.add_argument("--timeout-s", type=float, help="collective timeout of the lost-rank check (10; dry run 4)")
    parser.add_argument("--compile-backend", help="backend of the compile check (inductor; dry run aot_eager)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nvme-path", help="directory of the swap files (default: a new temporary directory)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip the checks not started after this")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    parser.add_argument("--out", help="write every result, tracebacks included, to this JSON file")
    parser.add_argument("--dry-run", action="store_true", help="the same code path on the CPU with gloo")
    for hidden in ("--worker", "--rank", "--world-size", "--worker-dir"):  # a subprocess of this script
        parser.add_argument(hidden, help=argparse.SUPPRESS, type=int if hidden in ("--rank", "--world-size") else str)
    args = parser.parse_args(argv)
    for name, (gpu, dry) in DEFAULTS.items():
        if getattr(args, name) is None:
            value = dry if args.dry_run else gpu
            setattr(args, name, type(gpu)(value))
    if args.steps < 1 or args.offload_steps < 1 or args.warmup < 0:
        parser.error(
            f"need --steps >= 1, --offload-steps >= 1 and --warmup >= 0, got {args.steps}, "
            f"{args.offload_steps}, {args.warmup}"
        )
    args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = [c for c in args.checks if c not in CHECKS]
    if unknown:
        parser.error(f"--checks: unknown {unknown}; choose from {list(CHECKS)}")
    return args


# ----------------------------------------------------------------------------- the run and its table


@dataclass
class Run:
    """The state of one run: where it computes, its rows, its clock and budget."""

    args: argparse.Namespace
    device: torch.device
    backend: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    start: float = field(default_factory=time.monotonic)
    two_ranks: dict[str, Any] | None = None  # the outcome of the two_ranks check, for lost_rank
    environment: dict[str, Any] = field(default_factory=dict)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    @property
    def deadline(self) -> float:
        return self.start + self.args.budget_s

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, message: str) -> None:
        print(f"[{self.elapsed:7.1f}s] {message}", flush=True)

    def check(self, name: str, fn: Callable[[], dict[str, Any]], skip: str | None = None) -> dict[str, Any]:
        """Run one check: its row has its figures, or ``FAIL: error`` (traceback in the JSON), or ``skipped``."""
        started = self.elapsed
        if skip is None and self.remaining() <= 0:
            skip = f"budget of {self.args.budget_s:g} s spent (at {started:.0f} s)"
        if skip is not None:
            row: dict[str, Any] = {"check": name, "status": f"skipped: {skip}"}
        else:
            self.log(f"{name}: start")
            try:
                row = {"check": name, "status": "ok", **fn()}
            except Exception as error:
                row = {"check": name, "status": f"FAIL: {short(error)}", "traceback": traceback.format_exc()}
            finally:
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        row["seconds"] = round(self.elapsed - started, 2)
        self.rows.append(row)
        self.log(f"{name}: {row['status']} ({row['seconds']:.1f} s)")
        self.save(finished=False)
        return row

    def save(self, finished: bool) -> None:
        if not self.args.out:
            return
        report = {
            "finished": finished,
            "elapsed_s": round(self.elapsed, 1),
            "args": {k: v for k, v in vars(self.args).items() if not k.startswith("worker")},
            "environment": self.environment,
            "table": format_table(self.rows),
            "results": self.rows,
        }
        path = Path(self.args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(path.suffix + ".partial")
        partial.write_text(json.dumps(report, indent=2, default=str))
        partial.replace(path)


def short(error: BaseException | str, limit: int = 160) -> str:
    """The first line of an error, cut to ``limit`` characters, for a table cell."""
    text = str(error).strip() if isinstance(error, str) else f"{type(error).__name__}: {error}".strip()
    first = text.splitlines()[0] if text else "?"
    return first if len(first) <= limit else first[: limit - 3] + "..."


COLUMNS = (
    ("check", "check"),
    ("status", "status"),
    ("step_ms", "step ms"),
    ("tokens_per_s", "tokens/s"),
    ("vs_ddp", "vs DDP"),
    ("vs_fsdp2", "vs FSDP2"),
    ("peak_gib", "peak GiB"),
    ("states_gib", "states GiB"),
    ("formula_gib", "formula GiB"),
    ("step_peak", "ZeRO step peak MiB: units + buckets + temporaries"),
    ("max_rel_diff", "max rel diff"),
    ("notes", "notes"),
)


def cell(value: Any) -> str:
    """A table cell: numbers to 4 significant digits (0 as 0), nothing as ``-``, ``|`` escaped."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if not math.isfinite(value):
            return str(value)
        return f"{value:.3e}" if abs(value) < 1e-3 or abs(value) >= 1e6 else f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as one markdown table, a column per entry of ``COLUMNS``; missing figures are ``-``."""
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(cell(row.get(key)) for key, _ in COLUMNS) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- devices and data


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device: torch.device, peak: bool = False) -> int | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)


def init_group(args: argparse.Namespace, backend: str, init_method: str, rank: int, world_size: int) -> None:
    """The default process group; on NCCL bound to ``cuda:0`` (every rank of this script uses the one GPU)."""
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(0)
        kwargs["device_id"] = torch.device("cuda", 0)
    timeout = timedelta(seconds=args.timeout_s if args.worker == "lost_rank" else 120)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout, **kwargs
    )


def make_batches(args: argparse.Namespace, cfg: Any, count: int, rank: int, device: torch.device) -> list:
    """``count`` batches ``(x, y)`` of corpus windows, the same for every system (seed + rank)."""
    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()
    generator = torch.Generator().manual_seed(args.seed + rank)
    batches = []
    for _ in range(count):
        starts = torch.randint(0, data.numel() - cfg.block_size - 1, (args.batch_size,), generator=generator)
        chunk = torch.stack([data[s : s + cfg.block_size + 1] for s in starts.tolist()]).to(device)
        batches.append((chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()))
    return batches


def gpt_config(params: float, block_size: int) -> Any:
    from examples.gpt import gpt_config_for_params

    return gpt_config_for_params(int(params), vocab_size=256, block_size=block_size)


# ----------------------------------------------------------------------------- systems


@dataclass(frozen=True)
class Spec:
    """One way of training the GPT: ``kind`` ddp / zero / fsdp2, a ZeRO stage, bf16-mixed or fp32, offload."""

    kind: str
    stage: int = 0
    bf16: bool = False
    offload_optimizer: str | bool = False
    offload_params: str | bool = False
    compiled: bool = False  # each GPT block torch.compile'd (inductor) before the system wraps the model

    @property
    def name(self) -> str:
        base = f"zero{self.stage}" if self.kind == "zero" else self.kind
        name = f"{base}_{'bf16' if self.bf16 else 'fp32'}" + (" compiled" if self.compiled else "")
        if self.offload_params:
            return f"{name} params+opt {self.offload_params}"
        return f"{name} opt {self.offload_optimizer}" if self.offload_optimizer else name

    @property
    def precision(self) -> str:
        return "bf16-mixed" if self.bf16 else "32-true"


@dataclass
class System:
    spec: Spec
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[Tensor, Tensor], Tensor]  # one training step; returns the loss
    engine: Any = None  # ZeroEngine for kind "zero"
    warnings: list[str] = field(default_factory=list)
    rss_growth: int | None = None  # host RSS growth while the engine was built (offload)


def adamw(model: nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW as in examples/gpt.py: weight decay on matrices only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def make_model(cfg: Any, seed: int, device: torch.device) -> nn.Module:
    """The GPT created on ``device`` from ``seed`` (on a GPU, without a detour through host memory)."""
    from examples.gpt import GPT

    torch.manual_seed(seed)
    with torch.device(device):
        return GPT(cfg)


def lm_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    logits = model(x)
    return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.view(-1))


def autocast(device: torch.device, bf16: bool, cache: bool = True) -> contextlib.AbstractContextManager:
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache)


def plain_step(module: nn.Module, optimizer: torch.optim.Optimizer, spec: Spec, device: torch.device) -> Callable:
    """A step of a wrapper that communicates by itself (DDP, FSDP2)."""

    def step(x: Tensor, y: Tensor) -> Tensor:
        optimizer.zero_grad()
        with autocast(device, spec.bf16):
            loss = lm_loss(module, x, y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def zero_step(engine: Any, optimizer: torch.optim.Optimizer, spec: Spec, device: torch.device) -> Callable:
    """A step as ZeroStrategy drives the engine (autocast without its cache, as ZeroPrecision)."""
    return lambda x, y: engine_step(engine, optimizer, spec.bf16, device, x, y)[0]


def engine_step(
    engine: Any,
    optimizer: torch.optim.Optimizer,
    bf16: bool,
    device: torch.device,
    x: Tensor,
    y: Tensor,
    clip: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """One step through the engine; with ``clip`` the gradients are clipped at that norm first (offloaded: the norm
    of host gradients, agreed on the device). Returns the loss and the norm before clipping."""
    engine.begin_iteration()
    optimizer.zero_grad()
    with autocast(device, bf16, cache=False):
        loss = lm_loss(engine.module, x, y)
    engine.scale_loss(loss).backward()
    engine.finish_backward()
    engine.step_of(optimizer).prepare()
    norm = engine.step_of(optimizer).clip_grad_norm_(clip) if clip is not None else None
    optimizer.step()
    return loss.detach(), norm


def build_system(spec: Spec, cfg: Any, args: argparse.Namespace, device: torch.device) -> System:
    model = make_model(cfg, args.seed, device)
    if spec.compiled:  # as docs/compile.md recommends: per block, before the strategy shards the model
        for block in model.blocks:
            block.compile(backend=args.compile_backend)
    if spec.kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
        optimizer = adamw(model, args.lr)
        return System(spec, model, optimizer, plain_step(ddp, optimizer, spec, device))
    if spec.kind == "fsdp2":
        return build_fsdp2(spec, model, args, device)
    return build_zero(spec, model, args, device)


def build_fsdp2(spec: Spec, model: nn.Module, args: argparse.Namespace, device: torch.device) -> System:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    dtypes = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if spec.bf16 else {}
    policy = MixedPrecisionPolicy(**dtypes)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = adamw(model, args.lr)
    return System(spec, model, optimizer, plain_step(model, optimizer, spec, device))


def build_zero(spec: Spec, model: nn.Module, args: argparse.Namespace, device: torch.device) -> System:
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.mixed_precision import PrecisionPolicy
    from lightning_zero.core.options import EngineOptions

    optimizer = adamw(model, args.lr)
    options = EngineOptions(
        stage=spec.stage,
        offload_optimizer=spec.offload_optimizer,
        offload_params=spec.offload_params,
        nvme_path=args.nvme_path,
    )
    policy = PrecisionPolicy(torch.bfloat16, torch.float32, torch.float32) if spec.bf16 else None
    rss = rss_bytes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = ZeroEngine(model, [optimizer], options, Communicator(), device=device, precision=policy)
    system = System(spec, model, optimizer, zero_step(engine, optimizer, spec, device), engine)
    system.warnings = sorted({short(str(w.message), 300) for w in caught})
    system.rss_growth = rss_bytes() - rss
    return system


def close_system(system: System) -> None:
    """``engine.release()``: full parameters back, offloaded memory freed (pinned host pages unregistered). Where it
    fails, the stores and the swap file are still closed, then the error is raised."""
    engine = system.engine
    if engine is None:
        return
    try:
        engine.release()
    except Exception:
        for store in (g.store for g in engine.model.trained):
            with contextlib.suppress(Exception):
                store.close()
        if engine.model.offload is not None:
            engine.model.offload.close()
        raise


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def train(system: System, batches: list, warmup: int, device: torch.device, deadline: float) -> dict[str, Any]:
    """Every batch in turn; step times of those after ``warmup``. Past ``deadline`` it stops after one timed step
    (the row says how many ran)."""
    times, losses = [], []
    for index, (x, y) in enumerate(batches):
        sync(device)
        start = time.perf_counter()
        loss = system.step(x, y)
        sync(device)
        if index >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss))
        if times and time.monotonic() > deadline:
            break
    return {"times": times, "losses": losses, "steps_run": len(losses)}


def full_state(system: System) -> dict[str, Tensor]:
    """Every parameter in full, in its best precision (ZeRO bf16: the fp32 masters); a collective."""
    model, engine = system.model, system.engine
    if system.spec.kind == "fsdp2":
        return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    if engine is None:
        return {name: p.detach().clone() for name, p in model.named_parameters()}
    if system.spec.bf16 or system.spec.offload_optimizer:
        state = engine.full_state_dict(keep=True)
        return {name: state[name] for name, _ in model.named_parameters()}
    with engine.gathered():
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def parameter_gap(state: dict[str, Tensor], base: dict[str, Tensor]) -> dict[str, Any]:
    """The largest over tensors of max|a - b| / max|b|, whether all are bit-equal, and ||a - b|| / ||b|| overall."""
    if list(state) != list(base):
        raise ValueError(f"parameter names differ: {sorted(set(state) ^ set(base))[:4]}")
    rel, equal, diff_sq, base_sq = 0.0, True, 0.0, 0.0
    for name, a in state.items():
        b = base[name].to(a.device)
        gap = (a.double() - b.double()).abs()
        rel = max(rel, gap.max().item() / max(b.abs().max().item(), 1e-30))
        equal = equal and torch.equal(a, b)
        diff_sq += gap.square().sum().item()
        base_sq += b.double().square().sum().item()
    return {"max_rel_diff": rel, "bitwise_equal": equal, "rel_l2_diff": math.sqrt(diff_sq / max(base_sq, 1e-300))}


def gap_text(gap: dict[str, Any] | None, against: str) -> str:
    if gap is None:
        return f"vs {against}: not compared"
    if gap["bitwise_equal"]:
        return f"vs {against}: bit-equal"
    return f"vs {against}: {gap['max_rel_diff']:.3g} (rel L2 {gap['rel_l2_diff']:.3g})"


# ----------------------------------------------------------------------------- memory


def state_bytes(system: System) -> dict[str, int]:
    """Model-state bytes this rank holds: ZeRO's ``memory_report()``; DDP and FSDP2 counted from their tensors."""
    if system.engine is not None:
        return system.engine.memory_report().as_dict()

    def local(t: Any) -> Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    params = [local(p) for p in system.model.parameters()]
    grads = [local(p.grad) for p in system.model.parameters() if p.grad is not None]
    states = [local(v) for s in system.optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
    nbytes = [sum(t.numel() * t.element_size() for t in ts) for ts in (params, grads, states)]
    return {"params": nbytes[0], "gradients": nbytes[1], "optimizer_states": nbytes[2], "total": sum(nbytes)}


def formula(spec: Spec, cfg: Any, world_size: int) -> Any:
    """``estimate_memory`` of the system: DDP as stage 0 and FSDP2 as stage 3, both fp32 states (FSDP2 bf16 keeps
    fp32 shards; DDP bf16 fp32 parameters under autocast)."""
    from examples.gpt import GPT
    from lightning_zero import estimate_memory

    with torch.device("meta"):
        model = GPT(cfg)
    stage = {"ddp": 0, "fsdp2": 3}.get(spec.kind, spec.stage)
    precision = spec.precision if spec.kind == "zero" else "32-true"
    return estimate_memory(
        model,
        stage=stage,
        world_size=world_size,
        precision=precision,
        optimizer="adamw",
        offload_optimizer=spec.offload_optimizer,
        offload_params=spec.offload_params,
    )


# ----------------------------------------------------------------------------- one system, measured


@dataclass
class Measured:
    row: dict[str, Any]
    state: dict[str, Tensor] | None  # the parameters after the run (kept as a reference by the caller)


def attempt(row: dict[str, Any], what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``; a failure is recorded in the row (its status becomes FAIL) instead of hiding the figures so far."""
    try:
        return fn()
    except Exception as error:
        row.setdefault("errors", []).append(
            {"what": what, "error": short(error, 500), "traceback": traceback.format_exc()}
        )
        if not str(row.get("status", "ok")).startswith("FAIL"):
            row["status"] = f"FAIL: {what}: {short(error)}"
        return None


def measure(
    run: Run,
    spec: Spec,
    cfg: Any,
    batches: list,
    world_size: int = 1,
    inspect: Callable[[System, dict[str, Any]], None] | None = None,
) -> Measured:
    """Build ``spec``, train it on ``batches``, and measure its time, memory and final parameters; ``inspect`` looks
    at the trained system (after its parameters were taken) before it is released."""
    device = run.device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    before = allocated(device)
    system = build_system(spec, cfg, run.args, device)
    row: dict[str, Any] = {}
    try:
        trained = train(system, batches, run.args.warmup, device, run.deadline)
        row.update(measured_row(run, system, cfg, trained, world_size))
        row["details"].update(steps_planned=len(batches), allocated_before_build=before)
        peak = row["details"]["max_memory_allocated"]
        row["peak_gib"] = None if peak is None or before is None else (peak - before) / GIB
        complete = trained["steps_run"] == len(batches)
        state = attempt(row, "full state", lambda: full_state(system)) if complete else None
        if inspect is not None:  # after the state is taken: it may run one more step
            inspect(system, row)
    finally:
        attempt(row, "release", lambda: close_system(system))
    return Measured(row, state)


def measured_row(run: Run, system: System, cfg: Any, trained: dict[str, Any], world_size: int) -> dict[str, Any]:
    """Step time, tokens/s and memory of a trained system."""
    states = state_bytes(system)
    estimate = formula(system.spec, cfg, world_size)
    median = statistics.median(trained["times"])
    row: dict[str, Any] = {
        "step_ms": 1000 * median,
        "tokens_per_s": run.args.batch_size * cfg.block_size * world_size / median,
        "states_gib": states["total"] / GIB,
        "formula_gib": estimate.total / GIB,
        "details": {
            "step_s": trained["times"],
            "losses": trained["losses"],
            "steps_run": trained["steps_run"],
            "model_states_bytes": states,
            "formula_bytes": estimate.as_dict(),
            "max_memory_allocated": allocated(run.device, peak=True),
            "warnings": system.warnings,
        },
    }
    if "peak" in states:  # ZeRO: its ledger's parts of the last step's peak (memory_report().step_peak)
        parts = [states[f"peak_{kind}"] / 2**20 for kind in ("gathered", "buckets", "temporaries")]
        row["step_peak"] = " + ".join(f"{part:.2f}" for part in parts)
    if not all(map(math.isfinite, trained["losses"])):
        row["status"] = f"FAIL: non-finite loss {trained['losses']}"
    return row


# ----------------------------------------------------------------------------- check: systems at world size 1


def system_specs(bf16: bool) -> list[Spec]:
    return [Spec("ddp", bf16=bf16), *(Spec("zero", s, bf16) for s in (1, 2, 3)), Spec("fsdp2", bf16=bf16)]


def check_systems(run: Run) -> None:
    args = run.args
    cfg = gpt_config(args.params, args.block_size)
    batches = make_batches(args, cfg, args.warmup + args.steps, 0, run.device)
    run.log(f"systems: GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd} block={cfg.block_size}, {len(batches)} steps")
    for bf16 in (False, True):
        refs: dict[str, dict[str, Tensor]] = {}
        rows = [run.check(spec.name, _system_check(run, spec, cfg, batches, refs)) for spec in system_specs(bf16)]
        add_ratios(rows)
        refs.clear()


def _system_check(run: Run, spec: Spec, cfg: Any, batches: list, refs: dict) -> Callable[[], dict[str, Any]]:
    def check() -> dict[str, Any]:
        measured = measure(run, spec, cfg, batches)
        row, state = measured.row, measured.state
        ddp, same = ("ddp_bf16", "zero1_bf16") if spec.bf16 else ("ddp_fp32", None)
        notes = []
        if spec.kind == "ddp":
            notes.append("reference")
        elif ddp in refs and state is not None:
            gap = parameter_gap(state, refs[ddp])
            row["max_rel_diff"], row["details"]["vs_ddp"] = gap["max_rel_diff"], gap
            notes.append(gap_text(gap, ddp) + (" (other maths)" if spec.bf16 else ""))
        if same and same in refs and state is not None:
            gap = parameter_gap(state, refs[same])
            row["details"]["vs_same_maths"] = gap
            notes.append(gap_text(gap, same))
        if state is not None and spec.name in (ddp, same):
            refs[spec.name] = state
        row["notes"] = "; ".join(notes)
        return row

    return check


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's step time over DDP's and FSDP2's of the same precision (rows of one precision, DDP first)."""
    by_kind = {row["check"].split("_")[0]: row.get("step_ms") for row in rows}
    for row in rows:
        if row.get("step_ms") is None:
            continue
        for kind, key in (("ddp", "vs_ddp"), ("fsdp2", "vs_fsdp2")):
            if by_kind.get(kind):
                row[key] = row["step_ms"] / by_kind[kind]


# ----------------------------------------------------------------------------- check: compile

COMPILE_SPECS = (Spec("ddp", compiled=True), Spec("zero", 3, compiled=True), Spec("zero", 3, True, compiled=True))


def check_compile(run: Run) -> None:
    """Stage 3 with every block compiled (inductor) against DDP compiled the same way and against its own eager row
    of ``systems``; the graphs dynamo made, and that one more step compiles nothing."""
    args = run.args
    cfg = gpt_config(args.params, args.block_size)
    batches = make_batches(args, cfg, args.warmup + args.steps, 0, run.device)
    refs: dict[str, dict[str, Tensor]] = {}
    for spec in COMPILE_SPECS:
        run.check(spec.name, _compile_check(run, spec, cfg, batches, refs))


def _compile_check(run: Run, spec: Spec, cfg: Any, batches: list, refs: dict) -> Callable[[], dict[str, Any]]:
    def check() -> dict[str, Any]:
        import torch._dynamo
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()

        def one_more_step(system: System, row: dict[str, Any]) -> None:
            graphs = counters["stats"]["unique_graphs"]
            system.step(*batches[0])
            row["details"]["graphs"] = graphs
            row["details"]["graphs_after_one_more_step"] = counters["stats"]["unique_graphs"]

        measured = measure(run, spec, cfg, batches, inspect=one_more_step)
        row, state = measured.row, measured.state
        details = row["details"]
        notes = [f"{details.get('graphs')} graphs, {details.get('graphs_after_one_more_step')} after one more step"]
        if details.get("graphs") != details.get("graphs_after_one_more_step"):
            row["status"] = "FAIL: a step after the first ones compiled again"
        eager = next((r for r in run.rows if r["check"] == spec.name.removesuffix(" compiled")), None)
        if eager is not None and eager.get("step_ms") and row.get("step_ms"):
            row["vs_eager"] = row["step_ms"] / eager["step_ms"]
            notes.append(f"{row['vs_eager']:.3f}x its eager step")
        ddp = "ddp_fp32 compiled"
        if spec.kind == "ddp" and state is not None:
            refs[ddp] = state
        elif ddp in refs and state is not None and not spec.bf16:
            gap = parameter_gap(state, refs[ddp])
            row["max_rel_diff"], details["vs_ddp"] = gap["max_rel_diff"], gap
            notes.append(gap_text(gap, ddp))
        row["notes"] = "; ".join(notes)
        return row

    return check


# ----------------------------------------------------------------------------- check: offload


CLIP = 1.0  # the offload check's last step is clipped at this gradient norm
OFFLOAD_SPECS = (  # the references first, the swap file (slowest, bounded by the disk) last
    Spec("zero", 2, True),
    Spec("zero", 3, True),
    Spec("zero", 2, True, offload_optimizer="cpu"),
    Spec("zero", 3, True, offload_optimizer="cpu", offload_params="cpu"),
    Spec("zero", 2, True, offload_optimizer="nvme"),
    Spec("zero", 3, True, offload_optimizer="nvme", offload_params="nvme"),
)


def check_offload(run: Run) -> None:
    args = run.args
    cfg = gpt_config(args.offload_params, args.block_size)
    batches = make_batches(args, cfg, args.warmup + args.offload_steps, 0, run.device)
    run.log(f"offload: GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd}; swap files in {args.nvme_path}")
    run.check("swap disk", lambda: disk_row(args.nvme_path, run.device))
    base: dict[int, Measured] = {}
    for spec in OFFLOAD_SPECS:
        run.check(spec.name + " (offload check)", _offload_check(run, spec, cfg, batches, base))
    base.clear()


def _offload_check(run: Run, spec: Spec, cfg: Any, batches: list, base: dict) -> Callable[[], dict[str, Any]]:
    def inspect(system: System, row: dict[str, Any]) -> None:
        if spec.offload_optimizer:
            row["details"]["host"] = attempt(row, "host buffers", lambda: host_buffers(system))
            row["details"]["copies"] = attempt(row, "profile", lambda: copy_overlap(system, batches[0], run.device))
        row["details"]["clip_norm"] = attempt(row, "clipped step", lambda: clipped_step(system, batches[0], run.device))

    def check() -> dict[str, Any]:
        measured = measure(run, spec, cfg, batches, inspect=inspect)
        row = measured.row
        if not spec.offload_optimizer:
            base[spec.stage] = measured
            row["notes"] = "no offload: the reference of this stage"
            return row
        notes = [pinned_text(row["details"].get("host")), overlap_text(row["details"].get("copies"))]
        if row["details"]["clip_norm"] is not None:
            notes.append(f"a step clipped at norm {CLIP:g}: ok (norm {row['details']['clip_norm']:.3g})")
        reference = base.get(spec.stage)
        if reference is not None and reference.row.get("step_ms"):
            row["vs_no_offload"] = row["step_ms"] / reference.row["step_ms"]
            notes.insert(0, f"{row['vs_no_offload']:.2f}x no offload's step")
        if reference is not None and reference.state is not None and measured.state is not None:
            gap = parameter_gap(measured.state, reference.state)
            row["max_rel_diff"], row["details"]["vs_no_offload"] = gap["max_rel_diff"], gap
            notes.append(gap_text(gap, "no offload"))
        notes.extend(f"warning: {w}" for w in row["details"]["warnings"])
        notes.extend(f"{e['what']} failed: {e['error']}" for e in row.get("errors", []))
        row["notes"] = "; ".join(notes)
        return row

    return check


def clipped_step(system: System, batch: tuple[Tensor, Tensor], device: torch.device) -> float:
    """One more step, clipped at ``CLIP`` through the engine (after the parameters were taken); its norm."""
    _, norm = engine_step(system.engine, system.optimizer, system.spec.bf16, device, *batch, clip=CLIP)
    sync(device)
    return float(norm)


def host_buffers(system: System) -> dict[str, Any]:
    """Whether the host buffers of an offloaded engine are pinned, their bytes, and the RSS growth at setup."""
    from lightning_zero.core.layout import host_memory
    from lightning_zero.core.layout.flat_buffer import ShardedBuffer
    from lightning_zero.core.store import host
    from lightning_zero.core.store.swap import aligned_empty

    engine = system.engine
    masters = [s.master for s in (g.store for g in engine.model.trained) if isinstance(s, host.HostStore)]
    shards = [b.shard for b in engine.model.buffers if isinstance(b, ShardedBuffer) and b.shard_home and not b.resting]
    swap = engine.model.offload.swap if engine.model.offload is not None else None
    return {
        "cuda": engine.device.type == "cuda",
        "masters": len(masters),
        "masters_pinned": sum(t.is_pinned() for t in masters),
        "masters_registered": sum(t.data_ptr() in host_memory._REGISTERED for t in masters),
        "master_bytes": sum(t.numel() * t.element_size() for t in masters),
        "param_shards": len(shards),
        "param_shards_pinned": sum(t.is_pinned() for t in shards),
        "swap_pages_pinned": aligned_empty(1).is_pinned() if swap is not None else None,
        "swap_direct_io": swap.direct if swap is not None else None,
        "swap_io": vars(engine.io_counts),
        "offloaded_bytes": engine.memory_report().offloaded,
        "rss_growth_at_setup": system.rss_growth,
    }


def pinned_text(host: dict[str, Any] | None) -> str:
    if host is None:
        return "host buffers: not inspected"
    parts = [] if host["cuda"] else ["a CPU run: nothing is pinned"]
    if host["masters"]:
        pinned, registered = host["masters_pinned"], host["masters_registered"]
        parts.append(f"masters pinned {pinned}/{host['masters']} (cudaHostRegister ok: {registered})")
    if host["param_shards"]:
        parts.append(f"param shards pinned {host['param_shards_pinned']}/{host['param_shards']}")
    if host["swap_pages_pinned"] is not None:
        parts.append(f"swap pages pinned: {cell(host['swap_pages_pinned'])}, O_DIRECT: {cell(host['swap_direct_io'])}")
        io = host["swap_io"]
        parts.append(f"swap file read {io['read'] / GIB:.2f} GiB, wrote {io['written'] / GIB:.2f} GiB so far")
    growth = host["rss_growth_at_setup"]
    parts.append(f"RSS {growth / GIB:+.2f} GiB at setup, {host['offloaded_bytes'] / GIB:.2f} GiB offloaded")
    return ", ".join(parts)


def copy_overlap(system: System, batch: tuple[Tensor, Tensor], device: torch.device) -> dict[str, Any]:
    """One more step under ``torch.profiler``: host<->device copies against the kernels that ran meanwhile."""
    if device.type != "cuda":
        return {"measured": False, "why": "no CUDA: host and device are the same memory, nothing is copied"}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        system.step(*batch)
        sync(device)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    summary = summarize_copies(events)
    if not summary["kernel_us"]:
        return {"measured": False, "why": "the profiler saw no kernels (CUPTI unavailable?)", **summary}
    return {"measured": True, **summary}


def summarize_copies(events: list[dict[str, Any]]) -> dict[str, Any]:
    """From chrome-trace events: per copy direction its count, time, bytes, memory kinds and streams, and the share
    of its time during which some compute kernel ran (``overlap``; 0: every copy ran alone). NCCL's kernels are
    communication, not compute: they are left out."""
    compute = [e for e in events if e.get("cat") == "kernel" and "dur" in e and "nccl" not in e["name"].lower()]
    kernels = merge([(e["ts"], e["ts"] + e["dur"]) for e in compute])
    kernel_streams = sorted({e.get("args", {}).get("stream") for e in compute} - {None})
    result: dict[str, Any] = {"kernel_streams": kernel_streams, "kernel_us": sum(b - a for a, b in kernels)}
    for direction in ("HtoD", "DtoH"):
        copies = [e for e in events if e.get("cat") == "gpu_memcpy" and direction in e.get("name", "") and "dur" in e]
        total = sum(e["dur"] for e in copies)
        covered = sum(overlap(e["ts"], e["ts"] + e["dur"], kernels) for e in copies)
        result[direction] = {
            "count": len(copies),
            "us": total,
            "bytes": sum(e.get("args", {}).get("bytes", 0) for e in copies),
            "kinds": sorted({e["name"] for e in copies}),
            "streams": sorted({e.get("args", {}).get("stream") for e in copies} - {None}),
            "overlap": covered / total if total else None,
        }
    return result


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping union of ``intervals``."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlap(start: float, end: float, merged: list[tuple[float, float]]) -> float:
    """Length of ``[start, end)`` covered by the merged intervals."""
    covered = 0.0
    index = max(bisect.bisect_right(merged, (start, math.inf)) - 1, 0)
    while index < len(merged) and merged[index][0] < end:
        covered += max(0.0, min(end, merged[index][1]) - max(start, merged[index][0]))
        index += 1
    return covered


def overlap_text(copies: dict[str, Any] | None) -> str:
    if copies is None:
        return "copy overlap: the profile failed"
    if not copies.get("measured"):
        return f"copy overlap: not measured ({copies.get('why')})"
    parts = []
    for direction in ("HtoD", "DtoH"):
        c = copies[direction]
        if c["count"]:
            share = "-" if c["overlap"] is None else f"{100 * c['overlap']:.0f}%"
            same = set(c["streams"]) <= set(copies["kernel_streams"])
            where = "the compute stream" if same else f"streams {c['streams']}"
            pageable = sum("Pageable" in kind for kind in c["kinds"])
            memory = f"{pageable} of {len(c['kinds'])} kinds pageable" if c["kinds"] else ""
            parts.append(f"{direction} {c['count']}x {c['us'] / 1000:.1f} ms, {share} overlapped, on {where}, {memory}")
    return "copies: " + ("; ".join(parts) if parts else "none seen")


def disk_row(path: str, device: torch.device) -> dict[str, Any]:
    """The swap directory's file system and its bandwidth through the offload's own swap file."""
    from zero_bench.measure import disk_bandwidth

    nbytes = 256 * 2**20 if device.type == "cuda" else 16 * 2**20
    bandwidth = disk_bandwidth(path, nbytes=nbytes, chunk=min(nbytes, 8 * 2**20))
    fs = filesystem(path)
    usage = shutil.disk_usage(path)
    notes = (
        f"{path} on {fs}, {usage.free / GIB:.0f} GiB free; write {bandwidth['write_bytes_per_s'] / 1e9:.2f} GB/s, "
        f"read {bandwidth['read_bytes_per_s'] / 1e9:.2f} GB/s (O_DIRECT: {cell(bandwidth['direct_io'])})"
    )
    return {"notes": notes, "details": {**bandwidth, "filesystem": fs, "free_bytes": usage.free}}


def filesystem(path: str) -> str:
    """The type of the file system that holds ``path`` (from /proc/mounts, the longest matching mount point)."""
    best, kind = "", "?"
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            parts = line.split()
            point, real = parts[1], os.path.realpath(path)
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, kind = point, parts[2]
    return f"{kind} ({best})"


# ----------------------------------------------------------------------------- subprocesses


@dataclass
class RankOutcome:
    rank: int
    returncode: int | None  # None: still running at the timeout (then killed)
    exit_at: float | None  # time.time() when it was seen to exit
    result: dict[str, Any] | None  # what the worker wrote
    log_tail: str
    progress: float | None  # time.time() the worker wrote before the interesting moment

    def describe(self) -> str:
        if self.returncode is None:
            return "still running at the timeout (killed)"
        if self.returncode < 0:
            return f"killed by {signal.Signals(-self.returncode).name}"
        return f"exit code {self.returncode}"


def spawn(run: Run, worker: str, world_size: int, timeout_s: float, env: dict | None = None, wait_for=None) -> list:
    """Run ``world_size`` ranks of ``--worker worker`` (this script); wait for the ranks ``wait_for`` (all) up to
    ``timeout_s``, then kill whatever still runs. Returns each rank's :class:`RankOutcome`."""
    folder = Path(tempfile.mkdtemp(prefix=f"gpu_check_{worker}_"))
    try:
        (folder / "args.json").write_text(json.dumps(vars(run.args)))
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        environment.update(env or {})
        procs = []
        for rank in range(world_size):
            command = [sys.executable, str(SCRIPT), "--worker", worker, "--rank", str(rank)]
            command += ["--world-size", str(world_size), "--worker-dir", str(folder)]
            with open(folder / f"rank{rank}.log", "w") as log:
                procs.append(subprocess.Popen(command, cwd=REPO, env=environment, stdout=log, stderr=subprocess.STDOUT))
        exits = wait_ranks(procs, list(range(world_size)) if wait_for is None else wait_for, timeout_s)
        return [outcome(folder, rank, proc, exits.get(rank)) for rank, proc in enumerate(procs)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def wait_ranks(procs: list[subprocess.Popen], wait_for: list[int], timeout_s: float) -> dict[int, float]:
    """Poll until the ranks ``wait_for`` ended or ``timeout_s`` passed; SIGKILL every process left (a stopped one
    too). Returns when each rank was seen to end (``time.time()``)."""
    exits: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(r in exits for r in wait_for):
        for rank, proc in enumerate(procs):
            if rank not in exits and proc.poll() is not None:
                exits[rank] = time.time()
        time.sleep(0.05)
    for rank, proc in enumerate(procs):
        if proc.poll() is None:
            proc.kill()
        elif rank not in exits:
            exits[rank] = time.time()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    return exits


def outcome(folder: Path, rank: int, proc: subprocess.Popen, exit_at: float | None) -> RankOutcome:
    result_file, progress_file = folder / f"rank{rank}.json", folder / f"rank{rank}.progress"
    result = json.loads(result_file.read_text()) if result_file.exists() else None
    progress = float(progress_file.read_text()) if progress_file.exists() else None
    log = (folder / f"rank{rank}.log").read_text(errors="replace")[-3000:]
    return RankOutcome(rank, proc.returncode if exit_at is not None else None, exit_at, result, log, progress)


def subprocess_timeout(run: Run, wanted: float) -> float:
    """``wanted`` seconds, less where the budget has less left (never under 30 s)."""
    return max(30.0, min(wanted, run.remaining() + 30.0))


def worker_main(args: argparse.Namespace) -> int:
    """A subprocess rank of this script: runs ``args.worker`` and writes its result to ``rank{r}.json``."""
    folder = Path(args.worker_dir)
    saved = json.loads((folder / "args.json").read_text())
    saved.update(worker=args.worker, rank=args.rank, world_size=args.world_size, worker_dir=args.worker_dir)
    args = argparse.Namespace(**saved)
    backend, device = ("gloo", torch.device("cpu")) if args.dry_run else ("nccl", torch.device("cuda", 0))
    work = {"two_ranks": two_ranks_worker, "lost_rank": lost_rank_worker, "lightning": lightning_worker}[args.worker]
    began = time.time()
    try:
        result = work(args, backend, device, folder)
    except Exception as error:
        result = {"ok": False, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    result.update(import_s=began - STARTED, work_s=time.time() - began)
    write_json(folder / f"rank{args.rank}.json", result)
    if not result.get("ok") or args.worker == "lost_rank":
        # A group that lost a peer or failed to start may hang in its destruction (NCCL): the result is written,
        # so end here instead of making the parent wait for the timeout.
        sys.stdout.flush()
        os._exit(0)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def write_json(path: Path, value: Any) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(value, default=str))
    partial.replace(path)


# ----------------------------------------------------------------------------- check: two ranks on one GPU


def two_ranks_worker(args: argparse.Namespace, backend: str, device: torch.device, folder: Path) -> dict[str, Any]:
    """All-reduce between the two ranks; where that works, stages 1-3 against DDP at world size 2 (fp32)."""
    began = time.time()
    init_group(args, backend, f"file://{folder}/store", args.rank, args.world_size)
    ones = torch.ones(4, device=device)
    dist.all_reduce(ones)
    sync(device)
    first_all_reduce_s = time.time() - began
    if ones.tolist() != [2.0] * 4:
        return {"ok": False, "error": f"all-reduce of ones over 2 ranks gave {ones.tolist()}"}
    run = Run(args, device, backend)
    cfg = gpt_config(args.two_rank_params, min(args.block_size, 256))
    batches = make_batches(args, cfg, args.warmup + 2, args.rank, device)
    gaps: dict[str, Any] = {}
    reference = measure(run, Spec("ddp"), cfg, batches, world_size=2).state
    for stage in (1, 2, 3):
        state = measure(run, Spec("zero", stage), cfg, batches, world_size=2).state
        gaps[f"zero{stage}_fp32"] = parameter_gap(state, reference) if state and reference else None
    return {"ok": True, "first_all_reduce_s": first_all_reduce_s, "parity": gaps}


def check_two_ranks(run: Run) -> dict[str, Any]:
    outcomes = spawn(run, "two_ranks", 2, subprocess_timeout(run, 90))
    results = [o.result or {} for o in outcomes]
    run.two_ranks = {"ok": all(r.get("ok") for r in results)}
    details = {"ranks": [{**vars(o), "result": o.result} for o in outcomes]}
    if run.two_ranks["ok"]:
        parity = results[0]["parity"]
        worst = max((g["max_rel_diff"] for g in parity.values() if g), default=None)
        notes = "2 ranks on one GPU work; world size 2 fp32 " + ", ".join(gap_text(g, k) for k, g in parity.items())
        return {"max_rel_diff": worst, "notes": notes.replace("vs zero", "zero"), "details": details}
    errors = [r.get("error") for r in results if r.get("error")] or [o.describe() for o in outcomes]
    error = key_line(errors[0])
    run.two_ranks["error"] = error
    refused = any("Duplicate GPU" in e or "invalid usage" in e.lower() for e in errors)
    what = "NCCL refused 2 ranks on one GPU" if refused else "2 ranks on one GPU failed"
    row = {"notes": f"{what}: {short(error, 200)}; the rest runs at world size 1", "details": details}
    if not refused:
        row["status"] = f"FAIL: {short(error)}"
    return row


def key_line(error: str) -> str:
    """The line of a (multi-line) NCCL error that says what went wrong: "Duplicate GPU detected ..." if there."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    return next((line for line in lines if "Duplicate GPU" in line), lines[0] if lines else error)


# ----------------------------------------------------------------------------- check: a stopped rank


def lost_rank_worker(args: argparse.Namespace, backend: str, device: torch.device, folder: Path) -> dict[str, Any]:
    """Stage 3 on a small model; rank 1 stops itself (SIGSTOP) at step 2; rank 0 reports what it raised, when."""
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    init_group(args, backend, f"file://{folder}/store", args.rank, args.world_size)
    torch.manual_seed(0)
    with torch.device(device):
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [optimizer], EngineOptions(stage=3), Communicator(), device=device)
    started = None
    try:
        for step in range(6):
            if step == 2:
                started = time.time()
                (folder / f"rank{args.rank}.progress").write_text(str(started))
                if args.rank == 1:
                    os.kill(os.getpid(), signal.SIGSTOP)
            engine.begin_iteration()
            optimizer.zero_grad()
            engine.scale_loss(model(torch.randn(8, 256, device=device)).square().mean()).backward()
            engine.finish_backward()
            optimizer.step()
            sync(device)
    except Exception as error:
        seconds = time.time() - started if started else None
        return {"ok": True, "raised": type(error).__name__, "message": str(error)[:2000], "seconds": seconds}
    return {"ok": True, "raised": None, "seconds": time.time() - started if started else None}


def check_lost_rank(run: Run, label: str, env: dict[str, str]) -> dict[str, Any]:
    timeout = run.args.timeout_s
    rank0 = spawn(run, "lost_rank", 2, subprocess_timeout(run, 60 + 3 * timeout), env=env, wait_for=[0])[0]
    result = rank0.result or {}
    seconds = result.get("seconds")
    if seconds is None and rank0.progress is not None and rank0.exit_at is not None:
        seconds = rank0.exit_at - rank0.progress  # it ended without writing a result (e.g. the NCCL watchdog)
    details = {"env": env, "rank0": {**vars(rank0)}, "timeout_s": timeout}
    when = f"after {seconds:.1f} s" if seconds is not None else "(time unknown)"
    if result.get("raised") == "RankTimeoutError" and seconds is not None and seconds < 3 * timeout + 10:
        return {"notes": f"{label}: RankTimeoutError {when} (timeout {timeout:g} s)", "details": details}
    if result.get("raised"):
        what = f"{result['raised']}: {short(result.get('message', ''), 120)}"
    elif result:
        what = result.get("error") or "no error: the step loop finished"
    else:
        what = f"rank 0 {rank0.describe()}, no result written"
    return {"status": f"FAIL: {short(what)}", "notes": f"{label}: {what} {when}", "details": details}


# ----------------------------------------------------------------------------- check: Lightning


def lightning_worker(args: argparse.Namespace, backend: str, device: torch.device, folder: Path) -> dict[str, Any]:
    """A few Trainer steps with ZeroStrategy(stage=3) in bf16-mixed on one device (gradients clipped at norm 1),
    then strategy.barrier()."""
    from lightning.pytorch import Trainer

    from examples.gpt import ByteDataModule, GPTLightningModule
    from lightning_zero import ZeroStrategy

    width = 256 if device.type == "cuda" else 64
    module = GPTLightningModule(block_size=args.block_size, n_layer=2, n_head=width // 64, n_embd=width)
    data = ByteDataModule(block_size=args.block_size, batch_size=args.batch_size)
    trainer = Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        strategy=ZeroStrategy(stage=3),
        precision="bf16-mixed",
        max_steps=args.lightning_steps,
        gradient_clip_val=1.0,  # ZeroPrecision.clip_grad_by_norm on the device
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    start = time.perf_counter()
    trainer.strategy.barrier("gpu_check")
    barrier_s = time.perf_counter() - start
    loss = trainer.callback_metrics.get("train_loss")
    report = trainer.strategy.memory_report().as_dict()
    return {
        "ok": True,
        "global_step": trainer.global_step,
        "train_loss": None if loss is None else float(loss),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "barrier_s": barrier_s,
        "max_memory_allocated": allocated(device, peak=True),
        "memory_report": report,
    }


def check_lightning(run: Run) -> dict[str, Any]:
    rank0 = spawn(run, "lightning", 1, subprocess_timeout(run, 150))[0]
    result = rank0.result or {}
    details = {"rank0": {**vars(rank0)}}
    if not result.get("ok"):
        error = result.get("error") or f"the Trainer process: {rank0.describe()}, no result written"
        return {"status": f"FAIL: {short(error)}", "details": details}
    loss, steps = result["train_loss"], result["global_step"]
    notes = (
        f"{steps} Trainer steps on {result['backend']}, train_loss {cell(loss)}; "
        f"strategy.barrier() {1000 * result['barrier_s']:.1f} ms"
    )
    row = {"notes": notes, "details": {**details, **result}}
    peak = result.get("max_memory_allocated")
    row["peak_gib"] = None if peak is None else peak / GIB
    if steps != run.args.lightning_steps or loss is None or not math.isfinite(loss):
        row["status"] = f"FAIL: {steps} steps of {run.args.lightning_steps}, train_loss {loss}"
    return row


# ----------------------------------------------------------------------------- environment and main


def environment(run: Run) -> dict[str, Any]:
    import lightning
    from zero_bench.report import code_version

    info: dict[str, Any] = {
        **code_version(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cpus": os.cpu_count(),
        "device": str(run.device),
        "backend": run.backend,
    }
    if run.device.type == "cuda":
        props = torch.cuda.get_device_properties(run.device)
        info.update(
            gpu=props.name,
            gpu_memory_gib=props.total_memory / GIB,
            cuda=torch.version.cuda,
            nccl=nccl_version(),
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        )
    return info


def nccl_version() -> str:
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def env_row(run: Run) -> dict[str, Any]:
    run.environment = environment(run)
    info = run.environment
    where = f"{info.get('gpu', 'CPU')} ({info['backend']}, world size 1 in this process)"
    versions = f"torch {info['torch']}, lightning {info['lightning']}"
    if "cuda" in info:
        versions += f", CUDA {info['cuda']}, NCCL {info['nccl']}, TF32 matmul {cell(info['tf32_matmul'])}"
    commit = (info.get("git_commit") or "?")[:10]
    return {"notes": f"{where}; {versions}; commit {commit}", "details": info}


def run_checks(run: Run, folder: str) -> None:
    """Every check asked for, in order; those of this process need its process group, the others start their own."""
    checks = run.args.checks
    run.check("environment", lambda: env_row(run))
    group = run.check(f"process group ({run.backend}, world size 1)", lambda: start_group(run, folder))
    no_group = "this process has no process group (see its row)" if group["status"].startswith("FAIL") else None
    if "two_ranks" in checks:
        run.check("two_ranks", lambda: check_two_ranks(run))
    if "systems" in checks and no_group:
        run.check("systems", dict, skip=no_group)
    elif "systems" in checks:
        check_systems(run)
    if "compile" in checks and no_group:
        run.check("compile", dict, skip=no_group)
    elif "compile" in checks:
        check_compile(run)
    if "lightning" in checks:
        run.check("lightning fit + barrier", lambda: check_lightning(run))
    if "lost_rank" in checks:
        lost_rank_checks(run)
    if "offload" in checks and no_group:
        run.check("offload", dict, skip=no_group)
    elif "offload" in checks:
        check_offload(run)


def start_group(run: Run, folder: str) -> dict[str, Any]:
    """This process as rank 0 of a world of one, on NCCL bound to ``cuda:0`` (gloo in a dry run)."""
    start = time.perf_counter()
    init_group(run.args, run.backend, f"file://{folder}/store", 0, 1)
    probe = torch.ones(1, device=run.device)
    dist.all_reduce(probe)
    sync(run.device)
    seconds = time.perf_counter() - start
    return {"notes": f"init and a first all-reduce {seconds:.2f} s", "details": {"seconds": seconds}}


def lost_rank_checks(run: Run) -> None:
    if run.two_ranks is None:
        run.check("lost_rank", dict, skip="needs the two_ranks check (add it to --checks)")
        return
    if not run.two_ranks["ok"]:
        why = f"not possible on one GPU: two NCCL ranks did not run there ({run.two_ranks.get('error')})"
        run.check("lost_rank", dict, skip=why)
        return
    if run.backend == "gloo":
        run.check("lost_rank (gloo)", lambda: check_lost_rank(run, "gloo", {}))
        return
    run.check("lost_rank (NCCL defaults)", lambda: check_lost_rank(run, "NCCL defaults", {}))
    blocking = {"TORCH_NCCL_BLOCKING_WAIT": "1"}
    run.check("lost_rank (BLOCKING_WAIT=1)", lambda: check_lost_rank(run, "TORCH_NCCL_BLOCKING_WAIT=1", blocking))


@contextlib.contextmanager
def nvme_directory(args: argparse.Namespace) -> Iterator[None]:
    """``--nvme-path``, or a temporary directory removed at the end."""
    if args.nvme_path:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="gpu_check_swap_") as folder:
        args.nvme_path = folder
        yield


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if not args.dry_run and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr, flush=True)
        return 2
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    run = Run(args, device, "gloo" if args.dry_run else "nccl")
    run.log(f"gpu_check on {device} ({run.backend}), budget {args.budget_s:g} s, checks {','.join(args.checks)}")
    with nvme_directory(args), tempfile.TemporaryDirectory(prefix="gpu_check_") as folder:
        try:
            run_checks(run, folder)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    table = format_table(run.rows)
    print(table, flush=True)
    run.save(finished=True)
    run.log(f"done: {sum(r['status'] == 'ok' for r in run.rows)} ok of {len(run.rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
