"""Requests and the built-in synthetic workloads of the simulator.

A :class:`Request` is what arrives at the router: a prompt (token ids), how many tokens the
answer has, and its reuse scope (LoRA adapter, tenant cache salt). Prompts are either explicit
token arrays (synthetic workloads) or Mooncake-style hash ids expanded on demand
(:mod:`router_sim.sim.trace`), so a 12k-request trace never holds all its prompts in memory.

The synthetic generators model the sharing patterns that make cache-aware routing matter:

- ``shared-prompts``: a few long system prompts, each request adds a unique user message;
- ``multi-turn``: sessions whose next turn is the previous prompt + answer + a new message;
- ``tenants``: tenants sending the *same* prompts, separated by cache salts (no sharing across);
- ``lora``: requests spread over LoRA adapters (each adapter its own namespace);
- ``mixed``: all of the above interleaved (the default of ``router-sim run``).

Arrivals are Poisson; everything is drawn from one ``random.Random(seed)``, so a seed fixes the
workload exactly.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import numpy

from kvcache.scope import ReuseScope
from router_sim.sim.native import expand_array


def _hash_ids_needed(hash_ids: tuple[int, ...], input_length: int, n: int) -> int:
    """How many of ``hash_ids`` (``n`` tokens each) a prompt of ``input_length`` tokens
    spans; ``ValueError`` when they are too few."""
    k = -(-input_length // n)
    if k > len(hash_ids):
        raise ValueError(
            f"input_length {input_length} needs more than {len(hash_ids)} hash ids of {n} tokens"
        )
    return k


_ZERO: Final = array("i", [0])  # repeated: a new zeroed array('i') for expand_array to fill

VOCAB_SIZE: Final = 32_000
"""Synthetic token ids are drawn from [0, VOCAB_SIZE) (a Llama-2-sized vocabulary)."""

TOKENS_PER_HASH_ID: Final = 512
"""Tokens per hash id in the Mooncake trace format."""

_THINK_MS: Final = 2000.0
_READ_MS_PER_TOKEN: Final = 40.0


PROMPT_TOKEN_BITS: Final = 30
"""Tokens of expanded hash ids lie below ``2**PROMPT_TOKEN_BITS``; generated answers of such
requests at and above it (:meth:`Request.output_tokens`), so that no answer token equals a
prompt token and a prompt never matches past the hash ids it shares."""


def _layout(tokens_per_hash_id: int) -> tuple[int, int]:
    """(bits for the position inside a block, mask of the hash id bits) of a token id: the
    position takes the high bits, the id the ``PROMPT_TOKEN_BITS - pos_bits`` low ones."""
    pos_bits = max(1, (tokens_per_hash_id - 1).bit_length())
    return pos_bits, (1 << (PROMPT_TOKEN_BITS - pos_bits)) - 1


def expand_hash_ids(
    hash_ids: tuple[int, ...], input_length: int, tokens_per_hash_id: int = TOKENS_PER_HASH_ID
) -> array[int]:
    """The prompt of a Mooncake-style request: each hash id becomes its own run of tokens.

    Token ``j`` of hash id ``h`` is ``j << b | (h mod 2**b)`` with ``b = 30 - position bits``
    (``b = 21`` for 512 tokens per id: 2,097,152 distinct ids; every token below 2**30): equal
    ids give equal tokens, distinct ids (below 2**b) give disjoint tokens, so two prompts share
    exactly the token prefix their hash ids share.
    The last block is cut so the prompt has ``input_length`` tokens. The simulator's native
    extension (``router_sim.sim._prefetch.expand_array``, the C statement of the formula its
    prompt thread uses too) writes the prompt in one pass, into an array made here.
    """
    n = tokens_per_hash_id
    _hash_ids_needed(hash_ids, input_length, n)
    pos_bits, mask = _layout(n)
    ids = hash_ids if type(hash_ids) is tuple else tuple(hash_ids)
    out = _ZERO * input_length
    return expand_array(out, ids, input_length, n, PROMPT_TOKEN_BITS - pos_bits, mask)


@dataclass(slots=True)
class Request:
    """One request: prompt, answer length, reuse scope and arrival time (ms, simulated)."""

    request_id: int
    arrival_ms: float
    input_length: int
    output_length: int
    lora_id: int | None = None
    cache_salt: str | None = None
    prompt: array[int] | None = None
    """Explicit prompt tokens; None when the prompt is given by ``hash_ids``."""
    hash_ids: tuple[int, ...] | None = None
    output: array[int] | None = None
    """The answer's tokens when the workload fixes them (a session's next turn repeats them)."""
    session_id: int | None = None
    tokens_per_hash_id: int = TOKENS_PER_HASH_ID
    scope: ReuseScope = field(init=False)

    def __post_init__(self) -> None:
        if self.input_length < 1:
            raise ValueError(f"request {self.request_id}: input_length must be >= 1")
        if self.output_length < 1:
            raise ValueError(f"request {self.request_id}: output_length must be >= 1")
        if self.prompt is None and self.hash_ids is None:
            raise ValueError(f"request {self.request_id}: give either prompt or hash_ids")
        if self.prompt is not None and len(self.prompt) != self.input_length:
            raise ValueError(
                f"request {self.request_id}: prompt has {len(self.prompt)} tokens, "
                f"input_length says {self.input_length}"
            )
        self.scope = ReuseScope.for_request(lora_id=self.lora_id, cache_salt=self.cache_salt)

    def tokens(self) -> array[int]:
        """The prompt's token ids (expanded from hash ids when needed; not cached)."""
        if self.prompt is not None:
            return self.prompt
        assert self.hash_ids is not None
        return expand_hash_ids(self.hash_ids, self.input_length, self.tokens_per_hash_id)

    def output_tokens(self) -> array[int]:
        """The answer's token ids: the fixed ones, or a run unique to this request.

        Generated tokens live at and above 2**30 so they never collide with prompt tokens of the
        trace expansion or the synthetic vocabulary (numpy writes the run: ``array('i',
        range(...))`` takes a Python int per id, about 60x as long for ids this large).
        """
        if self.output is not None:
            return self.output
        base = (1 << 30) + (self.request_id * 4099) % ((1 << 30) - self.output_length)
        ids = numpy.arange(base, base + self.output_length, dtype=numpy.int32)
        return array("i", ids.tobytes())


