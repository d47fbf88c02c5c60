"""A tiny Hugging Face tokenizer made by the ``tokenizers`` library, saved as a model ships it.

Word-level, so every id below can be derived by hand: ``<s>`` is 1, the chat markers 2-4,
the words ``w0`` .. ``w999`` are 10 .. 1009 (``wN`` is ``N + 10``), anything else ``[UNK]`` (0).
A text prompt gets ``<s>`` first (the post-processor adds it when special tokens are added).
The chat template writes the BOS itself, then ``<|role|> content`` per message, then
``<|assistant|>`` when a generation prompt is asked for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

BOS: Final = 1
ROLE_IDS: Final = {"user": 2, "assistant": 3, "system": 4}
CHAT_TEMPLATE: Final = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def word(n: int) -> int:
    """The id of the word ``w{n}``."""
    return n + 10


def words(ids: range | list[int]) -> str:
    """The text whose words have ``ids`` (each an id of a ``wN`` word)."""
    return " ".join(f"w{i - 10}" for i in ids)


def make_tokenizer(folder: Path, *, template: str | None = CHAT_TEMPLATE) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` under ``folder/tok``."""
    out = folder / "tok"
    out.mkdir(parents=True, exist_ok=True)
    vocab = {"[UNK]": 0, "<s>": BOS, "<|user|>": 2, "<|assistant|>": 3, "<|system|>": 4}
    vocab.update({f"w{i}": word(i) for i in range(1000)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in list(vocab)[1:5]])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS)]
    )
    tok.save(str(out / "tokenizer.json"))
    config: dict[str, object] = {"bos_token": "<s>", "eos_token": None, "model_max_length": 4096}
    if template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out
