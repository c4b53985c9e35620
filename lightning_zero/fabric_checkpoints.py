"""Fabric's ``fabric.save`` / ``fabric.load`` state dicts in the Trainer strategy's checkpoint format. Imports no
``lightning.pytorch``.

[Note: Fabric checkpoints]
``fabric.save(path, {"model": model, "optimizer": optimizer, "iter_num": n, ...})`` with ``state_dict_type=
"sharded"`` writes the Trainer strategy's sharded directory: the model's shards and every managed optimizer's state
in each rank's file, everything else (and the names under which the state held the model and the optimizers) in
rank 0's ``lightning.pt``. So a Fabric checkpoint resumes a ``Trainer`` (its ``state_dict`` and
``optimizer_states``) and a Trainer's resumes Fabric: ``fabric.load(path, state)`` fills the module and the
optimizers of ``state`` from the shards whatever names they have, restores the other entries of ``state`` that the
checkpoint holds and returns the rest; ``fabric.load(path)`` without a state reads it in full, as it was saved (the
model's and the optimizers' state dicts under their names). A Trainer resuming a Fabric checkpoint starts its loops
and schedulers fresh, with a warning (see ``_resume_fabric_checkpoint`` in strategy.py). With
``state_dict_type="full"`` rank 0 writes one ordinary file whose model and optimizer entries are full state dicts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import lightning.fabric as lf
from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer

from lightning_zero.checkpoint import full_checkpoint
from lightning_zero.session import FABRIC_KEYS, SHARDED_KEY, ZeroSession

# Entries of a checkpoint dict that are the shards or the reader, never handed back to the caller.
_OWN_KEYS = ("state_dict", "optimizer_states", SHARDED_KEY, FABRIC_KEYS)
# Written by fabric.save only for a Trainer that resumes the checkpoint: not handed back to Fabric either.
_VERSION_KEY = "pytorch-lightning_version"
# The precision's state (the fp16 loss scale), under the key the Trainer saves ZeroPrecision's: its class's name.
PRECISION_KEY = "ZeroPrecision"


def sharded_checkpoint(session: ZeroSession, module: nn.Module | None, state: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint dict ``session.save_sharded`` writes for ``fabric.save(path, state)``: the model's and the
    optimizers' entries become its shards, the others (Stateful ones by their ``state_dict()``) its extra state."""
    module_keys = [key for key, obj in state.items() if obj is module]
    optimizer_keys = [key for key, obj in state.items() if isinstance(obj, Optimizer)]
    checkpoint = {
        key: obj.state_dict() if isinstance(obj, _Stateful) else obj
        for key, obj in state.items()
        if key not in module_keys + optimizer_keys
    }
    # The key of each of the engine's optimizers, in the order of its state in the checkpoint (None: not in
    # `state`), for fabric.load(path) without a state.
    by_engine = [next((k for k in optimizer_keys if state[k] is o), None) for o in session.engine.optimizers]
    checkpoint[FABRIC_KEYS] = {"module": module_keys, "optimizers": optimizer_keys, "by_engine": by_engine}
    checkpoint[_VERSION_KEY] = lf.__version__  # a Trainer resuming it checks the version
    checkpoint["state_dict"] = session.module_state_dict(module, keep=False) if module is not None else {}
    checkpoint["optimizer_states"] = [{} for _ in session.engine.optimizers]
    return checkpoint


def load_sharded(
    session: ZeroSession, path: str | os.PathLike, state: dict[str, Any], strict: bool, module: nn.Module | None
) -> dict[str, Any]:
    """``fabric.load(path, state)`` of a sharded directory (a Fabric's or a Trainer's): the sharded ``module`` and
    the optimizers of ``state`` from the shards, its other entries (other modules too) from the extra state; returns
    what ``state`` did not ask for."""
    checkpoint = session.open_sharded(path)
    if not state:
        return _as_saved(full_checkpoint(checkpoint[SHARDED_KEY]))
    own = (*_OWN_KEYS, _VERSION_KEY) if FABRIC_KEYS in checkpoint else _OWN_KEYS
    modules = [key for key, obj in state.items() if isinstance(obj, nn.Module) and is_sharded(obj, module)]
    optimizers = [key for key, obj in state.items() if isinstance(obj, Optimizer)]
    held = set(checkpoint) - set(own) | set(modules) | set(optimizers)
    _validate_keys_for_strict_loading(state.keys(), held, strict=strict)
    for key in modules:
        session.load_module_state_dict(state[key], checkpoint, strict)
    if optimizers:
        session.load_optimizer_states(_in_saved_order(session, checkpoint, state, optimizers), checkpoint, strict)
    for key, obj in list(state.items()):
        if key in modules or key in optimizers or key not in checkpoint:
            continue
        if isinstance(obj, _Stateful):
            obj.load_state_dict(checkpoint.pop(key))
        else:
            state[key] = checkpoint.pop(key)
    return {k: v for k, v in checkpoint.items() if k not in own}