@dataclass(slots=True)
class SyntheticSpec:
    """Knobs of the synthetic workloads (defaults give a small run that finishes in seconds)."""

    num_requests: int = 400
    rate_per_s: float = 20.0
    """Mean Poisson arrival rate."""
    system_prompts: int = 6
    system_prompt_len: tuple[int, int] = (600, 1500)
    user_len: tuple[int, int] = (40, 300)
    output_len: tuple[int, int] = (20, 120)
    sessions: int = 40
    turns: tuple[int, int] = (2, 6)
    tenants: int = 4
    adapters: int = 3


def _tokens(rng: random.Random, n: int) -> array[int]:
    return array("i", [rng.randrange(VOCAB_SIZE) for _ in range(n)])


class _Builder:
    """Accumulates requests with Poisson arrival times from one RNG."""

    def __init__(self, spec: SyntheticSpec, seed: int) -> None:
        self.spec = spec
        self.rng = random.Random(seed)
        self.clock_ms = 0.0
        self.out: list[Request] = []
        self.system = [
            _tokens(self.rng, self.rng.randint(*spec.system_prompt_len))
            for _ in range(spec.system_prompts)
        ]

    def next_arrival(self) -> float:
        self.clock_ms += self.rng.expovariate(self.spec.rate_per_s) * 1000.0
        return self.clock_ms

    def add(
        self,
        prompt: array[int],
        *,
        lora_id: int | None = None,
        cache_salt: str | None = None,
        session_id: int | None = None,
        output: array[int] | None = None,
        arrival_ms: float | None = None,
    ) -> Request:
        out_len = len(output) if output is not None else self.rng.randint(*self.spec.output_len)
        req = Request(
            request_id=len(self.out),
            arrival_ms=round(self.next_arrival() if arrival_ms is None else arrival_ms, 6),
            input_length=len(prompt),
            output_length=out_len,
            lora_id=lora_id,
            cache_salt=cache_salt,
            prompt=prompt,
            output=output,
            session_id=session_id,
        )
        self.out.append(req)
        return req

    def user(self) -> array[int]:
        return _tokens(self.rng, self.rng.randint(*self.spec.user_len))

    def system_prompt(self) -> array[int]:
        # Zipf-like popularity: the first prompts are used much more than the last ones.
        weights = [1.0 / (i + 1) for i in range(len(self.system))]
        return self.rng.choices(self.system, weights)[0]


