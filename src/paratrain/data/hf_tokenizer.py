"""Hugging Face tokenizers for fine-tuning: load one offline, and render chats with it.

A pretrained model only understands the token ids of the tokenizer it was trained with, so
fine-tuning never trains a tokenizer: it loads the model's own from disk (no network, ever).
Every way that can fail becomes one ConfigError line that names the directory and the fix.
transformers is imported lazily so that the rest of paratrain works without it.

Chat templates are jinja code that each model family writes differently, so which tokens of a
rendered conversation belong to the assistant is measured from the template's own output
(rendered prefixes and the tokenizer's character offsets) rather than assumed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List, Tuple

from ..errors import ConfigError, DataError
from ..formatting import first_line

# Files any one of which makes a directory loadable by AutoTokenizer.from_pretrained.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                    "spiece.model", "vocab.txt")
_HF_PIP = "pip install 'paratrain[hf]'"
Span = Tuple[int, int]  # [start, end) character offsets into a rendered conversation


def load_tokenizer(path: str | os.PathLike) -> Tuple[Any, str]:
    """The tokenizer saved in directory `path`, and a note for the log ("" when none).

    A tokenizer without a pad token gets its EOS token as the pad token: padded positions are
    masked out of attention and their labels are IGNORE_INDEX, so the pad id never reaches the
    loss and the choice does not change training. The note says this happened."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(f"loading the tokenizer at {path} needs transformers; "
                          f"{_HF_PIP}") from None
    directory = Path(os.path.expanduser(str(path)))
    if not directory.exists():
        raise ConfigError(f"tokenizer directory {path} does not exist; pass data.tokenizer=DIR "
                          "(a directory saved with save_pretrained)")
    if not directory.is_dir():
        raise ConfigError(f"tokenizer path {path} is a file; pass data.tokenizer=DIR, the "
                          "directory that holds it and its tokenizer_config.json")
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        raise ConfigError(f"model directory {path} has no tokenizer (tokenizer.json / "
                          "tokenizer_config.json); pass data.tokenizer=DIR")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"cannot load the tokenizer in {path} ({first_line(e)}); check that it "
                          "was saved with save_pretrained, or pass data.tokenizer=DIR") from None
    note = ""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"tokenizer at {path} has neither a pad token nor an EOS token; "
                              "set eos_token in its tokenizer_config.json (every example or "
                              "document ends with EOS)")
        tokenizer.pad_token = tokenizer.eos_token
        note = (f"tokenizer at {path} has no pad token; padding with its EOS token "
                f"{tokenizer.eos_token!r} (id {tokenizer.eos_token_id}); padded positions are "
                "masked out of attention and the loss, so training is unchanged")
    return tokenizer, note


def tokenizer_name(tokenizer: Any) -> str:
    """Where the tokenizer came from, for error messages."""
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def eos_id(tokenizer: Any) -> int:
    """The EOS id that ends every fine-tuning example and every corpus document; ConfigError if
    the tokenizer has none."""
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer at {tokenizer_name(tokenizer)} has no EOS token, so the "
                          "model could not learn where a text ends; set eos_token in its "
                          "tokenizer_config.json")
    return int(tokenizer.eos_token_id)


def use_chat_template(tokenizer: Any, chat_template: str, *, required: bool) -> bool:
    """Resolve data.chat_template: "none", "auto", or a path to a jinja file.

    A path is read and set on the tokenizer (so a later save_pretrained keeps it). "auto" uses
    the tokenizer's own template; without one it means plain concatenation, unless `required`
    (chat data cannot be rendered without a template), which raises ConfigError."""
    name = tokenizer_name(tokenizer)
    if chat_template == "none":
        if required:
            raise ConfigError("data.format=chat renders conversations with a chat template; set "
                              "data.chat_template=auto or data.chat_template=PATH to a jinja file")
        return False
    if chat_template != "auto":
        template_path = Path(os.path.expanduser(str(chat_template)))
        if not template_path.is_file():
            raise ConfigError(f"data.chat_template={chat_template!r} is not a file; give 'none', "
                              "'auto', or a path to a jinja chat template")
        tokenizer.chat_template = template_path.read_text(encoding="utf-8")
        return True
    if getattr(tokenizer, "chat_template", None):
        return True
    if required:
        raise ConfigError(f"tokenizer at {name} has no chat template; pass "
                          "data.chat_template=PATH to a jinja file, or use data.format=pairs")
    return False


