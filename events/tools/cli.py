"""``kv-events``: listen to KV event streams, check them, and print golden hashes.

Commands (exit status 0: fine, 1: problems found, 2: usage error)::

    kv-events listen ENDPOINT... [--record FILE] [--replay-endpoint E]... [--count N] [--timeout S]
    kv-events doctor ENDPOINT|FILE [--block-size N] [--hash-algo A] [--lora-id N] [--cache-salt S]
    kv-events hash --tokens 1,2,3,... | --tokens-file F  --tokens-per-block N [--lora-id N]
                   [--cache-salt S | --salt-id N] [--json]
    kv-events hash --check GOLDEN [--capture FILE] [--algo A]... [--hasher library|worker]
    kv-events hash --record GOLDEN --corpus FILE [--capture FILE] [--algo A]...
    kv-events keygen DIR [--name NAME]

listen and doctor take ``--curve-key NAME.key_secret --curve-server-key SERVER.key`` to read a
CURVE-protected stream (:mod:`events.stream.security`).

Worker ``w`` is the ``w``-th endpoint given. The listener (:mod:`events.tools.listener`) connects to
each endpoint (a wildcard address such as ``tcp://*:5557`` is read as the loopback address), or
binds with ``--bind`` for publishers configured in connect mode.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import IO, Final

from events.stream.endpoints import EndpointError
from events.stream.security import (
    DEFAULT_MAX_MESSAGE_BYTES,
    SecurityError,
    curve_client_from,
    generate_keys,
)
from events.tools.capture import CaptureError, CaptureWriter, read_capture
from events.tools.cli_args import (
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_UNVERIFIED,
    EXIT_USAGE,
    ArgError,
    OneLineParser,
    UsageError,
    check_kv_events_args,
    error_line,
    parse_tokens,
    scope_from,
)
from events.tools.doctor import Doctor, DoctorOptions
from events.tools.golden_cli import golden_command
from events.tools.hashcheck import GoldenError
from events.tools.limits import MAX_TOKENS_FILE_BYTES, InputTooLarge, read_bounded_text
from events.tools.listener import OnMessage, listen
from events.wire.codec import DecodeError, decode_batch
from events.wire.model import (
    AllBlocksCleared,
    BlockHash,
    Created,
    KVCacheEvent,
    Removed,
    Stored,
    Updated,
    medium_of,
)
from kvcache.hashing import HashAlgo, blockchain_keys, hash_from_key, root_key, v1_block_hash
from kvcache.scope import ReuseScope, cache_salt_id
from kvcache.tokens import token_array

_ENDPOINT_SCHEMES: Final = ("tcp://", "ipc://", "inproc://")


# ---------------------------------------------------------------------------- formatting


def short_hash(h: BlockHash | None) -> str:
    """A block hash abbreviated for one-line output."""
    if h is None:
        return "-"
    return (f"{h:016x}" if isinstance(h, int) else h)[:10]


def describe_event(event: KVCacheEvent) -> str:
    """One readable line for an event."""
    data = event.data
    if isinstance(data, Stored):
        b = data.blocks
        first = b[0] if b else None
        return (
            f"BlockStored n={len(b)} [{' '.join(short_hash(x.block_hash) for x in b[:4])}"
            f"{' ...' if len(b) > 4 else ''}] parent={short_hash(data.parent_hash)} "
            f"tokens={sum(len(x.tokens) for x in b)} block_size={data.block_size} "
            f"medium={medium_of(first.cache_level) if first else '-'} "
            f"lora={first.lora_id if first else None} salt={first.cache_salt_id if first else None}"
        )
    if isinstance(data, Removed):
        hs = data.block_hashes
        medium = "-" if data.cache_level is None else medium_of(data.cache_level)
        return (
            f"BlockRemoved n={len(hs)} [{' '.join(short_hash(h) for h in hs[:4])}"
            f"{' ...' if len(hs) > 4 else ''}] medium={medium}"
        )
    if isinstance(data, Updated):
        return f"BlockUpdated {short_hash(data.block_hash)} level={data.cache_level}"
    if isinstance(data, AllBlocksCleared):
        return "AllBlocksCleared"
    if isinstance(data, Created):
        return f"CacheCreated blocks_per_level={data.num_blocks_per_cache_level}"
    return repr(data)


def _printer(out: IO[str]) -> OnMessage:
    """Prints each message as one line per event, noting gaps, restarts and decode errors."""
    last: dict[int, int] = {}

    def on_message(worker: int, frames: list[bytes], replay: bool) -> None:
        tag = f"w{worker}" + (" replay" if replay else "")
        if len(frames) != 3 or len(frames[1]) != 8:
            out.write(f"{tag} MALFORMED message: frame sizes {[len(f) for f in frames]}\n")
            return
        seq = int.from_bytes(frames[1], "big")
        prev = last.get(worker)
        if prev is not None and not replay:
            if seq > prev + 1:
                out.write(f"{tag} GAP: seq {prev + 1}..{seq - 1} missing\n")
            elif seq <= prev:
                out.write(f"{tag} seq went back from {prev} to {seq} (restart or duplicate)\n")
        if not replay or prev is None or seq > prev:
            last[worker] = seq
        try:
            batch = decode_batch(frames[2])
        except DecodeError as exc:
            out.write(f"{tag} seq={seq} DECODE ERROR: {exc}\n")
            return
        if not batch.events:
            out.write(f"{tag} seq={seq} (empty batch)\n")
        for event in batch.events:
            out.write(f"{tag} seq={seq} #{event.event_id} {describe_event(event)}\n")
        out.flush()

    return on_message


# --------------------------------------------------------------------------------- hash


MAX_HASH_BLOCKS: Final = 65536
"""Most blocks ``kv-events hash`` prints (about 1 s and 18 MB of output)."""


def _read_tokens_file(path: str) -> list[int]:
    try:
        text = read_bounded_text(path, "--tokens-file", MAX_TOKENS_FILE_BYTES)
    except OSError as exc:
        raise UsageError(f"cannot read --tokens-file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"--tokens-file {path} is not UTF-8 text ({exc.reason})") from None
    except InputTooLarge as exc:
        raise UsageError(str(exc)) from None
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            values = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--tokens-file {path}: invalid JSON list ({exc.msg})") from None
        if not isinstance(values, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in values
        ):
            raise UsageError(f"--tokens-file {path}: expected a JSON list of integers")
        if not values:
            raise UsageError(f"--tokens-file {path}: the token list is empty")
        return values
    return parse_tokens(stripped)


def hash_table(
    tokens: Sequence[int], tokens_per_block: int, scope: ReuseScope
) -> dict[str, object]:
    """Block keys and every algorithm's hash for each block of ``tokens`` under ``scope``.

    The last block may be partial: it has a key and hashes too (an engine announcing partial
    blocks would use them), but routers only hash full blocks.
    """
    keys = blockchain_keys(scope, tokens, tokens_per_block)
    blocks: list[dict[str, object]] = []
    parent = 0
    for i, key in enumerate(keys):
        chunk = tokens[i * tokens_per_block : (i + 1) * tokens_per_block]
        v1 = v1_block_hash(chunk, parent, scope.lora_id, scope.salt)
        parent = v1
        blocks.append(
            {
                "index": i,
                "start": i * tokens_per_block,
                "end": i * tokens_per_block + len(chunk),
                "full": len(chunk) == tokens_per_block,
                "key": key.hex(),
                HashAlgo.V1_BLOCK_KEY.value: v1,
                HashAlgo.V2_SHA256.value: hash_from_key(HashAlgo.V2_SHA256, key),
                HashAlgo.V2_SHA256_64.value: hash_from_key(HashAlgo.V2_SHA256_64, key),
            }
        )
    return {
        "tokens_per_block": tokens_per_block,
        "num_tokens": len(tokens),
        "lora_id": scope.lora_id,
        "salt_id": scope.salt,
        "scope_bytes": scope.to_bytes().hex(),
        "root_key": root_key(scope).hex(),
        "blocks": blocks,
    }


def _render_hash_table(table: dict[str, object]) -> str:
    lines = [
        f"tokens: {table['num_tokens']}, tokens_per_block: {table['tokens_per_block']}, "
        f"lora_id: {table['lora_id']}, salt_id: {table['salt_id']}",
        f"scope bytes: {table['scope_bytes']}",
        f"root key:    {table['root_key']}",
    ]
    blocks = table["blocks"]
    assert isinstance(blocks, list)
    for b in blocks:
        state = "full" if b["full"] else "partial (routers do not hash it)"
        lines.append(f"block {b['index']} tokens [{b['start']}:{b['end']}] {state}")
        lines.append(f"  key          {b['key']}")
        for algo in HashAlgo:
            lines.append(f"  {algo.value:<12} {b[algo.value]}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- arguments


def _add_scope_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-id", type=int, help="LoRA adapter id of the scope")
    p.add_argument("--cache-salt", help="the request's cache_salt string (salt = its salt id)")
    p.add_argument("--salt-id", type=int, help="the scope's 64-bit salt id itself")


def _add_stream_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--replay-endpoint",
        action="append",
        default=[],
        help="replay socket of the n-th endpoint (repeat per endpoint); fills gaps",
    )
    p.add_argument("--topic", default="", help="topic to subscribe to (default: all)")
    p.add_argument("--count", type=int, help="stop after this many live messages")
    p.add_argument("--timeout", type=float, help="stop after this many seconds")
    p.add_argument("--bind", action="store_true", help="bind instead of connecting")
    p.add_argument(
        "--curve-key",
        metavar="KEY_SECRET",
        help="this listener's CURVE key pair (a .key_secret file from kv-events keygen)",
    )
    p.add_argument(
        "--curve-server-key",
        metavar="KEY",
        help="the publisher's CURVE public key (.key file); with --curve-key, turns CURVE on",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help=f"drop a peer that sends a bigger message (default {DEFAULT_MAX_MESSAGE_BYTES})",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``kv-events`` argument parser."""
    parser = OneLineParser(
        prog="kv-events", description="Listen to, check and hash KV cache events."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("listen", help="print a live event stream, optionally recording it")
    p.add_argument("endpoints", nargs="+", metavar="ENDPOINT")
    p.add_argument("--record", metavar="FILE", help="write the raw frames to a capture file")
    _add_stream_args(p)

    p = sub.add_parser("doctor", help="check a live stream or a capture file")
    p.add_argument("target", metavar="ENDPOINT|FILE")
    p.add_argument("--block-size", type=int, help="the router's tokens per block")
    p.add_argument(
        "--hash-algo",
        choices=[a.value for a in HashAlgo],
        help="the router's hash algorithm: every block is checked against it (default: what "
        "the events declare)",
    )
    p.add_argument("--lora-id", type=int, help="impose this LoRA id on every block")
    p.add_argument("--salt-id", type=int, help="impose this 64-bit salt id on every block")
    p.add_argument(
        "--cache-salt",
        action="append",
        default=[],
        metavar="S",
        help="a cache_salt string the requests used (repeat for several): makes a stream "
        "without salt ids checkable, and checks announced salt ids' derivation",
    )
    p.add_argument(
        "--require-verified",
        action="store_true",
        help=f"exit {EXIT_UNVERIFIED} unless every block hash verified (no engine-native, "
        "unverifiable or unrecomputable blocks, at least one verified)",
    )
    _add_stream_args(p)

    p = sub.add_parser("keygen", help="write a CURVE key pair (NAME.key, NAME.key_secret)")
    p.add_argument("directory", help="folder for the key files (created if missing)")
    p.add_argument("--name", default="kv-events", help="file name stem (default kv-events)")

    p = sub.add_parser("hash", help="print block hashes, or check / record a golden file of them")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="token ids, comma or space separated")
    src.add_argument("--tokens-file", help="file of token ids (separated, or a JSON list)")
    src.add_argument(
        "--check", metavar="GOLDEN", help="compare hashes with a golden file (shipped:ALGO too)"
    )
    src.add_argument("--record", metavar="GOLDEN", help="write a golden file from --corpus")
    p.add_argument(
        "--force",
        action="store_true",
        help="--record hashes under this project's algorithm names even where they differ "
        "from the library's own computation",
    )
    p.add_argument("--tokens-per-block", type=int)
    _add_scope_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--corpus", help="prompts for --record: a golden-format file or token lines")
    p.add_argument("--capture", help="take the hashes an engine published in this capture")
    p.add_argument("--algo", action="append", default=[], help="algorithm(s) to check or record")
    p.add_argument(
        "--hasher",
        choices=["library", "worker"],
        default="library",
        help="hash with this library's functions or through this project's worker",
    )
    return parser


