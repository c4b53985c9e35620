"""Which module created each parameter of a model built on the meta device, so that a tied parameter is initialised
as it would have been on a real device.

[Note: tied parameters created on the meta device]
On a real device a parameter takes its values when its module creates it; tying (``head.weight = emb.weight``)
then shares those values, and the module that gave its own parameter up never writes into the shared one. On the
meta device nothing has values until stage 3 runs the owning modules' ``reset_parameters()`` (see
:func:`~lightning_zero.core.stage3.units.initialise`), and each module sharing the parameter would write its own
initialisation into it, the last one winning: a tied embedding got the output head's ``Linear`` initialisation
instead of the embedding's that DDP and stages 1-2 train from. So while a model is built for stage 3 every
parameter's first registration is recorded (``torch.nn``'s global parameter registration hook), and
``initialise`` keeps the values the creating module gave a shared parameter. A parameter whose creator is not in the
model (made by a module then dropped) keeps the first values a module of the model gave it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

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
