"""The simulator's errors (here, not in the modules that raise them: those are compiled by
mypyc, whose native classes cannot derive from built-in exceptions)."""

from __future__ import annotations


class SimulationError(RuntimeError):
    """The simulation cannot continue (for example the event stream stalled)."""


class WorkerError(RuntimeError):
    """A simulated worker reached a state it cannot continue from."""