# ------------------------------------------------------------------------------ commands


def _cmd_listen(args: argparse.Namespace, out: IO[str]) -> int:
    printer = _printer(out)
    if args.record is None:
        _listen_with(args, args.endpoints, printer)
        return EXIT_OK
    try:
        stream = open(args.record, "w", encoding="utf-8")  # noqa: SIM115 (closed by the with)
    except OSError as exc:
        raise UsageError(f"cannot write --record {args.record}: {exc.strerror}") from None
    with stream:
        writer = CaptureWriter(stream, args.endpoints)

        def record(worker: int, frames: list[bytes], replay: bool) -> None:
            writer.write(worker, frames, replay)
            printer(worker, frames, replay)

        _listen_with(args, args.endpoints, record)
    out.write(f"recorded {writer.count} messages to {args.record}\n")
    return EXIT_OK


def _listen_with(
    args: argparse.Namespace,
    endpoints: Sequence[str],
    on_message: OnMessage,
    default_timeout_s: float | None = None,
) -> int:
    """Run :func:`listen` with the stream options of the command line."""
    if args.count is not None and args.count < 1:
        raise UsageError(f"--count must be >= 1, got {args.count}")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0, got {args.timeout}")
    timeout = args.timeout
    if timeout is None and args.count is None:
        timeout = default_timeout_s
    try:
        curve = curve_client_from(args.curve_key, args.curve_server_key)
        return listen(
            endpoints,
            on_message,
            replay_endpoints=args.replay_endpoint,
            topic=args.topic,
            count=args.count,
            timeout_s=timeout,
            bind=args.bind,
            curve=curve,
            max_message_bytes=args.max_message_bytes,
        )
    except (EndpointError, SecurityError) as exc:
        raise UsageError(str(exc)) from None