def load_full(
    session: ZeroSession, checkpoint: dict[str, Any], state: dict[str, Any], strict: bool, module: nn.Module | None
) -> dict[str, Any]:
    """``fabric.load(path, state)`` of one ordinary file (``checkpoint``, read on every rank): full state dicts into
    the sharded ``module`` (collective), other modules and the managed optimizers' shards; returns what ``state``
    did not ask for."""
    if not state:
        return checkpoint
    _validate_keys_for_strict_loading(state.keys(), checkpoint.keys(), strict=strict)
    for key, obj in list(state.items()):
        if key not in checkpoint:
            continue
        saved = checkpoint.pop(key)
        if isinstance(obj, nn.Module) and is_sharded(obj, module):
            session.load_module_state_dict(obj, {"state_dict": saved}, strict)
        elif isinstance(obj, nn.Module):
            obj.load_state_dict(saved, strict=strict)
        elif isinstance(obj, Optimizer) and session.sharded and session.engine.model.manages(obj):
            session.engine.load_full_optimizer_state_dict(obj, saved)
        elif isinstance(obj, _Stateful):
            obj.load_state_dict(saved)
        else:
            state[key] = saved
    return checkpoint


def _in_saved_order(
    session: ZeroSession, checkpoint: dict[str, Any], state: dict[str, Any], keys: list[str]
) -> list[Optimizer]:
    """The optimizers of ``state`` in the checkpoint's order, by their keys (as Fabric's DDP loads each optimizer by
    its key): a run that sets them up in another order resumes them right. Where the keys differ from the saved ones
    (a Trainer's checkpoint), the engine's order (``session.load_optimizer_states`` keeps it too where the list is
    not the engine's optimizers)."""
    saved = (checkpoint.get(FABRIC_KEYS) or {}).get("by_engine")
    if saved is None or sorted(map(str, saved)) != sorted(keys):
        return session.engine.optimizers
    return [state[key] for key in saved]


def is_sharded(obj: nn.Module, module: nn.Module | None) -> bool:
    """``obj`` is the model the strategy shards (before setup, any module is taken for it); another module in a
    checkpoint's state (an EMA copy, a teacher) is an ordinary one, saved and loaded whole as Fabric's DDP does."""
    return module is None or obj is module


def with_precision(state: dict[str, Any], precision: Any) -> dict[str, Any]:
    """``state`` and, with a loss scale, the precision under the key the Trainer saves it under, so a resume goes on
    with the same scale (Fabric saves no precision state of its own)."""
    return {**state, PRECISION_KEY: precision} if precision.state_dict() else state


def restore_precision(remainder: dict[str, Any], precision: Any) -> dict[str, Any]:
    """What a load returns, less the precision's state, which goes back into ``precision``."""
    saved = remainder.pop(PRECISION_KEY, None)
    if saved is not None:
        precision.load_state_dict(saved)
    return remainder


def _as_saved(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A sharded checkpoint read in full (``fabric.load(path)`` without a state): as ``fabric.save`` was given it,
    the model's and each optimizer's state under their names, in full; a Trainer's in Lightning's form."""
    keys = checkpoint.pop(FABRIC_KEYS, None)
    if keys is None:
        return checkpoint
    checkpoint.pop(_VERSION_KEY, None)
    module_state = checkpoint.pop("state_dict")
    out = dict.fromkeys(keys["module"], module_state)
    for key, optimizer_state in zip(keys["by_engine"], checkpoint.pop("optimizer_states", []), strict=False):
        if key is not None:
            out[key] = optimizer_state
    return {**out, **checkpoint}
