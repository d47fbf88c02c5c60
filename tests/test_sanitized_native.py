"""The C extensions' tests pass on a build with AddressSanitizer and UndefinedBehaviorSanitizer
(``scripts/sanitize.sh``), and that script fails on a sanitizer report, even one made in a
child process whose parent goes on."""

from __future__ import annotations

import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "sanitize.sh"
# the extensions setup.py builds, as the script reads them
EXTENSIONS = re.findall(r'^\s*native\("([\w.]+)"', (ROOT / "setup.py").read_text(), re.M)


def _missing() -> str | None:
    """Why the sanitized build cannot be made here, or None."""
    for tool in ("gcc", "git", "nm", "tar"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    for lib in ("libasan.so", "libubsan.so"):
        where = subprocess.run(
            ["gcc", f"-print-file-name={lib}"], capture_output=True, text=True, check=False
        ).stdout.strip()
        if not Path(where).is_absolute() or not Path(where).exists():
            return f"gcc has no {lib} (install its sanitizer runtimes, e.g. libasan8 libubsan1)"
    if "router_sim.sim._prefetch" in EXTENSIONS:
        probe = subprocess.run(
            ["gcc", "-E", "-x", "c", "-"],
            input="#include <openssl/evp.h>\n",
            capture_output=True,
            text=True,
            check=False,
        )
        if probe.returncode != 0:
            return "no OpenSSL headers (router_sim.sim._prefetch includes <openssl/evp.h>)"
    if not (ROOT / ".git").exists():
        return "not a git checkout (the script copies the tree git lists)"
    return None


MISSING = _missing()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.timeout(1500)
def test_native_tests_pass_under_the_sanitizers() -> None:
    done = _run(timeout=1400)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "sanitize: ok" in out
    assert {"kvcache._v1hash", "events.wire._wire", "router_sim.router._match"} <= set(EXTENSIONS)
    for name in EXTENSIONS:  # each imported from the copy's build
        built = name.replace(".", "/") + ".cpython"
        assert re.search(rf"sanitize: {re.escape(name)} <- {re.escape(built)}", out), out[-3000:]


TRIGGERS = '''
"""Sanitizer errors in child processes whose failure the test ignores."""
import subprocess
import sys

LIB = {lib!r}


def _child(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], capture_output=True, check=False)


def test_an_overrun_in_a_child() -> None:
    # 16 bytes written into an allocation of 8 (libc's memset, the sanitizer's interceptor)
    _child(
        "import ctypes; c = ctypes.CDLL(None); c.malloc.restype = ctypes.c_void_p; "
        "p = c.malloc(8); c.memset(ctypes.c_void_p(p), 0, 16)"
    )


def test_a_signed_overflow_in_a_child() -> None:
    _child(f"import ctypes; ctypes.CDLL({{LIB!r}}).add_one(2**31 - 1)")
'''


@pytest.mark.timeout(600)
def test_the_script_fails_on_reports_of_child_processes(tmp_path: Path) -> None:
    """Reports reach the script's verdict through their log files, not only through exit
    statuses: here every test passes, and the script must still fail."""
    source = tmp_path / "overflow.c"
    source.write_text("int add_one(int x) { return x + 1; }\n")
    lib = tmp_path / "liboverflow.so"
    flags = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-O0"]
    subprocess.run(
        ["gcc", *flags, "-shared", "-fPIC", str(source), "-o", str(lib)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    triggers = tmp_path / "test_triggers.py"
    triggers.write_text(textwrap.dedent(TRIGGERS).format(lib=str(lib)))
    done = _run(str(triggers), timeout=500)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-4000:]
    assert "2 passed" in out, out[-4000:]  # the tests themselves passed
    assert "2 sanitizer report(s)" in out, out[-4000:]
    assert "heap-buffer-overflow" in out, out[-4000:]
    assert "__ubsan_handle_add_overflow" in out, out[-4000:]  # UBSan's abort, as ASan saw it
