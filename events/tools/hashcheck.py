"""Golden files of event block hashes: record them once, check every release against them.

A router finds a worker's prefixes only while both sides hash blocks identically; a worker
whose hashing drifts (a salt no longer mixed in, another block size, a new serialization)
breaks routing silently. A golden file pins the hashes of a corpus of prompts so a test or a CI
step fails instead. Format (JSON, UTF-8)::

    {"format": "kv-events-golden", "version": 1,
     "tokens_per_block": 16, "algorithms": ["v1_block_key"],
     "cases": [{"name": "tenant-a", "tokens": [...], "lora_id": null,
                "cache_salt": "tenant-a" | "salt_id": 123 | neither,
                "tokens_per_block": 16 (optional, overrides the file's),
                "hashes": {"v1_block_key": [...]}}]}

A corpus is the same file without ``hashes``. Hashes are the full blocks' event hashes: ints,
or hex strings for ``v2_sha256``. Algorithm names are those of :data:`KNOWN_ALGOS` (this project
recomputes them) or any other name for an engine's own hashing, checked from captures only.

Hashes come from a *hasher* (:data:`Hasher`: this library by default, :func:`worker_hasher` for
this project's worker, or an engine's own function), from a *request hasher*
(:data:`RequestHasher`: the engine's function handed the request's raw ``cache_salt`` string, so
its own salt derivation is tested too) or from a capture an engine published
(:class:`events.tools.capture_hashes.CaptureHashes`). :func:`compare` sets them against the
golden values and diagnoses each drift (:func:`events.tools.diagnosis.explain_chain`);
:func:`record` computes a golden file, and refuses (:class:`GoldenRefused`, with the diff) to
file hashes under one of this project's algorithm names that differ from this library's own
computation unless forced. :func:`write_golden` records each file's provenance (library
version, algorithms, date, command).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from importlib import metadata, resources
from pathlib import Path
from typing import Any, Final

from events.tools.diagnosis import KNOWN_ALGOS, explain_chain, reference_chain
from events.tools.limits import MAX_SMALL_FILE_BYTES, InputTooLarge, read_bounded_text
from events.wire.model import BlockHash
from kvcache.hashing import HashAlgo
from kvcache.scope import ReuseScope, cache_salt_id
from kvcache.tokens import token_array

GOLDEN_FORMAT: Final = "kv-events-golden"
GOLDEN_VERSION: Final = 1
SHIPPED_PREFIX: Final = "shipped:"

WORKER_ALGOS: Final = tuple(a.value for a in HashAlgo)
"""The algorithms this project's worker can announce (``KVCacheEventManager(hash_algo=...)``)."""

Hasher = Callable[[list[int], int, ReuseScope, str], Sequence[BlockHash]]
"""``hasher(tokens, tokens_per_block, scope, algo)`` -> the full blocks' hashes, in order."""


@dataclass(frozen=True, slots=True)
class Request:
    """What selects a request's cache scope, as an engine's API receives it."""

    lora_id: int | None
    #: the request's raw ``cache_salt`` string, when the case has one
    cache_salt: str | None
    #: the salt id WIRE.md 1 derives from ``cache_salt`` (or the case's own ``salt_id``)
    salt_id: int | None


RequestHasher = Callable[[list[int], int, Request, str], Sequence[BlockHash]]
"""``hasher(tokens, tokens_per_block, request, algo)`` -> the full blocks' hashes: an engine's
own function, deriving the salt from ``request.cache_salt`` itself."""


class GoldenError(ValueError):
    """A golden or corpus file that cannot be read or is not in the golden format."""


class GoldenRefused(GoldenError):
    """Hashes to be filed under one of this project's algorithm names differ from this
    library's own computation: recording them would change what that name means."""

    def __init__(self, drifts: Sequence[Drift]) -> None:
        self.drifts = list(drifts)
        algos = sorted({d.algo for d in drifts})
        lines = [
            f"refusing to record {len(drifts)} case(s) under {', '.join(algos)}: the hashes "
            "differ from this library's own computation of that algorithm, whose values never "
            "change (library = what the name means, actual = the hashes to record)"
        ]
        lines += [d.render(("library", "actual")) for d in drifts]
        lines.append(
            "Fix the hasher, record the engine's hashes under a name of its own (one this "
            "project does not define), or force it (pytest --kv-golden-update "
            "--kv-golden-force; kv-events hash --record ... --force)."
        )
        super().__init__("\n".join(lines))


