"""All-pairs case generation: a small set of cases in which every legal pair of values of two factors occurs.

Greedy, deterministic (the same cases on every run and every rank): each new case starts from the factor value pair
that is still uncovered first in the factors' order, then fills the other factors one by one with the value that
covers the most uncovered pairs with the values chosen so far, skipping values that ``allowed`` refuses.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Case = dict[str, Any]


def legal_pairs(
    factors: Mapping[str, Sequence[Any]], allowed: Callable[[Case], bool]
) -> set[tuple[str, Any, str, Any]]:
    """Every pair of values of two factors that some legal case can hold (``allowed`` judges partial cases)."""
    names = list(factors)
    return {
        (a, va, b, vb)
        for a, b in itertools.combinations(names, 2)
        for va in factors[a]
        for vb in factors[b]
        if allowed({a: va, b: vb})
    }


def pairs_of(case: Case) -> set[tuple[str, Any, str, Any]]:
    names = list(case)
    return {(a, case[a], b, case[b]) for a, b in itertools.combinations(names, 2)}


def all_pairs(factors: Mapping[str, Sequence[Any]], allowed: Callable[[Case], bool] = lambda case: True) -> list[Case]:
    """Cases (dicts of every factor) that together hold every legal pair; ``allowed(partial_case)`` must accept a
    case whose factors so far are legal together."""
    names = list(factors)
    uncovered = legal_pairs(factors, allowed)
    ordered = [(a, va, b, vb) for a, b in itertools.combinations(names, 2) for va in factors[a] for vb in factors[b]]
    cases: list[Case] = []
    while uncovered:
        a, va, b, vb = next(pair for pair in ordered if pair in uncovered)
        case: Case = {a: va, b: vb}
        for name in names:
            if name in case:
                continue
            best, best_gain = None, -1
            for value in factors[name]:
                trial = {**case, name: value}
                if not allowed(trial):
                    continue
                gain = sum(
                    (x, case[x], name, value) in uncovered or (name, value, x, case[x]) in uncovered for x in case
                )
                if gain > best_gain:
                    best, best_gain = value, gain
            if best_gain < 0:
                raise ValueError(f"no legal value of {name!r} completes {case}")
            case[name] = best
        ordered_case = {name: case[name] for name in names}
        uncovered -= pairs_of(ordered_case)
        cases.append(ordered_case)
    return cases