def _cmd_keygen(args: argparse.Namespace, out: IO[str]) -> int:
    try:
        public, secret = generate_keys(args.directory, args.name)
    except SecurityError as exc:
        raise UsageError(str(exc)) from None
    out.write(f"public key: {public}\nsecret key: {secret} (keep it private)\n")
    return EXIT_OK


def _cmd_doctor(args: argparse.Namespace, out: IO[str]) -> int:
    if args.block_size is not None and args.block_size < 1:
        raise UsageError(f"--block-size must be >= 1, got {args.block_size}")
    options = DoctorOptions(
        block_size=args.block_size,
        hash_algo=None if args.hash_algo is None else HashAlgo(args.hash_algo),
        scope=_doctor_scope(args),
        salts=tuple(args.cache_salt),
    )
    if args.target.startswith(_ENDPOINT_SCHEMES):
        doctor = Doctor(options, [args.target])
        # a live check must end on its own: 10 s unless --count or --timeout say otherwise
        received = _listen_with(args, [args.target], doctor.feed, default_timeout_s=10.0)
        if received == 0:
            # nothing was checked: "OK" would tell an operator a silent stream is healthy
            out.write(f"no messages received from {args.target}: nothing was checked\n")
            return EXIT_PROBLEMS
    else:
        try:
            capture = read_capture(args.target)
        except OSError as exc:
            raise UsageError(f"cannot read capture {args.target}: {exc.strerror}") from None
        except CaptureError as exc:
            raise UsageError(f"{args.target}: {exc}") from None
        if not capture.messages:
            # a header alone: "OK" would tell an operator a stream nothing was read from is fine
            raise UsageError(f"{args.target}: the capture holds no message: nothing to check")
        doctor = Doctor(options, capture.endpoints)
        for message in capture.messages:
            doctor.feed(message.worker, message.frames, message.replay)
    problems = [f for f in doctor.finish() if f.severity == "problem"]
    out.write(doctor.render() + "\n")
    if problems:
        return EXIT_PROBLEMS
    if args.require_verified and not doctor.fully_verified():
        out.write(
            f"--require-verified: not every block hash was verified ({doctor.verdict()}): "
            f"exit {EXIT_UNVERIFIED}\n"
        )
        return EXIT_UNVERIFIED
    return EXIT_OK


