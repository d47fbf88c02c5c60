"""The fleet file: which workers a router serves, where their events and HTTP API are.

A JSON file (the shape ``router-sim worker --count N --fleet-out FILE`` writes)::

    {"tokens_per_block": 16, "hash_algo": "v1_block_key", "loras": {"support-bot": 7},
     "models": {"Qwen/Qwen3-0.6B": {"tokenizer": "/models/qwen3", "max_model_len": 32768}},
     "workers": [{"id": 0, "engine": "vllm", "http": "http://127.0.0.1:8100",
                  "events": "tcp://127.0.0.1:5557", "replay": "tcp://127.0.0.1:5558"}]}

``engine`` says what the worker runs, and so which endpoints tell its health and load
(:mod:`router_sim.service.probes`): ``native`` (this project's worker, the default), ``vllm``,
``sglang`` or ``trtllm``. ``model`` (optional) is the model a worker serves; the router also
asks each worker's ``GET /v1/models``. ``models`` (optional) gives per model a local tokenizer
(a ``tokenizer.json`` or its directory), for text and chat prompts, and its context length.

``tokens_per_block`` and ``hash_algo`` must be those of the workers (the router hashes prompts
the way they announce blocks). ``loras`` maps adapter names a client may send (``model`` or
``lora_name``) to the LoRA ids the workers' caches key by. Workers may also be added and removed
at run time through ``POST /workers`` and ``DELETE /workers/{id}``; the file is read once.

The entries are checked here, at the edge: a bad file is a :class:`FleetError` that names the
field, never a half-configured router.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from events.stream.endpoints import EndpointError, should_bind
from events.tools.limits import MAX_SMALL_FILE_BYTES, InputTooLarge, read_bounded_bytes
from kvcache.hashing import HashAlgo
from router_sim.service.probes import Engine


class FleetError(ValueError):
    """A fleet file or worker entry that cannot be used; the message says which field."""


class WorkerEntry(BaseModel):
    """One worker: its id, engine, HTTP base address, event and replay endpoints."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: Annotated[int, Field(strict=True, ge=0, lt=2**31)]
    http: str
    events: str
    replay: str | None = None
    engine: Engine = "native"
    model: Annotated[str, Field(min_length=1, max_length=1024)] | None = None

    @field_validator("http")
    @classmethod
    def _http(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"want http://HOST:PORT, got {value!r}")
        return value.rstrip("/")

    @field_validator("events", "replay")
    @classmethod
    def _zmq(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            if should_bind(value):
                raise ValueError(
                    f"{value!r} is a bind address (wildcard or local); give the address the "
                    "worker's publisher is bound to, e.g. tcp://127.0.0.1:5557"
                )
        except EndpointError as exc:
            raise ValueError(str(exc)) from None
        return value


class ModelEntry(BaseModel):
    """One model of the fleet file: its local tokenizer and context length (both optional)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokenizer: Annotated[str, Field(min_length=1)] | None = None
    max_model_len: Annotated[int, Field(strict=True, ge=1)] | None = None


class FleetFile(BaseModel):
    """The whole fleet file; see the module docstring."""

    model_config = ConfigDict(extra="forbid")

    tokens_per_block: Annotated[int, Field(strict=True, ge=1)] = 16
    hash_algo: str = "v1_block_key"
    loras: dict[str, Annotated[int, Field(strict=True, ge=0, lt=2**64)]] = Field(
        default_factory=dict
    )
    models: dict[str, ModelEntry] = Field(default_factory=dict)
    workers: list[WorkerEntry] = Field(default_factory=list)

    @field_validator("hash_algo")
    @classmethod
    def _algo(cls, value: str) -> str:
        return HashAlgo.parse(value).value

    @field_validator("workers")
    @classmethod
    def _unique(cls, value: list[WorkerEntry]) -> list[WorkerEntry]:
        ids = [w.id for w in value]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"worker ids must be unique; repeated: {dup}")
        return value


def _explain(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False)[:3]:
        where = ".".join(str(p) for p in err["loc"]) or "file"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def parse_fleet(text: str | bytes) -> FleetFile:
    """A fleet from its JSON text; :class:`FleetError` when it is not one."""
    try:
        return FleetFile.model_validate_json(text)
    except ValidationError as exc:
        raise FleetError(f"bad fleet file: {_explain(exc)}") from None


def load_fleet(path: str | Path) -> FleetFile:
    """Read and check a fleet file."""
    try:
        text = read_bounded_bytes(path, "fleet file", MAX_SMALL_FILE_BYTES)
    except InputTooLarge as exc:
        raise FleetError(str(exc)) from None
    except OSError as exc:
        raise FleetError(f"cannot read fleet file {path}: {exc.strerror}") from None
    return parse_fleet(text)


def parse_worker(body: bytes) -> WorkerEntry:
    """A worker entry from a JSON body (``POST /workers``)."""
    try:
        return WorkerEntry.model_validate_json(body)
    except ValidationError as exc:
        raise FleetError(f"bad worker entry: {_explain(exc)}") from None


# ------------------------------------------------------------- a fleet from one command


def _child_argv(args: argparse.Namespace, i: int) -> list[str]:
    def port(base: int, step: int) -> str:
        return str(base + step * i if base else 0)

    return [
        sys.executable,
        "-m",
        "router_sim",
        "worker",
        "--id",
        str(args.id + i),
        "--host",
        args.host,
        "--port",
        port(args.port, 1),
        "--events-port",
        port(args.events_port, 2),
        "--replay-port",
        port(args.replay_port or (args.events_port + 1 if args.events_port else 0), 2),
        "--tokens-per-block",
        str(args.tokens_per_block),
        "--device-blocks",
        str(args.device_blocks),
        "--max-batch-tokens",
        str(args.max_batch_tokens),
        "--hash-algo",
        args.hash_algo,
        "--replay-steps",
        str(args.replay_steps),
        "--speedup",
        str(args.speedup),
        "--model",
        args.model,
        "--heartbeat",
        str(args.heartbeat),
        "--log-level",
        getattr(args, "log_level", "warning"),
        *(["--curve-key", args.curve_key] if args.curve_key else []),
        *(["--tokenizer", args.tokenizer] if getattr(args, "tokenizer", None) else []),
        *(arg for key in args.curve_allow for arg in ("--curve-allow", key)),
    ]


def run_fleet(args: argparse.Namespace, ready_timeout_s: float = 60.0) -> int:
    """``router-sim worker --count N``: start N workers (ports ``--port + i``, events
    ``--events-port + 2i``, replay the next port), write the fleet file, wait for them."""
    procs: list[subprocess.Popen[str]] = []
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    entries: list[dict[str, Any]] = []
    try:
        for i in range(args.count):
            procs.append(subprocess.Popen(_child_argv(args, i), stdout=subprocess.PIPE, text=True))
        deadline = time.monotonic() + ready_timeout_s
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()  # the child's ready line (empty if it died)
            if not line or time.monotonic() > deadline:
                sys.stderr.write("router-sim worker: a worker failed to start\n")
                stop(signal.SIGTERM, None)
                return 1
            entries.append(json.loads(line))
        first = entries[0]
        fleet = {
            "tokens_per_block": first["tokens_per_block"],
            "hash_algo": first["hash_algo"],
            "workers": [{k: e[k] for k in ("id", "http", "events", "replay")} for e in entries],
        }
        text = json.dumps(fleet, indent=2)
        if args.fleet_out:
            tmp = f"{args.fleet_out}.tmp{os.getpid()}"
            Path(tmp).write_text(text + "\n")
            os.replace(tmp, args.fleet_out)  # readers never see half a file
            print(f"{len(entries)} workers ready; fleet file {args.fleet_out}", flush=True)
        else:
            print(text, flush=True)
        for p in procs:
            p.wait()
        return 0 if stopping else max((p.returncode for p in procs), default=0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
