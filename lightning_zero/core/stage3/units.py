"""Stage 3: parameters sharded at rest, gathered per unit just before use and freed right after.

[Note: stage-3 gather units]
A unit is a module whose parameters are gathered together: the modules chosen by ``wrap_policy`` (a
set of module classes or a ``callable(module) -> bool``) plus the root for everything else. With no
policy, the outermost modules whose class occurs at least twice and that hold parameters become units
(the repeated blocks of a network, e.g. transformer layers). A policy that chooses no module warns, naming the
model's module classes and a class that has the name of a policy class but another module (a ``Block`` defined in
the script that runs is ``__main__.Block``): the model would be one unit. A parameter belongs to the innermost
unit that contains every module using it, so a weight tied across units (an embedding and an output head)
lives once, in their common ancestor, and has one gradient. Units nest: gathering a unit does not
gather the units inside it.

[Note: stage-3 life of a unit]
Forward: a pre-hook gathers the unit; a post-hook frees it again (except the root, whose backward
follows at once, and except during backward, where activation checkpointing recomputes) and hooks the
outputs so that the first gradient flowing into them gathers the unit again for its backward (see
[Note: stage-3 backward plan]). The unit is freed as soon as its backward is over: when the gradients of
its inputs are computed (autograd may hold a view of a weight after the weight's own gradient is done, e.g.
a weight also used detached), or, where its inputs need no gradient, once all its trainable parameters got
theirs; at the end of backward when it holds frozen parameters, or when a ``create_graph`` backward (a
gradient penalty) reached it, whose graph the backward runs through again. The root stays gathered from the
start of a training step to the end of its backward (in Lightning's manual optimization, to the end of the
step). With ``secondary_shard_size`` a unit whose backward will come keeps a slice of its parameters from forward
to backward, which its backward gathers from (see [Note: secondary shards]). Gradients go through the same buckets
as stage 2: one per buffer, reduce-scattered into the shard. Between uses every parameter rests (see [Note: stage-3
parameters at rest]).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_zero.core.comm import Communicator, Work
from lightning_zero.core.layout.flat_buffer import ShardedBuffer, ShardedState
from lightning_zero.core.layout.gather_memory import NO_REUSE, GatherMemory
from lightning_zero.core.layout.resting import engine_access
from lightning_zero.core.options import WrapPolicy
from lightning_zero.core.peak import DETACHED, PeakLedger
from lightning_zero.core.stage3.secondary import SecondaryShards

if TYPE_CHECKING:
    from lightning_zero.core.store.stores import ShardStore


def select_units(root: nn.Module, policy: WrapPolicy) -> list[nn.Module]:
    """The unit modules below ``root``, in registration order. See [Note: stage-3 gather units]."""
    if policy is None:
        return _repeated_blocks(root)
    matches = policy_matcher(policy)
    units = [m for m in root.modules() if m is not root and matches(m)]
    if not units and not matches(root):
        warn_unmatched_policy(root, policy, "wrap_policy", "stage 3 gathers the whole model as one unit")
    return units


def policy_matcher(policy: set[type[nn.Module]] | Callable[[nn.Module], bool]) -> Callable[[nn.Module], bool]:
    """A predicate from a policy: a collection of module classes, or already a ``callable(module) -> bool``."""
    if isinstance(policy, set | frozenset | list | tuple):
        return _class_policy(policy)
    return policy


def warn_unmatched_policy(root: nn.Module, policy: Any, option: str, consequence: str) -> None:
    """Warn that ``policy`` chose no module of ``root``: name it, the model's module classes, and any class that has
    a policy class's name but another module (a ``Block`` defined in the script that runs is ``__main__.Block``, not
    the ``examples.gpt.Block`` the policy names). The text depends on the model only, so every rank warns alike."""
    present = list(dict.fromkeys(type(m) for m in root.modules()))
    wanted = [c for c in policy if isinstance(c, type)] if isinstance(policy, set | frozenset | list | tuple) else []
    shown = ", ".join(_class_name(c) for c in present[:_LISTED])
    more = f" and {len(present) - _LISTED} more" if len(present) > _LISTED else ""
    message = (
        f"{option}={_policy_name(policy)} matches no module of the model ({_class_name(type(root))}), so "
        f"{consequence}. The model's module classes: {shown}{more}."
    )
    for cls in sorted(wanted, key=_class_name):
        twins = [c for c in present if c.__qualname__ == cls.__qualname__ and c is not cls]
        for twin in twins:
            message += f" The model's {_class_name(twin)} has the name of {_class_name(cls)} but is another class "
            message += (
                f"(module {twin.__module__!r}, not {cls.__module__!r}); a class defined in the script that runs "
                "belongs to '__main__'."
                if twin.__module__ != cls.__module__
                else "object (its module was imported twice, e.g. reloaded)."
            )
            message += " Name the class the model is built from, or pass a callable(module) -> bool."
    warnings.warn(message, UserWarning, stacklevel=3)


_LISTED = 12  # module classes named in the warning; a large model lists the rest as a count


def _class_name(cls: type) -> str:
    """``nn.Linear`` for torch's own modules, ``module.Qualname`` otherwise."""
    if getattr(nn, cls.__name__, None) is cls:
        return f"nn.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _policy_name(policy: Any) -> str:
    if isinstance(policy, set | frozenset | list | tuple):
        names = sorted(_class_name(c) if isinstance(c, type) else repr(c) for c in policy)
        return "{" + ", ".join(names) + "}"
    return getattr(policy, "__qualname__", None) or repr(policy)


