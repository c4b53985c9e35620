"""Stage-3 prefetch: start gathering the next unit while the current one computes.

[Note: stage-3 prefetch]
With ``overlap_comm=True`` the engine records the order in which units are gathered for forward in
each pass and, in the next pass, starts the all-gather of the unit that followed the current one
as soon as the current one is gathered; backward walks the same order in reverse. So at most two
units are gathered at a time besides the root: the one computing and the one arriving. The order
is taken from what actually ran (a unit used twice appears twice), and a cursor that only moves
forward (backward: backward) keeps lookups right when the order repeats. When the model takes
another path, a prefetched unit simply waits, gathered, until it is used or the pass ends and
every unit is freed: a wrong guess costs memory for a while, never correctness.
"""

from __future__ import annotations

from typing import Protocol


class _Unit(Protocol):
    def start_unshard(self) -> None: ...


class Prefetcher:
    """Predicts the next unit from the previous pass's gather order and starts its gather early."""

    def __init__(self) -> None:
        self._order: list[_Unit] = []  # forward gather order of the last complete pass
        self._recording: list[_Unit] = []  # this pass's forward gather order so far
        self._forward_cursor = 0
        self._backward_cursor = 0

    def after_forward_gather(self, unit: _Unit) -> None:
        self._recording.append(unit)
        position = self._find(unit, range(self._forward_cursor, len(self._order)))
        if position is None:
            return
        self._forward_cursor = position + 1
        if position + 1 < len(self._order):
            self._order[position + 1].start_unshard()

    def after_backward_gather(self, unit: _Unit) -> None:
        position = self._find(unit, range(self._backward_cursor - 1, -1, -1))
        if position is None:
            return
        self._backward_cursor = position
        if position > 0:
            self._order[position - 1].start_unshard()

    def end_pass(self) -> None:
        """Forward and backward of a step are over: the order just seen predicts the next step."""
        if self._recording:
            self._order, self._recording = self._recording, []
        self._forward_cursor = 0
        self._backward_cursor = len(self._order)

    def _find(self, unit: _Unit, positions: range) -> int | None:
        return next((i for i in positions if self._order[i] is unit), None)
