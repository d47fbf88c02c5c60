"""The runnable examples (```python blocks) of the README and the package docs run and print what
their comments say."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "docs/KVCACHE.md", "docs/EVENTS.md", "docs/ROUTER.md"]
BLOCKS = [
    (doc, code)
    for doc in DOCS
    for code in re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text("utf-8"), flags=re.S)
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_each_doc_has_runnable_examples() -> None:
    assert {doc for doc, _ in BLOCKS} == set(DOCS)
    assert sum(doc == "README.md" for doc, _ in BLOCKS) >= 4


@pytest.mark.parametrize(
    "index", range(len(BLOCKS)), ids=[f"{doc}-{i}" for i, (doc, _) in enumerate(BLOCKS)]
)
def test_readme_example_runs(index: int) -> None:
    code = BLOCKS[index][1]
    if "import torch" in code:
        pytest.importorskip("torch")
    # the example ports are fixed for readability; tests must not collide with anything
    for port in ("5557", "5558"):
        code = code.replace(port, str(_free_port()))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    # every "print(...)  # value" comment whose value is a literal must match the output
    # ("# 10" or "# 0 (why)"); comments in words are explanations and are not checked
    expected = [
        m.group(1).split(" (")[0].strip()
        for m in re.finditer(r"^print\(.*\)\s+#\s*(.+)$", code, flags=re.M)
    ]
    lines = [line.strip() for line in done.stdout.splitlines()]
    for want in expected:
        if want[0] in "0123456789[{'":
            assert want in lines, (want, lines)
