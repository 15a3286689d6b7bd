"""The errors a run can end with, in one place, so every layer raises them without importing the runtime.

`SetupError` is bad input found before anything ran (the CLI exits 2, as for bad config); `RunError` is a run
that cannot go on (exit 1). Both say what is wrong and what to do.
"""

from __future__ import annotations


class RunError(RuntimeError):
    """The run cannot go on; the message says why and what to do."""


class SetupError(RunError):
    """Bad input found before anything ran (agent, run directory, backend): the CLI exits 2, as for bad config."""


class CaptureError(RunError):
    """A rollout that finished but left nothing to train on: loud, never an empty update."""


class ServerError(RuntimeError):
    """An inference server (or the gateway) failed to start, died, or refused an adapter operation."""
