"""The HTTP bodies that the router service and the worker process speak, and their errors.

Both sides validate requests with the same pydantic models, so a prompt the router accepts is a
prompt the worker accepts. Prompts are token ids only (OpenAI's completions API allows a list of
ints as ``prompt``; there is no tokenizer here). Bodies are parsed with
``model_validate_json``: pydantic-core parses and checks an 8,192-id prompt in one pass, well
under the cost of ``json.loads`` followed by a Python check per id. ``POST /route``, the path
that runs at high rates, reads its JSON body with msgspec instead (:class:`RouteJson`: the
same fields and bounds), and its prompt, when it is written plainly (digits, commas, JSON
whitespace), straight into packed int32 ids natively: a body of 8,192 ids costs ~0.17 ms to
parse into Python ints with msgspec, ~0.05 ms when the prompt comes first (the native reader
takes it, msgspec the members after it) and ~0.12 ms when it comes later (msgspec walks it
once to find it), and the router hashes packed ids without unpacking them. Any other spelling
goes to msgspec, which accepts or names it.

``POST /route`` also takes the prompt packed (``Content-Type: application/octet-stream``,
little-endian int32 ids, the other fields as query parameters).

Every error answer is JSON in OpenAI's shape, ``{"error": {"message", "type", "code"}}``;
:func:`json_errors` is the aiohttp middleware that makes that true for aiohttp's own 404/405/413
answers too, and turns an unexpected exception into a logged 500 instead of a dropped
connection.
"""

from __future__ import annotations

import logging
import sys
from array import array
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Annotated, Any, Final, NamedTuple, TypeVar

import msgspec
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)

MAX_BODY_BYTES: Final = 16 * 1024 * 1024
"""Largest request body either side reads (a 1M-token prompt as JSON is about 8 MB)."""
MAX_PROMPT_TOKENS: Final = 1 << 20
MAX_OUTPUT_TOKENS: Final = 1 << 16

TokenId = Annotated[int, Field(strict=True, ge=0, lt=2**31)]
"""A token id: what ``kvcache.keys`` accepts (ints in [0, 2**31), no bools or floats)."""
U64 = Annotated[int, Field(strict=True, ge=0, lt=2**64)]


class _Body(BaseModel):
    # unknown OpenAI fields (temperature, top_p, ...) are accepted and ignored
    model_config = ConfigDict(extra="ignore", frozen=True)


class RouteBody(_Body):
    """``POST /route``: which worker should serve this prompt, and why."""

    prompt: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    lora_id: U64 | None = None
    lora_name: str | None = None
    cache_salt: Annotated[str, Field(max_length=4096)] | None = None


class _RouteRest(msgspec.Struct, frozen=True):
    """The members after a leading ``prompt`` (see :func:`parse_route_body`); with the prompt
    required, the whole body (:class:`RouteJson`)."""

    prompt: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET  # a second one: the full path
    lora_id: Annotated[int, msgspec.Meta(ge=0)] | None = None
    lora_name: str | None = None
    cache_salt: Annotated[str, msgspec.Meta(max_length=4096)] | None = None


class RouteJson(_RouteRest, frozen=True):
    """:class:`RouteBody` as msgspec reads it: the same fields and bounds (msgspec's ints are
    strict too: no bools, no floats), parsed in half pydantic's time for 8,192 ids, since
    ``POST /route`` is the path that runs at high rates. msgspec sets no upper bound on these
    ints, so ``lora_id < 2**64`` is checked after."""

    prompt: msgspec.Raw  # read by parse_route_body (see _PROMPT)


class RouteRequest(NamedTuple):
    """A parsed JSON ``POST /route`` body."""

    prompt: Sequence[int]  # array('i') when read natively, else a list
    lora_id: int | None
    lora_name: str | None
    cache_salt: str | None


_ROUTE_DECODER: Final = msgspec.json.Decoder(RouteJson)
_REST_DECODER: Final = msgspec.json.Decoder(_RouteRest)
_JSON_SPACE: Final = b" \t\n\r"
_PROMPT: Final = msgspec.json.Decoder(
    Annotated[
        list[Annotated[int, msgspec.Meta(ge=0, lt=2**31)]],
        msgspec.Meta(min_length=1, max_length=MAX_PROMPT_TOKENS),
    ]
)

try:
    from events.wire._json_prompt import json_prompt_first as _native_first
    from events.wire._json_prompt import tokens_from_json as _native_prompt
except ImportError:  # pragma: no cover - depends on the install
    _native_prompt = _native_first = None  # type: ignore[assignment]


def _prompt_first(body: bytes) -> RouteRequest | None:
    """The body read without msgspec walking the prompt: when it is an object whose first
    member is ``prompt``, written plainly, the native reader takes the prompt and msgspec
    reads the members after it (re-opened as an object of their own). None whenever that is
    not exactly what the body says (no such prompt, a second ``prompt``, anything malformed
    or refused after it): the full path then reads the body and names what is wrong."""
    got = _native_first(body, MAX_PROMPT_TOKENS)
    if got is None:
        return None
    prompt, end = got
    rest = body[end:].lstrip(_JSON_SPACE)
    if rest[:1] == b"}":
        return None if rest[1:].strip(_JSON_SPACE) else RouteRequest(prompt, None, None, None)
    if rest[:1] != b"," or rest[1:].lstrip(_JSON_SPACE)[:1] != b'"':
        return None  # not a member after the comma (a trailing comma is not JSON)
    try:
        more = _REST_DECODER.decode(b"{" + rest[1:])
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    if more.prompt is not msgspec.UNSET or (more.lora_id is not None and more.lora_id >= 2**64):
        return None
    return RouteRequest(prompt, more.lora_id, more.lora_name, more.cache_salt)


