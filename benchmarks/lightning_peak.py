"""Lightning's DDP and FSDP, raw DDP and FSDP2, and ZeroStrategy stages 1-3 on one GPT: step time and peak RSS,
each system in processes of its own, in interleaved rounds.

Run by hand from the repository root (never from the tests)::

    PYTHONPATH=. python benchmarks/lightning_peak.py --out benchmarks/out/lightning_peak.json   # the measurement
    PYTHONPATH=. python benchmarks/lightning_peak.py --rounds 1 --steps 4 --warmup 1            # a short check
    PYTHONPATH=. python benchmarks/lightning_peak.py --systems ddp,zero2,zero3 --malloc mmap64k,as-is

Systems, each also as ``NAME_bf16`` (``precision="bf16-mixed"``; the raw ones under bf16 autocast): ``ddp``:
``Trainer(strategy=DDPStrategy())`` (DDP's defaults: a bucket copy of the gradients); ``fsdp``: Lightning's
``FSDPStrategy(auto_wrap_policy={Block})`` (torch's FSDP1, FULL_SHARD; its bf16-mixed casts parameters, reductions
and buffers to bf16, and its autocast names "cuda", so on the CPU it computes on bf16 parameters without autocast);
``zero1``-``zero3``: ``ZeroStrategy(stage=s, state_dict_type="full")`` ("full" to read its parameters at the end);
``zero3_free``: the same at stage 3 with ``free_gradients_after_step=True``; ``--zero-reduce-dtype bfloat16``
gives the bf16-mixed ZeRO systems ``ZeroPrecision("bf16-mixed", reduce_dtype="bfloat16")`` (gradients summed in
bf16, as FSDP's bf16-mixed does; the default sums them in fp32);
``raw_ddp`` (DistributedDataParallel, its defaults) and ``fsdp2`` (``fully_shard`` per block and on the root),
stepped by a plain loop as in ``zero_bench/systems.py`` (its ``ddp_copy`` and ``fsdp2``); ``fsdp2_pl``: the same
``fully_shard`` calls in ``configure_model`` under Lightning's ``ModelParallelStrategy`` (FSDP2 as Lightning users
run it: the Trainer's loop, which frees the gradients at ``zero_grad`` after the next forward, as for every
Lightning system here, where the plain loop frees them before it).

All train the same seeded GPT (``--params``, as bench_zero.py) with the same AdamW (``make_adamw``) on the same
fixed batches (seed + rank), 2 gloo ranks. Each run of a system spawns a fresh pair of processes, so its RSS is its
own; ``--malloc`` sets ``MALLOC_MMAP_THRESHOLD_`` before the interpreters start. Round ``r`` runs every system once,
the order rotated by ``r``, to spread the machine's drift. Each rank reads (the table shows the larger rank):

- step time: a barrier, then the clock from ``on_train_batch_start`` to ``on_train_batch_end`` (a Callback; raw: the
  same span around the step); a step lasts as long as its slower rank; the run's median after ``--warmup``;
- ``before_model``: VmRSS after imports, process group and batches, before the model is built;
- ``baseline``: VmRSS after setup, before the first step (Lightning: ``on_train_start``, the model wrapped or sharded
  and the optimizer built, AdamW's states not yet: the first step makes them; raw: once built); there the high-water
  mark is reset (``/proc/self/clear_refs``), so ``peak`` (VmHWM) covers the steps alone;
- model states after the last step: ZeRO's ``trainer.strategy.memory_report()``, its gradients as held before that
  step (``free_gradients_after_step`` empties them after it); DDP and FSDP params + grads + optimizer states counted
  from the tensors (FSDP its local shards; DDP's bucket copy not counted);
- peak over model states = ``peak - before_model - model states``: activations, communication buffers, bucket copies
  and the allocator's slack;
- the final parameters against the same precision's ``ddp``: max over tensors of max|a-b| / max|b|, and L2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch.distributed.tensor import DTensor
from zero_bench.launch import on_ranks  # importing zero_bench puts the repository root on sys.path
from zero_bench.measure import batch_stream, model_config, parameter_gap
from zero_bench.names import BF16, RSS_VARIANTS, base_system, is_bf16
from zero_bench.report import environment, mib
from zero_bench.systems import build_system, lm_loss, make_adamw, make_model, tensor_bytes

from examples.gpt import DEFAULT_DATA, Block, count_params
from lightning_zero import ZeroPrecision, ZeroStrategy

BASES = ("ddp", "raw_ddp", "fsdp", "fsdp2", "fsdp2_pl", "zero1", "zero2", "zero3", "zero3_free")
SYSTEMS = (*BASES, *(f"{base}{BF16}" for base in BASES))
RAW = {"raw_ddp": "ddp_copy", "fsdp2": "fsdp2"}  # our name -> zero_bench/systems.py's
MEMORY_REFERENCES = ("ddp", "fsdp2", "fsdp", "fsdp2_pl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="runs of every system, interleaved")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per run before those")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {','.join(SYSTEMS)}")
    parser.add_argument("--malloc", default="mmap64k", help=f"comma-separated from {','.join(RSS_VARIANTS)}")
    parser.add_argument("--params", type=float, default=25e6, help="target parameter count of the GPT")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--bucket-cap-mb", type=float, default=25, help="raw systems' DDP bucket size")
    parser.add_argument(
        "--zero-reduce-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="bf16-mixed ZeRO systems: the dtype gradients are summed in (ZeroPrecision's reduce_dtype; FSDP's "
        "bf16-mixed sums in bfloat16)",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--out", help="also write every reading and the summary as JSON to this file")
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.malloc = [v.strip() for v in args.malloc.split(",") if v.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS] + [v for v in args.malloc if v not in RSS_VARIANTS]
    if unknown:
        parser.error(f"unknown systems or malloc variants {unknown}; systems: {SYSTEMS}, malloc: {list(RSS_VARIANTS)}")
    if not args.systems or len(set(args.systems)) != len(args.systems) or not args.malloc:
        parser.error("--systems needs distinct names and --malloc at least one variant")
    if min(args.rounds, args.steps) < 1 or args.warmup < 0:
        parser.error("--rounds and --steps must be >= 1, --warmup >= 0")
    args.world_size, args.device = 2, "cpu"  # gloo ranks, as zero_bench's helpers expect
    return args


# ----------------------------------------------------------------------------- in the ranks


def proc_status(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` of this process, in bytes."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(f"{field}:"))


def reset_peak() -> int:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0) and return that RSS: the baseline."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return proc_status("VmRSS")


class Probe:
    """What every run reads in a rank: baseline, per-step times, peak, model states, final parameters."""

    def __init__(self) -> None:
        self.before_model = proc_status("VmRSS")
        self.times: list[float] = []
        self.baseline = self.peak = 0
        self._start = 0.0

    def start_steps(self) -> None:
        self.baseline = reset_peak()

    def start_step(self) -> None:
        dist.barrier()
        self._start = time.perf_counter()

    def end_step(self) -> None:
        self.times.append(time.perf_counter() - self._start)

    def finish(self, memory: dict[str, int], full_state: Callable[[], dict], path: str) -> dict[str, Any]:
        """The readings; then rank 0 writes the full parameters (fp32, names without ``model.``) to ``path``."""
        self.peak = proc_status("VmHWM")  # before anything is gathered for the comparison
        state = full_state()  # a collective for the sharded systems: every rank calls it
        if dist.get_rank() == 0:
            torch.save({name_of(k): v.detach().float() for k, v in state.items() if v.is_floating_point()}, path)
        keys = ("before_model", "baseline", "peak", "times")
        return {**{k: getattr(self, k) for k in keys}, "memory": memory, "threads": torch.get_num_threads()}


def name_of(key: str) -> str:
    """A parameter's name in the GPT: without the LightningModule's ``model.`` and FSDP1's wrappers."""
    return key.removeprefix("model.").replace("_fsdp_wrapped_module.", "")


