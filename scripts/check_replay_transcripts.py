"""Check the golden replay transcripts (tests/data/engines/replay/) against the engines' own
released code (run by hand, never in CI: it needs the wheels).

For each transcript it imports ``vllm/distributed/kv_events.py`` from the release's wheel with
only engine-internal imports stubbed (the loader of ``record_engine_captures.py``), builds the
transcript's batches with the engine's own event classes, publishes them through the engine's
own ``ZmqEventPublisher`` (topic and ``ipc://`` endpoints as the transcript says), and compares,
byte for byte, the live frames a SUB receives and the replies a DEALER gets to each request.

Run from the repository root:
    python scripts/check_replay_transcripts.py [--wheels DIR]
DIR holds (or receives, by ``pip download --no-deps``) the wheels. Exit status 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_engine_captures import fetch_wheel, load_vllm

TRANSCRIPTS = Path(__file__).resolve().parent.parent / "tests" / "data" / "engines" / "replay"


def _event(mod: Any, spec: dict[str, Any]) -> Any:
    fields = {k: v for k, v in spec.items() if k != "type"}
    return getattr(mod, spec["type"])(**fields)


def check(path: Path, wheels: Path) -> list[str]:
    doc = json.loads(path.read_text())
    wheel = next(iter(wheels.glob(f"vllm-{doc['version']}-*.whl")), None)
    if wheel is None:
        wheel = fetch_wheel("vllm", doc["version"], wheels)
    mod = load_vllm(wheel)
    problems: list[str] = []
    ctx = zmq.Context.instance()
    with tempfile.TemporaryDirectory() as work:
        pub_ep, replay_ep = f"ipc://{work}/pub", f"ipc://{work}/replay"
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        topic = bytes.fromhex(doc["topic_hex"]).decode()
        publisher = mod.ZmqEventPublisher(
            0, endpoint=pub_ep, replay_endpoint=replay_ep, topic=topic
        )
        sub.connect(pub_ep)
        time.sleep(0.5)  # a PUB drops what it sends before the SUB joined (a script, not a test)
        for b in doc["batches"]:
            events = [_event(mod, e) for e in b["events"]]
            publisher.publish(mod.KVEventBatch(ts=b["ts"], events=events))
        live = []
        while len(live) < len(doc["batches"]) and sub.poll(5000):
            live.append([f.hex() for f in sub.recv_multipart()])
        if live != doc["live"]:
            problems.append(f"{path.name}: live frames differ:\n {live}\n {doc['live']}")
        for ex in doc["exchanges"]:
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(replay_ep)
            dealer.send_multipart([bytes.fromhex(f) for f in ex["request"]])
            got = []
            while dealer.poll(5000):
                frames = dealer.recv_multipart()
                got.append([f.hex() for f in frames])
                if b"\xff" * 8 in frames:
                    break
            dealer.close(0)
            if got != ex["reply"]:
                problems.append(
                    f"{path.name}: reply to {ex['request']} differs:\n {got}\n {ex['reply']}"
                )
        publisher.shutdown()
        sub.close(0)
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", default=tempfile.gettempdir() + "/engine-wheels")
    args = ap.parse_args()
    wheels = Path(args.wheels)
    wheels.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    for path in sorted(TRANSCRIPTS.glob("vllm-*.json")):
        found = check(path, wheels)
        print(f"{path.name}: {'ok' if not found else 'MISMATCH'}")
        problems += found
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