def _doctor_scope(args: argparse.Namespace) -> ReuseScope | None:
    """The scope ``--lora-id`` / ``--salt-id`` impose (with at most one ``--cache-salt``)."""
    if args.lora_id is None and args.salt_id is None:
        return None
    salt = args.salt_id
    if args.cache_salt:
        if salt is not None or len(args.cache_salt) > 1:
            raise UsageError(
                "an imposed scope (--lora-id / --salt-id) takes one salt: --salt-id or a "
                "single --cache-salt"
            )
        salt = cache_salt_id(args.cache_salt[0])
    try:
        return ReuseScope(args.lora_id, salt)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def _cmd_hash(args: argparse.Namespace, out: IO[str]) -> int:
    if args.check is not None or args.record is not None:
        return golden_command(args, out)
    if args.tokens_per_block is None:
        raise UsageError("--tokens-per-block is required to print hashes")
    if args.tokens_per_block < 1:
        raise UsageError(f"--tokens-per-block must be >= 1, got {args.tokens_per_block}")
    tokens = (
        parse_tokens(args.tokens)
        if args.tokens is not None
        else _read_tokens_file(args.tokens_file)
    )
    blocks = -(-len(tokens) // args.tokens_per_block)
    if blocks > MAX_HASH_BLOCKS:
        # each block prints ~270 bytes at ~16 us apiece: 2M blocks took minutes and half a
        # gigabyte of output
        raise UsageError(
            f"{len(tokens)} tokens at {args.tokens_per_block} per block are {blocks} blocks; "
            f"at most {MAX_HASH_BLOCKS} are printed: hash fewer tokens or use a larger "
            "--tokens-per-block"
        )
    try:
        token_array(tokens)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    table = hash_table(tokens, args.tokens_per_block, scope_from(args) or ReuseScope())
    out.write((json.dumps(table, indent=2) if args.json else _render_hash_table(table)) + "\n")
    return EXIT_OK


_COMMANDS: Final = {
    "listen": _cmd_listen,
    "doctor": _cmd_doctor,
    "hash": _cmd_hash,
    "keygen": _cmd_keygen,
}


def main(argv: Sequence[str] | None = None, out: IO[str] | None = None) -> int:
    """Run ``kv-events``; returns the exit status (0 ok, 1 problems found, 2 usage error, 3
    ``doctor --require-verified`` with block hashes left unverified)."""
    stream = sys.stdout if out is None else out
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse reports usage errors itself, with status 2
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        check_kv_events_args(args)  # types, ranges, UTF-8, endpoints: before any work
        return _COMMANDS[args.command](args, stream)
    except (UsageError, GoldenError, ArgError) as exc:
        sys.stderr.write(error_line(f"kv-events {args.command}: error: {exc}"))
        return EXIT_USAGE
    except RecursionError:  # json's parser on a file nested thousands of levels deep
        sys.stderr.write(f"kv-events {args.command}: error: an input is nested too deeply\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK
