"""Which of the project's modules run compiled (mypyc) in this install.

setup.py compiles :data:`COMPILED` with mypyc as one group when it can (it reads this list from
this file); a compiled module shadows its ``.py`` file. The source stays the reference: it runs
where the compile was skipped (``SCOPED_KV_PURE=1`` at install time) or failed, or under
``scripts/pure_python.py``, and both give the same results (tests compare them).
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from pathlib import Path
from typing import Final

COMPILED: Final = (
    "kvcache.block_pool",
    "kvcache.eviction",
    "kvcache.owner",
    "kvcache.pool",
    "kvcache.sequence",
    "kvcache.tree",
    "events.wire._records",
    "events.manager",
    "router_sim.router.policies.kernels",
    "router_sim.sim.simulator",
    "router_sim.sim.timing_model",
    "router_sim.sim.worker",
)
"""The simulator's hot modules that pay for their compile: the worker's cache bookkeeping and
events, the worker and the simulator's loop, the cost policies' per-candidate loops and the
default timing model (what each part pays is in docs/BUILD.md). The router, the engine
dialects and the step-timing front door gained at most 1.05x on the simulator compiled and
are Python, as are the modules whose classes users inspect, subclass or patch (policies,
configs, the cache manager's front door, protocols)."""


def compiled_modules() -> dict[str, bool]:
    """For each module of :data:`COMPILED`: whether it is loaded compiled (imports them)."""
    import importlib

    out: dict[str, bool] = {}
    for name in COMPILED:
        module = importlib.import_module(name)
        out[name] = not str(getattr(module, "__file__", "")).endswith(".py")
    return out


MANIFEST: Final = "_compiled_sources.json"
"""Written beside this file by a build that compiled the group: each compiled module's source
path and the SHA-256 of the source it was compiled from."""


def stale_modules() -> list[str]:
    """Modules of :data:`COMPILED` whose ``.py`` file changed since the compiled group was built
    from it: an import takes the compiled module, so an edit does not run until a rebuild
    (``python3 setup.py build_ext --inplace`` or ``pip install -e .``). Empty where nothing was
    compiled. Hashes the sources (a few hundred KB)."""
    here = Path(__file__).resolve().parent
    try:
        built = json.loads((here / MANIFEST).read_text())
    except (OSError, ValueError):  # not compiled, or by hand without the manifest
        return []
    if not isinstance(built, dict):  # not what a build writes: as unreadable as bad JSON
        return []
    root = here.parent
    out = []
    for name in COMPILED:
        path = name.replace(".", "/") + ".py"
        try:
            digest = hashlib.sha256((root / path).read_bytes()).hexdigest()
        except OSError:
            continue
        if built.get(path) != digest:
            out.append(name)
    return out


def warn_if_stale() -> None:
    """A warning naming :func:`stale_modules`, if any."""
    stale = stale_modules()
    if stale:
        warnings.warn(
            f"compiled modules older than their source (edits not in effect until a rebuild, "
            f"python3 setup.py build_ext --inplace): {', '.join(stale)}",
            RuntimeWarning,
            stacklevel=3,
        )


def is_compiled() -> bool:
    """Whether the compiled group is in use (all of it or none: it loads as one library)."""
    return all(compiled_modules().values())


if __name__ == "__main__":  # python3 -m router_sim.build_info: one line per module
    for name, native in compiled_modules().items():
        print(f"{name}: {'compiled' if native else 'pure Python'}")
    sys.exit(0)
