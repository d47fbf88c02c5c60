"""Which of the project's modules run compiled (mypyc) in this install.

setup.py compiles :data:`COMPILED` with mypyc as one group when it can (it reads this list from
this file); a compiled module shadows its ``.py`` file. The source stays the reference: it runs
where the compile was skipped (``SCOPED_KV_PURE=1`` at install time) or failed, or under
``scripts/pure_python.py``, and both give the same results (tests compare them).
"""

from __future__ import annotations

import sys
from typing import Final

COMPILED: Final = (
    "kvcache.block_pool",
    "kvcache.eviction",
    "kvcache.pool",
    "kvcache.sequence",
    "kvcache.tree",
    "events._records",
    "events.manager",
    "router_sim.dialects",
    "router_sim.indexer",
    "router_sim.router",
    "router_sim.sim",
    "router_sim.timing_model",
    "router_sim.worker",
)
"""The simulator's hot modules (the worker's cache bookkeeping and events, the router's index).
Modules whose classes users inspect, subclass or patch (policies, configs, the cache manager's
front door, protocols) stay Python."""


def compiled_modules() -> dict[str, bool]:
    """For each module of :data:`COMPILED`: whether it is loaded compiled (imports them)."""
    import importlib

    out: dict[str, bool] = {}
    for name in COMPILED:
        module = importlib.import_module(name)
        out[name] = not str(getattr(module, "__file__", "")).endswith(".py")
    return out


def is_compiled() -> bool:
    """Whether the compiled group is in use (all of it or none: it loads as one library)."""
    return all(compiled_modules().values())


if __name__ == "__main__":  # python3 -m router_sim.build_info: one line per module
    for name, native in compiled_modules().items():
        print(f"{name}: {'compiled' if native else 'pure Python'}")
    sys.exit(0)
