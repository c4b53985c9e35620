"""LightningModules, callbacks and helpers for the edges of a module's life: at rest, in callbacks, around ``fit``.

Used by test_at_rest.py, test_callbacks.py and the spawns of lifecycle_cases.py.

Everything is module level, so that the processes ``tests.helpers.run_on_ranks`` spawns can import it. Models
seed themselves in ``__init__`` (see tests/lightning/models.py), so every rank and strategy starts alike.

:func:`probe` runs one operation in a forked child of the rank: an operation that crashes the process (reading
a stage-3 parameter that holds no storage segfaults) is then reported as ``{"crashed": ...}`` for that
operation alone, and the rank, its process group and the other cases of the batch live on.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import io
import os
import select
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from tests.lightning.models import BATCH_SIZE, TiedLM, TwoLayer, state_of

TIMEOUT = timedelta(seconds=60)  # collectives give up after this, so a case that would hang fails instead
PROBE_TIMEOUT_S = 30.0


# ---------------------------------------------------------------------------------------------- helpers
def make_strategy(strategy: str | int, **kwargs: Any) -> Strategy:
    """``"ddp"`` (the oracle) or ``ZeroStrategy(stage=strategy)``, both with the short collective timeout.

    The timeout applies where the Trainer creates the process group: run the cases with
    ``run_on_ranks(..., init_group=False)``.
    """
    from lightning_zero import ZeroStrategy

    if strategy == "ddp":
        return DDPStrategy(find_unused_parameters=True, timeout=TIMEOUT)
    return ZeroStrategy(stage=int(strategy), timeout=TIMEOUT, **kwargs)


@contextlib.contextmanager
def full_params(trainer: pl.Trainer) -> Iterator[None]:
    """``trainer.strategy.gathered_params()`` under ZeroStrategy (collective), nothing under DDP."""
    from lightning_zero import ZeroStrategy

    if isinstance(trainer.strategy, ZeroStrategy):
        with trainer.strategy.gathered_params():
            yield
    else:
        yield


def regression_data(samples: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(samples, 7, generator=gen), torch.randn(samples, 3, generator=gen)


def regression_loader(samples: int, seed: int = 1) -> DataLoader:
    """Fixed data for TwoLayer-shaped models; Lightning's DistributedSampler splits it (no shuffling)."""
    return DataLoader(TensorDataset(*regression_data(samples, seed)), batch_size=BATCH_SIZE)


def tokens_loader(samples: int) -> DataLoader:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TiedLM.VOCAB, (samples, 5), generator=gen)
    return DataLoader(TensorDataset(tokens, torch.roll(tokens, 1, dims=1)), batch_size=BATCH_SIZE)


def error_of(error: BaseException) -> dict[str, Any]:
    """What a test needs to know of an exception raised on a rank (exceptions themselves may not pickle)."""
    return {"type": type(error).__name__, "runtime_error": isinstance(error, RuntimeError), "message": str(error)}