@dataclass(frozen=True, slots=True)
class Case:
    """One prompt of the corpus and, once recorded, its hashes per algorithm."""

    name: str
    tokens: list[int]
    tokens_per_block: int
    scope: ReuseScope
    cache_salt: str | None = None
    hashes: dict[str, list[BlockHash]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Golden:
    """A golden file (or a corpus: cases without hashes)."""

    tokens_per_block: int
    algorithms: list[str]
    cases: list[Case]
    extra: dict[str, Any] = field(default_factory=dict)  # other top-level keys, kept on write


# ------------------------------------------------------------------------ reading, writing


def _int(obj: dict[str, Any], key: str, where: str, *, optional: bool = False) -> int | None:
    value = obj.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GoldenError(f"{where}: {key!r} must be a non-negative integer, got {value!r}")
    return value


def _hash_list(value: object, where: str) -> list[BlockHash]:
    if not isinstance(value, list) or not all(
        isinstance(h, str) or (isinstance(h, int) and not isinstance(h, bool)) for h in value
    ):
        raise GoldenError(f"{where}: hashes must be a list of integers or hex strings")
    return list(value)


def _case(obj: object, index: int, default_tpb: int | None) -> Case:
    where = f"case {index}"
    if not isinstance(obj, dict):
        raise GoldenError(f"{where}: expected a JSON object")
    name = obj.get("name", f"case-{index}")
    where = f"case {name!r}"
    tokens = obj.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GoldenError(f"{where}: 'tokens' must be a non-empty list of token ids")
    try:
        token_array(tokens)
    except (TypeError, ValueError) as exc:
        raise GoldenError(f"{where}: {exc}") from None
    tpb = _int(obj, "tokens_per_block", where, optional=True)
    tpb = default_tpb if tpb is None else tpb
    if not tpb:
        raise GoldenError(
            f"{where}: tokens_per_block must be given (per case or for the file) and be >= 1"
        )
    salt_text = obj.get("cache_salt")
    if salt_text is not None and not isinstance(salt_text, str):
        raise GoldenError(f"{where}: 'cache_salt' must be a string")
    salt = _int(obj, "salt_id", where, optional=True)
    if salt_text is not None:
        if salt is not None and salt != cache_salt_id(salt_text):
            raise GoldenError(f"{where}: salt_id is not cache_salt's id; give one of them")
        salt = cache_salt_id(salt_text)
    try:
        scope = ReuseScope(_int(obj, "lora_id", where, optional=True), salt)
    except (TypeError, ValueError) as exc:
        raise GoldenError(f"{where}: {exc}") from None
    raw = obj.get("hashes", {})
    if not isinstance(raw, dict):
        raise GoldenError(f"{where}: 'hashes' must map algorithm names to lists")
    hashes = {str(k): _hash_list(v, f"{where}, {k}") for k, v in raw.items()}
    return Case(str(name), tokens, tpb, scope, salt_text, hashes)


def parse_golden(obj: object) -> Golden:
    """A golden file's content from its decoded JSON; raises :class:`GoldenError`."""
    if not isinstance(obj, dict) or obj.get("format") != GOLDEN_FORMAT:
        raise GoldenError(f'not a golden file: expected {{"format": "{GOLDEN_FORMAT}", ...}}')
    if obj.get("version") != GOLDEN_VERSION:
        raise GoldenError(f"golden version {obj.get('version')!r} is not {GOLDEN_VERSION}")
    tpb = _int(obj, "tokens_per_block", "file", optional=True)
    algos = obj.get("algorithms")
    if not isinstance(algos, list) or not algos or not all(isinstance(a, str) for a in algos):
        raise GoldenError("'algorithms' must be a non-empty list of algorithm names")
    cases = obj.get("cases")
    if not isinstance(cases, list) or not cases:
        raise GoldenError("'cases' must be a non-empty list")
    parsed = [_case(c, i, tpb) for i, c in enumerate(cases)]
    names = [c.name for c in parsed]
    if len(set(names)) != len(names):
        raise GoldenError("case names must be unique")
    known = {"format", "version", "tokens_per_block", "algorithms", "cases"}
    extra = {k: v for k, v in obj.items() if k not in known}
    return Golden(tpb or parsed[0].tokens_per_block, list(algos), parsed, extra)


def shipped_path(name: str) -> Path:
    """The golden vectors shipped for algorithm ``name`` (``events/tools/golden/NAME.json``)."""
    if name not in KNOWN_ALGOS:
        raise GoldenError(f"no shipped vectors for {name!r}; expected one of {KNOWN_ALGOS}")
    return Path(str(resources.files("events.tools") / "golden" / f"{name}.json"))


def resolve(spec: str | Path) -> Path:
    """A golden file's path; ``shipped:NAME`` names the vectors shipped for algorithm NAME."""
    text = str(spec)
    return (
        shipped_path(text[len(SHIPPED_PREFIX) :]) if text.startswith(SHIPPED_PREFIX) else Path(text)
    )


def load_golden(path: str | Path) -> Golden:
    """Read a golden (or corpus) file; raises :class:`GoldenError` when it is unusable."""
    try:
        text = read_bounded_text(path, "golden file", MAX_SMALL_FILE_BYTES)
    except InputTooLarge as exc:
        raise GoldenError(str(exc)) from None
    except OSError as exc:
        raise GoldenError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise GoldenError(f"{path}: not UTF-8 text") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GoldenError(f"{path}: not JSON ({exc.msg}, line {exc.lineno})") from None
    try:
        return parse_golden(obj)
    except GoldenError as exc:
        raise GoldenError(f"{path}: {exc}") from None


def dump_golden(golden: Golden) -> str:
    """The JSON text of a golden file: one case per block of lines, one hash list per line."""
    head = {
        "format": GOLDEN_FORMAT,
        "version": GOLDEN_VERSION,
        **golden.extra,
        "tokens_per_block": golden.tokens_per_block,
        "algorithms": golden.algorithms,
    }
    lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    lines.append('  "cases": [')
    for n, case in enumerate(golden.cases):
        fields: dict[str, object] = {"name": case.name}
        if case.tokens_per_block != golden.tokens_per_block:
            fields["tokens_per_block"] = case.tokens_per_block
        fields["lora_id"] = case.scope.lora_id
        if case.cache_salt is not None:
            fields["cache_salt"] = case.cache_salt
        else:
            fields["salt_id"] = case.scope.salt
        fields["tokens"] = case.tokens
        body = [f"      {json.dumps(k)}: {json.dumps(v)}" for k, v in fields.items()]
        hashes = [f"        {json.dumps(a)}: {json.dumps(h)}" for a, h in case.hashes.items()]
        body.append(
            '      "hashes": {' + ("\n" + ",\n".join(hashes) + "\n      }" if hashes else "}")
        )
        lines.append(
            "    {\n" + ",\n".join(body) + "\n    }" + ("," if n + 1 < len(golden.cases) else "")
        )
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def library_version() -> str:
    """This library's installed version ("unknown" when it runs uninstalled)."""
    try:
        return metadata.version("scoped-kv-router")
    except metadata.PackageNotFoundError:  # pragma: no cover - depends on the install
        return "unknown"


def with_provenance(golden: Golden, command: str) -> Golden:
    """``golden`` with its ``provenance``: the library version, the algorithms, the date
    (UTC), the command that wrote it, and what :func:`record` recorded (and forced) in it."""
    before = golden.extra.get("provenance")
    recorded = before if isinstance(before, dict) and "date" not in before else {}
    provenance = {
        "library": f"scoped-kv-router {library_version()}",
        "algorithms": list(golden.algorithms),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        **recorded,
    }
    return replace(golden, extra={**golden.extra, "provenance": provenance})


def write_golden(
    path: str | Path, golden: Golden, command: str = "events.tools.hashcheck.write_golden"
) -> None:
    """Write ``golden`` to ``path`` with its provenance (:func:`with_provenance`), through a
    temporary file so a failure keeps the old one."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(dump_golden(with_provenance(golden, command)), encoding="utf-8")
    tmp.replace(target)


# --------------------------------------------------------------------------- hashers


def library_hasher(
    tokens: list[int], tokens_per_block: int, scope: ReuseScope, algo: str
) -> list[BlockHash]:
    """This library's hashes (:func:`events.tools.diagnosis.reference_chain`)."""
    if algo not in KNOWN_ALGOS:
        raise GoldenError(f"{algo!r} is not one of this project's algorithms {KNOWN_ALGOS}")
    return reference_chain(algo, tokens, tokens_per_block, scope)


def worker_hasher(
    tokens: list[int], tokens_per_block: int, scope: ReuseScope, algo: str
) -> list[BlockHash]:
    """The hashes this project's worker announces: a real ``KVCacheManager`` computes the
    prompt and a ``KVCacheEventManager(hash_algo=algo)`` turns its commits into events."""
    from events.manager import KVCacheEventManager
    from events.wire.model import Stored
    from kvcache import KVCacheManager, KVCacheManagerConfig, TierConfig

    if algo not in WORKER_ALGOS:
        raise GoldenError(f"the worker announces {WORKER_ALGOS}, not {algo!r}")
    events = KVCacheEventManager(hash_algo=algo, tokens_per_block=tokens_per_block)
    blocks = len(tokens) // tokens_per_block + 2
    config = KVCacheManagerConfig(
        tokens_per_block=tokens_per_block, tiers=[TierConfig(name="device", num_blocks=blocks)]
    )
    manager = KVCacheManager(config, event_sink=events)
    with manager.create_kv_cache(tokens, scope) as seq:
        seq.commit(tokens)
    events.flush()
    return [
        b.block_hash
        for event in events.get_latest_events()
        if isinstance(event.data, Stored)
        for b in event.data.blocks
    ]


# ------------------------------------------------------------------------ comparing


@dataclass(frozen=True, slots=True)
class Drift:
    """One case whose hashes differ from the golden ones under one algorithm."""

    case: Case
    algo: str
    expected: list[BlockHash]
    actual: list[BlockHash]
    cause: str
    at: int | None = None  # the block a structural fault was found at, when hashes agree

    @property
    def first_block(self) -> int:
        """Index of the first block whose hash differs (or is missing on one side)."""
        if self.at is not None:
            return self.at
        return next(
            (i for i, (e, a) in enumerate(zip(self.expected, self.actual, strict=False)) if e != a),
            min(len(self.expected), len(self.actual)),
        )

    def render(self, labels: tuple[str, str] = ("golden", "actual")) -> str:
        """A few lines: the case, the first diverging block with both hashes, the cause."""
        c, i = self.case, self.first_block
        tpb = c.tokens_per_block
        salt = (
            f"cache_salt={c.cache_salt!r}"
            if c.cache_salt is not None
            else f"salt_id={c.scope.salt}"
        )
        differ = sum(1 for e, a in zip(self.expected, self.actual, strict=False) if e != a)
        differ += abs(len(self.expected) - len(self.actual))
        exp = self.expected[i] if i < len(self.expected) else "(no block)"
        act = self.actual[i] if i < len(self.actual) else "(no block)"
        return "\n".join(
            [
                f"case {c.name!r} [{self.algo}, {tpb} tokens per block, "
                f"lora_id={c.scope.lora_id}, {salt}]: {differ} of {len(self.expected)} "
                "block hashes differ",
                f"  first diverging block: {i} (tokens [{i * tpb}:{(i + 1) * tpb}])",
                f"    {labels[0]}: {exp}",
                f"    {labels[1]}: {act}",
                f"  likely cause: {self.cause}",
            ]
        )


def _hashes_of(
    case: Case, algo: str, hasher: Hasher | None, request_hasher: RequestHasher | None
) -> list[BlockHash]:
    """``case``'s hashes under ``algo`` from the request hasher (handed the raw salt string)
    or the hasher (handed the derived scope; this library's by default)."""
    tokens, tpb = list(case.tokens), case.tokens_per_block
    if request_hasher is not None:
        request = Request(case.scope.lora_id, case.cache_salt, case.scope.salt)
        return list(request_hasher(tokens, tpb, request, algo))
    return list((hasher or library_hasher)(tokens, tpb, case.scope, algo))


def compare(
    golden: Golden,
    hasher: Hasher | None = None,
    algorithms: Sequence[str] | None = None,
    *,
    request_hasher: RequestHasher | None = None,
) -> list[Drift]:
    """Every (case, algorithm) whose hashes from ``hasher`` (or ``request_hasher``) differ
    from the golden ones, each with its diagnosis.

    Raises :class:`GoldenError` when a case has no golden hashes for an algorithm (record them
    first) or the hasher fails.
    """
    drifts: list[Drift] = []
    for case in golden.cases:
        for algo in algorithms or golden.algorithms:
            expected = case.hashes.get(algo)
            if expected is None:
                raise GoldenError(f"case {case.name!r} has no {algo} hashes: record them first")
            actual = _hashes_of(case, algo, hasher, request_hasher)
            if actual != expected:
                cause = explain_chain(
                    algo,
                    case.tokens,
                    case.tokens_per_block,
                    case.scope,
                    expected,
                    actual,
                    case.cache_salt,
                )
                drifts.append(Drift(case, algo, expected, actual, cause))
    return drifts


def library_drifts(golden: Golden, algorithms: Sequence[str] | None = None) -> list[Drift]:
    """The cases whose filed hashes under one of this project's algorithm names differ from
    this library's computation (library = expected, filed = actual)."""
    drifts = []
    for case in golden.cases:
        for algo in algorithms or golden.algorithms:
            filed = case.hashes.get(algo)
            if algo not in KNOWN_ALGOS or filed is None:
                continue
            library = reference_chain(algo, case.tokens, case.tokens_per_block, case.scope)
            if filed != library:
                cause = explain_chain(
                    algo,
                    case.tokens,
                    case.tokens_per_block,
                    case.scope,
                    library,
                    filed,
                    case.cache_salt,
                )
                drifts.append(Drift(case, algo, library, filed, cause))
    return drifts


def record(
    golden: Golden,
    hasher: Hasher | None = None,
    algorithms: Sequence[str] | None = None,
    *,
    request_hasher: RequestHasher | None = None,
    force: bool = False,
) -> Golden:
    """``golden`` with every case's ``algorithms`` hashes (default: all of the file's)
    recomputed by ``hasher`` (or ``request_hasher``); the corpus is kept, and so are other
    algorithms' hashes where every case has them.

    Hashes for one of this project's algorithm names (:data:`KNOWN_ALGOS`) that differ from
    this library's own computation raise :class:`GoldenRefused` with the diff, unless
    ``force``; the result's ``provenance`` says which algorithms were recorded (and forced).
    """
    fresh = list(dict.fromkeys(algorithms or golden.algorithms))
    kept = [a for a in golden.algorithms if a in fresh or all(a in c.hashes for c in golden.cases)]
    algos = kept + [a for a in fresh if a not in kept]
    cases = []
    for c in golden.cases:
        hashes = {a: c.hashes[a] for a in kept if a not in fresh}
        hashes.update({a: _hashes_of(c, a, hasher, request_hasher) for a in fresh})
        cases.append(replace(c, hashes={a: hashes[a] for a in algos}))
    recorded = replace(golden, algorithms=algos, cases=cases)
    differ = library_drifts(recorded, fresh)
    if differ and not force:
        raise GoldenRefused(differ)
    provenance: dict[str, Any] = {"recorded": fresh}
    if differ:
        provenance["forced"] = sorted({d.algo for d in differ})
    return replace(recorded, extra={**golden.extra, "provenance": provenance})


def render_report(
    source: str,
    golden: Golden,
    drifts: Sequence[Drift],
    algorithms: Sequence[str] | None = None,
) -> str:
    """The failure text: what differs in which golden file, then each drift."""
    checks = len(golden.cases) * len(algorithms or golden.algorithms)
    lines = [f"KV event hash drift against {source}: {len(drifts)} of {checks} checks differ"]
    lines += [d.render() for d in drifts]
    lines.append(
        "An algorithm's output never changes: fix the hashing, or give the new hashes a new "
        "algorithm name. Rewrite the golden file (pytest --kv-golden-update, kv-events hash "
        "--record) only for a deliberate change."
    )
    return "\n".join(lines)
