"""Where a system's peak RSS comes from: the RSS at every block boundary of a training step, forward and backward.

Run on demand, from the repository root::

    python benchmarks/peak_trace.py zero3 fsdp2 --steps 3          # one line per system: peak and where
    python benchmarks/peak_trace.py zero3_bf16 --trace             # and every event of the last step

Each system (names of bench_zero.py) is built alone on 2 fresh gloo ranks with ``MALLOC_MMAP_THRESHOLD_=65536``
(freed buffers leave the RSS, see docs/benchmarks.md) and trains ``--steps`` steps as ``rss_rank`` does. Hooks
read ``VmRSS`` at events: each block's forward start and end, its backward start (the gradient of its output
arrives) and end (the gradient of its input), the loss, the end of backward, of ``prepare_step`` and of the
optimizer step; ``VmHWM`` is reset at every event, so each event also reports the peak since the one before.
Printed (rank 0, MiB over the RSS before the system was built, as bench_zero's RSS runs): the peak over all
steps, the event that ended the interval holding it, the peak of building the system, and the RSS at the start of
the last step and after it; with ``--trace`` every event of the last step as ``event=rss/peak``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_zero
import torch
from phase_memory import _status_mib
from torch import Tensor
from zero_bench.launch import on_ranks
from zero_bench.measure import batch_stream, model_config
from zero_bench.names import SYSTEMS
from zero_bench.systems import build_system

MMAP64K = {"MALLOC_MMAP_THRESHOLD_": "65536"}


class Recorder:
    """Events ``(name, rss, peak since the previous event)`` in MiB over ``base``."""

    def __init__(self, base: float) -> None:
        self.base = base
        self.events: list[tuple[str, float, float]] = []
        self.mark("start")

    def mark(self, name: str) -> None:
        self.events.append((name, _status_mib("VmRSS") - self.base, _status_mib("VmHWM") - self.base))
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # VmHWM := VmRSS


def _hook_blocks(model: torch.nn.Module, recorder: list[Recorder]) -> None:
    """Forward start/end of every block; backward start (gradient of its output) and end (of its input)."""
    for index, block in enumerate(model.blocks):

        def pre(module: Any, args: Any, i: int = index) -> None:
            recorder[0].mark(f"fwd{i}<")
            x = args[0]
            if torch.is_grad_enabled() and isinstance(x, Tensor) and x.requires_grad:
                x.register_hook(lambda g, i=i: recorder[0].mark(f"bwd{i}>"))

        def post(module: Any, args: Any, out: Tensor, i: int = index) -> None:
            recorder[0].mark(f"fwd{i}>")
            if out.requires_grad:
                out.register_hook(lambda g, i=i: recorder[0].mark(f"bwd{i}<"))

        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)


def trace_rank(rank: int, world_size: int, args: argparse.Namespace, name: str) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    stream = batch_stream(args, rank)
    batches = [next(stream) for _ in range(args.steps)]
    base = _status_mib("VmRSS")
    build = Recorder(base)
    system = build_system(name, model_config(args), args, None)
    build.mark("built")
    recorder = [build]
    _hook_blocks(system.model, recorder)
    engine = getattr(system, "engine", None)
    if engine is not None:  # mark the end of backward and of prepare_step (the optimizer step calls it again)
        original_prepare = engine.step_of(system.optimizer).prepare

        def prepare(*args: Any, **kwargs: Any) -> bool:
            fresh = engine.step_of(system.optimizer).state.name == "IDLE"
            if fresh:
                recorder[0].mark("backward_end")
            finite = original_prepare(*args, **kwargs)
            if fresh:
                recorder[0].mark("prepare_step")
            return finite

        engine.step_of(system.optimizer).prepare = prepare  # type: ignore[method-assign]
    steps = []
    for x, y in batches:
        recorder[0] = Recorder(base)
        system.step(x, y)
        recorder[0].mark("step_end")
        steps.append(recorder[0].events)
    return {"build": build.events, "steps": steps, "end": _status_mib("VmRSS") - base}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("systems", nargs="+", help=f"from {', '.join(SYSTEMS)}")
    parser.add_argument("--params", default="25e6")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trace", action="store_true", help="print every event of the last step")
    options, rest = parser.parse_known_args(argv)
    args = bench_zero.parse_args(["--params", options.params, *rest])
    args.steps = options.steps
    for name in options.systems:
        result = on_ranks(trace_rank, args, name, env=MMAP64K)[0]
        build_peak = max(peak for _, _, peak in result["build"])
        peak, where, step = max(
            (peak, event, s) for s, events in enumerate(result["steps"]) for event, _, peak in events
        )
        last = result["steps"][-1]
        print(
            f"{name}: peak {max(peak, build_peak):.1f} MiB (step {step + 1}, before {where}); build {build_peak:.1f};"
            f" last step starts at {last[0][1]:.1f}, ends at {result['end']:.1f}"
        )
        if options.trace:
            print("  " + " ".join(f"{event}={rss:.0f}/{peak:.0f}" for event, rss, peak in last))


if __name__ == "__main__":
    main()
