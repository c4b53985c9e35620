"""Stage 3 at rest: a parameter outside its unit's forward/backward refuses to be read, naming gathered_params.

After ``trainer.fit`` (TwoLayer, every Linear a gather unit) and between steps (``ProbeBetweenSteps``, a TiedLM, in
``on_train_batch_end``), ``print(p)``, ``p.sum()``, ``p.clone()``, ``copy.deepcopy(model)`` and ``model.state_dict()``
through ``torch.save``/``torch.load`` must raise a ``RuntimeError`` that names the parameter and
``gathered_params`` (they used to segfault or write unloadable files), while shape, dtype, numel, ``is_shared()``
and the other metadata queries still answer. Inside ``trainer.strategy.gathered_params()`` the same operations give
the full values: those of stage 2 (same precision) and, in fp32, of DDP; the deep copy is a plain module that runs in
this (the pytest) process, which has no process group. At stages 1 and 2 every operation simply works, at rest too.

Each operation runs in a forked child of the rank (``lifecycle_models.probe``), so one that crashes fails only its
own assertion. One spawn of 2 ranks runs every case.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tests.helpers import run_on_ranks
from tests.lightning.lifecycle_models import (
    ProbeBetweenSteps,
    full_params,
    make_strategy,
    metadata_of,
    regression_data,
    regression_loader,
    tokens_loader,
    value_probes,
)
from tests.lightning.models import TiedLM, TwoLayer, make_trainer, max_rel_diff, result_of, state_of

WORLD_SIZE = 2
STEPS = 4
PROBE_STEP = 2
RTOL = 1e-5
PRECISIONS = ("32-true", "bf16-mixed")
STRATEGIES = ("ddp", 1, 2, 3)
WHEN = ("after_fit", "between_steps")
OPERATIONS = ("print", "sum", "clone", "deepcopy", "state_dict_save_load")
# The parameter each "when" reads; an error about the whole module may name any parameter of its model.
PARAM = {"after_fit": "b.weight", "between_steps": "up.weight"}
MODEL = {"after_fit": TwoLayer, "between_steps": TiedLM}
CASES = [
    {"when": when, "strategy": strategy, "precision": precision}
    for when in WHEN
    for precision in PRECISIONS
    for strategy in STRATEGIES
    if not (strategy == "ddp" and precision != "32-true")
]
INPUT = regression_data(5, seed=7)[0]


def _run_case(world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    stage3 = {"wrap_policy": {nn.Linear}} if case["strategy"] == 3 else {}
    trainer = make_trainer(
        world_size, make_strategy(case["strategy"], **stage3), max_steps=STEPS, precision=case["precision"]
    )
    if case["when"] == "between_steps":
        model = ProbeBetweenSteps(PROBE_STEP)
        trainer.fit(model, tokens_loader(32))
        return model.record
    module = TwoLayer()
    trainer.fit(module, regression_loader(32))
    name = PARAM["after_fit"]
    record: dict[str, Any] = {"metadata": metadata_of(module.get_parameter(name))}
    record["at_rest"] = value_probes(module, name)
    with full_params(trainer):
        record["gathered"] = value_probes(module, name)
        record["state"] = state_of(module)
        with torch.no_grad():  # outside autocast: the input in the parameters' dtype
            record["output"] = module(INPUT.to(module.a.weight.dtype))
        try:  # a forward inside the block leaves the module gathered
            record["after_forward"] = state_of(module)
        except RuntimeError as error:
            record["after_forward"] = f"raised: {error}"
    return record


def _run_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for case in cases:
        try:
            results.append(_run_case(world_size, case))
        except Exception:
            results.append({"error": f"rank {rank}, case {case}:\n{traceback.format_exc()}"})
    return results


@pytest.fixture(scope="module")
def outcomes() -> dict[tuple[str, Any, str], list[dict[str, Any]]]:
    """``outcomes[(when, strategy, precision)]``: every rank's record."""
    per_rank = run_on_ranks(_run_cases, WORLD_SIZE, CASES, init_group=False)
    return {
        (case["when"], case["strategy"], case["precision"]): [result_of(results[index]) for results in per_rank]
        for index, case in enumerate(CASES)
    }


def _value(probed: dict[str, Any], what: str) -> Any:
    """The operation's value, or a test failure that says how it failed."""
    assert "ok" in probed, f"{what}: expected a value, got {probed}"
    return probed["ok"]


