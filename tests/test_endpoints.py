"""The bind/connect rule and data-parallel offset of WIRE.md section 4."""

from __future__ import annotations

import pytest

from events.stream.endpoints import EndpointError, connectable, offset_for_rank, should_bind


@pytest.mark.parametrize(
    ("endpoint", "bind"),
    [
        ("tcp://*:5557", True),
        ("tcp://127.0.0.1:*", True),
        ("tcp://[::]:5557", True),
        ("tcp://0.0.0.0:5557", True),
        ("ipc:///tmp/kv-events", True),
        ("inproc://kv-events", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://router.example:5557", False),
        ("tcp://10.0.0.3:5557", False),
    ],
)
def test_bind_or_connect(endpoint: str, bind: bool) -> None:
    assert should_bind(endpoint) is bind


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 3, "tcp://*:5560"),
        ("tcp://10.0.0.3:5557", 1, "tcp://10.0.0.3:5558"),
        ("tcp://[::1]:5557", 2, "tcp://[::1]:5559"),
        ("inproc://kv", 0, "inproc://kv"),
        ("inproc://kv", 2, "inproc://kv_dp2"),
        ("ipc:///tmp/kv", 1, "ipc:///tmp/kv_dp1"),
        ("tcp://127.0.0.1:*", 4, "tcp://127.0.0.1:*"),
        # port 0 is "any free port" to ZeroMQ: every rank binds its own, never port 0 + rank
        ("tcp://127.0.0.1:0", 3, "tcp://127.0.0.1:0"),
        ("tcp://*:0", 1, "tcp://*:0"),
    ],
)
def test_data_parallel_offset(endpoint: str, rank: int, expected: str) -> None:
    assert offset_for_rank(endpoint, rank) == expected


@pytest.mark.parametrize(
    ("endpoint", "rank", "message"),
    [
        ("udp://1.2.3.4:5", 0, "unsupported endpoint"),
        ("tcp://host", 1, "has no port"),
        ("tcp://host:http", 1, "non-numeric port"),
        ("tcp://host:65535", 1, "exceeds 65535"),
        ("tcp://host:5557", -1, "dp_rank must be"),
    ],
)
def test_bad_endpoints_are_typed_errors(endpoint: str, rank: int, message: str) -> None:
    with pytest.raises(EndpointError, match=message):
        offset_for_rank(endpoint, rank)


def test_connectable_maps_wildcard_hosts_to_loopback() -> None:
    assert connectable("tcp://0.0.0.0:6000") == "tcp://127.0.0.1:6000"
    assert connectable("tcp://*:6000") == "tcp://127.0.0.1:6000"
    assert connectable("tcp://10.1.2.3:6000") == "tcp://10.1.2.3:6000"
    assert connectable("inproc://x") == "inproc://x"
