"""Which leaf tensors (parameters) a backward pass can reach: a walk of the autograd graph from its roots.

[Note: units a backward passes over]
At stage 3 a rank's backward issues the plan's gathers in order (see [Note: stage-3 backward plan]). When its graph
skips units (a loss that reaches only the first blocks, a head used on some ranks only), it issues their gathers
on the way to the unit it needs, then waits for that unit's gather, which a rank whose graph does reach the skipped
units issues only later. That rank may meanwhile wait for a gradient reduction (at most two are in flight, to
bound staging memory) that the skipping rank would launch only at the end of its backward: each would wait for the
other. So when a backward passes over units, the engine walks the graph once from the backward's roots (the loss
given to ``ZeroEngine.scale_loss``) and marks every parameter of those units that the graph does not reach as done
for this pass (it gets no gradient here, as a parameter no hook fires for at the end of backward): their buckets
are complete and launch in order, as the other rank expects. The walk visits each graph node once (a few
milliseconds for a GPT graph) and runs only in a backward that passes over units. A reentrant checkpoint's node
reaches its module's parameters through a graph of its own, built inside backward (see [Note: reentrant activation
checkpointing at stage 3]).
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import Any

from lightning_zero.core.stage3.reentrant import checkpointed_module


class _EveryLeaf(Container[int]):
    """What a graph reaches where that cannot be told: every leaf."""

    def __contains__(self, item: object) -> bool:
        return True


def reached_leaves(roots: Iterable[Any]) -> Container[int]:
    """The ``id`` of every leaf tensor whose gradient accumulator the autograd graph from ``roots`` (``grad_fn``
    nodes) reaches; every ``id`` where that cannot be told (a reentrant checkpoint of a function that is no
    module's)."""
    stack = [node for node in roots if node is not None]
    visited: list[Any] = []  # keeps every node alive while ids are compared
    seen: set[int] = set()
    leaves: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        visited.append(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf it accumulates into
        if variable is not None:
            leaves.add(id(variable))
        if hasattr(node, "run_function"):  # a reentrant checkpoint: its backward recomputes a graph of its own
            module = checkpointed_module(node)
            if module is None:
                return _EveryLeaf()
            leaves.update(id(p) for p in module.parameters())
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return leaves