def parse_route_body(body: bytes) -> RouteRequest:
    """A JSON ``POST /route`` body (what :class:`RouteBody` accepts; :class:`BadRequest`
    with a short message otherwise)."""
    if _native_first is not None and type(body) is bytes:
        fast = _prompt_first(body)
        if fast is not None:
            return fast
    try:
        got = _ROUTE_DECODER.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise BadRequest(str(exc)) from None
    if got.lora_id is not None and got.lora_id >= 2**64:
        raise BadRequest("lora_id: must be < 2**64")
    prompt: Sequence[int] | None = None
    if _native_prompt is not None:
        prompt = _native_prompt(got.prompt, MAX_PROMPT_TOKENS)
    if prompt is None:  # no native reader, or a spelling it leaves to msgspec
        try:
            prompt = _PROMPT.decode(got.prompt)
        except msgspec.ValidationError as exc:  # its path is within the prompt: say so
            message = str(exc)
            where = message.replace("- at `$", "- at `$.prompt", 1)
            raise BadRequest(where if where != message else f"{message} - at `$.prompt`") from None
    return RouteRequest(prompt, got.lora_id, got.lora_name, got.cache_salt)


PACKED_TOKENS: Final = "application/octet-stream"
"""``POST /route`` body of raw token ids: little-endian int32s, the parameters in the query."""


class RouteQuery(_Body):
    """The query parameters of a packed ``POST /route`` (same meaning as in the JSON body)."""

    lora_id: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    lora_name: str | None = None
    cache_salt: Annotated[str, Field(max_length=4096)] | None = None


def packed_tokens(body: bytes) -> array[int]:
    """Token ids from a packed body (little-endian int32s). Their range is checked where they
    are hashed: the router refuses negative ids with a ``ValueError``."""
    if not body or len(body) % 4:
        raise BadRequest(f"a packed prompt is a non-empty multiple of 4 bytes, got {len(body)}")
    if len(body) > 4 * MAX_PROMPT_TOKENS:
        raise BadRequest(f"a prompt has at most {MAX_PROMPT_TOKENS} tokens")
    tokens: array[int] = array("i")
    tokens.frombytes(body)
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens


class CompletionBody(RouteBody):
    """``POST /v1/completions`` with a token-id prompt (the subset of OpenAI's fields used).

    ``model`` may name a LoRA adapter of the fleet file (the router resolves it to
    ``lora_id``). One prompt per request: OpenAI's batch form (a list of prompts) is refused.
    """

    model: str | None = None
    max_tokens: Annotated[int, Field(strict=True, ge=1, le=MAX_OUTPUT_TOKENS)] = 16
    stream: Annotated[bool, Field(strict=True)] = False


class BadRequest(ValueError):
    """A request body that does not validate; the message says what was wrong."""


M = TypeVar("M", bound=BaseModel)


def parse_body(model: type[M], body: bytes) -> M:
    """Validate a JSON body against ``model``; :class:`BadRequest` with a short message."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _bad(exc) from None


def parse_query(model: type[M], query: Mapping[str, str]) -> M:
    """Validate query parameters against ``model``; :class:`BadRequest` when they do not."""
    try:
        return model.model_validate(dict(query))
    except ValidationError as exc:
        raise _bad(exc) from None


def _bad(exc: ValidationError) -> BadRequest:
    first = exc.errors(include_url=False)[:3]
    parts = []
    for err in first:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    more = exc.error_count() - len(first)
    suffix = f" (and {more} more errors)" if more > 0 else ""
    return BadRequest("; ".join(parts) + suffix)


_ENCODE = msgspec.json.Encoder().encode


def json_answer(body: Any, status: int = 200) -> web.Response:
    """``body`` as a JSON answer. msgspec's encoder (int dict keys become strings, as with
    ``json.dumps``) takes ~5 us for a decision's explanation where ``json.dumps`` and
    ``web.json_response`` take ~25; a non-finite float becomes ``null`` (valid JSON)."""
    return web.Response(body=_ENCODE(body), status=status, content_type="application/json")


def error_response(status: int, message: str, kind: str | None = None) -> web.Response:
    """An OpenAI-shaped JSON error."""
    if kind is None:
        kind = "invalid_request_error" if status < 500 else "server_error"
    return json_answer({"error": {"message": message, "type": kind, "code": status}}, status)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error as JSON: BadRequest -> 400, aiohttp's HTTP errors keep their status."""
    try:
        return await handler(request)
    except BadRequest as exc:
        return error_response(400, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason if not exc.text else exc.text)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "internal error (logged by the server)")


async def read_body(request: web.Request) -> bytes:
    """The request body; a body over :data:`MAX_BODY_BYTES` is a 413 (as JSON, through
    :func:`json_errors`)."""
    return await request.read()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage`` object, with ``prompt_tokens_details.cached_tokens`` (prefix hits)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
