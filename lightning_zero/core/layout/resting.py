"""Stage-3 parameters at rest: shaped like the full tensor, holding no values, and saying so when read.

[Note: stage-3 parameters at rest]
Outside the forward and backward of its unit (and outside ``gathered()``) a stage-3 parameter keeps its
shape, dtype and device, but its storage is freed (see [Note: freeing gathered storage]): reading it would
read freed memory. Each such parameter is therefore made a :class:`RestingParameter`, a subclass of
``nn.Parameter`` (so ``isinstance`` checks, the module's registration, optimizers and hooks see the same
object) whose ``__torch_function__`` lets metadata through (``shape``, ``dtype``, ``requires_grad``,
``grad``, hooks, ``is_shared()`` (Lightning's spawn launcher asks it), ``is_pinned()``, strides, ...: what a
plain tensor answers from its sizes, flags and storage pointer, never a view of its storage) and raises a
``RuntimeError`` naming the parameter and ``gathered_params()`` for anything that would read or write its
elements while it is at rest: ``print``, arithmetic, ``clone``,
``copy.deepcopy``, ``state_dict()`` (which detaches), ``torch.save``. Inside a gather it behaves like any
parameter; ``copy.deepcopy`` of a gathered one is a plain ``nn.Parameter`` with the full values. Comparing
two different parameters with ``torch.equal`` while one rests is answered from what is known without the
values: tensors of different shapes are unequal, a tensor equals itself, and two different parameters are
taken as unequal (the only question callers such as Lightning's ``BaseFinetuning`` ask is whether a
parameter is already in an optimizer). The engine's own accesses run inside :func:`engine_access`.

[Note: compiled forwards of resting parameters]
``torch.compile`` traces ``__torch_function__`` of a tensor subclass into the graph. The check above asks the
storage's size, which dynamo cannot trace: every operation on a parameter broke the graph, so a compiled block ran
its layers eagerly between tiny graphs. While dynamo traces, ``__torch_function__`` is therefore the plain
operation: a compiled forward runs inside its unit's hooks, which gather the parameters first (``UnitHook`` runs
outside any graph, ``torch.compiler.disable``, so a module compiled together with its hooks calls them as they are).
Where dynamo falls back to running a frame eagerly (a graph break inside a loop over the blocks), it would compile
every ``__torch_function__`` frame called from there as a graph of its own, without the check and recompiling for
each operation: that frame is never compiled (``skip_code``), while calls from traced code are still inlined.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch._dynamo.eval_frame
from torch import Tensor, nn
from torch._C import DisableTorchFunctionSubclass
from torch.utils.hooks import RemovableHandle

_ACCESS = threading.local()  # the engine's own reads and writes of resting parameters (engine_access)

# Tensor attributes and methods that only read or set metadata, never the elements.
_METADATA: frozenset[Callable[..., Any]] = frozenset(
    [
        getattr(Tensor, name).__get__
        for name in (
            "shape", "dtype", "device", "layout", "ndim", "requires_grad", "grad", "grad_fn", "is_leaf",
            "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "names", "_version",
            "_base", "itemsize", "nbytes", "is_mps", "is_xpu", "output_nr", "_post_accumulate_grad_hooks",
            "retains_grad", "_backward_hooks", "is_sparse_csr", "is_mkldnn", "is_vulkan", "is_ipu", "is_xla",
            "is_mtia", "is_maia",
        )
        if hasattr(Tensor, name) and hasattr(getattr(Tensor, name), "__get__")
    ]
    + [
        getattr(Tensor, name).__set__
        for name in ("requires_grad", "grad", "_post_accumulate_grad_hooks", "_backward_hooks")
        if hasattr(getattr(Tensor, name, None), "__set__")
    ]
    + [
        getattr(torch, name)  # functional forms, and factories that take only the shape, dtype and device
        for name in (
            "numel", "is_floating_point", "is_complex", "is_conj", "is_neg", "is_same_size", "zeros_like",
            "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
        )
        if hasattr(torch, name)
    ]
    + [
        getattr(Tensor, name)
        for name in (
            "is_pinned", "new_zeros", "new_ones", "new_empty", "new_full", "size", "dim", "numel", "nelement",
            "ndimension", "element_size", "is_floating_point", "is_complex",
            "is_contiguous", "stride", "storage_offset", "untyped_storage", "requires_grad_", "register_hook",
            "register_post_accumulate_grad_hook", "__hash__", "__len__", "get_device", "is_signed",
            "_is_view", "is_inference", "data_ptr", "retain_grad", "is_shared", "is_set_to", "is_same_size",
            "is_conj", "is_neg", "dim_order", "sparse_dim", "dense_dim", "is_distributed", "__dlpack_device__",
        )
        if hasattr(Tensor, name)
    ]
)  # fmt: skip


class RestingParameter(nn.Parameter):
    """A stage-3 parameter. See [Note: stage-3 parameters at rest]."""

    _zero_name: str

    @classmethod
    def adopt(cls, param: nn.Parameter, name: str) -> None:
        """Make ``param`` (the same object) a resting parameter called ``name`` in errors."""
        param.__class__ = cls
        param._zero_name = name

    @staticmethod
    def release(param: nn.Parameter) -> None:
        """Make ``param`` a plain ``nn.Parameter`` again (it holds its full values)."""
        if isinstance(param, RestingParameter):
            param.__class__ = nn.Parameter

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # inlined into a compiled graph: see the note above
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func not in _METADATA and not getattr(_ACCESS, "depth", 0):
            resting = next((a for a in _tensor_args(args, kwargs) if _is_resting(a)), None)
            if resting is not None:
                if func is torch.equal:
                    return _equal_without_values(*args[:2])
                if _is_noop(func, resting, args, kwargs):
                    return None if func is _SET_DATA else resting
                if not _reads_values(func, resting, args, kwargs):
                    with DisableTorchFunctionSubclass():
                        return func(*args, **kwargs)
                raise _resting_error(resting, func)
        with DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __repr__(self) -> str:
        if _is_resting(self):
            raise _resting_error(self, "repr")
        with DisableTorchFunctionSubclass():
            return repr(nn.Parameter(self.data, self.requires_grad))  # as a plain parameter prints

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        if id(self) in memo:
            return memo[id(self)]
        if _is_resting(self):
            raise _resting_error(self, "copy.deepcopy")
        with DisableTorchFunctionSubclass():
            copy = nn.Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = copy
        return copy

    def __reduce_ex__(self, protocol: int) -> Any:
        if _is_resting(self):
            raise _resting_error(self, "pickling (torch.save)")
        with DisableTorchFunctionSubclass():
            return torch._utils._rebuild_parameter, (self.data.clone(), self.requires_grad, {})


# Run eagerly when called from eager code, inlined when called from traced code (see the note above).
torch._dynamo.eval_frame.skip_code(RestingParameter.__torch_function__.__func__.__code__)


def clone_gathered_in_state_dicts(module: nn.Module) -> list[RemovableHandle]:
    """``state_dict()`` taken inside ``gathered()`` holds copies: views of a unit's storage would read freed memory
    once the block ends (a ``state_dict`` is usually kept, e.g. saved afterwards). Outside the block it raises."""
    return [m.register_state_dict_post_hook(_clone_gathered) for m in module.modules() if m._parameters]


def _clone_gathered(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for name, param in module._parameters.items():
        value = state_dict.get(prefix + name)
        if isinstance(param, RestingParameter) and isinstance(value, Tensor) and not isinstance(value, nn.Parameter):
            state_dict[prefix + name] = value.clone()  # keep_vars=True returns the parameters themselves, uncopied


@contextmanager
def engine_access() -> Iterator[None]:
    """The engine reads and writes resting parameters inside (to gather, free, load, swap in a step)."""
    _ACCESS.depth = getattr(_ACCESS, "depth", 0) + 1
    try:
        yield
    finally:
        _ACCESS.depth -= 1


def _is_resting(tensor: Any) -> bool:
    if not isinstance(tensor, RestingParameter):
        return False
    with DisableTorchFunctionSubclass():
        return tensor.untyped_storage().nbytes() == 0 and tensor.numel() > 0


def _tensor_args(args: tuple, kwargs: dict) -> Iterator[Any]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, list | tuple):
            yield from value
        else:
            yield value


_SET_DATA = Tensor.data.__set__
_TARGET_DTYPES = {Tensor.float: torch.float32, Tensor.double: torch.float64, Tensor.half: torch.float16,
                  Tensor.bfloat16: torch.bfloat16}  # fmt: skip


def _is_noop(func: Any, param: Tensor, args: tuple, kwargs: dict) -> bool:
    """Conversions that would return the parameter itself (``module.cpu()`` on the CPU, ``module.float()`` of an
    fp32 module, ``param.data = param``), which need no values: what ``nn.Module._apply`` does to every parameter."""
    with DisableTorchFunctionSubclass():
        if func is _SET_DATA:
            return args[1] is param
        if func is Tensor.cpu:
            return param.device.type == "cpu"
        if func in _TARGET_DTYPES:
            return param.dtype == _TARGET_DTYPES[func]
        if func is Tensor.to and args and args[0] is param:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
            same_device = device is None or torch.device(device) == param.device
            same_dtype = dtype is None or dtype == param.dtype
            return same_device and same_dtype and memory_format in (None, torch.preserve_format)
    return False


def _reads_values(func: Any, param: Tensor, args: tuple, kwargs: dict) -> bool:
    """``p.type()`` (the type's name) and ``p.to("meta")`` (a tensor with p's metadata) read no values."""
    with DisableTorchFunctionSubclass():
        if func is Tensor.type:
            return bool(args[1:] or kwargs)
        if func is Tensor.to and args and args[0] is param:
            device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
            return device is None or torch.device(device).type != "meta"
    return True


def _equal_without_values(a: Tensor, b: Tensor) -> bool:
    """``torch.equal`` where one side rests: see [Note: stage-3 parameters at rest]."""
    return a is b


def _resting_error(param: RestingParameter, what: Any) -> RuntimeError:
    name = getattr(what, "__qualname__", None) or getattr(what, "__name__", None) or str(what)
    return RuntimeError(
        f"parameter {param._zero_name!r} of shape {tuple(param.shape)} is sharded by ZeroStrategy(stage=3) (or "
        f"ZeroFabricStrategy) and holds no values outside the forward and backward of its unit, so {name} cannot "
        "read it. Read or copy the module inside `with trainer.strategy.gathered_params():` (Fabric: "
        "`fabric.strategy.gathered_params()`; entered on every rank; add write_back=True to keep changes), save it "
        "with trainer.save_checkpoint (Fabric: fabric.save), or train with stage 1 or 2. "
        "Inside a forward: a unit's parameters are gathered only around its own module's forward, so code that reads "
        "them without calling that module (nn.MultiheadAttention reads its out_proj's weight) needs the module "
        "that reads them to be the unit: take the owner's class out of wrap_policy, or add the reader's."
    )
