"""Tests marked ``pure`` patch or inspect what the mypyc build compiles (a method replaced to
count calls, a module's clock, a class's slots): they run where the modules are pure Python
(``python3 scripts/pure_python.py pytest``, which CI runs too) and are skipped beside the
compiled ones, whose calls between compiled functions do not go through such patches."""

from __future__ import annotations

import pytest

from router_sim.build_info import is_compiled


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not is_compiled():
        return
    skip = pytest.mark.skip(
        reason="patches what the compiled build compiles; runs under scripts/pure_python.py"
    )
    for item in items:
        if item.get_closest_marker("pure") is not None:
            item.add_marker(skip)