def probe(operation: Callable[[], Any], timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """Run ``operation()`` in a forked child; ``{"ok": value}``, ``{"error": error_of(...)}`` or ``{"crashed": why}``.

    The child sees this process's memory as it is (gathered or not) and sends its result back through a pipe with
    ``torch.save``; a value that cannot be sent (e.g. a module that holds a process group) is reported as an error.
    The operation must not communicate: only this process would take part.

    A child that has not answered in time writes the stacks of its threads first; they are part of the
    ``"crashed"`` message. Such a child is tried once more: the rank is multi-threaded (gloo's workers), and a
    fork can copy a lock another thread holds, a hazard of this harness, not of the operation. The first try's
    stacks are kept under ``"retried"``; an operation that hangs hangs twice and is reported.
    """
    first = _probe_once(operation, timeout_s)
    if "timed_out" not in first:
        return first
    second = _probe_once(operation, timeout_s)
    if "timed_out" in second:
        stacks = second["timed_out"]
        return {"crashed": f"the operation did not finish within {timeout_s} s, twice; its stacks:\n{stacks}"}
    return second | {"retried": first["timed_out"]}


def _probe_once(operation: Callable[[], Any], timeout_s: float) -> dict[str, Any]:
    """One forked try of :func:`probe`; ``{"timed_out": stacks}`` where the child did not answer in time."""
    read_fd, write_fd = os.pipe()
    with tempfile.TemporaryFile() as stacks:
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            faulthandler.dump_traceback_later(max(timeout_s - 2.0, timeout_s / 2), file=stacks)
            _child(operation, write_fd)
        os.close(write_fd)
        try:
            data = _read_all(read_fd, timeout_s)
        finally:
            os.close(read_fd)
        if data is None:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if data is None:
            stacks.seek(0)
            return {"timed_out": stacks.read().decode(errors="replace") or "(none written)"}
    if os.WIFSIGNALED(status):
        return {"crashed": f"the process died of signal {signal.Signals(os.WTERMSIG(status)).name}"}
    if not data:
        return {"crashed": f"the process exited with status {os.waitstatus_to_exitcode(status)} and no result"}
    return torch.load(io.BytesIO(data), weights_only=False)


def _child(operation: Callable[[], Any], write_fd: int) -> None:
    """The forked child of :func:`probe`: run, send, exit (never returns, runs no atexit handler)."""
    try:
        try:
            outcome: dict[str, Any] = {"ok": operation()}
        except BaseException as error:
            outcome = {"error": error_of(error)}
        payload = io.BytesIO()
        try:
            torch.save(outcome, payload)
        except BaseException as error:
            payload = io.BytesIO()
            torch.save({"error": error_of(error) | {"message": f"the result could not be sent: {error}"}}, payload)
        data = payload.getvalue()
        while data:
            data = data[os.write(write_fd, data) :]
    finally:
        os._exit(0)


def _read_all(read_fd: int, timeout_s: float) -> bytes | None:
    """Everything written to the pipe until the child closes it, or ``None`` after ``timeout_s``."""
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([read_fd], [], [], left)[0]:
            return None
        chunk = os.read(read_fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _printed(param: Tensor) -> str:
    out = io.StringIO()
    print(param, file=out)
    return out.getvalue()


def _save_and_load(module: nn.Module) -> dict[str, Tensor]:
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def value_probes(module: nn.Module, name: str) -> dict[str, dict[str, Any]]:
    """The operations that read values: ``print(p)``, ``p.sum()``, ``p.clone()``, ``copy.deepcopy(module)`` and
    ``module.state_dict()`` through ``torch.save``/``torch.load``, each run by :func:`probe`."""
    param = module.get_parameter(name)
    operations: dict[str, Callable[[], Any]] = {
        "print": lambda: _printed(param),
        "sum": lambda: param.sum().detach(),
        "clone": lambda: param.clone().detach(),  # detach only to send it: a non-leaf does not pickle
        "deepcopy": lambda: copy.deepcopy(module),
        "state_dict_save_load": lambda: _save_and_load(module),
    }
    return {op: probe(operation) for op, operation in operations.items()}


def metadata_of(param: Tensor) -> dict[str, Any]:
    """The queries that need no values (those asked of every parameter by Lightning and torch included), each
    answered or ``"raised ..."``; ``storage_offset()`` and ``data_ptr()`` only by their type, as the storage differs
    between strategies (a view of a flat buffer, or none at rest)."""
    queries: dict[str, Callable[[], Any]] = {
        "shape": lambda: tuple(param.shape),
        "size(0)": lambda: param.size(0),
        "numel": param.numel,
        "nelement": param.nelement,
        "torch.numel": lambda: torch.numel(param),
        "len": lambda: len(param),
        "dtype": lambda: param.dtype,
        "device": lambda: str(param.device),
        "get_device": param.get_device,
        "layout": lambda: param.layout,
        "requires_grad": lambda: param.requires_grad,
        "is_leaf": lambda: param.is_leaf,
        "grad_fn": lambda: param.grad_fn,
        "dim": param.dim,
        "ndim": lambda: param.ndim,
        "nbytes": lambda: param.nbytes,
        "element_size": param.element_size,
        "itemsize": lambda: param.itemsize,
        "stride": param.stride,
        "dim_order": param.dim_order,
        "is_contiguous": param.is_contiguous,
        "is_shared": param.is_shared,
        "is_pinned": param.is_pinned,
        "is_same_size": lambda: param.is_same_size(param),
        "is_floating_point": param.is_floating_point,
        "is_complex": param.is_complex,
        "is_signed": param.is_signed,
        "is_conj": param.is_conj,
        "is_neg": param.is_neg,
        "is_inference": param.is_inference,
        "device_flags": lambda: (param.is_cuda, param.is_cpu, param.is_meta, param.is_mkldnn, param.is_xla),
        "layout_flags": lambda: (param.is_sparse, param.is_sparse_csr, param.is_quantized, param.is_nested),
        "sparse_dense_dim": lambda: (param.sparse_dim(), param.dense_dim()),
        "type": param.type,
        "storage_offset": lambda: type(param.storage_offset()).__name__,
        "data_ptr": lambda: type(param.data_ptr()).__name__,
    }
    answers = {}
    for query, ask in queries.items():
        try:
            answers[query] = ask()
        except Exception as error:
            answers[query] = f"raised {type(error).__name__}: {error}"
    return answers


# ---------------------------------------------------------------------------------------------- models
class HParamNet(TwoLayer):
    """TwoLayer with ``save_hyperparameters()`` and a logged ``val_loss``; ``seed`` picks other initial weights."""

    def __init__(self, hidden: int = 16, lr: float = 1e-2, seed: int = 0) -> None:
        super().__init__(hidden=hidden, lr=lr)
        self.save_hyperparameters()
        if seed:
            torch.manual_seed(seed)
            self.a.reset_parameters()
            self.b.reset_parameters()

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx), sync_dist=True)


