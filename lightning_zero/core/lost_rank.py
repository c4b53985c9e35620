"""What a collective's failure means: another rank was lost (its process ended) or did not answer in time.

[Note: lost and hung ranks]
When a rank's process ends (a crash, ``SIGKILL``, the out-of-memory killer) the others' collectives fail with the
backend's own words (gloo: "Connection closed by peer [127.0.0.1]:23986"); when a rank stops answering (stopped,
deadlocked, far slower) they fail after the process group's ``timeout``. Every collective the engine issues goes
through :class:`~lightning_zero.core.comm.Communicator`, which turns such failures into a :class:`RankLostError`
or a :class:`RankTimeoutError` naming the collective this rank was in, its size and the rank, and keeps the
backend's message; any other error passes unchanged. The process then exits non-zero as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# Words of the backends' errors when a peer's process is gone (gloo's TCP transport, NCCL's abort).
_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote worker crashing", "aborted")
_TIMED_OUT = ("Timed out", "timed out", "Timeout", "timeout")


class RankLostError(RuntimeError):
    """A collective failed because another rank's process ended or its connection broke."""


class RankTimeoutError(RuntimeError):
    """A collective did not complete within the process group's timeout: another rank is hung or far behind."""


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
            f"only if a rank is legitimately that slow. (backend: {first})"
        )
    return error


def guarded(what: str, rank: int, call: Callable[[], T]) -> T:
    """``call()``, its backend failures translated (see [Note: lost and hung ranks])."""
    try:
        result = call()
    except RuntimeError as error:
        translated = translate(error, what, rank)
        if translated is error:
            raise
        raise translated from error
    if result is not None and hasattr(result, "wait"):  # an asynchronous collective's work
        return GuardedWork(result, what, rank)  # type: ignore[return-value]
    return result


class GuardedWork:
    """An asynchronous collective whose ``wait()`` translates backend failures."""

    def __init__(self, work: Any, what: str, rank: int) -> None:
        self.work, self.what, self.rank = work, what, rank

    def wait(self, *args: Any) -> bool:
        return guarded(self.what, self.rank, lambda: self.work.wait(*args))

    def is_completed(self) -> bool:
        return self.work.is_completed()
