"""Fine-tuning data: prompt/answer pairs and chats as token sequences (labelled texts:
classify.py).

This lives beside the pretraining pipeline (cache.py, dataset.py) rather than inside it because
fine-tuning differs in three ways: it must use the pretrained model's own tokenizer, the loss is
masked (the model is taught the answers, not to imitate the prompts), and examples vary a lot in
length, so each stays whole and is padded per micro-batch instead of packed into fixed windows.

An encoded example is {"input_ids": [...], "targets": [...]} with the targets already shifted:
targets[i] is the token after input_ids[i] when that token is counted, else IGNORE_INDEX. A
sequence of n tokens gives n-1 inputs (its last token is only ever a target), as the packed
windows of pretraining do. `max_length` bounds n, the whole sequence: prompt, answer and EOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import ConfigError, DataError
from .dataset import IGNORE_INDEX
from .examples import Example
from .hf_tokenizer import (
    assistant_spans,
    eos_id,
    render_chat,
    special_prefix,
    tokens_in_spans,
    use_chat_template,
)

CHAT_ROLES = ("system", "user", "assistant")
TOKENIZE_BATCH = 1024  # texts per call to the (Rust, multi-threaded) batch tokenizer


@dataclass
class EncodeStats:
    """What encoding did to one source: the lead logs `summary()`; the counts are for tests."""
    source_name: str
    rows: int = 0
    kept: int = 0
    truncated: int = 0  # kept, but the input was cut (pairs: from the left; classify: the right)
    dropped: int = 0  # longer than max_length even after truncation
    skipped: int = 0  # nothing to learn: no assistant turn, or no tokens at all
    longest: int = 0  # tokens in the longest kept sequence (prompt + answer + EOS)
    longest_raw: int = 0  # tokens in the longest sequence before truncation, kept or not
    longest_target: int = 0  # counted tokens (answer + EOS) in the longest answer, kept or not

    def summary(self) -> str:
        return (f"{self.source_name}: {self.rows} rows -> {self.kept} examples ({self.truncated} "
                f"truncated, {self.dropped} dropped as too long, {self.skipped} with nothing to "
                f"learn); longest {self.longest} tokens")

    def _keep(self, examples: List[Example], seq: List[int], counted: List[bool],
              truncated: bool = False) -> None:
        if len(seq) < 2 or not any(counted[1:]):
            self.skipped += 1  # a single token has no next token; nothing to score
            return
        examples.append(_shift(seq, counted))
        self.kept += 1
        self.truncated += truncated
        self.longest = max(self.longest, len(seq))

    def _see(self, raw_length: int, target_length: int) -> None:
        self.longest_raw = max(self.longest_raw, raw_length)
        self.longest_target = max(self.longest_target, target_length)

    def _check_some_kept(self, max_length: int, what: str) -> None:
        if self.kept:
            return
        if self.dropped:
            raise DataError(
                f"all {self.dropped} {what} from {self.source_name} were dropped as longer than "
                f"data.max_length={max_length} tokens (longest answer: {self.longest_target} "
                f"tokens with EOS; longest example: {self.longest_raw}); raise data.max_length")
        raise DataError(f"no row of {self.source_name} has anything to learn (an assistant turn "
                        "or a non-empty answer); check the data and data.format")


def _shift(seq: List[int], counted: List[bool]) -> Example:
    """Tokens and per-token "is it scored" flags -> inputs seq[:-1] and shifted targets."""
    targets = [tok if flag else IGNORE_INDEX for tok, flag in zip(seq[1:], counted[1:])]
    return {"input_ids": list(seq[:-1]), "targets": targets}


def check_inputs(rows: Sequence[Any], max_length: int, source_name: str) -> None:
    if not rows:
        raise DataError(f"{source_name} has no rows; point it at a non-empty dataset")
    if not isinstance(max_length, int) or max_length < 2:
        raise ConfigError(f"data.max_length={max_length!r} must be an integer >= 2 (tokens per "
                          "example, prompt and answer together)")


def row_field(row: Dict[str, Any], field: str, setting: str, source_name: str, row_number: int
           ) -> Any:
    if field not in row:
        fields = ", ".join(map(str, row)) or "none"
        raise DataError(f"{source_name}: row {row_number} has no field {field!r} (its fields: "
                        f"{fields}); set {setting} to the field that holds it")
    value = row[field]
    if value is None:
        raise DataError(f"{source_name}: row {row_number} has an empty (null) {field!r}; fill "
                        "it in or remove the row")
    return value


def row_text(row: Dict[str, Any], field: str, setting: str, source_name: str, row_number: int
          ) -> str:
    value = row_field(row, field, setting, source_name, row_number)
    if not isinstance(value, str):
        raise DataError(f"{source_name}: row {row_number} field {field!r} is a "
                        f"{type(value).__name__}, not text; set {setting} to a text field")
    return value


def tokenize_texts(tokenizer: Any, texts: List[str], specials: bool = False) -> List[List[int]]:
    """Every text's ids, TOKENIZE_BATCH texts per call (the Rust tokenizer works a batch on all
    cores); `specials`: with the BOS/EOS the tokenizer adds on its own."""
    ids: List[List[int]] = []
    for start in range(0, len(texts), TOKENIZE_BATCH):
        ids += tokenizer(texts[start:start + TOKENIZE_BATCH],
                         add_special_tokens=specials)["input_ids"]
    return [list(x) for x in ids]


# ---- pairs -------------------------------------------------------------------------------
def encode_pairs(rows: Sequence[Dict[str, Any]], tokenizer: Any, *, input_field: str = "input",
                 output_field: str = "output", max_length: int, chat_template: str = "none",
                 system_prompt: Optional[str] = None, source_name: str = "data"
                 ) -> Tuple[List[Example], EncodeStats]:
    """Prompt/answer rows -> examples whose loss counts only the answer and the EOS after it.

    chat_template "none": [BOS if the tokenizer adds one] + input + output + EOS, each part
    tokenized on its own (put any separator you want into the data). "auto": the tokenizer's
    chat template, with the input as the user message, the output as the assistant message and
    `system_prompt` (if given) first; plain as "none" when the tokenizer has no template. A PATH:
    that jinja file becomes the tokenizer's chat template. With a template, EOS is appended
    unless the rendered conversation already ends with it.

    Truncation: when a sequence exceeds max_length, the INPUT is cut from the left (its end,
    next to the answer, is what matters most) until it fits, so the output always survives
    whole. An example whose output alone (with BOS/template and EOS) does not fit is dropped and
    counted in stats.dropped; if every example is dropped, DataError says to raise max_length."""
    check_inputs(rows, max_length, source_name)
    eos = eos_id(tokenizer)
    templated = use_chat_template(tokenizer, chat_template, required=False)
    pairs = [(row_text(row, input_field, "data.input_field", source_name, i),
              row_text(row, output_field, "data.output_field", source_name, i))
             for i, row in enumerate(rows, start=1)]
    stats = EncodeStats(source_name, rows=len(pairs))
    examples: List[Example] = []
    if templated:
        head = [{"role": "system", "content": system_prompt}] if system_prompt else []
        for i, (prompt, answer) in enumerate(pairs, start=1):
            fitted = _fit_templated_pair(tokenizer, head, prompt, answer, eos, max_length, stats,
                                         where=f"{source_name}: row {i}")
            if fitted is None:
                stats.dropped += 1
            else:
                stats._keep(examples, *fitted)
    else:
        prefix = special_prefix(tokenizer)
        prompts = tokenize_texts(tokenizer, [p for p, _ in pairs])
        answers = tokenize_texts(tokenizer, [a for _, a in pairs])
        for prompt_ids, answer_ids in zip(prompts, answers):
            answer_ids = answer_ids + [eos]
            stats._see(len(prefix) + len(prompt_ids) + len(answer_ids), len(answer_ids))
            room = max_length - len(prefix) - len(answer_ids)  # tokens left for the input
            if room < 0:
                stats.dropped += 1
                continue
            cut = len(prompt_ids) > room
            if cut:
                prompt_ids = prompt_ids[len(prompt_ids) - room:]  # keep the last `room` tokens
            seq = prefix + prompt_ids + answer_ids
            counted = [False] * (len(prefix) + len(prompt_ids)) + [True] * len(answer_ids)
            stats._keep(examples, seq, counted, truncated=cut)
    stats._check_some_kept(max_length, "examples")
    return examples, stats


def _fit_templated_pair(tokenizer: Any, head: List[dict], prompt: str, answer: str, eos: int,
                        max_length: int, stats: EncodeStats, where: str
                        ) -> Optional[Tuple[List[int], List[bool], bool]]:
    """(seq, counted, truncated) with the prompt cut from the left to fit, or None to drop.

    A template wraps the prompt in text of its own, so the cut is made on the prompt's tokens,
    decoded back to text and re-rendered; re-tokenizing may shift a token or two at the cut, so
    it repeats (always cutting more) until the sequence fits."""
    def build(user_text: str) -> Tuple[List[int], List[bool]]:
        messages = head + [{"role": "user", "content": user_text},
                           {"role": "assistant", "content": answer}]
        return _encode_conversations(tokenizer, [messages], eos, [where])[0]

    seq, counted = build(prompt)
    stats._see(len(seq), sum(counted))
    if len(seq) <= max_length:
        return seq, counted, False
    bare_seq, bare_counted = build("")
    if len(bare_seq) > max_length:
        return None
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    keep = len(prompt_ids) - (len(seq) - max_length)
    while keep > 0:
        tail = tokenizer.decode(prompt_ids[len(prompt_ids) - keep:],
                                clean_up_tokenization_spaces=False)
        seq, counted = build(tail)
        if len(seq) <= max_length:
            return seq, counted, True
        keep -= len(seq) - max_length
    return bare_seq, bare_counted, True


# ---- chat --------------------------------------------------------------------------------
def encode_chat(rows: Sequence[Dict[str, Any]], tokenizer: Any, *,
                messages_field: str = "messages", max_length: int, chat_template: str = "auto",
                system_prompt: Optional[str] = None, source_name: str = "data"
                ) -> Tuple[List[Example], EncodeStats]:
    """Rows holding a list of {role, content} messages -> examples with loss on assistant turns.

    Rendered with the chat template (chat_template "auto" or a PATH; "none" or a tokenizer
    without a template is a ConfigError). `system_prompt` is put first in conversations that do
    not start with a system message. Counted: each assistant turn from its first content token
    through the template's end-of-turn text (e.g. <|im_end|>), without trailing whitespace; the
    template's own "assistant:" header is not counted. EOS is appended, and counted, after a
    final assistant turn unless the template already ends the conversation with it.

    Each assistant span is found by rendering the conversation up to that turn with and without
    it (the template's add_generation_prompt gives where the answer starts) and mapping those
    character positions onto the tokens of the full rendering with the tokenizer's offsets. A
    template that renders earlier turns differently once later ones exist falls back to finding
    each message's text in order. Conversations longer than max_length are dropped (counted)."""
    check_inputs(rows, max_length, source_name)
    eos = eos_id(tokenizer)
    use_chat_template(tokenizer, chat_template, required=True)
    stats = EncodeStats(source_name, rows=len(rows))
    conversations, wheres = [], []
    for i, row in enumerate(rows, start=1):
        messages = _messages(row, messages_field, source_name, i)
        if not any(m["role"] == "assistant" for m in messages):
            stats.skipped += 1  # nothing to learn from (and an empty one cannot be rendered)
            continue
        if system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system_prompt}] + messages
        conversations.append(messages)
        wheres.append(f"{source_name}: row {i}")
    examples: List[Example] = []
    for start in range(0, len(conversations), TOKENIZE_BATCH):
        chunk = slice(start, start + TOKENIZE_BATCH)
        for seq, counted in _encode_conversations(tokenizer, conversations[chunk], eos,
                                                  wheres[chunk]):
            stats._see(len(seq), sum(counted))
            if len(seq) > max_length:
                stats.dropped += 1
            else:
                stats._keep(examples, seq, counted)
    stats._check_some_kept(max_length, "conversations")
    return examples, stats


