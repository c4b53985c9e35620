"""The forward prefetch's guess: the order in which the last complete pass gathered units (see [Note: stage-3
prefetch])."""

from __future__ import annotations

from lightning_zero.core.stage3.units import GatherUnit


class ForwardOrder:
    """Records the units a forward gathers, in order, and predicts the next pass's from the last complete one."""

    def __init__(self) -> None:
        self._last: list[GatherUnit] = []  # forward gather order of the last complete pass
        self._seen: list[GatherUnit] = []  # this pass's so far
        self._cursor = 0  # where this pass stands in _last

    def forget_pass(self) -> None:
        """A new iteration: this pass's record is dropped (a pass that raised did not complete)."""
        self._seen, self._cursor = [], 0

    def end_pass(self) -> None:
        """A pass is over: its order, if it gathered any unit, is the next pass's guess."""
        if self._seen:
            self._last, self._seen = self._seen, []
        self._cursor = 0

    def gathered(self, unit: GatherUnit) -> tuple[GatherUnit | None, GatherUnit | None]:
        """Record that forward gathered ``unit``; return the units that followed it last time (the next one, to
        gather now, and the one after, to read ahead from disk), or ``None`` where the guess has none."""
        self._seen.append(unit)
        order = self._last
        position = next((i for i in range(self._cursor, len(order)) if order[i] is unit), None)
        if position is None:
            return None, None
        self._cursor = position + 1
        following = order[position + 1 : position + 3]
        return (following[0] if following else None), (following[1] if len(following) > 1 else None)

    def expects_more(self, count: int) -> bool:
        """This pass gathered units and, going by the last one, at least ``count`` more follow."""
        return bool(self._seen) and self._cursor + count <= len(self._last)
