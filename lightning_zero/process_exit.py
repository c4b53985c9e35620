"""The end of a rank's process groups, whatever started the rank (Lightning's launchers, torchrun, a cluster's,
Fabric's). Imports no ``lightning.pytorch``.

[Note: destroying the groups when a rank ends]
A rank that ends with its gloo groups alive may abort in interpreter teardown (see [Note: groups alive at exit] in
core/comm/groups.py), so after a run that ended well they are destroyed while the interpreter is whole: by the
spawn/fork worker when ``fit`` returned, and, for ranks that run the script themselves (Lightning's ``"popen"``
launcher, torchrun, a cluster's launcher), by an exit hook the strategy registers when it sets up the process group. The
groups stay until exit: a second ``fit``, ``trainer.test`` or the user's own collectives may follow. Once this
process saw an exception (the strategy's ``on_exception``, the worker's, or one that ends the script) the hook
leaves them: destroying a group with a collective in flight waits for the other ranks, which may never come.
"""

from __future__ import annotations

import atexit
import sys

from lightning_zero.core.comm import destroy_groups


class _Exit:
    """This process's exit hook: registered once; ``raised`` once an exception was seen."""

    registered = False
    raised = False


def destroy_groups_at_exit() -> None:
    """Destroy the process groups when this process exits, unless it saw an exception (see [Note: destroying the
    groups when a rank ends]). Registered once per process."""
    if not _Exit.registered:
        _Exit.registered = True
        atexit.register(_destroy_groups_unless_raised)


def note_exception() -> None:
    """This process saw an exception in a run: its groups stay at exit."""
    _Exit.raised = True


def _destroy_groups_unless_raised() -> None:
    uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # an exception ended the script
    if not (_Exit.raised or uncaught is not None):
        destroy_groups()