def _repeated_blocks(root: nn.Module) -> list[nn.Module]:
    """Outermost members of ``nn.ModuleList``/``nn.Sequential`` whose class repeats there and that hold parameters."""
    chosen: list[nn.Module] = []
    for container in root.modules():
        if not isinstance(container, nn.ModuleList | nn.Sequential):
            continue
        members = [m for m in container.children() if any(True for _ in m.parameters())]
        counts = Counter(type(m) for m in members)
        for member in members:
            if counts[type(member)] >= 2 and not any(_contains(parent, member) for parent in chosen):
                chosen.append(member)
    order = {module: index for index, module in enumerate(root.modules())}
    return sorted(chosen, key=order.__getitem__)


def _class_policy(classes: Iterable[type[nn.Module]]) -> Callable[[nn.Module], bool]:
    classes = tuple(classes)
    return lambda module: isinstance(module, classes)


def _contains(parent: nn.Module, module: nn.Module) -> bool:
    return any(m is module for m in parent.modules())


def assign_params(root: nn.Module, units: list[nn.Module]) -> dict[nn.Module, list[nn.Parameter]]:
    """Map each unit (and ``root``) to the parameters it gathers, in registration order."""
    unit_of_module: dict[nn.Module, nn.Module] = {}

    def visit(module: nn.Module, unit: nn.Module) -> None:
        current = module if module in units else unit
        unit_of_module[module] = current
        for child in module.children():
            visit(child, current)

    visit(root, root)
    ancestors = {unit: _unit_ancestors(unit, root, units) for unit in [root, *units]}
    owners: dict[nn.Parameter, nn.Module] = {}
    for module in root.modules():
        for param in module.parameters(recurse=False):
            unit = unit_of_module[module]
            owners[param] = unit if param not in owners else _common_unit(owners[param], unit, ancestors)
    assigned: dict[nn.Module, list[nn.Parameter]] = {unit: [] for unit in [root, *units]}
    for param in dict.fromkeys(root.parameters()):
        assigned[owners[param]].append(param)
    return assigned


