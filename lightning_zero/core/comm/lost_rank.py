"""What a collective's failure means: another rank was lost (its process ended) or did not answer in time.

[Note: lost and hung ranks]
When a rank's process ends (a crash, ``SIGKILL``, the out-of-memory killer) the others' collectives fail with the
backend's own words (gloo: "Connection closed by peer [127.0.0.1]:23986"); when a rank stops answering (stopped,
deadlocked, far slower) they fail after the process group's ``timeout``. Every collective the engine issues goes
through :class:`~lightning_zero.core.comm.Communicator`, which turns such failures into a :class:`RankLostError`
or a :class:`RankTimeoutError` naming the collective this rank was in, its size and the rank, and keeps the
backend's message; any other error passes unchanged. The process then exits non-zero as usual.

[Note: a rank that raises and stays alive]
A rank whose process ends is noticed at once: its connections close. A rank that raises and lives on (an error in
a callback caught by a notebook, a process stuck in its teardown) closes nothing, so the others would wait in their
next collective until the timeout (30 minutes by default). So a rank that raises posts a notice in the process
group's store (``FailureNotices.post``: its rank and error; the strategy's ``on_exception`` does it), and every
wait of a gloo collective the engine issues is a wait in slices of ``POLL`` that reads the notices between slices
(one small store request per slice, none while collectives complete within a slice): a waiting rank raises
:class:`RankFailedError` naming the failed rank and its error within a slice of the notice. A rank whose
collectives failed because another rank failed does not post (it names the first failure, and posting it would
only repeat it). NCCL waits do not block the host, so they are not polled: there the process group's timeout (and
NCCL's watchdog) end a wait.

[Note: a rank that finished]
Ranks that run different numbers of steps (loaders of different lengths with ``use_distributed_sampler=False``, an
early stop on one rank) end apart: one finishes its fit while another waits in a collective it will never join.
When the finished rank's process (or its process group) ends, the waiting rank's collective fails as if that rank
had crashed, though its log holds no error. So a rank whose fit ended normally says so in the store
(``FailureNotices.post_finished``, from the strategy's ``on_train_end``; cleared at the next fit's start), under keys
of its own that the failure count does not see, and a lost-rank or timeout error that finds such a notice is a
:class:`RankFinishedError` naming the rank and where its fit ended. Polled waits do not end on it: in Lightning's
loop the waiting rank is by then blocked in the loop's own broadcast at the start of each batch (the SIGTERM
flag, a plain ``torch.distributed`` call), and a finished rank that lives on keeps it there until the timeout, as
under DDP.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")

# Words of the backends' errors when a peer's process is gone (gloo's TCP transport, NCCL's abort).
_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote worker crashing", "aborted")
_TIMED_OUT = ("Timed out", "timed out", "Timeout", "timeout")


class RankLostError(RuntimeError):
    """A collective failed because another rank's process ended or its connection broke."""


class RankTimeoutError(RuntimeError):
    """A collective did not complete within the process group's timeout: another rank is hung or far behind."""


class RankFailedError(RankLostError):
    """Another rank raised (and posted a notice) while this rank waited for it in a collective."""


class RankFinishedError(RankLostError):
    """Another rank finished its fit normally while this rank waited for it in a collective."""


POLL = timedelta(milliseconds=200)  # a gloo wait reads the failure notices this often (see the note above)
_POLL_EXPIRED = "Operation timed out!"  # what a work's wait(timeout) raises when the slice ends first
_CONSEQUENCES = (RankLostError, RankTimeoutError)  # errors that are about another rank: not posted


class FailureNotices:
    """Where a rank that raised says so and waiting ranks look: keys under ``prefix`` in the process group's store.
    See [Note: a rank that raises and stays alive].

    Args:
        store: the job's store (``torch.distributed``'s default store).
        prefix: keys of this run (each new communicator root gets its own, on every rank alike).
        world_size: the job's ranks (global), any of which may post.
    """

    def __init__(self, store: Any, prefix: str, world_size: int) -> None:
        self.store = store
        self.prefix = prefix
        self.world_size = world_size
        self._readable = True  # turns False when the store is gone (its host's process ended)

    def post(self, rank: int, error: BaseException) -> None:
        """Say that ``rank`` raised ``error`` (not posted for errors that are about another rank)."""
        if isinstance(error, _CONSEQUENCES):
            return
        text = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        try:
            self.store.set(f"{self.prefix}/rank{rank}", text[:2000])
            self.store.add(f"{self.prefix}/count", 1)
        except Exception:  # the store is gone with its host: the others see the connection close
            return

    def post_finished(self, rank: int, where: str) -> None:
        """Say that ``rank``'s fit ended normally, ``where`` (see [Note: a rank that finished])."""
        try:
            if not self.store.check([f"{self.prefix}/finished{rank}"]):
                self.store.add(f"{self.prefix}/finished", 1)
            self.store.set(f"{self.prefix}/finished{rank}", where[:500])
        except Exception:
            return

    def clear_finished(self, rank: int) -> None:
        """A new fit starts on ``rank``: its earlier notice no longer holds."""
        try:
            if self.store.check([f"{self.prefix}/finished{rank}"]):
                self.store.delete_key(f"{self.prefix}/finished{rank}")
                self.store.add(f"{self.prefix}/finished", -1)
        except Exception:
            return

    def finished(self) -> str | None:
        """The ranks whose fit ended, or ``None`` (one store request when there are none)."""
        if not self._readable:
            return None
        try:
            if self.store.add(f"{self.prefix}/finished", 0) <= 0:
                return None
            keys = {r: f"{self.prefix}/finished{r}" for r in range(self.world_size)}
            done = [r for r, key in keys.items() if self.store.check([key])]
            return "; ".join(f"rank {r} finished: {self.store.get(keys[r]).decode()}" for r in done) or None
        except Exception:
            self._readable = False
            return None

    def read(self) -> str | None:
        """The posted failures, or ``None`` (one store request when there are none)."""
        if not self._readable:
            return None
        try:
            if self.store.add(f"{self.prefix}/count", 0) == 0:
                return None
            posted = [r for r in range(self.world_size) if self.store.check([f"{self.prefix}/rank{r}"])]
            return "; ".join(f"rank {r} raised {self.store.get(f'{self.prefix}/rank{r}').decode()}" for r in posted)
        except Exception:  # a store whose host is gone: wait as without notices
            self._readable = False
            return None


