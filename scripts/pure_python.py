"""Run a module (as ``python3 -m`` does) with the project's pure-Python modules, even where
the compiled ones are built: ``python3 scripts/pure_python.py pytest -q`` runs the tests on the
reference source, ``python3 scripts/pure_python.py router_sim run ...`` the simulator (a first
argument ending in ``.py`` is run as a script).

setup.py compiles the simulator's hot modules with mypyc; a compiled module sits beside its
``.py`` file and the import system takes it first. Here the three packages' folders get an
import finder that takes a ``.py`` file first instead (the hand-written C extensions have no
``.py`` of the same name, so they still load). The Python processes it starts do the same:
``scripts/pure_site`` goes first on their ``PYTHONPATH``, and its ``sitecustomize`` sets the
finder up at their start (unless a process is given an environment without it).
"""

from __future__ import annotations

import importlib.machinery as machinery
import os
import runpy
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvcache", "events", "router_sim")


def source_first() -> None:
    """Make every later import of the three packages' modules take the ``.py`` file first."""
    folders = {str(ROOT / pkg) for pkg in PACKAGES}
    folders |= {str(p) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*") if p.is_dir()}
    hook = machinery.FileFinder.path_hook(
        (machinery.SourceFileLoader, machinery.SOURCE_SUFFIXES),
        (machinery.ExtensionFileLoader, machinery.EXTENSION_SUFFIXES),
        (machinery.SourcelessFileLoader, machinery.BYTECODE_SUFFIXES),
    )

    def finder(path: str) -> machinery.FileFinder:
        if path not in folders:
            raise ImportError(f"not one of the project's folders: {path}")
        return hook(path)

    if any(name.split(".")[0] in PACKAGES for name in sys.modules):
        raise RuntimeError("one of the project's packages was imported before source_first()")
    sys.path_hooks.insert(0, finder)
    sys.path_importer_cache.clear()


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    source_first()
    site = str(ROOT / "scripts" / "pure_site")
    inherited = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = site + (os.pathsep + inherited if inherited else "")
    target, sys.argv = argv[0], argv
    if target.endswith(".py"):  # a script, as ``python3 path.py`` runs it
        sys.path.insert(0, str(Path(target).resolve().parent))
        runpy.run_path(target, run_name="__main__")
    else:
        run: Callable[..., object] = runpy.run_module
        run(target, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
