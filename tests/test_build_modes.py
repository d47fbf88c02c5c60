"""The mypyc-compiled simulator against its pure-Python source (the reference)."""

from __future__ import annotations

import hashlib
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import setuptools

from router_sim import build_info
from router_sim.build_info import COMPILED, compiled_modules, is_compiled, stale_modules
from router_sim.sim.simulator import Restart, SimConfig, simulate
from router_sim.sim.trace import load_trace
from router_sim.sim.workloads import synthetic_workload

ROOT = Path(__file__).resolve().parent.parent
PURE = [sys.executable, str(ROOT / "scripts" / "pure_python.py")]

# report fields that are wall-clock measurements, not results of the simulation
_WALL = {"wall_s", "decision_us_p50", "decision_us_p99", "decision_us_mean"}

# workloads and configurations that take different paths: eviction under a small device tier,
# a host tier, restarts, another engine's dialect, delayed events, step by step
CASES: dict[str, tuple[str, str, dict[str, object]]] = {
    "kv-small": ("mixed", "kv_overlap", {"workers": 3, "device_blocks": 96}),
    "rr-host": (
        "multi-turn",
        "round_robin",
        {"workers": 2, "device_blocks": 64, "host_blocks": 96},
    ),
    "pt-restart": (
        "shared-prompts",
        "predicted_ttft",
        {"workers": 3, "device_blocks": 128, "restarts": [Restart(1, 3000.0)]},
    ),
    "kv-vllm-delay": (
        "mixed",
        "kv_overlap",
        {"workers": 2, "device_blocks": 128, "engine": "vllm", "event_delay_ms": 20.0},
    ),
    "cache-aware-steps": (
        "tenants",
        "cache_aware",
        {"workers": 2, "device_blocks": 96, "fast_forward": False},
    ),
    "approximate-lora": ("lora", "approximate", {"workers": 3, "device_blocks": 96}),
    # the bundled Mooncake trace's first requests at 4x speed-up, 512-token blocks, under
    # eviction: the simulator's main job (workload "mooncake" is read by digest below)
    "mooncake-oracle": (
        "mooncake",
        "oracle",
        {"workers": 4, "device_blocks": 300, "tokens_per_block": 512},
    ),
}


