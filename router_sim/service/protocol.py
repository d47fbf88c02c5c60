"""The HTTP bodies that the router service and the worker process speak, and their errors.

Both sides validate requests with the same pydantic models, so a prompt the router accepts is a
prompt the worker accepts. A completions ``prompt`` is any of OpenAI's forms (a string, token
ids, or a list of either: :func:`read_prompts`); chat bodies (:class:`ChatBody`) carry
``messages``; text becomes ids through the model's tokenizer (:mod:`.tokenizer`). Bodies are
parsed with ``model_validate_json``, token ids checked by msgspec in one pass. ``POST /route``,
the path that runs at high rates, reads a token-id body with msgspec instead
(:class:`RouteJson`: the same fields and bounds); a body it refuses may still be a text, batch
or chat route (:class:`TextRouteBody`).

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
"""A token id: what ``kvcache.tokens`` accepts (ints in [0, 2**31), no bools or floats)."""
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


class RouteJson(msgspec.Struct, frozen=True):
    """:class:`RouteBody` as msgspec reads it: the same fields and bounds (msgspec's ints are
    strict too: no bools, no floats), parsed in half pydantic's time for 8,192 ids, since
    ``POST /route`` is the path that runs at high rates. msgspec sets no upper bound on these
    ints, so ``lora_id < 2**64`` is checked after. The prompt is read on its own (``_PROMPT``),
    as pydantic does, from the last ``prompt`` member when a body repeats it."""

    prompt: msgspec.Raw
    lora_id: Annotated[int, msgspec.Meta(ge=0)] | None = None
    lora_name: str | None = None
    cache_salt: Annotated[str, msgspec.Meta(max_length=4096)] | None = None


class RouteRequest(NamedTuple):
    """A parsed JSON ``POST /route`` body."""

    prompt: Sequence[int]
    lora_id: int | None
    lora_name: str | None
    cache_salt: str | None


_PromptIds = Annotated[
    list[Annotated[int, msgspec.Meta(ge=0, lt=2**31)]],
    msgspec.Meta(min_length=1, max_length=MAX_PROMPT_TOKENS),
]


class _RouteJsonTyped(RouteJson, frozen=True):
    """:class:`RouteJson` with its prompt read in the same pass: what a well-formed body takes
    (one parse of the ids instead of a skip and a parse, ~40% of a JSON decision's CPU)."""

    prompt: _PromptIds  # type: ignore[assignment]


class _RouteJsonInts(RouteJson, frozen=True):
    """:class:`_RouteJsonTyped` without the range of each id: ints (no bools, floats or
    strings), as many as :class:`RouteBody` takes, of any value. Checking each id's range took
    ~10% of the service's CPU per JSON decision of 8,192 ids; the hashing that follows checks
    it anyway (see :func:`parse_route_body`'s ``check_ids``)."""

    prompt: Annotated[list[int], msgspec.Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]  # type: ignore[assignment]


_ROUTE_TYPED: Final = msgspec.json.Decoder(_RouteJsonTyped)
_ROUTE_INTS: Final = msgspec.json.Decoder(_RouteJsonInts)
_ROUTE_DECODER: Final = msgspec.json.Decoder(RouteJson)
_PROMPT: Final = msgspec.json.Decoder(_PromptIds)

UNCHECKED_IDS_MAX_BYTES: Final = 1 << 20
"""The largest body whose ids :func:`parse_route_body` reads unchecked when asked to: an id
outside the range stops the checked reading at once, while the unchecked one reads every id,
each up to 4,300 digits (Python's own limit), and a body of such ids is ~4x slower to read
than one of small ids. Up to this size (~130,000 ids) that costs a few milliseconds at
worst; a larger body is read checked, so the slowest body to refuse stays what it was."""


def parse_route_body(body: bytes, *, check_ids: bool = True) -> RouteRequest:
    """A JSON ``POST /route`` body (what :class:`RouteBody` accepts; :class:`BadRequest`
    with a short message otherwise).

    ``check_ids=False``: a body of up to :data:`UNCHECKED_IDS_MAX_BYTES` whose prompt is a
    list of ints is returned without checking that they are token ids (in [0, 2**31)); every
    other body is read as with ``check_ids=True``. For a caller that hands the ids to the
    router's hashing at once (which refuses any id out of that range with a ``ValueError``)
    and, on any :class:`BadRequest` after this reading, reads the body again checked, so that
    a bad id is reported as it always was, before anything else
    (:func:`router_sim.service.app.route`)."""
    try:
        typed: _RouteJsonTyped | _RouteJsonInts
        if check_ids or len(body) > UNCHECKED_IDS_MAX_BYTES:
            typed = _ROUTE_TYPED.decode(body)
        else:
            typed = _ROUTE_INTS.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass  # read again in two steps, which say what is wrong (or take a repeated prompt)
    else:
        if typed.lora_id is None or typed.lora_id < 2**64:
            return RouteRequest(typed.prompt, typed.lora_id, typed.lora_name, typed.cache_salt)
    try:
        got = _ROUTE_DECODER.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise BadRequest(str(exc)) from None
    if got.lora_id is not None and got.lora_id >= 2**64:
        raise BadRequest("lora_id: must be < 2**64")
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


class BadRequest(ValueError):
    """A request body that does not validate; the message says what was wrong."""


class NotFound(ValueError):
    """A request for something the service does not serve (a 404); the message says what
    it does serve."""


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
    except NotFound as exc:
        return error_response(404, str(exc), "not_found_error")
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


# ---------------------------------------------------------------- text and chat prompts

MAX_PROMPT_CHARS: Final = 8 << 20
MAX_BATCH_PROMPTS: Final = 1024
MAX_MESSAGES: Final = 4096
ROLES: Final = ("system", "user", "assistant", "tool", "developer")

Prompt = str | Sequence[int]
"""One prompt: text, or token ids."""


def read_prompts(value: Any, where: str = "prompt") -> list[Prompt]:
    """OpenAI's ``prompt``: a string, a list of token ids, a list of strings or a list of
    token-id lists; as a list of prompts. :class:`BadRequest` saying what is wrong otherwise
    (strings where ids are expected and the reverse included)."""
    if isinstance(value, str):
        return [_text(value, where)]
    if not isinstance(value, list) or not value:
        raise BadRequest(
            f"{where}: want a string, a list of token ids, a list of strings or a list of "
            f"lists of token ids; got {_kind(value)}"
        )
    first = value[0]
    if isinstance(first, int) and not isinstance(first, bool):
        return [_ids(value, where)]
    if len(value) > MAX_BATCH_PROMPTS:
        raise BadRequest(f"{where}: at most {MAX_BATCH_PROMPTS} prompts in a batch")
    if isinstance(first, str):
        for i, v in enumerate(value):
            if not isinstance(v, str):
                raise BadRequest(f"{where}[{i}]: a batch of strings holds {_kind(v)}")
        return [_text(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(first, list):
        out: list[Prompt] = []
        for i, v in enumerate(value):
            if not isinstance(v, list):
                raise BadRequest(f"{where}[{i}]: a batch of token-id lists holds {_kind(v)}")
            out.append(_ids(v, f"{where}[{i}]"))
        return out
    raise BadRequest(f"{where}[0]: want a token id or a string, got {_kind(first)}")


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    return {str: "a string", int: "an integer", float: "a number", dict: "an object"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def _text(value: str, where: str) -> str:
    if not value:
        raise BadRequest(f"{where}: the prompt is empty")
    if len(value) > MAX_PROMPT_CHARS:
        raise BadRequest(f"{where}: a text prompt has at most {MAX_PROMPT_CHARS} characters")
    return value


_IDS: Final = list[Annotated[int, msgspec.Meta(ge=0, lt=2**31)]]


def _ids(value: list[Any], where: str) -> list[int]:
    if not value:
        raise BadRequest(f"{where}: the prompt is empty")
    if len(value) > MAX_PROMPT_TOKENS:
        raise BadRequest(f"{where}: a prompt has at most {MAX_PROMPT_TOKENS} tokens")
    try:
        return msgspec.convert(value, _IDS, strict=True)  # one pass in C, bools refused
    except msgspec.ValidationError:
        pass
    for i, t in enumerate(value):  # say which id, and what it is
        if type(t) is not int or not 0 <= t < 2**31:
            got = f"{t!r}" if type(t) in (int, float) else _kind(t)
            raise BadRequest(
                f"{where}[{i}]: token ids are integers in [0, 2**31), got {got}"
                + (" (a list of token ids holds no strings)" if isinstance(t, str) else "")
            )
    raise BadRequest(f"{where}: not a list of token ids")  # pragma: no cover - unreachable


class _OpenAIBody(_Body):
    model: str | None = None
    lora_id: U64 | None = None
    lora_name: str | None = None
    cache_salt: Annotated[str, Field(max_length=4096)] | None = None
    max_tokens: Annotated[int, Field(strict=True, ge=1, le=MAX_OUTPUT_TOKENS)] | None = None
    stream: Annotated[bool, Field(strict=True)] = False
    add_special_tokens: Annotated[bool, Field(strict=True)] | None = None


class CompletionBody(_OpenAIBody):
    """``POST /v1/completions`` as the router reads it: ``prompt`` is any of OpenAI's forms
    (see :func:`read_prompts`); ``model`` may name a LoRA adapter of the fleet file."""

    prompt: Any = None


class ChatMessage(_Body):
    """One chat message; ``content`` a string or a list of text parts. Other members
    (``name``, ``tool_calls``, ...) are handed to the chat template as sent."""

    model_config = ConfigDict(extra="allow", frozen=True)

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_OpenAIBody):
    """``POST /v1/chat/completions``: ``messages`` rendered by the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1, le=MAX_OUTPUT_TOKENS)] | None = (
        None
    )
    add_generation_prompt: Annotated[bool, Field(strict=True)] = True
    continue_final_message: Annotated[bool, Field(strict=True)] = False
    chat_template_kwargs: dict[str, Any] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the template reads them (text parts joined by newlines, as vLLM
        does for templates that take string content); :class:`BadRequest` for unknown
        roles, missing content and parts that are not text."""
        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            if m.role not in ROLES:
                raise BadRequest(f"{where}.role: want one of {', '.join(ROLES)}; got {m.role!r}")
            content = m.content
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise BadRequest(
                            f"{where}.content[{j}]: only text parts can be routed "
                            f"(type {part.get('type')!r})"
                        )
                    texts.append(part["text"])
                content = "\n".join(texts)
            extra = dict(m.model_extra or {})
            if content is None and not (m.role == "assistant" and extra.get("tool_calls")):
                raise BadRequest(f"{where}: a {m.role} message needs content")
            out.append({**extra, "role": m.role, "content": content})
        return out


class TextRouteBody(_Body):
    """``POST /route`` with a text prompt, a batch, or chat ``messages`` (exactly one)."""

    prompt: Any = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = (
        None
    )
    model: str | None = None
    lora_id: U64 | None = None
    lora_name: str | None = None
    cache_salt: Annotated[str, Field(max_length=4096)] | None = None
    add_special_tokens: Annotated[bool, Field(strict=True)] | None = None
    add_generation_prompt: Annotated[bool, Field(strict=True)] = True
    continue_final_message: Annotated[bool, Field(strict=True)] = False
    chat_template_kwargs: dict[str, Any] | None = None

    def as_chat(self) -> ChatBody:
        assert self.messages is not None
        return ChatBody.model_validate(
            {
                "messages": self.messages,
                "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
                "chat_template_kwargs": self.chat_template_kwargs,
                "add_special_tokens": self.add_special_tokens,
            }
        )