def _shared_prompts(b: _Builder) -> Callable[[], None]:
    def one() -> None:
        b.add(b.system_prompt() + b.user())

    return one


def _tenants(b: _Builder) -> Callable[[], None]:
    def one() -> None:
        tenant = b.rng.randrange(b.spec.tenants)
        b.add(b.system_prompt() + b.user(), cache_salt=f"tenant-{tenant}")

    return one


def _lora(b: _Builder) -> Callable[[], None]:
    def one() -> None:
        adapter = b.rng.randrange(b.spec.adapters)
        b.add(b.system_prompt() + b.user(), lora_id=adapter + 1)

    return one


def _multi_turn(b: _Builder) -> Callable[[], None]:
    # Each session keeps its conversation so far; the next turn appends the previous answer
    # and a new user message, so consecutive turns share everything but the new message. A
    # session's next turn comes only after its answer could have been read (think time), as a
    # real user's would.
    history: dict[int, array[int]] = {}
    turns_left: dict[int, int] = {}
    ready_at: dict[int, float] = {}
    next_session = [0]

    def one() -> None:
        now = b.next_arrival()
        ready = [s for s, left in turns_left.items() if left > 0 and ready_at[s] <= now]
        if not ready or (len(ready) < b.spec.sessions and b.rng.random() < 0.3):
            sid = next_session[0]
            next_session[0] += 1
            history[sid] = b.system_prompt() + b.user()
            turns_left[sid] = b.rng.randint(*b.spec.turns)
        else:
            sid = b.rng.choice(ready)
        prompt = history[sid]
        answer = _tokens(b.rng, b.rng.randint(*b.spec.output_len))
        b.add(prompt, session_id=sid, output=answer, arrival_ms=now)
        history[sid] = prompt + answer + b.user()
        turns_left[sid] -= 1
        ready_at[sid] = now + _THINK_MS + _READ_MS_PER_TOKEN * len(answer)

    return one


WORKLOADS: Final[dict[str, tuple[str, ...]]] = {
    "shared-prompts": ("shared-prompts",),
    "multi-turn": ("multi-turn",),
    "tenants": ("tenants",),
    "lora": ("lora",),
    "mixed": ("shared-prompts", "multi-turn", "tenants", "lora"),
}
"""Workload names accepted by :func:`synthetic_workload` and ``router-sim run --workload``."""

_MAKERS: Final[dict[str, Callable[[_Builder], Callable[[], None]]]] = {
    "shared-prompts": _shared_prompts,
    "multi-turn": _multi_turn,
    "tenants": _tenants,
    "lora": _lora,
}


def synthetic_workload(
    name: str = "mixed", seed: int = 0, spec: SyntheticSpec | None = None
) -> list[Request]:
    """Requests of a named synthetic workload, in arrival order; equal seeds give equal lists."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    b = _Builder(spec or SyntheticSpec(), seed)
    makers = [_MAKERS[part](b) for part in WORKLOADS[name]]
    for _ in range(b.spec.num_requests):
        b.rng.choice(makers)()
    return b.out


def identical_prompts_for_tenants(
    tenants: int, prompts: int, repeats: int, seed: int = 0, rate_per_s: float = 10.0
) -> list[Request]:
    """Every tenant sends the same prompts (each ``repeats`` times) under its own cache salt.

    With salts honoured, tenants never share cache: the reachable hit rate is the per-tenant
    one, not the one of the pooled prompts.
    """
    spec = SyntheticSpec(rate_per_s=rate_per_s, system_prompts=prompts)
    b = _Builder(spec, seed)
    for _ in range(repeats):
        for p in b.system:
            for t in range(tenants):
                b.add(array("i", p), cache_salt=f"tenant-{t}")
    return b.out
