"""Offload against DDP in real gloo runs on 2 and 3 ranks: the optimizer on the CPU (``"cpu"``) or paged from
an unlinked swap file (``"nvme"``) at stages 1-3, stage-3 parameter shards on the host, fp32 and bf16-mixed.

In fp32 every offload mode must equal DDP (relative 1e-5, the tolerance the parity tests calibrate with a
reordered DDP) with accumulation, clipping, tied, frozen and unused parameters; ``"cpu"`` and ``"nvme"`` run the
same maths on the same values (with or without the parameter shards on the host), so they must equal each other
bit for bit. Offload switches Adam/AdamW/SGD/Adagrad to torch's fused CPU kernel, which is the same maths but not
bit-identical to the default foreach kernel (measured here: AdamW, Adam and Adagrad differ in the last bit, SGD
does not), so against the engine without offload only the oracle's tolerance holds. The swap
file's byte counters must equal the formula: Adam with an fp32 master reads and writes 12 bytes per owned
element per step, and the process's own ``/proc/self/io`` agrees.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero.core.comm import Communicator
from lightning_zero.core.store.disk import DiskStore
from tests.distributed import mixed_parity
from tests.distributed.models import TinyLM, batch, loss_fn
from tests.distributed.parity import CASES, STAGES, relative_difference, train_ddp, train_zero
from tests.helpers import run_on_ranks

TOLERANCE = 1e-5
FP32_CASES = (
    "plain",
    "accumulate",
    "clip_norm",
    "clip_value",
    "tied",
    "frozen",
    "unused",
    "unused_on_one_rank",
    "two_groups",
    "sgd_momentum",
    "adagrad",
    "no_zero_grad_between_steps",
)
# On 3 ranks (uneven shards) the cases whose layout or reduction depends on the world size; the optimizers' and
# zero_grad's cases run on 2 ranks only, where they test the same code.
THREE_RANK_CASES = ("plain", "accumulate", "clip_norm", "tied", "frozen", "unused_on_one_rank")
CASES_ON = {2: FP32_CASES, 3: THREE_RANK_CASES}
MIXED_CASES = ("plain", "accumulate", "clip_norm", "frozen", "two_groups")
MODES = {
    "cpu": {"offload_optimizer": "cpu"},
    "nvme": {"offload_optimizer": "nvme"},
    "cpu+params": {"offload_optimizer": "cpu", "offload_params": "cpu"},
    "nvme+params": {"offload_optimizer": "nvme", "offload_params": "cpu"},
    "nvme+nvmeparams": {"offload_optimizer": "nvme", "offload_params": "nvme"},
    "cpu+nvmeparams": {"offload_optimizer": "cpu", "offload_params": "nvme"},
}


def _modes(stage: int) -> list[str]:
    return [mode for mode in MODES if stage == 3 or "params" not in mode]


def _options(mode: str, directory: str) -> dict[str, Any]:
    options = dict(MODES[mode])
    if "nvme" in options.values():
        options["nvme_path"] = directory
    return options


def _state(engine: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with engine.gathered():
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def _proc_io() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def run_fp32(rank: int, world_size: int) -> dict[str, Any]:
    comm = Communicator()
    directory = tempfile.mkdtemp(prefix="lz-offload-")
    results: dict[str, Any] = {"nvme_path_entries": []}
    for name in CASES_ON[world_size]:
        case = CASES[name]
        torch.manual_seed(0)
        initial = TinyLM(**case.model_kwargs)
        reference = train_ddp(copy.deepcopy(initial), case, rank)
        for stage in STAGES[name]:
            states = {}
            for mode in _modes(stage):
                model = copy.deepcopy(initial)
                engine = train_zero(model, case, rank, stage, comm, **_options(mode, directory))
                if "nvmeparams" in mode:  # at rest every shard is on disk, none in memory
                    results[f"{name}/stage{stage}/{mode}/resident_shards"] = sum(
                        b._shard is not None for b in engine.model.buffers
                    )
                    report = engine.memory_report()
                    results[f"{name}/stage{stage}/{mode}/gradients"] = {
                        "resident_shards": sum(b._shard_grad is not None for b in engine.model.buckets),
                        "report": report.gradients,
                        "on_disk": sum(b.offloaded_nbytes for b in engine.model.buckets),
                        "held": sum(
                            b.buffer.layout.shard_numel * b.buffer.data.element_size() for b in engine.model.buckets
                        ),
                    }
                with engine.gathered():
                    results[f"{name}/stage{stage}/{mode}"] = relative_difference(reference, model)
                states[mode] = _state(engine, model)
                if name == "plain" and mode == "nvme":
                    owned = sum(s.numel for s in (g.store for g in engine.model.trained) if isinstance(s, DiskStore))
                    counts = engine.io_counts
                    results[f"io/stage{stage}"] = {
                        "owned": owned,
                        "read": counts.read,
                        "written": counts.written,
                    }
                engine.release()
                results["nvme_path_entries"].append(len(list(Path(directory).iterdir())))
            first = states["cpu"]
            results[f"{name}/stage{stage}/bitwise"] = {
                mode: all(torch.equal(state[k], first[k]) for k in state) for mode, state in states.items()
            }
    return results


def run_mixed(rank: int, world_size: int) -> dict[str, Any]:
    comm = Communicator()
    directory = tempfile.mkdtemp(prefix="lz-offload-")
    results: dict[str, Any] = {}
    dtype = torch.bfloat16
    for name in MIXED_CASES:
        case = CASES[name]
        torch.manual_seed(0)
        initial = TinyLM(**case.model_kwargs)
        trainable = [n for n, p in initial.named_parameters() if p.requires_grad]
        for stage in (1, 2, 3):
            reference = mixed_parity.train_reference(initial, case, rank, dtype, None, stage >= 2).state_dict()
            first = None
            for mode in _modes(stage):
                state = mixed_parity.train_zero(initial, case, stage, comm, dtype, None, **_options(mode, directory))
                first = first or state
                results[f"{name}/stage{stage}/{mode}"] = mixed_parity._difference(reference, state, trainable)
                results[f"{name}/stage{stage}/{mode}/bitwise"] = all(torch.equal(state[k], first[k]) for k in first)
    return results


@pytest.fixture(scope="module")
def fp32_on_2() -> list[dict[str, Any]]:
    return run_on_ranks(run_fp32, 2)


@pytest.fixture(scope="module")
def fp32_on_3() -> list[dict[str, Any]]:
    return run_on_ranks(run_fp32, 3)


def _fp32(request: pytest.FixtureRequest, ranks: int) -> list[dict[str, Any]]:
    """The per-rank results of the one fp32 run on ``ranks`` ranks (each world size spawns once per module)."""
    return request.getfixturevalue(f"fp32_on_{ranks}")


def _runs(stage3_only: bool = False) -> list[Any]:
    """(ranks, stage, case) of every fp32 run, or (ranks, case) of its stage-3 ones."""
    runs = [(n, c) for n, cases in CASES_ON.items() for c in cases]
    if stage3_only:
        return [pytest.param(n, c, id=f"{n}ranks-{c}") for n, c in runs if 3 in STAGES[c]]
    return [pytest.param(n, s, c, id=f"{n}ranks-{s}-{c}") for n, c in runs for s in STAGES[c]]


RANKS = pytest.mark.parametrize("ranks", list(CASES_ON), ids=lambda n: f"{n}ranks")


@pytest.fixture(scope="module")
def mixed() -> list[dict[str, Any]]:
    return run_on_ranks(run_mixed, 2)


@pytest.mark.parametrize(("ranks", "stage", "case"), _runs())
def test_fp32_offload_equals_ddp(request: pytest.FixtureRequest, ranks: int, stage: int, case: str) -> None:
    for rank, per_rank in enumerate(_fp32(request, ranks)):
        for mode in _modes(stage):
            difference = per_rank[f"{case}/stage{stage}/{mode}"]
            assert difference <= TOLERANCE, f"rank {rank} {mode}: {difference:.2e} from DDP"


@pytest.mark.parametrize(("ranks", "case"), _runs(stage3_only=True))
def test_stage3_shards_rest_on_disk_with_offload_params_nvme(
    request: pytest.FixtureRequest, ranks: int, case: str
) -> None:
    for rank, per_rank in enumerate(_fp32(request, ranks)):
        for mode in ("nvme+nvmeparams", "cpu+nvmeparams"):
            assert per_rank[f"{case}/stage3/{mode}/resident_shards"] == 0, (rank, mode)


@pytest.mark.parametrize(("ranks", "case"), _runs(stage3_only=True))
def test_stage3_gradients_rest_on_disk_with_everything_on_nvme(
    request: pytest.FixtureRequest, ranks: int, case: str
) -> None:
    """With optimizer and parameters on NVMe the reduced gradient shards rest in the swap file too: after training
    none is in memory and the report counts no gradient bytes; with the optimizer on the host they stay there."""
    for rank, per_rank in enumerate(_fp32(request, ranks)):
        on_nvme = per_rank[f"{case}/stage3/nvme+nvmeparams/gradients"]
        assert on_nvme["resident_shards"] == 0, (rank, on_nvme)
        assert on_nvme["report"] == 0, (rank, on_nvme)
        assert on_nvme["on_disk"] >= on_nvme["held"] > 0, (rank, on_nvme)
        on_host = per_rank[f"{case}/stage3/cpu+nvmeparams/gradients"]
        assert on_host["on_disk"] == 0, (rank, on_host)
        assert on_host["report"] > 0, (rank, on_host)


@pytest.mark.parametrize(("ranks", "stage", "case"), _runs())
def test_fp32_offload_modes_equal_each_other_bit_for_bit(
    request: pytest.FixtureRequest, ranks: int, stage: int, case: str
) -> None:
    for rank, per_rank in enumerate(_fp32(request, ranks)):
        bitwise = per_rank[f"{case}/stage{stage}/bitwise"]
        assert all(bitwise.values()), f"rank {rank}: not bit-equal to offload_optimizer='cpu': {bitwise}"


@RANKS
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_swap_file_bytes_equal_the_formula(request: pytest.FixtureRequest, ranks: int, stage: int) -> None:
    """AdamW, fp32 master: setup writes the master (4 bytes an owned element); step 1 reads it and writes master,
    exp_avg and exp_avg_sq (12); each later step reads and writes 12."""
    steps = 5  # tests.distributed.parity.STEPS
    for rank, per_rank in enumerate(_fp32(request, ranks)):
        io = per_rank[f"io/stage{stage}"]
        owned = io["owned"]
        assert owned > 0
        assert io["read"] == 4 * owned + 12 * owned * (steps - 1), (rank, io)
        assert io["written"] == 4 * owned + 12 * owned * steps, (rank, io)


def run_io(
    rank: int, world_size: int, stage: int, params: str | bool = False, clip: bool = False, free: bool = False
) -> dict[str, Any]:
    """AdamW steps of a 0.5M-parameter model with NVMe offload (and ``offload_params``), clipped by norm (``clip``),
    with ``free_gradients_after_step`` (``free``); the swap file's counts and the process's /proc/self/io around
    steps 2 and 3 (setup and the first step excluded: file-system metadata writes of a few pages, and modules the
    first step imports, read from disk when the page cache is cold), and the parameters after the steps."""
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    directory = tempfile.mkdtemp(prefix="lz-io-")
    options = EngineOptions(
        stage=stage,
        offload_optimizer="nvme",
        offload_params=params,
        nvme_path=directory,
        free_gradients_after_step=free,
    )
    engine = ZeroEngine(model, [optimizer], options, Communicator())
    for step in range(3):
        if step == 1:
            before, counts_before = _proc_io(), copy.copy(engine.io_counts)
        optimizer.zero_grad()
        model(torch.randn(8, 512, generator=torch.Generator().manual_seed(step + 10 * rank))).square().mean().backward()
        if clip:
            engine.step_of(optimizer).clip_grad_norm_(0.05)
        optimizer.step()
    after, counts = _proc_io(), copy.copy(engine.io_counts)
    owned = sum(s.numel for s in (g.store for g in engine.model.trained) if isinstance(s, DiskStore))
    with engine.gathered():
        state = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine.release()
    return {
        "state": state,
        "owned": owned,
        "read": counts.read - counts_before.read,
        "written": counts.written - counts_before.written,
        "read_padded": counts.read_padded - counts_before.read_padded,
        "written_padded": counts.written_padded - counts_before.written_padded,
        "proc_read": after[0] - before[0],
        "proc_written": after[1] - before[1],
    }


# Bytes per owned element per step, fp32 AdamW. Optimizer on NVMe: the master and both moments read and written
# (12 each way). Everything on NVMe (ZeRO-Infinity, stage 3): also the gradient shard written after its reduction
# and read for the step (4 each way), the parameter shard read for each of its unit's two gathers (forward,
# backward: 8) and written after the step (4); clipped, the gradient shard also read for the norm (4) and written
# back after the step (4) unless free_gradients_after_step empties it then (see [Note: the write a free makes
# needless]).
IO_PER_STEP = {  # (stage, offload_params, clip, free) -> (read, written)
    (1, False, False, False): (12, 12),
    (3, False, False, False): (12, 12),
    (3, "nvme", False, False): (24, 20),
    (3, "nvme", True, False): (28, 24),
    (3, "nvme", True, True): (28, 20),
}


def run_io_cases(rank: int, world_size: int) -> dict[tuple[Any, ...], dict[str, Any]]:
    """:func:`run_io` for every case of ``IO_PER_STEP``, in one process per rank."""
    return {case: run_io(rank, world_size, *case) for case in IO_PER_STEP}


@pytest.fixture(scope="module")
def io_cases() -> list[dict[tuple[Any, ...], dict[str, Any]]]:
    return run_on_ranks(run_io_cases, 2)


@pytest.mark.parametrize("case", list(IO_PER_STEP), ids=lambda case: "-".join(map(str, case)))
def test_proc_self_io_agrees_with_the_swap_file_counts(
    io_cases: list[dict[tuple[Any, ...], dict[str, Any]]], case: tuple[Any, ...]
) -> None:
    read, written = IO_PER_STEP[case]
    for rank, per_rank in enumerate(io_cases):
        io = {key: value for key, value in per_rank[case].items() if key != "state"}
        assert io["read"] == read * io["owned"] * 2, (rank, io)
        assert io["written"] == written * io["owned"] * 2, (rank, io)
        assert abs(io["proc_read"] - io["read_padded"]) <= 0.01 * io["read_padded"], (rank, io)
        assert abs(io["proc_written"] - io["written_padded"]) <= 0.01 * io["written_padded"], (rank, io)


def test_a_free_that_skips_the_gradient_write_back_steps_the_same(
    io_cases: list[dict[tuple[Any, ...], dict[str, Any]]],
) -> None:
    """Everything on NVMe, clipped: the parameters after three steps are the same bits whether or not the clipped
    gradient shards went back to disk (the next reduction replaces them)."""
    for per_rank in io_cases:
        kept, freed = per_rank[3, "nvme", True, False]["state"], per_rank[3, "nvme", True, True]["state"]
        unclipped = per_rank[3, "nvme", False, False]["state"]
        for name, value in kept.items():
            assert torch.equal(freed[name], value), name
        assert any(not torch.equal(unclipped[name], value) for name, value in kept.items())  # the clip is active


@RANKS
def test_nvme_path_stays_empty(request: pytest.FixtureRequest, ranks: int) -> None:
    """The swap file has no name from the moment it exists: nothing in nvme_path, ever."""
    for per_rank in _fp32(request, ranks):
        assert per_rank["nvme_path_entries"]
        assert set(per_rank["nvme_path_entries"]) == {0}


@pytest.mark.parametrize("case", MIXED_CASES)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_offload_matches_the_same_maths_and_no_offload(mixed: list[dict[str, Any]], stage: int, case: str) -> None:
    for rank, per_rank in enumerate(mixed):
        for mode in _modes(stage):
            difference = per_rank[f"{case}/stage{stage}/{mode}"]
            assert difference <= mixed_parity_exact(), f"rank {rank} {mode}: {difference:.2e} from the reference"
            assert per_rank[f"{case}/stage{stage}/{mode}/bitwise"], f"rank {rank} {mode}: not bit-equal to no offload"


def mixed_parity_exact() -> float:
    from tests.distributed.test_mixed_precision import EXACT

    return EXACT


def _step_with_a_failing_read(rank: int, world_size: int, directory: str) -> str:
    """Rank 1's disk fails (EIO) in the second step's read-ahead; every rank must raise, none may hang."""
    import errno
    import os

    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = EngineOptions(stage=2, bucket_cap_mb=0.0005, offload_optimizer="nvme", nvme_path=directory)
    engine = ZeroEngine(model, [optimizer], options, Communicator())
    real = os.preadv
    for step in range(2):
        if step == 1 and rank == 1:

            def failing(fd: int, buffers: Any, offset: int) -> int:
                raise OSError(errno.EIO, os.strerror(errno.EIO))

            os.preadv = failing  # type: ignore[assignment]
        engine.begin_iteration()
        optimizer.zero_grad()
        try:
            loss_fn(model, *batch(10 * step + rank)).backward()
            optimizer.step()
        except RuntimeError as error:
            os.preadv = real
            return str(error)
    return "no error"


def test_an_io_error_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    messages = run_on_ranks(_step_with_a_failing_read, 2, str(tmp_path))
    assert "another rank failed to read or write its swap file" in messages[0], messages
    assert "reading the unlinked swap file of rank 1 in" in messages[1], messages
    assert "at offset" in messages[1]
    assert "[errno 5 EIO]" in messages[1]


def _norms_after_a_step_that_raised(rank: int, world_size: int, directory: str) -> dict[bool, tuple[float, float]]:
    """Everything on NVMe (stage 3), clipped to a norm of 0.05, ``free_gradients_after_step`` off and on: rank 1's
    first read of optimizer state in the step fails, so every rank raises after rank 0 stepped every store. Per
    option: the norm before clipping, and the norm of the gradients after the failure (those torch would leave:
    clipped)."""
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions
    from lightning_zero.core.store.swap import SwapIOError

    def failing(store: DiskStore, optimizer: torch.optim.Optimizer) -> Any:
        raise SwapIOError("a read of optimizer state failed (injected)")

    norms = {}
    for free in (False, True):
        torch.manual_seed(0)
        model = TinyLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        options = EngineOptions(
            stage=3,
            offload_optimizer="nvme",
            offload_params="nvme",
            nvme_path=directory,
            free_gradients_after_step=free,
        )
        engine = ZeroEngine(model, [optimizer], options, Communicator())
        engine.begin_iteration()
        loss_fn(model, *batch(rank)).backward()
        before = float(engine.step_of(optimizer).clip_grad_norm_(0.05))
        real = DiskStore.page_in
        if rank == 1:
            DiskStore.page_in = failing  # type: ignore[method-assign]
        try:
            optimizer.step()
        except SwapIOError:
            pass
        finally:
            DiskStore.page_in = real  # type: ignore[method-assign]
        after = float(engine.step_of(optimizer).clip_grad_norm_(1e9))
        norms[free] = (before, after)
        engine.release()
    return norms


def test_a_step_that_raised_leaves_the_clipped_gradients_with_or_without_the_free(tmp_path: Path) -> None:
    """A free after the step skips writing clipped gradient shards back (see [Note: the write a free makes
    needless]); a step that raises before that free leaves the gradients clipped all the same, as torch does."""
    for rank, norms in enumerate(run_on_ranks(_norms_after_a_step_that_raised, 2, str(tmp_path))):
        for free, (before, after) in norms.items():
            assert before > 0.1, (rank, free, before)  # the clip is active
            assert abs(after - 0.05) < 1e-5, (rank, free, after)


def _odd_uses(rank: int, world_size: int, directory: str, stage: int) -> dict[str, Any]:
    """SGD (its fused kernel is bit-identical to the default), fp16 with a dynamic loss scale and an inf in rank
    1's gradient at step 2, and a layer frozen at setup and unfrozen after step 3: every offload mode must give
    the engine without offload's parameters and scale bit for bit (the overflow skipped on every rank, the
    unfrozen layer sharded into new swap regions)."""
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.mixed_precision import DynamicLossScaler, PrecisionPolicy
    from lightning_zero.core.options import EngineOptions

    results: dict[str, Any] = {}
    for mode in ["none", *_modes(stage)]:
        torch.manual_seed(0)
        model = TinyLM()
        model.emb.weight.requires_grad_(False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        offload = {} if mode == "none" else _options(mode, directory)
        policy_units = {torch.nn.Linear} if stage == 3 else None
        options = EngineOptions(stage=stage, bucket_cap_mb=0.0005, wrap_policy=policy_units, **offload)
        policy = PrecisionPolicy(torch.float16, torch.float32, torch.float32)
        scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2)
        engine = ZeroEngine(model, [optimizer], options, Communicator(), precision=policy, loss_scaler=scaler)
        for step in range(6):
            if step == 3:
                model.emb.weight.requires_grad_(True)
            engine.begin_iteration()
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model, *batch(10 * step + rank))
            if step == 2 and rank == 1:
                loss = loss * float("inf")
            engine.scale_loss(loss).backward()
            engine.finish_backward()
            optimizer.step()
        results[mode] = {"state": engine.full_state_dict(keep=True), "scale": scaler.scale}
        engine.release()
    return results


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_overflow_skip_and_unfreezing_after_setup_match_no_offload_bit_for_bit(tmp_path: Path, stage: int) -> None:
    for rank, results in enumerate(run_on_ranks(_odd_uses, 2, str(tmp_path), stage)):
        reference = results.pop("none")
        assert reference["scale"] < 2.0**10 * 2**3  # six clean steps would have doubled it three times
        for mode, result in results.items():
            assert result["scale"] == reference["scale"], (rank, mode)
            for key, value in reference["state"].items():
                assert torch.equal(value, result["state"][key]), (rank, mode, key)