class NoOptimizer(TwoLayer):
    """``configure_optimizers`` returns ``None``: Lightning trains with its ``_MockOptimizer``, i.e. not at all."""

    def configure_optimizers(self) -> None:
        return None


class SharedParamManual(pl.LightningModule):
    """Manual optimization with two optimizers whose parameter lists overlap in ``shared.weight`` (torch allows it).

    ``opt_a`` (AdamW) trains ``gen`` and ``shared.weight`` from ``loss_a``; ``opt_b`` (SGD with momentum) trains
    ``disc``, ``shared.weight`` and ``shared.bias`` from ``loss_b``. So ``shared.weight`` moves twice a step, once
    by each optimizer, each from the gradient of its own loss.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.gen = nn.Linear(7, 5)
        self.shared = nn.Linear(5, 5)
        self.disc = nn.Linear(5, 3)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        opt_a, opt_b = self.optimizers()
        loss_a = nn.functional.mse_loss(self.disc(torch.tanh(self.shared(torch.tanh(self.gen(x))))), y)
        opt_a.zero_grad()
        self.manual_backward(loss_a)
        opt_a.step()
        loss_b = nn.functional.mse_loss(self.disc(torch.tanh(self.shared(x[:, :5]))), -y)
        opt_b.zero_grad()
        self.manual_backward(loss_b)
        opt_b.step()

    def configure_optimizers(self) -> Any:
        opt_a = torch.optim.AdamW([*self.gen.parameters(), self.shared.weight], lr=1e-2, weight_decay=0.01)
        opt_b = torch.optim.SGD([*self.disc.parameters(), *self.shared.parameters()], lr=5e-2, momentum=0.9)
        return opt_a, opt_b


class TiedCheck(TiedLM):
    """TiedLM whose ``on_fit_start`` records that the head's weight is the embedding's: equal values, same object."""

    def __init__(self) -> None:
        super().__init__()
        self.record: list[bool] = []

    def on_fit_start(self) -> None:
        self.record = [torch.equal(self.embed.weight, self.head.weight), self.embed.weight is self.head.weight]


class BeforeAfter(TwoLayer):
    """TwoLayer that clones ``b.weight`` when a batch starts and records whether the step changed it."""

    def __init__(self) -> None:
        super().__init__()
        self.before: Tensor | None = None
        self.record: list[bool] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.before = self.b.weight.clone()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        assert self.before is not None
        self.record.append(not torch.equal(self.before, self.b.weight))


class MaskRecording(TwoLayer):
    """TwoLayer that records its pruning masks (``*_mask`` buffers) at every epoch end, after ModelPruning pruned."""

    def __init__(self) -> None:
        super().__init__()
        self.record: list[dict[str, Tensor]] = []

    def on_train_epoch_end(self) -> None:  # runs after the callbacks' on_train_epoch_end
        self.record.append({n: b.detach().clone() for n, b in self.named_buffers() if n.endswith("_mask")})


class ProbeBetweenSteps(TiedLM):
    """TiedLM that, in ``on_train_batch_end`` after optimizer step ``probe_step``, reads ``up.weight`` and the module
    at rest (:func:`value_probes`) and again inside ``full_params`` (every rank enters it), into ``record``."""

    def __init__(self, probe_step: int) -> None:
        super().__init__()
        self.probe_step = probe_step
        self.record: dict[str, Any] = {}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step != self.probe_step:
            return
        name = "up.weight"
        self.record["metadata"] = metadata_of(self.get_parameter(name))
        self.record["at_rest"] = value_probes(self, name)
        with full_params(self.trainer):
            self.record["gathered"] = value_probes(self, name)
            self.record["state"] = state_of(self)
            with torch.no_grad():  # a forward inside the block (an evaluation, a generation)
                self(torch.randint(0, self.VOCAB, (2, 5), generator=torch.Generator().manual_seed(3)))
            try:
                self.record["after_forward"] = state_of(self)
            except RuntimeError as error:
                self.record["after_forward"] = f"raised: {error}"


class RecordBeforeTrainEnd(pl.Callback):
    """Records the module's parameters in ``on_train_end``; put it before a callback that changes them there."""

    def __init__(self) -> None:
        self.state: dict[str, Tensor] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with full_params(trainer):  # stage 3 holds no values at rest
            self.state = state_of(pl_module)


class SaveAndRecordAt(pl.Callback):
    """After optimizer step ``step``: ``trainer.save_checkpoint(path)`` and record the full weights saved."""

    def __init__(self, step: int, path: str) -> None:
        self.step = step
        self.path = path
        self.state: dict[str, Tensor] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            with full_params(trainer):
                self.state = state_of(pl_module)
