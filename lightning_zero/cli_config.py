"""What a LightningCLI config says about ``lightning-zero estimate``'s arguments: the model section, and the
trainer section's world size, precision, accumulation and ``ZeroStrategy`` options, each used where the command
line did not give it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentError, ArgumentParser

from lightning_zero.config import PRESETS
from lightning_zero.estimate import PRECISIONS

# Lightning's precision inputs that name one of the estimate's precisions under another spelling.
_PRECISION_ALIASES = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true"}
# The estimate's arguments a ZeroStrategy option sets (its init_args name = the argument's dest), and each one's
# value when neither the command line nor the config gives it.
_STRATEGY_DEFAULTS: dict[str, Any] = {
    "offload_optimizer": False,
    "offload_params": False,
    "partition": "flat",
    "shard_size": None,
    "secondary_shard_size": None,
    "quantize_gradients": False,
    "wrap_policy": None,
}


def read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        config = yaml.safe_load(path.read_text())
    except OSError as error:
        raise SystemExit(f"lightning-zero estimate: cannot read --config {str(path)!r}: {error}") from None
    except yaml.YAMLError as error:
        where = " ".join(str(error).strip().splitlines())
        raise SystemExit(f"lightning-zero estimate: --config {str(path)!r} is not valid YAML: {where}") from None
    return config if isinstance(config, dict) else {}


def read_model_section(path: Path) -> tuple[str | None, dict[str, Any]]:
    """``model:`` of a LightningCLI config: ``{class_path, init_args}`` or the init args themselves."""
    model = read_yaml(path).get("model")
    if not isinstance(model, dict):
        raise SystemExit(
            f"lightning-zero estimate: --config {str(path)!r} has no 'model:' section with init args or a class_path."
        )
    if "class_path" in model:
        return model["class_path"], dict(model.get("init_args") or {})
    return None, model


def apply_trainer_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Fill the arguments not given on the command line from --config's ``trainer:`` section: precision, world
    size, accumulation, nodes, and the options of a ``ZeroStrategy`` (a registry string or a class_path with
    init_args); then the defaults. Returns the strategy options taken from the config."""
    trainer = read_yaml(args.config).get("trainer") if args.config is not None else None
    trainer = trainer if isinstance(trainer, dict) else {}
    if args.precision is None:
        args.precision = _precision(trainer) if args.config is not None else "16-mixed"
    if args.accumulate_grad_batches is None:
        configured = trainer.get("accumulate_grad_batches", 1)
        args.accumulate_grad_batches = configured if isinstance(configured, int) and configured > 1 else 1
    nodes = trainer.get("num_nodes", 1)
    if args.num_nodes is None:
        args.num_nodes = nodes if isinstance(nodes, int) and nodes > 0 else 1
    if args.world_size is None:
        devices = trainer.get("devices")
        if not (isinstance(devices, int) and isinstance(nodes, int) and devices > 0 and nodes > 0):
            raise SystemExit(
                "lightning-zero estimate: pass --world-size N (or a --config whose trainer has integer devices)."
            )
        args.world_size = devices * nodes
    configured = _strategy_options(trainer.get("strategy"))
    taken = {"stage": configured["stage"]} if "stage" in configured else {}  # shown: the table has every stage
    for name, default in _STRATEGY_DEFAULTS.items():
        if getattr(args, name) is None:
            if name in configured:
                taken[name] = configured[name]
            value = configured.get(name, default)
            setattr(args, name, "cpu" if value is True and name.startswith("offload") else value)
    return taken


def _precision(trainer: dict[str, Any]) -> str:
    """The precision a Trainer built from this section trains in: ``trainer.precision`` (or a ``ZeroPrecision``
    plugin's), else Lightning's default, 32-true."""
    configured = trainer.get("precision")
    for plugin in trainer.get("plugins") or []:
        if isinstance(plugin, dict) and str(plugin.get("class_path", "")).endswith("ZeroPrecision"):
            configured = (plugin.get("init_args") or {}).get("precision", configured)
    configured = "32-true" if configured is None else str(configured)
    precision = _PRECISION_ALIASES.get(configured, configured)
    if precision not in PRECISIONS:
        raise SystemExit(
            f"lightning-zero estimate: --config's precision {configured!r} is not one the estimate knows "
            f"({', '.join(PRECISIONS)}): pass --precision."
        )
    return precision


def _strategy_options(strategy: Any) -> dict[str, Any]:
    """The estimate's options in a trainer's ``strategy:``: a registry string's preset, or a ZeroStrategy's
    init_args (and its stage); nothing for another strategy."""
    if isinstance(strategy, str):
        options = PRESETS[strategy][0] if strategy in PRESETS else {}
    elif isinstance(strategy, dict) and str(strategy.get("class_path", "")).rpartition(".")[2] == "ZeroStrategy":
        options = strategy.get("init_args") or {}
        _check_init_args(options)
    else:
        options = {}
    return {name: value for name, value in options.items() if name in _STRATEGY_DEFAULTS or name == "stage"}


def _check_init_args(options: dict[str, Any]) -> None:
    """As LightningCLI and the strategy would: an option ZeroStrategy does not take, or values it refuses, end the
    command (the estimate would describe a run that cannot start)."""
    import inspect

    from lightning_zero.strategy import ZeroStrategy

    accepted = set(inspect.signature(ZeroStrategy.__init__).parameters) - {"self"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise SystemExit(
            f"lightning-zero estimate: --config's ZeroStrategy has no option {unknown[0]!r} (LightningCLI refuses it "
            f"too); its options: {', '.join(sorted(accepted))}."
        )
    as_read = {name: "cpu" if v is True and name.startswith("offload") else v for name, v in options.items()}
    as_read["nvme_path"] = "/"  # the estimate needs no swap directory
    try:
        ZeroStrategy(**_as_lightning_cli_types(ZeroStrategy, as_read))
    except (ValueError, TypeError, ArgumentError) as error:
        raise SystemExit(f"lightning-zero estimate: --config's ZeroStrategy refuses its options: {error}") from None


def _as_lightning_cli_types(cls: type, init_args: dict[str, Any]) -> dict[str, Any]:
    """``init_args`` converted to the types of ``cls``'s signature, as LightningCLI's jsonargparse converts them
    (``timeout: "0:05:00"`` becomes a ``timedelta``)."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "init")
    return parser.parse_object({"init": init_args}).init.as_dict()
