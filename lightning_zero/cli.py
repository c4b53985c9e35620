"""The ``lightning-zero`` command: argument parsing, then a call into the library.

``lightning-zero estimate`` builds a model on the meta device (nothing is allocated) and prints the
per-rank memory of its model states at every ZeRO stage::

    lightning-zero estimate --model examples.gpt:GPTLightningModule \\
        --init-args '{"n_layer": 8, "n_embd": 512, "n_head": 8}' --world-size 8

``lightning-zero consolidate DIR OUT`` writes a sharded checkpoint directory as one ordinary Lightning
checkpoint file, ``lightning-zero convert DIR OUT --to dcp`` as a ``torch.distributed.checkpoint`` directory that
FSDP2 and Lightning's ModelParallelStrategy load (see docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_zero.cli_config import apply_trainer_settings, read_model_section
from lightning_zero.core.options import check_secondary_shard_size
from lightning_zero.estimate import (
    OPTIMIZER_STATE_BYTES,
    PRECISIONS,
    STAGES,
    MemoryEstimate,
    estimate_memory,
    shard_group_size,
)
from lightning_zero.version import __version__

_FROM_CONFIG = "; a --config's ZeroStrategy may set it"
_COLUMNS = ("stage", "params", "gradients", "optimizer states", "offloaded", "total")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-zero", description="ZeRO for PyTorch Lightning.")
    parser.add_argument("--version", action="version", version=f"lightning-zero {__version__}")
    commands = parser.add_subparsers(dest="command", title="commands")
    _add_estimate_parser(commands)
    _add_consolidate_parser(commands)
    _add_convert_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
    elif args.command == "estimate":
        _estimate(args)
    elif args.command == "consolidate":
        return _consolidate(args)
    elif args.command == "convert":
        return _convert(args)
    return 0


# ----------------------------------------------------------------------------- consolidate


def _add_consolidate_parser(commands: argparse._SubParsersAction) -> None:
    consolidate = commands.add_parser(
        "consolidate",
        help="turn a sharded checkpoint directory into one ordinary Lightning checkpoint file",
        description=(
            "Read a sharded checkpoint (state_dict_type='sharded') and write one ordinary Lightning checkpoint "
            "(module state_dict keys, ordinary optimizer states) that Model.load_from_checkpoint reads without "
            "lightning_zero. Tensors are streamed one at a time, so memory stays near one tensor."
        ),
    )
    consolidate.add_argument("checkpoint_dir", type=Path, help="the sharded checkpoint directory")
    consolidate.add_argument("out_file", type=Path, help="the checkpoint file to write, e.g. model.ckpt")


def _consolidate(args: argparse.Namespace) -> int:
    from lightning_zero.checkpoint import CheckpointError, consolidate

    if not args.out_file.parent.is_dir():
        print(f"lightning-zero consolidate: {args.out_file.parent} does not exist: create it first.", file=sys.stderr)
        return 1
    try:
        consolidate(args.checkpoint_dir, args.out_file, progress=_ProgressLine())
    except (CheckpointError, ValueError) as error:  # a damaged checkpoint, an output inside it
        print(f"lightning-zero consolidate: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # the output cannot be written (permissions, a full disk, a read-only file system)
        print(f"lightning-zero consolidate: cannot write {args.out_file}: {error.strerror or error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out_file} ({args.out_file.stat().st_size:,} bytes)")
    return 0


# ----------------------------------------------------------------------------- convert


def _add_convert_parser(commands: argparse._SubParsersAction) -> None:
    convert = commands.add_parser(
        "convert",
        help="write a sharded checkpoint directory in another format (dcp: torch.distributed.checkpoint)",
        description=(
            "Read a sharded checkpoint (state_dict_type='sharded') and write a torch.distributed.checkpoint "
            "directory: 'model' and 'optim' keyed by parameter name as get_state_dict names them (FSDP2, plain "
            "models), the same tensors under Lightning's 'state_dict' and 'optimizer_<n>' keys, and Lightning's "
            "loop state in meta.pt (ModelParallelStrategy). Tensors are streamed one at a time."
        ),
    )
    convert.add_argument("checkpoint_dir", type=Path, help="the sharded checkpoint directory")
    convert.add_argument("out_dir", type=Path, help="the directory to write; must not exist or be empty")
    convert.add_argument("--to", choices=["dcp"], default="dcp", help="the output format (default: dcp)")


def _convert(args: argparse.Namespace) -> int:
    from torch.distributed.checkpoint.api import CheckpointException

    from lightning_zero.checkpoint import CheckpointError, convert

    try:
        convert(args.checkpoint_dir, args.out_dir, to=args.to, progress=_ProgressLine("convert"))
    except (CheckpointError, ValueError) as error:  # a damaged checkpoint, an output inside it or not empty
        print(f"lightning-zero convert: {error}", file=sys.stderr)
        return 1
    except (OSError, CheckpointException) as error:  # the output cannot be written (DCP wraps its writers' errors)
        cause = next(iter(error.failures.values()), error) if isinstance(error, CheckpointException) else error
        cause = cause[0] if isinstance(cause, tuple) else cause  # DCP keeps (exception, its stack) per rank
        print(f"lightning-zero convert: cannot write {args.out_dir}: {cause}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in args.out_dir.iterdir() if f.is_file())
    print(f"wrote {args.out_dir} ({size:,} bytes, {args.to})")
    return 0


class _ProgressLine:
    """Prints ``consolidate: 40% (1.2 of 3.0 GB)`` to stderr at every further 10% of a checkpoint over 100 MB."""

    def __init__(self, command: str = "consolidate") -> None:
        self._shown = 0
        self._command = command

    def __call__(self, written: int, total: int) -> None:
        if total < 100e6:
            return
        percent = int(100 * written / total) // 10 * 10
        if percent > self._shown:
            self._shown = percent
            print(f"{self._command}: {percent}% ({written / 1e9:.1f} of {total / 1e9:.1f} GB)", file=sys.stderr)


# ----------------------------------------------------------------------------- estimate


def _add_estimate_parser(commands: argparse._SubParsersAction) -> None:
    estimate = commands.add_parser(
        "estimate",
        help="per-rank memory of parameters, gradients and optimizer states at each ZeRO stage",
        description=(
            "Build the model on the meta device (nothing is allocated) and print the per-rank bytes of its "
            "model states at stage 0 (DDP), 1, 2 and 3. Activations, buffers, padding and optimizer step "
            "counters are not included."
        ),
    )
    estimate.add_argument(
        "--model",
        help="the model class as package.module:Class (or package.module.Class); overrides the class_path of --config",
    )
    estimate.add_argument("--init-args", default="{}", help="keyword arguments of the class, as a JSON object")
    estimate.add_argument(
        "--config",
        type=Path,
        help="a LightningCLI YAML config; its model section gives class_path and init_args, or plain init args",
    )
    estimate.add_argument(
        "--world-size", type=_positive_int, help="number of ranks (default: devices x num_nodes of --config's trainer)"
    )
    estimate.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        help="default: --config's trainer.precision (Lightning's 32-true where it has none), else 16-mixed",
    )
    estimate.add_argument("--optimizer", choices=list(OPTIMIZER_STATE_BYTES), default="adamw", help="default: adamw")
    estimate.add_argument(
        "--offload-optimizer", choices=["cpu", "nvme"], help="stages 1-3: optimizer states off device" + _FROM_CONFIG
    )
    estimate.add_argument(
        "--offload-params", choices=["cpu", "nvme"], help="stage 3: parameter shard off device" + _FROM_CONFIG
    )
    estimate.add_argument(
        "--accumulate-grad-batches",
        type=_positive_int,
        help="default: --config's trainer.accumulate_grad_batches, else 1 (adds a swap region with both offloads nvme)",
    )
    estimate.add_argument(
        "--partition",
        choices=["flat", "parameter"],
        help="flat: even shards (default); parameter: whole tensors per owner, the most loaded rank's bytes"
        + _FROM_CONFIG,
    )
    estimate.add_argument(
        "--shard-size",
        type=_positive_int,
        help="hybrid sharding: shard inside groups of this many ranks (e.g. per node), replicate across them; "
        "a divisor of the world size (default: all ranks)" + _FROM_CONFIG,
    )
    estimate.add_argument(
        "--secondary-shard-size",
        type=_positive_int,
        help="stage 3 (ZeRO++ hpZ): units keep 1/N of their parameters from forward to backward, N ranks per "
        "group inside a node; the stage-3 row counts them as at the end of forward (default: none)" + _FROM_CONFIG,
    )
    estimate.add_argument(
        "--wrap-policy",
        nargs="+",
        metavar="CLASS",
        help="stage-3 gather units as import paths (package.module.Block), read with --secondary-shard-size: the "
        "units other than the root keep the slices (default: the repeated blocks, as ZeroStrategy)" + _FROM_CONFIG,
    )
    estimate.add_argument(
        "--quantize-gradients",
        action="store_true",
        default=None,
        help="ZeRO++ qgZ: gradients cross nodes in int8 with error feedback, whose fp32 residuals stages 1-3 count "
        "(with --num-nodes above 1; on one node it changes nothing)" + _FROM_CONFIG,
    )
    estimate.add_argument(
        "--num-nodes",
        type=_positive_int,
        help="the nodes the --world-size ranks run on, as many on each (default: --config's trainer.num_nodes, else 1)",
    )


def _estimate(args: argparse.Namespace) -> None:
    _import_from_the_working_directory()  # --config's class paths, as --model's
    from_config = apply_trainer_settings(args)
    try:
        group = shard_group_size(args.shard_size, args.world_size)
        check_secondary_shard_size(args.secondary_shard_size, 3, group)
        if args.world_size % args.num_nodes:
            raise ValueError(f"num_nodes={args.num_nodes} does not divide world_size={args.world_size}")
        _check_as_the_strategy(args)
    except ValueError as error:  # checked before the model is built: the fix is on the command line
        message = str(error).replace("secondary_shard_size=", "--secondary-shard-size ")
        message = message.replace("shard_size=", "--shard-size ").replace("world_size=", "--world-size ")
        message = message.replace("num_nodes=", "--num-nodes ")
        raise SystemExit(f"lightning-zero estimate: {message}") from None
    class_path, init_args = _model_spec(args)
    model = _build_on_meta(class_path, init_args)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print(f"{class_path}: {total:,} parameters ({trainable:,} trainable)")
    if from_config:
        print("From --config's strategy: " + ", ".join(f"{name}={value}" for name, value in from_config.items()))
    print(
        f"world_size={args.world_size}, precision={args.precision}, optimizer={args.optimizer}, "
        f"offload_optimizer={args.offload_optimizer}, offload_params={args.offload_params}, "
        f"partition={args.partition}, accumulate_grad_batches={args.accumulate_grad_batches}, "
        f"shard_size={args.shard_size}, secondary_shard_size={args.secondary_shard_size}, "
        f"quantize_gradients={args.quantize_gradients}, num_nodes={args.num_nodes}\n"
    )
    try:
        rows = [_row(model, stage, args) for stage in STAGES]
    except ValueError as error:  # an option the checks above do not see (e.g. from --config's strategy)
        raise SystemExit(f"lightning-zero estimate: {error}") from None
    print(_format_table(rows))
    print("Per rank; 1 GB = 1e9 bytes. Not included: activations, buffers, padding, optimizer step counters.")
    if args.offload_optimizer or args.offload_params:
        print("Offload applies where the stage allows it: optimizer from stage 1, parameters at stage 3 only.")
    if args.partition == "parameter":
        owned = estimate_memory(
            model, stage=1, world_size=args.world_size, partition="parameter", shard_size=args.shard_size
        )
        print(
            f"partition=parameter: the most loaded rank owns {owned.owned_max:,} trained elements, the least "
            f"{owned.owned_min:,} (even shards: {-(-trainable // group):,}); the table is the most loaded's."
        )
    if args.shard_size is not None:
        print(
            f"Hybrid sharding: stages 1-3 shard over groups of {group} ranks, replicated {args.world_size // group} "
            "times; stage 0 (DDP) shards nothing."
        )
    if args.secondary_shard_size is not None:
        print(
            f"Secondary shards: stage 3's parameters include 1/{args.secondary_shard_size} of every unit but the "
            "root, which is counted gathered in full, as at the end of forward (every slice alive)."
        )
    if args.quantize_gradients and args.num_nodes > 1:
        print(
            "Quantized gradients: stages 1-3's gradients include error feedback's fp32 residuals of what a rank "
            "sends across nodes."
        )


def _check_as_the_strategy(args: argparse.Namespace) -> None:
    """Refuse what ZeroStrategy refuses of these options (the table would show a run that cannot start)."""
    if args.offload_params and not args.offload_optimizer:
        raise ValueError(
            f"offload_params={args.offload_params} needs offload_optimizer: ZeroStrategy refuses parameters offloaded "
            "without the optimizer (it steps the shards where they rest). Add --offload-optimizer cpu (or nvme)."
        )
    per_node = args.world_size // args.num_nodes
    straddles = {  # option: value, and whether it may also span whole nodes (hybrid shard groups may)
        "secondary_shard_size": (args.secondary_shard_size, False),
        "shard_size": (args.shard_size, True),
    }
    for option, (size, whole_nodes) in straddles.items():
        if size is not None and per_node % size and (not whole_nodes or size % per_node):
            raise ValueError(
                f"{option}={size} does not fit nodes of {per_node} ranks (world_size={args.world_size} over "
                f"num_nodes={args.num_nodes}): a group would straddle two nodes, which ZeroStrategy refuses."
            )


def _row(model: nn.Module, stage: int, args: argparse.Namespace) -> list[str]:
    """One table row; each offload option is applied only at the stages that support it."""
    estimate = estimate_memory(
        model,
        stage=stage,
        world_size=args.world_size,
        precision=args.precision,
        optimizer=args.optimizer,
        offload_optimizer=args.offload_optimizer if stage >= 1 else False,
        offload_params=args.offload_params if stage == 3 else False,
        partition=args.partition,
        accumulate_grad_batches=args.accumulate_grad_batches,
        shard_size=args.shard_size,
        secondary_shard_size=args.secondary_shard_size if stage == 3 else None,
        quantize_gradients=args.quantize_gradients,
        num_nodes=args.num_nodes,
        wrap_policy=args.wrap_policy,
    )
    return [_stage_label(stage), *map(_human_bytes, _columns_of(estimate))]


def _columns_of(estimate: MemoryEstimate) -> tuple[int, ...]:
    return estimate.params, estimate.gradients, estimate.optimizer_states, estimate.offloaded, estimate.total


def _stage_label(stage: int) -> str:
    return "0 (DDP)" if stage == 0 else str(stage)


def _human_bytes(nbytes: int) -> str:
    """Decimal units, as in the ZeRO paper: GB with 2 decimals from 1 GB, MB below."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.2f} MB"


