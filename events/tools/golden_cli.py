"""``kv-events hash --check GOLDEN`` and ``kv-events hash --record GOLDEN --corpus FILE``.

The CI side of :mod:`events.tools.hashcheck` for pipelines without pytest: ``--check`` exits 0 when
every case's hashes match the golden file, 1 on a drift (with each drift's first diverging
block and likely cause), 2 on a usage error; ``--record`` writes a golden file from a corpus,
with its provenance, and exits 1 without writing when hashes filed under one of this project's
algorithm names differ from this library's own computation (the diff is printed) unless
``--force``.
Hashes come from this library (``--hasher library``), this project's worker (``--hasher
worker``) or a capture an engine published (``--capture FILE``).
"""

from __future__ import annotations

import argparse
import shlex
from typing import IO

from events.tools.capture_hashes import CaptureHashes, compare_capture
from events.tools.cli_args import EXIT_OK, EXIT_PROBLEMS, UsageError, parse_tokens, scope_from
from events.tools.hashcheck import (
    Case,
    Golden,
    GoldenRefused,
    Hasher,
    compare,
    library_hasher,
    load_golden,
    record,
    render_report,
    resolve,
    worker_hasher,
    write_golden,
)
from events.tools.limits import MAX_SMALL_FILE_BYTES, InputTooLarge, read_bounded_text
from kvcache.hashing import HashAlgo
from kvcache.scope import ReuseScope
from kvcache.tokens import token_array


def _read_corpus(args: argparse.Namespace) -> Golden:
    """The prompts to record: a golden-format file, or one prompt of token ids per line
    (then ``--tokens-per-block``, the scope flags and ``--algo`` apply to every line)."""
    if args.corpus is None:
        raise UsageError("--record needs a --corpus of prompts")
    try:
        text = read_bounded_text(args.corpus, "--corpus", MAX_SMALL_FILE_BYTES)
    except InputTooLarge as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot read --corpus {args.corpus}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"--corpus {args.corpus} is not UTF-8 text ({exc.reason})") from None
    if text.lstrip().startswith("{"):
        return load_golden(args.corpus)
    tpb = args.tokens_per_block
    if tpb is None or tpb < 1:
        raise UsageError("a corpus of token lines needs --tokens-per-block N (N >= 1)")
    scope = scope_from(args) or ReuseScope()
    salt = args.cache_salt
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise UsageError(f"--corpus {args.corpus} holds no prompts")
    cases = [Case(f"line-{n}", parse_tokens(line), tpb, scope, salt) for n, line in lines]
    for case in cases:
        try:
            token_array(case.tokens)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"--corpus {args.corpus}, {case.name}: {exc}") from None
    return Golden(tpb, args.algo or [HashAlgo.V1_BLOCK_KEY.value], cases)


def _command(args: argparse.Namespace) -> str:
    """The ``kv-events hash --record`` command line, for the file's provenance."""
    parts = ["kv-events", "hash", "--record", str(args.record)]
    for flag, value in (
        ("--corpus", args.corpus),
        ("--tokens-per-block", args.tokens_per_block),
        ("--lora-id", args.lora_id),
        ("--cache-salt", args.cache_salt),
        ("--salt-id", args.salt_id),
        ("--capture", args.capture),
        ("--hasher", args.hasher if args.capture is None else None),
    ):
        if value is not None:
            parts += [flag, str(value)]
    for algo in args.algo:
        parts += ["--algo", algo]
    return shlex.join(parts + (["--force"] if args.force else []))


def golden_command(args: argparse.Namespace, out: IO[str]) -> int:
    """``hash --check GOLDEN`` (0 stable, 1 drift) and ``hash --record GOLDEN --corpus C``."""
    hasher: Hasher = worker_hasher if args.hasher == "worker" else library_hasher
    capture = None if args.capture is None else CaptureHashes(args.capture)
    if args.record is not None:
        corpus = _read_corpus(args)
        algos = args.algo or corpus.algorithms
        if capture is not None:
            if len(algos) != 1:
                raise UsageError("name the engine's one algorithm with --algo to record a capture")
            hasher = capture.hasher
        try:
            golden = record(corpus, hasher, algos, force=args.force)
        except GoldenRefused as exc:
            out.write(f"{exc}\nnothing written to {args.record}\n")
            return EXIT_PROBLEMS
        try:
            write_golden(args.record, golden, _command(args))
        except OSError as exc:
            raise UsageError(f"cannot write --record {args.record}: {exc.strerror}") from None
        out.write(f"recorded {len(golden.cases)} case(s) x {algos} to {args.record}\n")
        return EXIT_OK
    golden = load_golden(resolve(args.check))
    algos = args.algo or golden.algorithms
    if capture is not None:
        if len(algos) != 1:
            raise UsageError(
                f"the golden file has {algos}: name the engine's algorithm with --algo"
            )
        drifts = compare_capture(golden, capture, algos[0])
    else:
        drifts = compare(golden, hasher, algos)
    if drifts:
        out.write(render_report(args.check, golden, drifts, algos) + "\n")
        return EXIT_PROBLEMS
    source = "the capture" if capture is not None else f"the {args.hasher} hasher"
    out.write(f"stable: {len(golden.cases)} case(s) x {algos} from {source} match {args.check}\n")
    return EXIT_OK