def special_prefix(tokenizer: Any) -> List[int]:
    """The special ids the tokenizer puts before a text (BOS for Llama-style ones, none for GPT-2).

    Found by encoding a probe text with and without special tokens; whatever the tokenizer adds
    at the end (some append EOS) is ignored, because fine-tuning appends EOS itself."""
    probe = "x"
    with_specials = tokenizer(probe, add_special_tokens=True)["input_ids"]
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    for start in range(len(with_specials) - len(plain) + 1):
        if with_specials[start:start + len(plain)] == plain:
            return list(with_specials[:start])
    return []


# ---- chat rendering: which tokens belong to assistant turns ------------------------------
def render_chat(tokenizer: Any, messages: List[dict], add_generation_prompt: bool,
                where: str) -> str:
    """The template's text for `messages`; a template that refuses them is a DataError."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:
        if not type(e).__module__.startswith("jinja2"):
            raise
        # e.g. raise_exception('System role not supported') in the template itself
        reason = first_line(e)
        raise DataError(f"{where}: the chat template rejects this conversation ({reason}); fix "
                        "the row, drop data.system_prompt, or pass data.chat_template=PATH"
                        ) from None


def assistant_spans(tokenizer: Any, messages: List[dict], text: str, where: str) -> List[Span]:
    """Character spans of `text` (the full rendering) that hold the assistant turns.

    A turn starts where the rendering of the messages before it, with the generation prompt,
    ends; it ends where the rendering through it ends, trailing whitespace excluded. Templates
    whose earlier turns change once later ones exist fall back to a search for the contents."""
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if k == 0:  # templates refuse to render an empty conversation (the prompt part)
            return _spans_by_search(tokenizer, messages, text, where)
        before = render_chat(tokenizer, messages[:k], True, where)  # up to the answer
        through = render_chat(tokenizer, messages[:k + 1], False, where)  # and its end-of-turn
        if not (through.startswith(before) and text.startswith(through)):
            return _spans_by_search(tokenizer, messages, text, where)
        start, end = len(before), len(through.rstrip())
        spans.append((start, end if end > start else len(through)))
    return spans


def _spans_by_search(tokenizer: Any, messages: List[dict], text: str, where: str) -> List[Span]:
    """Fallback: each message's content found in order; an EOS right after an answer counts."""
    spans, cursor = [], 0
    for message in messages:
        content = message["content"]
        pos = text.find(content, cursor)
        if pos < 0 and content.strip():
            content = content.strip()  # templates often trim contents
            pos = text.find(content, cursor)
        if pos < 0:
            raise DataError(f"{where}: the chat template changes the text of a "
                            f"{message['role']} message, so its tokens cannot be located; use "
                            "a template that renders message contents verbatim")
        end = pos + len(content)
        if message["role"] == "assistant":
            eos_token = tokenizer.eos_token or ""
            if eos_token and text.startswith(eos_token, end):
                end += len(eos_token)
            spans.append((pos, end))
        cursor = end
    return spans


def tokens_in_spans(tokenizer: Any, texts: List[str], spans: List[List[Span]]
                    ) -> List[Tuple[List[int], List[bool]]]:
    """Tokenize whole texts; a token is counted when it starts inside one of the spans."""
    try:
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:  # a slow (Python) tokenizer has no offsets: tokenize by piece
        return [_tokens_by_piece(tokenizer, text, text_spans)
                for text, text_spans in zip(texts, spans)]
    out = []
    for ids, offsets, text_spans in zip(encoded["input_ids"], encoded["offset_mapping"], spans):
        counted = [any(a <= start < b for a, b in text_spans) for start, _ in offsets]
        out.append((list(ids), counted))
    return out


def _tokens_by_piece(tokenizer: Any, text: str, spans: List[Span]
                     ) -> Tuple[List[int], List[bool]]:
    seq: List[int] = []
    counted: List[bool] = []
    cursor = 0
    for start, end in spans + [(len(text), len(text))]:
        for piece, flag in ((text[cursor:start], False), (text[start:end], True)):
            if piece:
                ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
                seq += ids
                counted += [flag] * len(ids)
        cursor = end
    return seq, counted