def digest(case: str) -> str:
    """A digest of everything ``case``'s run reports, wall-clock figures left out."""
    workload, policy, options = CASES[case]
    if workload == "mooncake":
        requests = load_trace("mooncake", max_requests=300, speedup=4)
    else:
        requests = synthetic_workload(workload, seed=3)[:150]
    config = SimConfig(**{"tokens_per_block": 16, **options})  # type: ignore[arg-type]
    summary = simulate(requests, policy, config)
    report = {k: v for k, v in summary.as_dict().items() if k not in _WALL}
    records = [
        (r.request_id, r.worker, r.first_token_ms, r.finish_ms, r.reused_tokens, r.preemptions)
        for r in summary.records
    ]
    text = json.dumps([report, records], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _pure(*args: str) -> str:
    done = subprocess.run(
        [*PURE, *args], capture_output=True, text=True, timeout=300, cwd=ROOT, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_pure_python_runs_the_source_of_every_compiled_module() -> None:
    lines = _pure("router_sim.build_info").splitlines()
    assert lines == [f"{name}: pure Python" for name in COMPILED]


def test_processes_a_pure_run_starts_run_the_source_too() -> None:
    lines = _pure(str(Path(__file__).resolve()), "child").splitlines()
    assert lines == [f"{name}: pure Python" for name in COMPILED]


def test_the_group_is_compiled_whole_or_not_at_all() -> None:
    assert len(set(compiled_modules().values())) == 1


def test_no_compiled_module_is_older_than_its_source() -> None:
    # an edit after the last build would be tested as the old compiled code
    stale = stale_modules()
    assert not stale, f"rebuild (python3 setup.py build_ext --inplace): {stale} changed since"


def test_an_edited_source_is_reported_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "router_sim").mkdir()
    (tmp_path / "kvcache").mkdir()
    monkeypatch.setattr(build_info, "__file__", str(tmp_path / "router_sim" / "build_info.py"))
    assert build_info.stale_modules() == []  # no manifest: nothing was compiled
    (tmp_path / "router_sim" / build_info.MANIFEST).write_text("[1, 2]")
    assert build_info.stale_modules() == []  # not a build's manifest: read as none, no crash
    source = tmp_path / "kvcache" / "tree.py"
    source.write_text("x = 1\n")
    digest = hashlib.sha256(b"x = 1\n").hexdigest()
    (tmp_path / "router_sim" / build_info.MANIFEST).write_text(
        json.dumps({"kvcache/tree.py": digest})
    )
    assert "kvcache.tree" not in build_info.stale_modules()
    os.utime(source, (2_000_000_000, 2_000_000_000))  # touched, same text: not stale
    assert "kvcache.tree" not in build_info.stale_modules()
    source.write_text("x = 2\n")
    assert "kvcache.tree" in build_info.stale_modules()
    with pytest.warns(RuntimeWarning, match="kvcache.tree"):
        build_info.warn_if_stale()
    # a run warns too (the simulator calls the check)
    with pytest.warns(RuntimeWarning, match="kvcache.tree"):
        simulate(synthetic_workload("mixed", seed=1)[:3], "round_robin", SimConfig())


@pytest.mark.skipif(not is_compiled(), reason="the compiled modules are not built here")
def test_compiled_and_pure_python_give_the_same_reports() -> None:
    here = {case: digest(case) for case in CASES}
    # this file run as a script under pure_python.py prints the same digests from the source
    there = json.loads(_pure(str(Path(__file__).resolve())))
    assert there == here


if __name__ == "__main__":
    if sys.argv[1:] == ["child"]:  # what a process this one starts loads
        child = [sys.executable, "-m", "router_sim.build_info"]
        print(subprocess.run(child, capture_output=True, text=True, check=True).stdout, end="")
    else:
        print(json.dumps({case: digest(case) for case in CASES}))


def test_an_in_place_build_removes_the_compiled_twin_of_a_module_no_longer_compiled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module taken off the compiled list keeps the compiled twin an earlier in-place build
    left beside it, which would shadow its source and load a group that no longer holds it:
    the next build deletes it, and keeps the compiled modules and the hand-written extensions
    (no ``.py`` twin)."""
    (tmp_path / "router_sim").mkdir()
    (tmp_path / "router_sim" / "build_info.py").write_text('COMPILED = ("kvcache.tree",)\n')
    (tmp_path / "setup.py").write_text((ROOT / "setup.py").read_text())
    (tmp_path / "kvcache").mkdir()
    (tmp_path / "events").mkdir()
    files = {
        "kvcache/tree.py": "",
        "kvcache/tree.cpython-311-x86_64-linux-gnu.so": "compiled, listed",
        "kvcache/manager.py": "",
        "kvcache/manager.cpython-311-x86_64-linux-gnu.so": "compiled earlier, not listed now",
        "kvcache/_tokens.cpython-311-x86_64-linux-gnu.so": "hand-written extension",
        "events/_wire.cpython-311-x86_64-linux-gnu.so": "hand-written extension",
        # where builds before the group moved to the bottom package left its library
        "router_sim/_compiled__mypyc.cpython-311-x86_64-linux-gnu.so": "an old group library",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(setuptools, "setup", lambda **_: None)
    namespace = runpy.run_path(str(tmp_path / "setup.py"))
    namespace["_remove_compiled_in_place"](["kvcache/tree.py"])
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.so"))
    assert left == [
        "events/_wire.cpython-311-x86_64-linux-gnu.so",
        "kvcache/_tokens.cpython-311-x86_64-linux-gnu.so",
        "kvcache/tree.cpython-311-x86_64-linux-gnu.so",
    ]
    # a build that compiles nothing (SCOPED_KV_PURE=1, or a failed group) leaves no compiled
    # module, group library or manifest behind, and still the hand-written extensions
    (tmp_path / "kvcache" / "_compiled__mypyc.cpython-311-x86_64-linux-gnu.so").write_text("")
    (tmp_path / "router_sim" / "_compiled_sources.json").write_text("{}")
    namespace["_remove_compiled_in_place"]()
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.so"))
    assert left == [
        "events/_wire.cpython-311-x86_64-linux-gnu.so",
        "kvcache/_tokens.cpython-311-x86_64-linux-gnu.so",
    ]
    assert not (tmp_path / "router_sim" / "_compiled_sources.json").exists()
