"""Start-up hook of the Python processes a ``scripts/pure_python.py`` run starts (it puts this
folder first on ``PYTHONPATH``): they too take the project's ``.py`` sources first, so a test's
``router-sim`` subprocess runs the same source as the test."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_scoped_kv_pure_python", Path(__file__).resolve().parent.parent / "pure_python.py"
)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    _module.source_first()
