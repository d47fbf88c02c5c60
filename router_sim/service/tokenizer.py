"""Text and chat prompts into token ids, with the model's own tokenizer, as the engine does.

The router hashes token ids; clients send text and chat messages. So the router tokenizes the
way the engine behind it will: a local Hugging Face tokenizer (a ``tokenizer.json``, or the
directory that holds it with its ``tokenizer_config.json``; nothing is downloaded) read by the
``tokenizers`` library, and the chat template the model ships (``chat_template`` of
``tokenizer_config.json``, or ``chat_template.jinja`` / ``chat_template.json`` beside it),
rendered with jinja2 in a sandbox the way Hugging Face chat templates are rendered: blocks
trimmed, ``raise_exception`` and ``strftime_now`` available, ``tojson`` as a filter, the
tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables.

As vLLM does: a completions prompt is tokenized with the tokenizer's special tokens added
(``add_special_tokens`` true), a rendered chat prompt without them (the template writes its
own), and a request may say otherwise with ``add_special_tokens``.

A tokenizer that cannot be loaded is a :class:`TokenizerError` naming the path (the service
refuses to start); a template that fails on a request's messages is a ``BadRequest``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from router_sim.service.protocol import BadRequest, ChatBody, Prompt

_SPECIAL: Final = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
MAX_TEMPLATE_BYTES: Final = 1 << 20
MAX_RENDERED_CHARS: Final = 64 << 20  # a rendered prompt larger than this is refused


class TokenizerError(ValueError):
    """A tokenizer or chat template that cannot be used; the message names the path."""


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise TokenizerError(f"{path} is not a JSON object")
    return doc


def _pick_template(value: Any, where: Path) -> str | None:
    """``chat_template`` as saved: a string, or a list of named ones (the ``default`` one)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
    raise TokenizerError(f"{where}: chat_template is neither a string nor a named 'default'")


class PromptTokenizer:
    """See the module docstring."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        *,
        source: str = "<memory>",
    ) -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        if chat_template is not None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True,
                lstrip_blocks=True,
                extensions=[jinja2.ext.loopcontrols],
                undefined=jinja2.Undefined,
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(chat_template)
            except jinja2.TemplateSyntaxError as exc:
                raise TokenizerError(f"{source}: the chat template does not parse: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> PromptTokenizer:
        """From a ``tokenizer.json`` file or a directory holding one (with its config and
        chat template, when present)."""
        p = Path(path)
        folder = p if p.is_dir() else p.parent
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise TokenizerError(f"no tokenizer at {path}: want a tokenizer.json or its directory")
        try:
            tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises its own Exception subclass
            raise TokenizerError(f"cannot load the tokenizer {file}: {exc}") from None
        config: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            config = _read_json(folder / "tokenizer_config.json")
        template = _pick_template(config.get("chat_template"), folder / "tokenizer_config.json")
        jinja_file = folder / "chat_template.jinja"
        json_file = folder / "chat_template.json"
        if jinja_file.is_file():
            if jinja_file.stat().st_size > MAX_TEMPLATE_BYTES:
                raise TokenizerError(f"{jinja_file} is over {MAX_TEMPLATE_BYTES} bytes")
            template = jinja_file.read_text(encoding="utf-8")
        elif template is None and json_file.is_file():
            template = _pick_template(_read_json(json_file).get("chat_template"), json_file)
        special = {k: t for k in _SPECIAL if (t := _token_text(config.get(k))) is not None}
        return cls(tok, template, special, source=str(path))

    # ------------------------------------------------------------ prompts

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat template applied to ``messages`` (:class:`BadRequest` when the model has
        no template or the template refuses the messages)."""
        if self._template is None:
            raise BadRequest(
                f"the tokenizer {self.source} has no chat template: send prompts to /v1/completions"
            )
        if continue_final_message and add_generation_prompt:
            raise BadRequest("add_generation_prompt and continue_final_message exclude each other")
        context = {
            **(extra or {}),
            **self.special_tokens,
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            text = self._template.render(context)
        except _TemplateRefused as exc:
            raise BadRequest(f"the chat template refused the messages: {exc}") from None
        except jinja2.TemplateError as exc:
            raise BadRequest(f"the chat template failed on these messages: {exc}") from None
        if len(text) > MAX_RENDERED_CHARS:
            raise BadRequest("the rendered chat prompt is too large")
        if continue_final_message:
            final = messages[-1].get("content")
            if isinstance(final, str) and final:
                at = text.rfind(final.strip())
                if at >= 0:  # end the prompt with the last message's text: the model continues it
                    text = text[: at + len(final.strip())]
        return text

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        extra: Mapping[str, Any] | None = None,
    ) -> list[int]:
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            extra=extra,
        )
        return self.encode(text, add_special_tokens=add_special_tokens)


class _TemplateRefused(Exception):
    """``raise_exception(...)`` called by a chat template."""


def _raise(message: str) -> None:
    raise _TemplateRefused(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=False)


def prompt_ids(
    tok: PromptTokenizer | None, prompt: Prompt, add_special_tokens: bool | None
) -> list[int]:
    """The ids an engine computes for one completions prompt: ids as sent, text tokenized
    with special tokens added unless the request says otherwise (``tok`` None: text is a
    :class:`BadRequest` whose message is the caller's to complete)."""
    if not isinstance(prompt, str):
        return list(prompt)
    if tok is None:
        raise BadRequest("no tokenizer")
    ids = tok.encode(
        prompt, add_special_tokens=True if add_special_tokens is None else add_special_tokens
    )
    if not ids:
        raise BadRequest("prompt: the text tokenizes to no token")
    return ids


def chat_body_ids(tok: PromptTokenizer, body: ChatBody) -> list[int]:
    """The ids an engine computes for a chat request: the chat template over its messages,
    then the tokenizer without special tokens unless the request says otherwise."""
    ids = tok.encode_chat(
        body.template_messages(),
        add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
        continue_final_message=body.continue_final_message,
        add_special_tokens=bool(body.add_special_tokens),
        extra=body.chat_template_kwargs,
    )
    if not ids:
        raise BadRequest("messages: the chat template renders no token")
    return ids