def _unit_ancestors(unit: nn.Module, root: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """``unit`` and the units containing it, innermost first, ending with ``root``."""
    chain = [u for u in units if u is not unit and _contains(u, unit)]
    chain.sort(key=lambda u: sum(1 for _ in u.modules()))
    return [unit, *chain, root] if unit is not root else [root]


def _common_unit(a: nn.Module, b: nn.Module, ancestors: dict[nn.Module, list[nn.Module]]) -> nn.Module:
    return next(unit for unit in ancestors[a] if unit in ancestors[b])


@contextmanager
def held_gathered(
    units: list[GatherUnit],
    start: Callable[[GatherUnit], None],
    write_back: bool = False,
    stores: Callable[[], Iterable[ShardStore]] = tuple,
) -> Iterator[None]:
    """Every unit gathered inside the block (``start`` issues each unit's gather, collective), and held there: a
    forward (or backward) run inside frees none of them. With ``write_back`` changes made to the parameters inside
    (e.g. ``load_state_dict``) are kept: written into the shards and the ``stores``' copies."""
    for unit in units:
        start(unit)
    for unit in units:
        unit.wait()
    for unit in units:
        unit.held += 1
    try:
        yield
    finally:
        for unit in units:
            unit.held -= 1
        for buffer in [buffer for unit in units for buffer in unit.buffers]:  # a parameter given new data inside:
            buffer.reattach() if write_back else buffer.restore_param_views()  # kept with write_back, else undone
        if write_back:
            for unit in units:
                unit.write_back()
            for store in stores():
                store.sync_from_params()
        for unit in units:
            unit.reshard()
            unit.drop_secondary()  # written back: slices cut before would be stale


class GatherUnit:
    """The flat buffers of one unit and their gather and free. See [Note: stage-3 life of a unit]."""

    ledger: PeakLedger = DETACHED  # counts the gathered buffers (see [Note: step peak ledger])

    def __init__(self, module: nn.Module, name: str, buffers: list[ShardedBuffer], is_root: bool) -> None:
        self.module = module
        self.name = name  # the module's qualified name, for errors ("<root>" for the root)
        self.buffers = buffers
        self.is_root = is_root
        self.holds_frozen = any(not p.requires_grad for b in buffers for p in b.params)
        self._pending: list[Work | None] = []  # gathers started and not waited for, one per buffer
        self._handles: list[RemovableHandle] = []
        # With secondary_shard_size: the slices kept from forward to backward (see [Note: secondary shards]).
        self.secondary: SecondaryShards | None = None
        self._from_secondary = False  # the pending gathers read the secondary slices: drop them once complete
        self.held = 0  # gathered() blocks holding the unit in full: reshard() frees nothing until the last ends
        self.memory = NO_REUSE  # where freed buffers keep memory for the next gather (see use_memory)

    def use_memory(self, memory: GatherMemory) -> None:
        """Freed buffers keep their memory in ``memory`` for the next gather (the scheduler's: see [Note: reusing
        gathered storage])."""
        self.memory = memory
        for buffer in self.buffers:
            buffer.gather_memory = memory

    def replace_buffer(self, buffer: ShardedBuffer, pieces: list[ShardedBuffer]) -> None:
        """``pieces`` take ``buffer``'s place (a frozen buffer split by ``requires_grad``, see [Note: changes after
        setup])."""
        index = self.buffers.index(buffer)
        self.buffers[index : index + 1] = pieces
        self.use_memory(self.memory)
        self.holds_frozen = any(not p.requires_grad for b in self.buffers for p in b.params)

    def register_hooks(self, pre_forward: Callable[..., Any], post_forward: Callable[..., Any]) -> None:
        """Call the scheduler around the module's forward (again, after :meth:`remove_hooks`)."""
        if not self._handles:
            self._handles = [
                self.module.register_forward_pre_hook(UnitHook(pre_forward)),
                self.module.register_forward_hook(UnitHook(post_forward)),
            ]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def state(self) -> ShardedState:
        return self.buffers[0].state if self.buffers else ShardedState.SHARDED

    @property
    def gathered_or_pending(self) -> bool:
        return bool(self._pending) or self.state is ShardedState.GATHERED

    def start_unshard(self, comm: Communicator, quantized: bool = False) -> None:
        """Start gathering without waiting (as int8 with ``quantized``, see [Note: quantized gathers never reach the
        shard]); a no-op when gathered or already started."""
        if not self.gathered_or_pending:
            with engine_access():
                self._pending = [
                    buffer.start_unshard(comm, quantized, f"unit {self.name!r} buffer {index} ({buffer.data.dtype})")
                    for index, buffer in enumerate(self.buffers)
                ]
            self._count()

    def start_backward_unshard(self, comm: Communicator, quantized: bool = False) -> None:
        """:meth:`start_unshard` for backward: from the secondary slices where they are kept, inside the secondary
        group (see [Note: secondary shards]), else as :meth:`start_unshard` with ``quantized``."""
        if not self.holds_secondary or self.gathered_or_pending:
            self.start_unshard(comm, quantized)
            return
        assert self.secondary is not None
        with engine_access():
            self._pending = self.secondary.start_gather(self.buffers)  # type: ignore[arg-type]
        self._from_secondary = True
        self._count()

    @property
    def holds_secondary(self) -> bool:
        return self.secondary is not None and self.secondary.held

    def keep_secondary(self) -> None:
        """Keep this rank's secondary slices of the gathered buffers (after forward, before :meth:`reshard`)."""
        if self.secondary is not None and self.buffers:
            self.secondary.keep(self.buffers)  # type: ignore[arg-type]
            self._count()

    def drop_secondary(self) -> None:
        """Free the secondary slices (a backward's plan is over or forgotten); a gather reading them completes first."""
        if self.holds_secondary:
            self.wait()
            assert self.secondary is not None
            self.secondary.drop()
            self._count()

    @property
    def quantized(self) -> bool:
        """Some buffer holds values of a quantized gather (started or done)."""
        return any(buffer.quantized for buffer in self.buffers)

    def start_exact(self, comm: Communicator) -> None:
        """Start gathering exactly: a unit gathered quantized is gathered again, into the same storage (the views
        autograd saved keep theirs); otherwise as :meth:`start_unshard`."""
        if self.quantized:
            self.wait()
            with engine_access():
                self._pending = [buffer.start_unshard(comm) for buffer in self.buffers]
            return
        self.start_unshard(comm)

    def read_ahead(self) -> None:
        """Start reading shards that rest on disk (``offload_params="nvme"``): the unit is gathered next."""
        for buffer in self.buffers:
            buffer.read_ahead()

    def unshard(self, comm: Communicator) -> None:
        """Make the parameters usable: finish a started gather, or gather now."""
        self.start_unshard(comm)
        self.wait()

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        for work in pending:
            if work is not None:
                work.wait()
        if self._from_secondary:  # the backward's gather read them: they are spent
            self._from_secondary = False
            self.drop_secondary()

    def write_back(self) -> None:
        for buffer in self.buffers:
            if buffer.state is ShardedState.GATHERED:
                buffer.write_back()

    def reshard(self, keep: bool = False) -> None:
        """Free the full buffers; ``keep``: another gather follows soon (see [Note: reusing gathered storage])."""
        if self.held:  # inside gathered(): a forward or backward run there leaves the unit full
            return
        self.wait()  # never free a buffer that a gather still writes into
        for buffer in self.buffers:
            buffer.reshard(keep)
        self._count()

    def _count(self) -> None:
        """Tell the ledger the bytes of full buffers this unit holds now."""
        for buffer in self.buffers:
            self.ledger.hold("gathered", (id(buffer), "gathered"), buffer.data.untyped_storage().nbytes())
        if self.buffers:  # memory a reshard kept, counted once the buffers' bytes are dropped
            self.memory.count()
        if self.secondary is not None:
            self.ledger.hold("secondary", (id(self), "secondary"), self.secondary.nbytes)


class UnitHook:
    """A module hook that ``copy.deepcopy`` and pickling turn into a no-op: a copy of a gathered module is a plain
    module (see [Note: stage-3 parameters at rest]), not a second handle on this engine's units. Dynamo never traces
    it: a compiled call of the module runs it eagerly (see [Note: compiled forwards of resting parameters])."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    @torch.compiler.disable  # see [Note: compiled forwards of resting parameters]
    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return inert_hook

    def __reduce__(self) -> tuple[Any, tuple]:
        return inert_hook_factory, ()


def inert_hook(*args: Any) -> None:
    """What a copied module keeps of a unit's hooks: nothing."""


def inert_hook_factory() -> Callable[..., None]:
    return inert_hook