def _assert_close(expected: dict[str, Tensor], actual: dict[str, Tensor], what: str, rtol: float = RTOL) -> None:
    diffs = max_rel_diff(expected, actual)
    bad = {key: diff for key, diff in diffs.items() if not diff <= rtol}
    assert not bad, f"{what}: relative differences {bad}"


def _assert_values(probes: dict[str, Any], reference: dict[str, Tensor], name: str, what: str) -> None:
    """Every operation gave the values of ``reference`` (a full state dict)."""
    printed = _value(probes["print"], f"{what}: print(p)")
    assert printed.startswith("Parameter containing:"), f"{what}: print(p) gave {printed!r}"
    assert "tensor(" in printed, f"{what}: print(p) gave {printed!r}"
    expected = reference[name].double()
    total = _value(probes["sum"], f"{what}: p.sum()")
    rtol = RTOL if total.dtype == torch.float32 else 1e-2  # a bf16 sum is rounded to bf16
    assert abs(total.double() - expected.sum()) <= rtol * expected.abs().sum(), f"{what}: p.sum() {total}"
    _assert_close({name: reference[name]}, {name: _value(probes["clone"], f"{what}: p.clone()")}, f"{what}: p.clone()")
    copied = _value(probes["deepcopy"], f"{what}: copy.deepcopy(model)")
    _assert_close(reference, state_of(copied), f"{what}: copy.deepcopy(model)")
    loaded = _value(probes["state_dict_save_load"], f"{what}: state_dict through torch.save/torch.load")
    _assert_close(reference, loaded, f"{what}: state_dict through torch.save/torch.load")


