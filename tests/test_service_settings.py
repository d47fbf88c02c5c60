"""``router-sim serve``'s settings: defaults in every help, a TOML config file under the
command line, timestamped and levelled log lines, startup errors that name what is wrong."""

from __future__ import annotations

import argparse
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from router_sim.cli import build_parser
from router_sim.service.settings import ConfigError, resolve

pytestmark = pytest.mark.timeout(60)


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices["serve"]
    return parser


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_every_serve_option_has_help_ending_with_its_default() -> None:
    for action in serve_parser()._actions:
        if not action.option_strings or action.dest in ("help", "config"):
            continue
        assert action.help, action.dest
        text, sep, default = action.help.rpartition(" (default: ")
        assert text and sep and default.endswith(")"), (action.dest, action.help)
    helps = {a.dest: a.help for a in serve_parser()._actions}
    assert str(helps["port"]).endswith("(default: 8000)")
    assert str(helps["policy"]).endswith("(default: kv_overlap)")
    assert str(helps["reuse_port"]).endswith("(default: off)")


def test_the_config_file_fills_what_the_command_line_leaves_out(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(
        'port = 9000\nhealth-interval = 0.25\npolicy = "round_robin"\nlog_level = "debug"\n'
        "reuse-port = true\n"
    )
    args = resolve(parse("--config", str(config), "--policy", "least_loaded", "--port", "8000"))
    assert args.port == 8000  # given, though equal to the default: the command line wins
    assert args.policy == "least_loaded"
    assert args.health_interval == 0.25 and args.log_level == "debug" and args.reuse_port
    assert args.replay_timeout_ms == 1000 and args.fleet is None  # neither given: defaults
    plain = resolve(parse())
    assert (plain.port, plain.policy, plain.reuse_port) == (8000, "kv_overlap", False)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("health-intervall = 1.0", "did you mean health-interval?"),
        ('port = "80"', "port wants a int"),
        ("reuse-port = 1", "reuse-port wants a bool"),
        ('policy = "nope"', "policy must be one of"),
        ("port = [", "is not TOML"),
    ],
)
def test_a_bad_config_file_names_the_file_and_the_key(tmp_path: Path, text: str, says: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(text + "\n")
    with pytest.raises(ConfigError, match=re.escape(says)) as err:
        resolve(parse("--config", str(config)))
    assert str(config) in str(err.value)
    with pytest.raises(ConfigError, match="cannot read"):
        resolve(parse("--config", str(tmp_path / "missing.toml")))


def _run(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "router_sim", "serve", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_startup_errors_name_the_tokenizer_and_the_config_file(tmp_path: Path) -> None:
    for argv, says in (
        (["--tokenizer", str(tmp_path / "no-model")], str(tmp_path / "no-model")),
        (["--config", str(tmp_path / "none.toml")], str(tmp_path / "none.toml")),
    ):
        p = _run("--port", "0", *argv)
        _, err = p.communicate(timeout=30)
        assert p.returncode == 2 and says in err, err


def test_log_lines_carry_time_and_level_and_a_down_worker_is_logged(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.json"
    fleet.write_text(
        '{"workers": [{"id": 3, "engine": "vllm", "http": "http://127.0.0.1:9", '
        '"events": "tcp://127.0.0.1:9"}]}'
    )
    p = subprocess.Popen(
        [sys.executable, "-m", "router_sim", "serve", "--fleet", str(fleet), "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        bufsize=0,
    )
    try:
        assert p.stderr is not None
        seen = b""
        deadline = time.monotonic() + 20
        while b"worker 3 is down" not in seen:
            left = deadline - time.monotonic()
            assert left > 0, f"no log line saying worker 3 is down: {seen!r}"
            ready, _, _ = select.select([p.stderr], [], [], left)
            if ready:
                chunk = os.read(p.stderr.fileno(), 65536)
                assert chunk, f"serve exited: {seen!r}"
                seen += chunk
        line = next(x for x in seen.decode().splitlines() if "worker 3 is down" in x)
        stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING router_sim\.service\.core: "
        want = stamp + r"worker 3 is down: cannot connect to http://127\.0\.0\.1:9/health"
        assert re.match(want, line), line
    finally:
        p.terminate()
        p.wait(timeout=10)


def test_a_misspelt_policy_option_is_named_with_the_one_meant() -> None:
    p = _run("--port", "0", "--policy-options", '{"overlap_weigth": 2}')
    _, err = p.communicate(timeout=30)
    assert p.returncode == 2, err
    assert "no option 'overlap_weigth' (did you mean 'overlap_weight'?)" in err
    assert "'balance'" not in err.split("its options")[0]  # the valid one is not blamed