def _messages(row: Dict[str, Any], field: str, source_name: str, row_number: int) -> List[dict]:
    messages = row_field(row, field, "data.messages_field", source_name, row_number)
    where = f"{source_name}: row {row_number}"
    if not isinstance(messages, list):
        raise DataError(f"{where}: {field!r} is a {type(messages).__name__}, not a list of "
                        "{role, content} messages")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(f"{where}: every message must be a dict with 'role' and 'content'; "
                            f"got {str(message)[:80]}")
        if message["role"] not in CHAT_ROLES:
            raise DataError(f"{where} has a message with role {message['role']!r}; only "
                            f"{', '.join(CHAT_ROLES)} are supported, so drop or rename that turn")
        if not isinstance(message["content"], str):
            raise DataError(f"{where}: a {message['role']} message has "
                            f"{type(message['content']).__name__} content; only text is supported")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _encode_conversations(tokenizer: Any, conversations: List[List[dict]], eos: int,
                          wheres: List[str]) -> List[Tuple[List[int], List[bool]]]:
    texts = [render_chat(tokenizer, messages, False, where)
             for messages, where in zip(conversations, wheres)]
    spans = [assistant_spans(tokenizer, messages, text, where)
             for messages, text, where in zip(conversations, texts, wheres)]
    encoded = tokens_in_spans(tokenizer, texts, spans)
    eos_token = tokenizer.eos_token
    for (seq, counted), messages, text in zip(encoded, conversations, texts):
        if messages and messages[-1]["role"] == "assistant" \
                and not text.rstrip().endswith(eos_token):
            seq.append(eos)
            counted.append(True)
    return encoded


# ---- datasets, batches, splits -----------------------------------------------------------


def messages_or_text(row: Dict[str, Any], field: str, setting: str, source_name: str,
                      row_number: int) -> Any:
    """A record's field as text, or as a list of {role, content} messages (one message dict
    counts as a list of one): what pairs, prompts and chats may hold."""
    value = row_field(row, field, setting, source_name, row_number)
    if isinstance(value, dict):  # one message
        value = [value]
    if isinstance(value, list):
        for m in value:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise DataError(f"{source_name}: row {row_number} field {field!r}: every "
                                "message must be a dict with text 'role' and 'content'")
        return [{"role": m["role"], "content": m["content"]} for m in value]
    return row_text(row, field, setting, source_name, row_number)
