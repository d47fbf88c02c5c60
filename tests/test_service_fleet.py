"""The fleet file, ``router-sim worker --count`` and the service CLIs' usage errors."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from service_procs import get_json, poll

from router_sim.cli import main
from router_sim.service.fleet import FleetError, load_fleet, parse_fleet, parse_worker

pytestmark = pytest.mark.timeout(60)

GOOD = {
    "tokens_per_block": 32,
    "loras": {"a": 3},
    "workers": [
        {"id": 0, "http": "http://127.0.0.1:8100/", "events": "tcp://127.0.0.1:5600"},
        {"id": 1, "http": "http://h:1", "events": "tcp://h:2", "replay": "tcp://h:3"},
    ],
}


def test_a_good_fleet_file_parses_with_defaults() -> None:
    fleet = parse_fleet(json.dumps(GOOD))
    assert fleet.tokens_per_block == 32 and fleet.hash_algo == "v1_block_key"
    assert fleet.loras == {"a": 3}
    assert [w.id for w in fleet.workers] == [0, 1]
    assert fleet.workers[0].http == "http://127.0.0.1:8100"  # trailing slash dropped
    assert fleet.workers[0].replay is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokens_per_block": 0}, "tokens_per_block"),
        ({"hash_algo": "md5"}, "hash_algo"),
        ({"loras": {"a": -1}}, "loras.a"),
        ({"extra": 1}, "extra"),
        ({"workers": [GOOD["workers"][0]] * 2}, "repeated: [0]"),  # type: ignore[index]
        ({"workers": [{"id": 0, "http": "h:1", "events": "tcp://h:2"}]}, "workers.0.http"),
        ({"workers": [{"id": 0, "http": "http://h:1", "events": "tcp://*:2"}]}, "bind address"),
        ({"workers": [{"id": 0, "http": "http://h:1", "events": "udp://h:2"}]}, "workers.0"),
        ({"workers": [{"id": "0", "http": "http://h:1", "events": "tcp://h:2"}]}, "workers.0.id"),
    ],
)
def test_a_bad_fleet_file_names_the_field(change: dict[str, object], message: str) -> None:
    with pytest.raises(FleetError, match="bad fleet file") as err:
        parse_fleet(json.dumps({**GOOD, **change}))
    assert message in str(err.value)


def test_unreadable_files_and_bad_entries_are_fleet_errors(tmp_path: Path) -> None:
    with pytest.raises(FleetError, match="cannot read fleet file"):
        load_fleet(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(FleetError, match="bad fleet file"):
        load_fleet(tmp_path / "bad.json")
    with pytest.raises(FleetError, match="bad worker entry"):
        parse_worker(b'{"id": 1}')


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--fleet", "nope/fleet.json", "--port", "0"], "cannot read fleet file"),
        (["serve", "--port", "0", "--policy-options", "[1]"], "JSON object"),
        (["serve", "--port", "0", "--policy-options", '{"no_such": 1}'], "no_such"),
        (["serve", "--port", "0", "--health-interval", "0"], "--health-interval"),
        (["worker", "--speedup", "0"], "--speedup"),
        (["worker", "--count", "0"], "--count"),
        (["worker", "--count", "100000"], "--count must be in [1, 256]"),  # no fork bomb
        (["worker", "--port", "99999"], "--port"),
        (["worker", "--count", "4", "--events-port", "65530"], "--events-port"),
        (["worker", "--replay-port", "-1"], "--replay-port"),
        (["worker", "--speedup", "nan"], "--speedup"),
        (["worker", "--heartbeat", "inf"], "--heartbeat"),
        (["worker", "--device-blocks", "1e10"], "--device-blocks"),  # argparse: not an int
        (["worker", "--device-blocks", str(2**40)], "--device-blocks"),
        (["worker", "--hash-algo", "md5"], "hash_algo"),
        (["serve", "--port", "99999"], "--port"),
        (["serve", "--port", "0", "--replay-timeout-ms", "-1"], "--replay-timeout-ms"),
        (["serve", "--port", "0", "--health-interval", "nan"], "--health-interval"),
    ],
)
def test_service_usage_errors_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors (a value that is not an int)
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_worker_count_starts_a_fleet_and_writes_its_file(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    argv = ["worker", "--count", "2", "--id", "5", "--speedup", "100", "--fleet-out", str(out)]
    parent = subprocess.Popen(
        [sys.executable, "-m", "router_sim", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        poll("the fleet file", out.exists, timeout_s=30)
        fleet = load_fleet(out)
        assert [w.id for w in fleet.workers] == [5, 6]
        assert fleet.tokens_per_block == 16
        for w in fleet.workers:
            assert get_json(w.http + "/healthz")["id"] == w.id
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=20) == 0
        for w in fleet.workers:  # the children went with it
            with pytest.raises(OSError):
                get_json(w.http + "/healthz")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
