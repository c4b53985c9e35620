"""Stage 3's initialisation of a model built on the meta device (``configure_model``, Fabric's ``init_module()``):
buffers, then each unit's parameters by the modules' ``reset_parameters()``, as they would have been on a real device.

[Note: initialising a model built on the meta device]
The engine gives one unit's parameters real storage at a time, then runs, deepest module first, the
``reset_parameters()`` of every module whose subtree holds one of them: the modules that own them (``nn.Linear``'s
own initialisation), and their ancestors that define one (a block or a model that initialises its children, as its
``__init__`` would on a real device after building them: on the meta device that call did nothing). Parameters that
other units hold (already sharded and at rest, or still on the meta device) are replaced by meta tensors while a
reset runs: what it writes into them is dropped, and they get their values when their own unit is created, by the
same resets. So an ancestor's initialisation reaches every parameter, unit by unit; where it draws from torch's
global generator, the draws come in another order than on a real device (the same distribution, not the same
values), as they do for the owners' own resets.

[Note: tied parameters created on the meta device]
On a real device a parameter takes its values when its module creates it; tying (``head.weight = emb.weight``)
then shares those values, and the module that gave its own parameter up never writes into the shared one. On the
meta device nothing has values until stage 3 runs the owning modules' ``reset_parameters()`` (see
:func:`initialise`), and each module sharing the parameter would write its own
initialisation into it, the last one winning: a tied embedding got the output head's ``Linear`` initialisation
instead of the embedding's that DDP and stages 1-2 train from. So while a model is built for stage 3 every
parameter's first registration is recorded (``torch.nn``'s global parameter registration hook), and
``initialise`` keeps the values the creating module gave a shared parameter. A parameter whose creator is not in the
model (made by a module then dropped) keeps the first values a module of the model gave it.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.utils._device import DeviceContext, _device_constructors

# id(parameter) -> (the module that registered it first, under which name). Not a weak mapping of the parameters:
# ``torch.utils.swap_tensors``, by which the engine gives them storage, refuses tensors with weak references. A
# record is current while its module still holds that parameter under that name (an id can be reused).
_CREATORS: dict[int, tuple[weakref.ref[nn.Module], str]] = {}


def _recorded(param: Any) -> nn.Module | None:
    entry = _CREATORS.get(id(param))
    if entry is None:
        return None
    module = entry[0]()
    return module if module is not None and module._parameters.get(entry[1]) is param else None


class _MetaDevice(DeviceContext):
    """``torch.device("meta")``, except for the tensors a torchmetrics ``Metric`` creates while it is built: its states
    are neither parameters nor buffers, so nothing could give them their values later (``reset()`` copies them from
    defaults made on the meta device too); they are made as on a real device, the metric holds no parameter."""

    def __init__(self) -> None:
        super().__init__("meta")

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None and not _building_a_metric():
            kwargs["device"] = self.device
        return func(*args, **kwargs)


def _building_a_metric() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__" and _is_metric(type(frame.f_locals.get("self"))):
            return True
        frame = frame.f_back
    return False


@functools.cache
def _is_metric(cls: type) -> bool:
    return any(c.__name__ == "Metric" and c.__module__.startswith("torchmetrics") for c in cls.__mro__)


@contextmanager
def on_meta_device() -> Iterator[None]:
    """Modules built inside go to the meta device (torchmetrics metrics excepted, see :class:`_MetaDevice`), and the
    creators of their parameters are recorded (see [Note: tied parameters created on the meta device])."""
    with _MetaDevice(), recording_creators():
        yield


@contextmanager
def recording_creators() -> Iterator[None]:
    """Record the module that creates each parameter registered inside the block (see the note)."""
    for key in [key for key, (module, _) in _CREATORS.items() if module() is None]:
        del _CREATORS[key]

    def record(module: nn.Module, name: str, param: Any) -> None:
        if param is not None and _recorded(param) is None:  # called before the module holds it
            _CREATORS[id(param)] = (weakref.ref(module), name)

    handle = register_module_parameter_registration_hook(record)
    try:
        yield
    finally:
        handle.remove()


def creator_of(param: nn.Parameter) -> nn.Module | None:
    """The module that created ``param`` inside :func:`recording_creators`, if one did and still holds it."""
    return _recorded(param)


def materialize_buffers(root: nn.Module, device: torch.device) -> None:
    """Give module buffers created on the meta device real storage, initialised by their ``reset_parameters()``."""
    for module in root.modules():
        meta = [name for name, buffer in module._buffers.items() if buffer is not None and buffer.is_meta]
        if not meta:
            continue
        if _reset_of(module) is None:
            raise RuntimeError(
                f"{type(module).__name__} has buffers {meta} on the meta device (created in configure_model under "
                "ZeroStrategy(stage=3)) but no reset_parameters() to initialise them. Define reset_parameters() or "
                "create the buffers in __init__."
            )
        for name in meta:
            module._buffers[name] = torch.empty_like(module._buffers[name], device=device)


def initialise(root: nn.Module, params: list[nn.Parameter]) -> None:
    """Run the ``reset_parameters()`` of every module whose subtree holds some of ``params`` (just given real storage),
    deepest first (see [Note: initialising a model built on the meta device]). A parameter several modules share
    keeps the values its creator gave it (see [Note: tied parameters created on the meta device])."""
    if not params:
        return
    wanted = set(params)
    in_model = set(root.modules())
    settled: set[nn.Parameter] = set()  # shared parameters whose values are final: later resets must not change them
    for module in _deepest_first_holding(root, wanted):
        owned = [(name, p) for name, p in module.named_parameters(recurse=False) if p in wanted]
        reset = _reset_of(module)
        if not owned:  # an ancestor: its reset_parameters(), if it has one, initialises its children
            if reset is not None:
                with torch.no_grad(), _stand_ins(module, wanted):
                    reset()
            continue
        if reset is None:
            raise RuntimeError(
                f"{type(module).__name__} parameters {[name for name, _ in owned]} were created on the meta device "
                "(configure_model under ZeroStrategy(stage=3)) but the module has no reset_parameters() to initialise "
                "them. Define reset_parameters(), or build the model in __init__."
            )
        with torch.no_grad(), _stand_ins(module, wanted):
            kept = [(p, p.detach().clone()) for _, p in owned if p in settled]
            reset()
            for param, values in kept:
                param.copy_(values)
        for _, param in owned:
            creator = creator_of(param)
            if creator is module or creator not in in_model:
                settled.add(param)


def _reset_of(module: nn.Module) -> Callable[[], None] | None:
    """The module's ``reset_parameters()``, or torch's private ``_reset_parameters()`` (``nn.MultiheadAttention``,
    ``nn.Transformer``: their ``__init__`` calls it)."""
    for name in ("reset_parameters", "_reset_parameters"):
        reset = getattr(module, name, None)
        if callable(reset):
            return reset
    return None


def _deepest_first_holding(root: nn.Module, wanted: set[nn.Parameter]) -> list[nn.Module]:
    """The modules whose subtree holds a parameter of ``wanted``, each after its descendants."""
    order: list[nn.Module] = []
    holding: set[nn.Module] = set()

    def visit(module: nn.Module) -> bool:
        held = any(p in wanted for p in module.parameters(recurse=False))
        for child in module.children():
            held = visit(child) or held
        if held and module not in holding:  # a module reached twice (shared) is listed once
            holding.add(module)
            order.append(module)
        return held

    visit(root)
    return order


@contextmanager
def _stand_ins(module: nn.Module, wanted: set[nn.Parameter]) -> Iterator[None]:
    """Inside, the parameters of ``module``'s subtree that are not in ``wanted`` (held by other units: at rest, or
    still on the meta device) are meta tensors of their shape: a reset writes nothing into them."""
    replaced: list[tuple[nn.Module, str, nn.Parameter]] = []
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None and param not in wanted and not param.is_meta:
                replaced.append((owner, name, param))
    for owner, name, param in replaced:
        owner._parameters[name] = nn.Parameter(
            torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=param.requires_grad
        )
    try:
        yield
    finally:
        for owner, name, param in replaced:
            owner._parameters[name] = param