def _reference(outcomes: dict, when: str, precision: str) -> list[dict[str, Tensor]]:
    """The full values stage 3 must give: DDP's in fp32, stage 2's in bf16-mixed (DDP keeps fp32 parameters)."""
    oracle = "ddp" if precision == "32-true" else 2
    return [record["state"] for record in outcomes[(when, oracle, precision)]]


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("operation", OPERATIONS)
def test_stage3_reading_a_parameter_at_rest_raises_naming_it_and_gathered_params(
    outcomes: dict, when: str, precision: str, operation: str
) -> None:
    """Outside gathered_params a stage-3 parameter holds no values: reading them is a clear error, not a crash."""
    name = PARAM[when]
    names = [name] if operation in ("print", "sum", "clone") else [n for n, _ in MODEL[when]().named_parameters()]
    for rank, record in enumerate(outcomes[(when, 3, precision)]):
        probed = record["at_rest"][operation]
        assert "error" in probed, f"rank {rank}: {operation} at rest should raise, got {probed}"
        error = probed["error"]
        assert error["runtime_error"], f"rank {rank}: {operation}: expected a RuntimeError, got {error}"
        assert "gathered_params" in error["message"], f"rank {rank}: {operation}: {error['message']}"
        assert any(n in error["message"] for n in names), (
            f"rank {rank}: {operation}: the error should name the parameter ({' or '.join(names)}): {error['message']}"
        )


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_stage3_metadata_queries_work_at_rest(outcomes: dict, when: str, precision: str) -> None:
    """Shape, numel, dtype, device, requires_grad, ``is_shared()`` (Lightning's spawn launcher asks it),
    ``is_pinned()``, strides and the other queries that need no values (``metadata_of``) answer at rest as stage
    2's parameter does."""
    expected = outcomes[(when, 2, precision)][0]["metadata"]
    assert expected["numel"] > 0
    raised = {query: answer for query, answer in expected.items() if str(answer).startswith("raised")}
    assert not raised, f"stage 2: {raised}"
    for rank, record in enumerate(outcomes[(when, 3, precision)]):
        differ = {q: (a, expected[q]) for q, a in record["metadata"].items() if a != expected[q]}
        assert not differ, f"rank {rank}: (stage 3 at rest, stage 2) answers differ: {differ}"


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_stage3_gathered_params_gives_the_full_values(outcomes: dict, when: str, precision: str) -> None:
    """Inside gathered_params every operation reads the trained values (DDP's in fp32, stage 2's in bf16-mixed)."""
    name = PARAM[when]
    references = _reference(outcomes, when, precision)
    for rank, (record, reference) in enumerate(zip(outcomes[(when, 3, precision)], references, strict=True)):
        _assert_close(reference, record["state"], f"rank {rank}: state_dict in gathered_params")
        _assert_values(record["gathered"], reference, name, f"rank {rank}, in gathered_params")


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_forward_inside_gathered_params_keeps_the_values(
    outcomes: dict, when: str, precision: str, strategy: Any
) -> None:
    """Running the module inside gathered_params (an evaluation, a generation) does not free its units: the values
    are still there to read after it (stage 3 used to free each unit at the end of its forward, so a read after
    the forward raised the at-rest error, inside the block that should prevent it)."""
    if strategy == "ddp" and precision != "32-true":
        return
    for rank, record in enumerate(outcomes[(when, strategy, precision)]):
        assert not isinstance(record["after_forward"], str), f"rank {rank}: {record['after_forward']}"
        assert max(max_rel_diff(record["state"], record["after_forward"]).values()) == 0.0, f"rank {rank}"


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_stage3_deepcopy_in_gathered_params_is_a_plain_module(outcomes: dict, when: str, precision: str) -> None:
    """The copy made inside gathered_params holds ordinary nn.Parameters with the full values, and runs here, in a
    process without a process group (no collectives, no hooks that free it), as often as asked."""
    for rank, record in enumerate(outcomes[(when, 3, precision)]):
        copied = _value(record["gathered"]["deepcopy"], f"rank {rank}: copy.deepcopy(model) in gathered_params")
        kinds = {name: type(p).__name__ for name, p in copied.named_parameters() if type(p) is not nn.Parameter}
        assert not kinds, f"rank {rank}: parameters of the copy that are not nn.Parameter: {kinds}"
        assert max(max_rel_diff(record["state"], state_of(copied)).values()) == 0.0, f"rank {rank}"
        if when == "after_fit":
            inputs, expected = INPUT, record["output"]
        else:  # the same model, made here from the gathered values
            inputs = torch.randint(0, TiedLM.VOCAB, (3, 5), generator=torch.Generator().manual_seed(3))
            fresh = TiedLM().to(copied.embed.weight.dtype)
            fresh.load_state_dict(record["state"])
            expected = fresh(inputs).detach()
        inputs = inputs if inputs.dtype == torch.long else inputs.to(expected.dtype)
        rtol = RTOL if precision == "32-true" else 1e-2
        for call in range(2):
            with torch.no_grad():
                got = copied(inputs)
            _assert_close({"out": expected}, {"out": got}, f"rank {rank}: forward {call + 1} of the copy", rtol)
        copied(inputs).float().pow(2).sum().backward()
        assert all(p.grad is not None for p in copied.parameters()), f"rank {rank}: backward of the copy"


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_2_read_at_rest_the_values_of_ddp(outcomes: dict, when: str, stage: int) -> None:
    """Stages 1 and 2 keep full parameters: every operation works, at rest and in gathered_params, with DDP's values."""
    name = PARAM[when]
    references = _reference(outcomes, when, "32-true")
    for rank, (record, reference) in enumerate(zip(outcomes[(when, stage, "32-true")], references, strict=True)):
        _assert_close(reference, record["state"], f"rank {rank}: state_dict")
        _assert_values(record["at_rest"], reference, name, f"rank {rank}, at rest")
        _assert_values(record["gathered"], reference, name, f"rank {rank}, in gathered_params")


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_2_bf16_mixed_read_at_rest_the_values_held(outcomes: dict, when: str, stage: int) -> None:
    """In bf16-mixed the operations at rest give the bf16 parameters the module holds, as in gathered_params."""
    name = PARAM[when]
    for rank, record in enumerate(outcomes[(when, stage, "bf16-mixed")]):
        assert record["state"][name].dtype == torch.bfloat16, f"rank {rank}: {record['state'][name].dtype}"
        _assert_values(record["at_rest"], record["state"], name, f"rank {rank}, at rest")


def test_the_oracles_trained(outcomes: dict) -> None:
    """The compared values are trained ones, not the initial weights that every run starts from."""
    for when in WHEN:
        trained = outcomes[(when, "ddp", "32-true")][0]["state"]
        assert max(max_rel_diff(state_of(MODEL[when]()), trained).values()) > 1e-3, when