def notices_prefix(generation: int, ranks: list[int]) -> str:
    """The store prefix of one communicator root (``generation``: how many roots this process made before), the
    same on every rank of it."""
    return f"lightning_zero/failures/{generation}/{zlib.crc32(repr(ranks).encode())}"


def translate(error: BaseException, what: str, rank: int) -> BaseException:
    """The error to raise for ``error``, raised by the collective ``what`` on ``rank``."""
    text = str(error)
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    if any(word in text for word in _LOST):
        return RankLostError(
            f"rank {rank} lost another rank during {what}: its process ended (a crash, a kill, the out-of-memory "
            f"killer) or its connection broke. The first error is in that rank's log. (backend: {first})"
        )
    if any(word in text for word in _TIMED_OUT):
        return RankTimeoutError(
            f"rank {rank} waited in {what} longer than the process group's timeout: another rank is hung (stopped, "
            f"deadlocked) or far behind, or took another path through the program. Raise ZeroStrategy(timeout=...) "
            f"(or ZeroFabricStrategy's) only if a rank is legitimately that slow. (backend: {first})"
        )
    return error


def guarded(what: str, rank: int, call: Callable[[], T], notices: FailureNotices | None = None) -> T:
    """``call()``, its backend failures translated (see [Note: lost and hung ranks]); an asynchronous work it returns
    is wrapped so that its ``wait()`` translates them too and reads ``notices`` (see [Note: a rank that raises and
    stays alive])."""
    try:
        result = call()
    except RuntimeError as error:
        _raise_translated(error, what, rank, notices)
    if result is not None and hasattr(result, "wait"):  # an asynchronous collective's work
        return GuardedWork(result, what, rank, notices)  # type: ignore[return-value]
    return result


def _raise_translated(error: RuntimeError, what: str, rank: int, notices: FailureNotices | None) -> NoReturn:
    """Raise ``error`` as what it means; a lost rank that posted why it ended is named with its error."""
    translated = translate(error, what, rank)
    if translated is error:
        raise error
    posted = notices.read() if notices is not None and isinstance(translated, RankLostError) else None
    if posted:
        raise _failed(what, rank, posted) from error
    finished = notices.finished() if notices is not None else None
    if finished:
        raise _finished(what, rank, finished) from error
    raise translated from error


def _failed(what: str, rank: int, posted: str) -> RankFailedError:
    return RankFailedError(
        f"rank {rank} stopped waiting in {what}: {posted}, so this collective can never complete. The first error "
        "is in that rank's log."
    )


def _finished(what: str, rank: int, finished: str) -> RankFinishedError:
    return RankFinishedError(
        f"rank {rank} stopped waiting in {what}: {finished}, so this collective can never complete. The ranks ran "
        "different numbers of steps: give every rank as many batches (Lightning's DistributedSampler does; with "
        "use_distributed_sampler=False, make each rank's loader the same length) and stop every rank at the same step."
    )


class GuardedWork:
    """An asynchronous collective whose ``wait()`` translates backend failures and, with ``notices``, waits in slices
    that read them."""

    def __init__(self, work: Any, what: str, rank: int, notices: FailureNotices | None = None) -> None:
        self.work, self.what, self.rank, self.notices = work, what, rank, notices

    def wait(self, *args: Any) -> bool:
        if self.notices is None or args:
            return guarded(self.what, self.rank, lambda: self.work.wait(*args))
        while True:
            try:
                return self.work.wait(POLL)
            except RuntimeError as error:
                if str(error) != _POLL_EXPIRED:
                    _raise_translated(error, self.what, self.rank, self.notices)
            posted = self.notices.read()
            if posted:
                raise _failed(self.what, self.rank, posted)

    def is_completed(self) -> bool:
        return self.work.is_completed()
