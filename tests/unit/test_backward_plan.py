"""The stage-3 backward plan's bookkeeping on its own: entries, what keeps a unit gathered, retained graphs."""

from __future__ import annotations

from typing import Any

from lightning_zero.core.stage3.backward_plan import BackwardPlan


class _Unit:
    """Stands for a GatherUnit: the plan only keys on units."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _recorded(plan: BackwardPlan, *units: Any) -> None:
    for unit in units:
        plan.record(unit)
        plan.inputs_hooked(unit)


def _drain(plan: BackwardPlan) -> list[Any]:
    taken = []
    while plan.pending:
        taken.append(plan.take())
    return taken


def test_entries_come_in_reverse_forward_order_and_keep_their_units_until_taken() -> None:
    a, b, c = _Unit("a"), _Unit("b"), _Unit("c")
    plan = BackwardPlan()
    _recorded(plan, a, b, c, b)  # b runs twice: two entries
    plan.open()
    assert plan.recorded == []
    assert plan.is_open
    assert plan.peek() is b
    assert plan.has_entry(b)
    assert plan.take() is b
    assert plan.has_entry(b), "b's first forward still has an entry"
    assert _drain(plan) == [c, b, a]
    assert not plan.has_entry(b)
    assert plan.keeps(a), "a's inputs have not got their gradients yet"
    assert plan.inputs_done(a), "no entry and no input left: a may be freed"
    assert not plan.inputs_done(b), "b's second forward's inputs are still awaited"
    assert plan.inputs_done(b)


def test_a_pinned_unit_is_kept_until_the_backward_ends() -> None:
    a = _Unit("a")
    plan = BackwardPlan()
    _recorded(plan, a)
    plan.open()
    plan.take()
    plan.pin(a)
    assert not plan.inputs_done(a)
    assert plan.has_entry_or_pin(a)
    plan.close()
    assert not plan.keeps(a)
    assert not plan.is_open


def test_a_retained_backward_records_its_entries_again_until_the_next_forward() -> None:
    a, b, late = _Unit("a"), _Unit("b"), _Unit("late")
    plan = BackwardPlan()
    _recorded(plan, a, b)
    plan.open()
    assert _drain(plan) == [b, a]
    plan.inputs_done(a)
    plan.inputs_done(b)
    _recorded(plan, late)  # a forward after the backward was announced (a closure's second forward)
    plan.close(retain=True)
    assert plan.recorded == [a, b, late], "the retained graph's units first, in forward order"
    assert plan.keeps(a), "its input count is as its forward left it"
    assert plan.keeps(b)
    plan.open()
    assert _drain(plan) == [late, b, a]
    plan.close()
    _recorded(plan, a)
    plan.close(retain=True)
    assert plan.recorded == [a]
    plan.drop_retained()  # a forward begins: the retained entries go
    assert plan.recorded == []
    assert not plan.keeps(a)


def test_forwards_without_backward_are_dropped_only_outside_a_plan() -> None:
    a, b = _Unit("a"), _Unit("b")
    plan = BackwardPlan()
    _recorded(plan, a)
    plan.drop_unplanned()
    assert plan.recorded == []
    _recorded(plan, a)
    plan.open()
    _recorded(plan, b)
    plan.drop_unplanned()
    assert plan.recorded == [b], "a step inside an open backward keeps what its forwards recorded"
    plan.forget()
    assert plan.recorded == []
    assert not plan.is_open
    assert not plan.pending