def _format_table(rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(_COLUMNS, *rows, strict=True)]
    lines = []
    for cells in [list(_COLUMNS), *rows]:
        stage, *values = cells
        lines.append(
            "  ".join([stage.ljust(widths[0])] + [v.rjust(w) for v, w in zip(values, widths[1:], strict=True)])
        )
    return "\n".join(lines)


def _model_spec(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The class path and init args from --config, then --model and --init-args on top."""
    class_path, init_args = read_model_section(args.config) if args.config is not None else (None, {})
    class_path = args.model or class_path
    if class_path is None:
        raise SystemExit(
            "lightning-zero estimate: no model class given. Pass --model package.module:Class, "
            "or a --config whose model section has a class_path."
        )
    try:
        overrides = json.loads(args.init_args)
    except json.JSONDecodeError as error:
        raise SystemExit(
            f"lightning-zero estimate: --init-args {args.init_args!r} is not valid JSON: {error}"
        ) from None
    if not isinstance(overrides, dict):
        raise SystemExit(f"lightning-zero estimate: --init-args must be a JSON object, got {args.init_args!r}.")
    return class_path, {**init_args, **overrides}


def _build_on_meta(class_path: str, init_args: dict[str, Any]) -> nn.Module:
    """Instantiate the class on the meta device, then run its ``configure_model()`` if it has one."""
    cls = _import_class(class_path)
    with torch.device("meta"):
        try:
            model = cls(**init_args)
        except TypeError as error:
            raise SystemExit(f"lightning-zero estimate: cannot build {class_path} with {init_args}: {error}") from None
        configure_model = getattr(model, "configure_model", None)
        if callable(configure_model):
            configure_model()
    if not isinstance(model, nn.Module):
        raise SystemExit(
            f"lightning-zero estimate: {class_path} built a {type(model).__name__}, not a torch.nn.Module."
        )
    return model


def _import_from_the_working_directory() -> None:
    """A console script's sys.path starts at its own directory; models (and a config's classes, e.g. a
    ``wrap_policy``'s blocks) usually live in the working one, as for ``python train.py``."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def _import_class(class_path: str) -> Any:
    """``package.module:Class`` or ``package.module.Class``, importable from the working directory."""
    module_name, sep, name = class_path.partition(":") if ":" in class_path else class_path.rpartition(".")
    if not module_name or not name or not sep:
        raise SystemExit(f"lightning-zero estimate: --model {class_path!r} is not of the form package.module:Class.")
    _import_from_the_working_directory()
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise SystemExit(f"lightning-zero estimate: cannot import {class_path!r}: {error}") from None
    if not hasattr(module, name):
        raise SystemExit(
            f"lightning-zero estimate: cannot import {class_path!r}: module {module_name!r} has no {name!r}."
        )
    return getattr(module, name)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return int(text)


if __name__ == "__main__":  # python -m lightning_zero.cli
    sys.exit(main())
