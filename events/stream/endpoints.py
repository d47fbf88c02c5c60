"""ZeroMQ endpoint rules shared by the event publisher and subscriber (WIRE.md section 4).

Two rules, both fixed by compatibility with existing engines and routers:

* **bind or connect**: a publisher binds when the endpoint names a local wildcard or a local
  transport (it contains ``*`` or ``::``, or is ``ipc://``, ``inproc://`` or
  ``tcp://0.0.0.0:...``); for anything else (``tcp://host:port``) it connects, and the
  subscriber on the other side is the one that binds.
* **data-parallel offset**: the publisher of data-parallel rank ``r`` uses the tcp port plus
  ``r``, and an ``inproc://`` or ``ipc://`` name with the suffix ``_dp{r}``. Rank 0 keeps the
  endpoint unchanged for every transport, so a single-rank worker is reachable at exactly the
  address it was configured with (an in-process name cannot be shared with another process, so
  nothing outside this project depends on the rank-0 inproc spelling).
"""

from __future__ import annotations

from typing import Final

_LOCAL_SCHEMES: Final[tuple[str, ...]] = ("ipc://", "inproc://")
_TCP: Final = "tcp://"


class EndpointError(ValueError):
    """An endpoint string that the ZeroMQ transport cannot use."""


def should_bind(endpoint: str) -> bool:
    """True when a publisher at ``endpoint`` binds, False when it connects (WIRE.md 4)."""
    _check(endpoint)
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith(_LOCAL_SCHEMES)
        or endpoint.startswith("tcp://0.0.0.0:")
    )


def offset_for_rank(endpoint: str, dp_rank: int) -> str:
    """The endpoint the publisher of data-parallel rank ``dp_rank`` uses.

    tcp: port + rank (a wildcard port ``*`` or port 0 cannot be offset and is returned
    unchanged, each rank then gets its own ephemeral port); inproc/ipc: ``_dp{rank}`` suffix for
    ranks above 0.
    """
    _check(endpoint)
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
        raise EndpointError(f"dp_rank must be an int >= 0, got {dp_rank!r}")
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith(_LOCAL_SCHEMES):
        return f"{endpoint}_dp{dp_rank}"
    host, sep, port = endpoint.rpartition(":")
    if not sep or host == "tcp":
        raise EndpointError(f"tcp endpoint {endpoint!r} has no port; write tcp://HOST:PORT")
    if port in ("*", "0"):
        # an ephemeral port: each rank binds its own. vLLM's rule adds the rank to the number
        # (port 0 becomes port r, a fixed low port nobody chose); ZeroMQ's wildcard and port 0
        # both mean "any free port", so they stay as they are
        return endpoint
    if not port.isdigit():
        raise EndpointError(f"tcp endpoint {endpoint!r} has a non-numeric port {port!r}")
    new_port = int(port) + dp_rank
    if new_port > 65535:
        raise EndpointError(
            f"tcp port {port} + dp_rank {dp_rank} = {new_port} exceeds 65535; pick a lower port"
        )
    return f"{host}:{new_port}"


def connectable(endpoint: str) -> str:
    """An address a peer can connect to for a bound ``endpoint`` (as reported by ZeroMQ's
    LAST_ENDPOINT): the wildcard hosts ``0.0.0.0`` and ``*`` become the loopback address."""
    if endpoint.startswith("tcp://0.0.0.0:"):
        return "tcp://127.0.0.1:" + endpoint[len("tcp://0.0.0.0:") :]
    if endpoint.startswith("tcp://*:"):
        return "tcp://127.0.0.1:" + endpoint[len("tcp://*:") :]
    return endpoint


def _check(endpoint: str) -> None:
    if not isinstance(endpoint, str):
        raise EndpointError(f"endpoint must be a str, got {type(endpoint).__name__}")
    if not endpoint.startswith((*_LOCAL_SCHEMES, _TCP)):
        raise EndpointError(
            f"unsupported endpoint {endpoint!r}: use tcp://HOST:PORT, ipc://PATH or inproc://NAME"
        )