def raw_rank(rank: int, world_size: int, args: argparse.Namespace, name: str, path: str) -> dict[str, Any]:
    stream = batch_stream(args, rank)
    batches = [next(stream) for _ in range(args.warmup + args.steps)]
    probe = Probe()
    system = build_system(reference_of(RAW[base_system(name)], name), model_config(args), args, None)
    probe.start_steps()
    for x, y in batches:
        probe.start_step()
        system.step(x, y)
        probe.end_step()
    return probe.finish(system.memory(), system.full_state, path)


class BenchGPT(pl.LightningModule):
    """The seeded GPT, built here (before any strategy, so every system starts from the same weights), the
    benchmark's AdamW, no logging."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.model = make_model(model_config(args), args.seed)
        self.matrices = {id(p) for p in self.model.parameters() if p.dim() >= 2}  # before FSDP flattens them
        self.lr = args.lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return lm_loss(self.model, *batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_adamw(self.model, self.lr, self.matrices)


class ShardedBenchGPT(BenchGPT):
    """:class:`BenchGPT` sharded by FSDP2 in ``configure_model``, as ``fsdp2`` shards it (per block and the root;
    bf16-mixed: parameters gathered in bf16, gradients reduced in fp32)."""

    def __init__(self, args: argparse.Namespace, bf16: bool) -> None:
        super().__init__(args)
        self.bf16 = bf16

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self.device_mesh["data_parallel"]
        dtypes = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if self.bf16 else {}
        policy = MixedPrecisionPolicy(**dtypes)
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)
        self.matrices = {id(p) for p in self.model.parameters() if p.dim() >= 2}  # fully_shard made new parameters


class ProbeHooks(pl.Callback):
    """The Trainer's side of a :class:`Probe`: the steps begin at ``on_train_start``, each is timed from
    ``on_train_batch_start`` to ``on_train_batch_end``, and ``on_train_end`` (before the strategy's teardown)
    finishes the readings."""

    def __init__(self, probe: Probe, path: str) -> None:
        self.probe, self.path = probe, path
        self.result: dict[str, Any] | None = None

    def on_train_start(self, *_: Any) -> None:
        self.probe.start_steps()

    def on_train_batch_start(self, *_: Any) -> None:
        self.probe.start_step()

    def on_train_batch_end(self, *_: Any) -> None:
        self.probe.end_step()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.result = self.probe.finish(model_states(trainer), lambda: full_state(trainer), self.path)


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy with the two changes the CPU needs: the Trainer refuses the class itself without a GPU
    (it checks the exact type), and torch's FSDP1 wants ``device_id=cpu`` where Lightning passes ``None`` (the CPU
    device's index). The wrapping is Lightning's call otherwise; the rest of the strategy is unchanged."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        kwargs = dict(self.kwargs)
        self.kwargs.pop("auto_wrap_policy", None)  # applied here; Lightning then finds the model wrapped
        wrapped = FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **kwargs,
        )
        return super()._setup_model(wrapped)


def lightning_strategy(name: str, reduce_dtype: str = "float32") -> pl.strategies.Strategy:
    base = base_system(name)
    if base == "ddp":
        return DDPStrategy()
    if base == "fsdp":
        return CPUFSDPStrategy(auto_wrap_policy={Block})
    if base == "fsdp2_pl":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    free = base.endswith("_free")
    bf16_sums = is_bf16(name) and reduce_dtype != "float32"  # else the Trainer's flag, as users pass it
    precision = ZeroPrecision("bf16-mixed", reduce_dtype=reduce_dtype) if bf16_sums else None
    return ZeroStrategy(
        stage=int(base[4]), state_dict_type="full", free_gradients_after_step=free, precision_plugin=precision
    )


def lightning_rank(rank: int, world_size: int, args: argparse.Namespace, name: str, path: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore", ".*(num_workers|autocast|CUDA is not available).*")
    stream = batch_stream(args, rank)
    batches = [next(stream) for _ in range(args.warmup + args.steps)]
    hooks = ProbeHooks(Probe(), path)
    module = ShardedBenchGPT(args, is_bf16(name)) if base_system(name) == "fsdp2_pl" else BenchGPT(args)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=lightning_strategy(name, args.zero_reduce_dtype),
        precision="bf16-mixed" if is_bf16(name) else "32-true",
        max_steps=len(batches),
        callbacks=[hooks],
        use_distributed_sampler=False,  # each rank its own fixed batches
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    assert hooks.result is not None, "the Trainer ended without on_train_end"
    return hooks.result


def model_states(trainer: pl.Trainer) -> dict[str, int]:
    """Bytes this rank holds: ZeRO's own report; else params + grads + optimizer states counted from the tensors."""
    if isinstance(trainer.strategy, ZeroStrategy):
        report = trainer.strategy.memory_report()
        emptied = report.step_peak.model_states - report.total  # gradients held at the step's end, emptied since
        gradients = report.gradients + emptied
        return {"params": report.params, "gradients": gradients, "optimizer_states": report.optimizer_states}
    params = list(trainer.lightning_module.parameters())  # FSDP's use_orig_params: views of this rank's shards
    states = [v for optimizer in trainer.optimizers for s in optimizer.state.values() for v in s.values()]
    return {
        "params": tensor_bytes(map(local, params)),
        "gradients": tensor_bytes(local(p.grad) for p in params),
        "optimizer_states": tensor_bytes(map(local, states)),
    }


def local(tensor: Any) -> Any:
    """This rank's part of an FSDP2 ``DTensor``; anything else as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_state(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """The full parameters on rank 0 at least (a collective): ZeRO's masters where it keeps them, FSDP's gathered
    (its full state dict, offloaded to the CPU, crashes there), DDP's own."""
    if isinstance(trainer.strategy, ModelParallelStrategy):  # every rank gathers each, in the same order
        return {name: p.full_tensor().detach() for name, p in trainer.lightning_module.named_parameters()}
    if not isinstance(trainer.strategy, FSDPStrategy):
        return trainer.strategy.lightning_module_state_dict()
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(trainer.strategy.model, writeback=False):
        return {name: p.detach().clone() for name, p in trainer.lightning_module.named_parameters()}


# ----------------------------------------------------------------------------- in the parent


def run_once(args: argparse.Namespace, name: str, variant: str, path: Path) -> dict[str, Any]:
    """One run of ``name`` in a fresh pair of ranks: its readings, or ``{"error": ...}``."""
    fn = raw_rank if base_system(name) in RAW else lightning_rank
    try:
        ranks = on_ranks(fn, args, name, str(path), env=RSS_VARIANTS[variant])
    except Exception as error:  # a failing system gets an error row; the others go on
        lines = [line.strip() for line in str(error).splitlines() if line.strip() and not line.startswith("(also")]
        return {"error": lines[-1] if lines else type(error).__name__}  # the first failing rank's exception
    steps = [max(r["times"][i] for r in ranks) for i in range(args.warmup, args.warmup + args.steps)]
    states = [sum(r["memory"].values()) for r in ranks]
    return {
        "step_ms": 1e3 * statistics.median(steps),
        "steps_ms": [1e3 * t for t in steps],
        "peak_over_baseline": max(r["peak"] - r["baseline"] for r in ranks),
        "model_states": max(states),
        "peak_over_states": max(r["peak"] - r["before_model"] - s for r, s in zip(ranks, states, strict=True)),
        "ranks": ranks,
    }


def reference_of(base: str, name: str) -> str:
    """``base`` in ``name``'s precision: ``reference_of("ddp", "zero2_bf16") == "ddp_bf16"``."""
    return base + (BF16 if is_bf16(name) else "")


def ran(runs: dict[str, dict[str, Any]], *names: str) -> bool:
    return all(name in runs and "error" not in runs[name] for name in names)


def compare_parameters(runs: dict[str, dict[str, Any]], paths: dict[str, Path]) -> None:
    """Add to each run its parameters' gap to its precision's ``ddp`` of the same round, on the names both have."""
    for name, run in runs.items():
        ref = reference_of("ddp", name)
        if name != ref and ran(runs, name, ref):
            state, base = torch.load(paths[name]), torch.load(paths[ref])
            common = [key for key in base if key in state]
            run.update(parameter_gap({k: state[k] for k in common}, {k: base[k] for k in common}))


def summarize(args: argparse.Namespace, rounds: list[dict[str, dict[str, dict]]]) -> dict[str, dict[str, Any]]:
    """Per malloc variant and system: medians over the rounds that ran, medians of per-round ratios, failures."""
    summary: dict[str, dict[str, Any]] = {}
    for variant in args.malloc:
        summary[variant] = {}
        for name in args.systems:
            runs = [r[variant] for r in rounds]
            ok = [r[name] for r in runs if ran(r, name)]
            entry: dict[str, Any] = {"failed": [r[name]["error"] for r in runs if not ran(r, name)]}
            if ok:
                for key in ("step_ms", "peak_over_baseline", "model_states", "peak_over_states"):
                    entry[key] = statistics.median(run[key] for run in ok)
                entry["step_ms_min_max"] = (min(run["step_ms"] for run in ok), max(run["step_ms"] for run in ok))
                for base in ("ddp", "raw_ddp"):
                    ref = reference_of(base, name)
                    ratios = [r[name]["step_ms"] / r[ref]["step_ms"] for r in runs if ran(r, name, ref)]
                    entry[f"vs_{base}"] = statistics.median(ratios) if ratios else None
                gaps = [run["max_rel_param_diff"] for run in ok if "max_rel_param_diff" in run]
                entry["max_rel_param_diff"] = max(gaps) if gaps else None
                entry["rel_l2_param_diff"] = max((run.get("rel_l2_param_diff", 0.0) for run in ok), default=None)
                entry["bitwise_equal"] = bool(gaps) and all(run["bitwise_equal"] for run in ok)
            summary[variant][name] = entry
    return summary


def markdown(args: argparse.Namespace, summary: dict[str, dict[str, Any]], numel: int) -> str:
    """One table per malloc variant; a failed system's row carries its error."""
    refs = [ref for ref in MEMORY_REFERENCES if ref in {base_system(n) for n in args.systems}]
    lines = [
        f"GPT {numel / 1e6:.2f}M parameters, 2 gloo ranks x {args.threads} thread, batch {args.batch_size} x block "
        f"{args.block_size} per rank, AdamW; {args.rounds} round(s) of one run per system in fresh processes, "
        f"{args.warmup} warmup + {args.steps} measured steps a run. Step: median over rounds of each run's median "
        "(min-max); vs: median of the per-round ratios to the same precision's ddp / raw_ddp. MiB, larger rank, "
        "median over rounds; `- X`: peak over model states minus X's, same precision.",
    ]
    for variant, table in summary.items():
        malloc = " ".join(f"{k}={v}" for k, v in RSS_VARIANTS[variant].items()) or "the environment unchanged"
        lines += [
            "",
            f"malloc {variant} ({malloc}):",
            "",
            "| system | precision | step ms median (min-max) | vs ddp | vs raw_ddp | peak - baseline | model states "
            "| peak over model states | " + " | ".join(f"- {ref}" for ref in refs) + " | max rel param diff vs ddp |",
            "|---" * (9 + len(refs)) + "|",
        ]
        for name, s in table.items():
            if "step_ms" not in s:
                lines.append(f"| {name} | {_precision(name)} | FAILED: {s['failed'][0]} |" + " |" * (6 + len(refs)))
                continue
            cells = [name + (f" ({len(s['failed'])} runs failed)" if s["failed"] else ""), _precision(name)]
            low, high = s["step_ms_min_max"]
            cells += [f"{s['step_ms']:.0f} ({low:.0f}-{high:.0f})", _ratio(s["vs_ddp"]), _ratio(s["vs_raw_ddp"])]
            cells += [mib(s[key]) for key in ("peak_over_baseline", "model_states", "peak_over_states")]
            for ref in (reference_of(base, name) for base in refs):
                other = table.get(ref, {}).get("peak_over_states")
                cells.append("-" if other is None else f"{(s['peak_over_states'] - other) / 2**20:+.1f}")
            cells.append(_gap(name, s))
            lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def _precision(name: str) -> str:
    return "bf16-mixed" if is_bf16(name) else "fp32"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def _gap(name: str, s: dict[str, Any]) -> str:
    if s["max_rel_param_diff"] is None:
        return "(reference)" if name == reference_of("ddp", name) else "-"
    return "bit-equal" if s["bitwise_equal"] else f"{s['max_rel_param_diff']:.1e} (L2 {s['rel_l2_param_diff']:.0e})"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    entries = [(name, variant) for variant in args.malloc for name in args.systems]
    print(f"# {model_config(args)} | {len(entries)} runs x {args.rounds} rounds", file=sys.stderr, flush=True)
    started, rounds = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="lightning_peak_") as tmp:
        for index in range(args.rounds):
            shift = index % len(entries)
            runs: dict[str, dict[str, dict]] = {variant: {} for variant in args.malloc}
            paths = {variant: {} for variant in args.malloc}
            for name, variant in entries[shift:] + entries[:shift]:
                t = time.perf_counter()
                paths[variant][name] = Path(tmp) / f"{variant}.{name}.pt"
                runs[variant][name] = run_once(args, name, variant, paths[variant][name])
                status = runs[variant][name].get("error") or f"{runs[variant][name]['step_ms']:.0f} ms/step"
                print(f"# round {index} {variant}/{name}: {time.perf_counter() - t:.0f} s, {status}", file=sys.stderr)
            for variant in args.malloc:
                compare_parameters(runs[variant], paths[variant])
            rounds.append(runs)
    summary = summarize(args, rounds)
    print(markdown(args, summary, count_params(model_config(args))))
    print(f"# total: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {"config": vars(args), "environment": environment(), "summary": summary, "rounds": rounds}
        out.write_text(json.dumps(record, indent=2, default=str))


if __name__ == "__main__":
    main()
