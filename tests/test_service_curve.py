"""``router-sim worker`` and ``serve`` with CURVE: only a router holding an allowed key reads a
worker's events (real processes on loopback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from service_procs import (
    fleet_file,
    poll,
    post_json,
    request,
    start_serve,
    start_worker,
    workers_by_id,
)

from events.stream.security import generate_keys

pytestmark = pytest.mark.timeout(120)

TPB = 16


def test_only_a_router_with_an_allowed_key_reads_the_events(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys, "worker")
    generate_keys(keys, "router")
    generate_keys(keys, "stranger")
    worker = start_worker(0, curve_key=keys / "worker.key_secret", curve_allow=keys / "router.key")
    procs = [worker]
    try:
        fleet = fleet_file(tmp_path / "fleet.json", [worker])
        server_key = str(keys / "worker.key")
        allowed = start_serve(
            fleet, "--curve-key", str(keys / "router.key_secret"), "--curve-server-key", server_key
        )
        procs.append(allowed)
        stranger = start_serve(
            fleet,
            "--curve-key",
            str(keys / "stranger.key_secret"),
            "--curve-server-key",
            server_key,
        )
        procs.append(stranger)
        plain = start_serve(fleet)
        procs.append(plain)

        prompt = [7_000 + i for i in range(4 * TPB)]
        status, _, _ = request(
            "POST", worker.http + "/v1/completions", {"prompt": [*prompt, 1], "max_tokens": 1}
        )
        assert status == 200

        def overlap(serve: object) -> int:
            code, _, body = post_json(serve.http + "/route", {"prompt": prompt})  # type: ignore[attr-defined]
            assert code == 200, body
            return int(body["overlaps"].get("0", 0))

        poll("the allowed router indexes the prompt", lambda: overlap(allowed) == 4)
        # the others were subscribed before the completion, as long as the allowed router
        assert overlap(stranger) == 0 and overlap(plain) == 0
        for other in (stranger, plain):
            assert workers_by_id(other)[0]["blocks_indexed"] == 0
            assert workers_by_id(other)[0]["state"] == "waiting"  # not a single batch read
        assert workers_by_id(allowed)[0]["blocks_indexed"] == 4
    finally:
        for p in procs:
            p.stop()


@pytest.mark.parametrize(
    "argv",
    [
        ["worker", "--curve-key", "x.key_secret"],  # no --curve-allow: refused, not plain
        ["worker", "--curve-allow", "x.key"],
        ["serve", "--port", "0", "--tokens-per-block", "16", "--curve-key", "x.key_secret"],
    ],
)
def test_half_a_curve_setting_is_a_usage_error(argv: list[str], tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "router_sim", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "CURVE" in done.stderr and "Traceback" not in done.stderr
