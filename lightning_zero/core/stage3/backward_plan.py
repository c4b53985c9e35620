"""Stage 3: the bookkeeping of a backward plan: the units forwards recorded, the entries a backward issues, and what
still holds each unit gathered. See [Note: stage-3 backward plan] and [Note: a retained graph] in scheduler.py.

It issues no collective and frees nothing: :class:`Stage3Scheduler` asks it which unit comes next and whether a unit
may be freed, and acts on every rank alike."""

from __future__ import annotations

from collections import Counter

from lightning_zero.core.stage3.units import GatherUnit


class BackwardPlan:
    """The units recorded by forwards since the last plan, the open plan's entries, and per unit what keeps it."""

    def __init__(self) -> None:
        self.recorded: list[GatherUnit] = []  # units whose outputs need backward, in order of forward end
        self.is_open = False  # a backward was announced and has not ended
        self._entries: list[GatherUnit] = []  # the open plan (reversed recorded units)
        self._cursor = 0  # next entry to issue
        self._remaining: Counter[GatherUnit] = Counter()  # entries left per unit
        self._input_hooks: Counter[GatherUnit] = Counter()  # per unit, its forwards whose inputs await gradients
        self._forward_inputs: Counter[GatherUnit] = Counter()  # the same as the forwards left them (retained graphs)
        self._pinned: set[GatherUnit] = set()  # reached by a create_graph backward: stay until the backward ends
        self._retained = False  # recorded holds a retained graph's units
        self.ahead: GatherUnit | None = None  # the entry the backward prefetch issued, not reached yet

    # ------------------------------------------------------------------ forward
    def record(self, unit: GatherUnit) -> None:
        """A forward of ``unit`` that backward needs: an entry of the next plan (a retained graph's are dropped)."""
        self.drop_retained()
        self.recorded.append(unit)

    def inputs_hooked(self, unit: GatherUnit) -> None:
        """A forward of ``unit`` took inputs that need gradients: its backward ends when they get them."""
        self._input_hooks[unit] += 1
        self._forward_inputs[unit] += 1

    def inputs_done(self, unit: GatherUnit) -> bool:
        """The gradients of one forward's inputs were computed; whether ``unit`` may be freed now."""
        self._input_hooks[unit] = max(0, self._input_hooks[unit] - 1)
        return not self.keeps(unit)

    def drop_retained(self) -> None:
        """A forward begins: a retained graph's entries are not kept past it."""
        if self._retained:
            self.recorded, self._retained = [], False
            self._input_hooks, self._forward_inputs = Counter(), Counter()

    def drop_unplanned(self) -> None:
        """A step ended: forwards no backward followed leave no entries behind."""
        if not self.is_open:
            self.recorded = []

    # ------------------------------------------------------------------ backward
    def open(self) -> None:
        """A backward begins: the recorded units, in reverse order, become its entries."""
        self.is_open, self.ahead = True, None
        self._entries.extend(reversed(self.recorded))
        self._remaining.update(self.recorded)
        self.recorded = []

    @property
    def pending(self) -> bool:
        return self._cursor < len(self._entries)

    def peek(self) -> GatherUnit:
        return self._entries[self._cursor]

    def take(self) -> GatherUnit:
        """The next entry, consumed."""
        unit = self._entries[self._cursor]
        self._cursor += 1
        self._remaining[unit] -= 1
        return unit

    def has_entry(self, unit: GatherUnit) -> bool:
        return bool(self._remaining[unit])

    def pin(self, unit: GatherUnit) -> None:
        """A ``create_graph`` backward reached ``unit``: its graph may use it again before the backward ends."""
        self._pinned.add(unit)

    def keeps(self, unit: GatherUnit) -> bool:
        """Something still needs ``unit`` gathered: inputs awaiting gradients, an entry left, a pin, or the prefetch,
        which took its next entry while it was gathered (a unit used again next: inside a reentrant checkpoint and
        outside it) and must find it gathered when the backward reaches it."""
        return bool(self._input_hooks[unit] or self._remaining[unit] or unit in self._pinned or unit is self.ahead)

    def has_entry_or_pin(self, unit: GatherUnit) -> bool:
        return bool(self._remaining[unit]) or unit in self._pinned

    def close(self, retain: bool = False) -> None:
        """The backward ended (or raised). ``retain``: its graph may be used again, so its entries are recorded again
        and its units' input counts restored (see [Note: a retained graph])."""
        retained, inputs = list(reversed(self._entries)), self._forward_inputs
        self.is_open, self.ahead = False, None
        self._entries, self._cursor, self._remaining, self._input_hooks = [], 0, Counter(), Counter()
        self._forward_inputs, self._pinned = Counter(), set()
        if retain:
            self.recorded, self._retained = retained + self.recorded, True
            self._input_hooks, self._forward_inputs = Counter(inputs), Counter(inputs)

    def forget(self) -> None:
        """A new iteration: nothing recorded, nothing open."""
        self.close()
        self.recorded, self._retained = [], False
