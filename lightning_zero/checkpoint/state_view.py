"""The ``checkpoint["state_dict"]`` that checkpoint hooks see when the checkpoint is sharded.

[Note: the state_dict of sharded checkpoint hooks]
Lightning hands the checkpoint dict to ``on_save_checkpoint`` and ``on_load_checkpoint`` (of the LightningModule
and of callbacks), and a hook may read, rename or replace what is under ``"state_dict"``. No rank of a sharded run
holds the full model, so each key's value there is a :class:`LazyTensor`: its shape and dtype are known, its values
are read only when used.

- Load: ``checkpoint["state_dict"]`` has every key of the saved module's ``state_dict`` (tied keys share one
  value). A hook that renames keys (``{k.replace("old.", "new."): v for k, v in sd.items()}``) reads no values:
  each key whose value is still an unread LazyTensor loads that tensor's saved elements, and its optimizer state,
  under the new name, a rename of the checkpoint's metadata only. A value that the hook read (the first use reads
  it, whole, from the shard files), changed in place or replaced is loaded as the hook left it (each rank takes its
  own elements). The keys must then match the model's, as for any sharded load, or the load raises, on every rank,
  naming the first difference.
- Save: each rank writes its own shards, and no rank gathers the model, so the values cannot be read (reading
  one raises, pointing to ``gathered_params`` and to ``state_dict_type="full"``). A hook or callback that renames,
  removes, adds or replaces entries (``ModelPruning(make_pruning_permanent=True)`` and ``WeightAveraging`` replace
  them all) makes the save raise on every rank before anything is written: a sharded checkpoint holds the module's
  own tensors, and ignoring the change would save another model than the hook meant.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

_T = Tensor
# What a LazyTensor answers without its values (on its meta-device stand-in).
_WITHOUT_VALUES = {
    _T.shape.__get__,  # type: ignore[attr-defined]
    _T.dtype.__get__,  # type: ignore[attr-defined]
    _T.ndim.__get__,  # type: ignore[attr-defined]
    _T.requires_grad.__get__,  # type: ignore[attr-defined]
    _T.size,
    _T.dim,
    _T.numel,
    _T.nelement,
    _T.element_size,
    _T.is_floating_point,
    _T.__len__,
}
_DEVICE = _T.device.__get__  # type: ignore[attr-defined]
SAVING = "a sharded save"  # the origin of the values a save's hooks see


class LazyTensor(Tensor):
    """A saved tensor whose values are read when first used (see [Note: the state_dict of sharded checkpoint
    hooks]).

    Shape, dtype, ``size()``, ``dim()`` and ``numel()`` need no values, and the device is the CPU. Any other use
    reads the values once, with ``read()``, and works on them: an in-place change stays in :meth:`value`.

    Attributes:
        saved_name: the tensor's name in the checkpoint.
        origin: the checkpoint it comes from (:data:`SAVING` for a save's).
    """

    saved_name: str
    origin: object
    _read: Callable[[], Tensor]
    _value: Tensor | None

    @staticmethod
    def __new__(
        cls, saved_name: str, shape: list[int], dtype: torch.dtype, read: Callable[[], Tensor], origin: object
    ) -> LazyTensor:
        tensor = Tensor._make_subclass(cls, torch.empty(shape, dtype=dtype, device="meta"))
        tensor.saved_name, tensor.origin, tensor._read, tensor._value = saved_name, origin, read, None
        return tensor

    @property
    def was_read(self) -> bool:
        return self._value is not None

    def value(self) -> Tensor:
        """The values, read on the first call."""
        if self._value is None:
            self._value = self._read()
        return self._value

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func in _WITHOUT_VALUES:
                return func(*args, **kwargs)
            if func == _DEVICE:
                return torch.device("cpu")
            if func is _T.__repr__ and not args[0].was_read:
                lazy = args[0]
                return f"LazyTensor({lazy.saved_name!r}, shape={list(lazy.shape)}, dtype={lazy.dtype}, not read yet)"
            return func(*_values(args), **_values(kwargs))


def _values(obj: Any) -> Any:
    """``obj`` with every LazyTensor in it (in tuples, lists and dicts) replaced by its values."""
    if isinstance(obj, LazyTensor):
        return obj.value()
    if isinstance(obj, tuple | list):
        return type(obj)(_values(item) for item in obj)
    if isinstance(obj, dict):
        return {key: _values(value) for key, value in obj.items()}
    return obj


def values_of(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each LazyTensor's values (tied keys keep sharing one tensor)."""
    return {key: value.value() if isinstance(value, LazyTensor) else value for key, value in state_dict.items()}


def is_unread(value: Any, origin: object, saved_name: str) -> bool:
    """Whether ``value`` is saved tensor ``saved_name`` of ``origin``, values never read."""
    return (
        isinstance(value, LazyTensor)
        and value.origin is origin
        and value.saved_name == saved_name
        and not value.was_read
    )


def saving_state_dict(keys: list[list[str]], specs: Mapping[str, Mapping[str, Any]]) -> dict[str, Tensor]:
    """What a sharded save's hooks see as ``checkpoint["state_dict"]``: every ``[key, tensor name]`` of ``keys``,
    with values that cannot be read (``specs``: per tensor name, its ``shape`` and ``dtype``)."""
    lazy = {}
    for name, spec in specs.items():

        def unreadable(name: str = name) -> Tensor:
            raise RuntimeError(
                f"checkpoint['state_dict'][{name!r}] has no values in a sharded save: each rank saves its own shards "
                "of the model, and none gathers it. Read the module's parameters instead (at stage 3 inside "
                "`with trainer.strategy.gathered_params():`, entered by every rank), or save full checkpoints: "
                "ZeroStrategy(state_dict_type='full')."
            )

        lazy[name] = LazyTensor(name, spec["shape"], getattr(torch, spec["dtype"]), unreadable, SAVING)
    return {key: lazy[name] for key, name in keys}


def saving_changes(state_dict: Any, keys: list[list[str]]) -> str | None:
    """How a save's hooks changed :func:`saving_state_dict`'s ``state_dict`` (``None``: they did not)."""
    if not isinstance(state_dict, Mapping):
        return f"it is a {type(state_dict).__name__}, not the state_dict"
    names = dict(keys)
    changes = {
        "removed": [key for key in names if key not in state_dict],
        "added": [key for key in state_dict if key not in names],
        "replaced": [k for k, n in names.items() if k in state_dict and not is_unread(state_dict[k], SAVING, n)],
    }
    said = [f"{how} {_few(found)}" for how, found in changes.items() if found]
    return "; ".join(said) if said else None


def _few(keys: list[str], shown: int = 3) -> str:
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return ", ".join(repr(key) for key in keys[:shown]) + more
