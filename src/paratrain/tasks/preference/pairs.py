"""Preference data: {prompt, chosen, rejected} records as token pairs, for DPO and reward models.

A record holds a prompt and two responses, the preferred one first. The prompt is text, or chat
messages (then the responses are assistant turns, rendered with the model's chat template, and
a text prompt with a template becomes one user turn, as pairs do). Each pair is encoded once, as
two whole sequences that share the prompt:

- for DPO (`encode_dpo`), prompt and response are tokenized apart and joined (the policy scores
  the response tokens given the prompt's), EOS after each response; when a pair is longer than
  data.max_length the prompt is cut from the left, and a pair whose longer response does not fit
  even so is dropped;
- for a reward model (`encode_reward`), the text prompt + response is tokenized whole, with the
  tokenizer's own special tokens, exactly as `tokenizer(text)` gives it to transformers later
  (the score is the model's on that text); a pair longer than data.max_length is dropped.

Pairs whose two responses are the same tokens teach nothing and are skipped. Every drop is
counted in the note each source logs, and a source left with no pair is one DataError line.
A batch holds its chosen rows first, then the rejected rows in the same order: one forward
scores both halves (the concatenated forward of TRL and torchtune).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ...errors import ConfigError, DataError
from ...data.dataset import IGNORE_INDEX
from ...data.finetune import check_inputs, messages_or_text, row_field, tokenize_texts
from ...data.hf_tokenizer import eos_id, render_chat, special_prefix, use_chat_template
from ...data.ragged import RaggedDataset, pad_rows

# {"chosen": [ids], "rejected": [ids], "prompt_len": int, "margin": float}: whole sequences
Pair = Dict[str, Any]


@dataclass
class PairStats:
    """What encoding did to one source: the lead logs `summary()`; the counts are for tests."""
    source_name: str
    max_length: int
    rows: int = 0
    kept: int = 0
    truncated: int = 0  # kept with the prompt cut from the left
    dropped: int = 0  # longer than data.max_length
    identical: int = 0  # chosen and rejected are the same tokens
    longest: int = 0  # tokens in the longest kept sequence
    empty_prompts: int = 0  # rows whose prompt field is empty
    warning: str = ""  # said after the summary (KTO: every example of one label)

    def summary(self) -> str:
        return (f"{self.source_name}: {self.rows} pairs -> {self.kept} kept ({self.truncated} "
                f"with the prompt cut, {self.dropped} dropped as longer than data.max_length="
                f"{self.max_length}, {self.identical} with chosen = rejected skipped"
                + (f", {self.empty_prompts} with an empty prompt" if self.empty_prompts else "")
                + f"); longest {self.longest} tokens"
                + (f"; warning: {self.warning}" if self.warning else ""))

    def count_empty_prompts(self, rows: Sequence[Dict[str, Any]], field: str,
                            refuse_all: bool) -> None:
        """Empty prompts are counted (the summary says how many); all of them empty is almost
        always a field-name mistake, refused when the task needs prompts (`refuse_all`)."""
        self.empty_prompts = sum(1 for row in rows if _empty(row.get(field)))
        if refuse_all and rows and self.empty_prompts == len(rows):
            raise DataError(f"every prompt of {self.source_name} is empty (field {field!r}): "
                            "DPO scores each response given its prompt; set data.prompt_field "
                            "to the field that holds the prompts (Python: the records' keys, "
                            "or train_prompts=)")

    def check_some_kept(self) -> None:
        if self.kept:
            return
        if self.dropped:
            raise DataError(f"data.max_length={self.max_length} cuts away all {self.dropped} "
                            f"pairs of {self.source_name} (a response does not fit); raise "
                            "data.max_length")
        raise DataError(f"every pair of {self.source_name} has chosen = rejected: nothing to "
                        "prefer; check data.chosen_field and data.rejected_field")


@dataclass(frozen=True)
class PreferenceFields:
    """The data.* keys that name a record's fields, and how texts are rendered."""
    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    margin: Optional[str] = None
    chat_template: str = "auto"
    system_prompt: Optional[str] = None
    keep_after_eos: bool = False  # dpo.after_eos=keep: a template's text after EOS is scored

    @classmethod
    def of(cls, cfg: Any) -> "PreferenceFields":
        """From a run's TrainConfig (its data.* fields, dpo.after_eos)."""
        d = cfg.data
        return cls(d.prompt_field, d.chosen_field, d.rejected_field, d.margin_field,
                   d.chat_template, d.system_prompt, cfg.dpo.after_eos == "keep")


def preference_texts(rows: Sequence[Dict[str, Any]], tokenizer: Any, f: PreferenceFields,
                     source_name: str) -> Tuple[List[Tuple[str, str, str, float]], bool]:
    """([(prompt text, chosen text, rejected text, margin)], whether a chat template rendered
    them). A prompt of chat messages needs a template; the responses' texts are what the
    template adds after the prompt (its generation prompt) for each of them."""
    chat = any(isinstance(row.get(f.prompt), list) for row in rows)
    templated = use_chat_template(tokenizer, f.chat_template, required=chat)
    out = []
    for i, row in enumerate(rows, start=1):
        where = f"{source_name}: row {i}"
        prompt = messages_or_text(row, f.prompt, "data.prompt_field", source_name, i)
        answers = [messages_or_text(row, key, setting, source_name, i) for key, setting in
                   ((f.chosen, "data.chosen_field"), (f.rejected, "data.rejected_field"))]
        margin = 0.0
        if f.margin is not None:
            value = row_field(row, f.margin, "data.margin_field", source_name, i)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise DataError(f"{where}: {f.margin!r} is a {type(value).__name__}, not a "
                                "number; data.margin_field names each pair's margin")
            margin = float(value)
        if not templated:
            if not all(isinstance(x, str) for x in [prompt] + answers):
                raise DataError(f"{where}: chat messages need a chat template; set "
                                "data.chat_template")
            out.append((prompt, answers[0], answers[1], margin))
            continue
        head = [{"role": "system", "content": f.system_prompt}] if f.system_prompt else []
        prompt_msgs = head + (prompt if isinstance(prompt, list)
                              else [{"role": "user", "content": prompt}])
        prompt_text = render_chat(tokenizer, prompt_msgs, True, where)
        texts = []
        for answer in answers:
            turn = answer if isinstance(answer, list) else [{"role": "assistant",
                                                              "content": answer}]
            full = render_chat(tokenizer, prompt_msgs + turn, False, where)
            if not full.startswith(prompt_text):
                raise DataError(f"{where}: the chat template renders the prompt differently "
                                "once a response follows it, so the response cannot be told "
                                "apart; use a template that renders messages in order")
            response = full[len(prompt_text):]
            texts.append(response if f.keep_after_eos else
                         _through_eos(response, tokenizer.eos_token))
        out.append((prompt_text, texts[0], texts[1], margin))
    return out, templated


def _through_eos(response: str, eos_token: Optional[str]) -> str:
    """A templated response without the whitespace its template writes after the EOS token
    (ChatML's "<|im_end|>" then a newline): supervised fine-tuning does not count it either
    (hf_tokenizer.assistant_spans), and after the last token it predicts nothing."""
    kept = response.rstrip()
    return kept if eos_token and kept.endswith(eos_token) else response


def _empty(value: Any) -> bool:
    """A prompt with nothing in it: blank text, no messages, or messages without content."""
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, dict):
        value = [value]
    return isinstance(value, list) and not any(
        isinstance(m, dict) and str(m.get("content") or "").strip() for m in value)


def encode_dpo(rows: Sequence[Dict[str, Any]], tokenizer: Any, fields: PreferenceFields, *,
               max_length: int, source_name: str = "data") -> Tuple[List[Pair], PairStats]:
    """Pairs for DPO: [BOS] + prompt + response + EOS, tokenized in parts (module docstring)."""
    check_inputs(rows, max_length, source_name)
    texts, templated = preference_texts(rows, tokenizer, fields, source_name)
    eos = eos_id(tokenizer)
    prefix = [] if templated else special_prefix(tokenizer)
    prompts = tokenize_texts(tokenizer, [t[0] for t in texts])
    chosen = tokenize_texts(tokenizer, [t[1] for t in texts])
    rejected = tokenize_texts(tokenizer, [t[2] for t in texts])
    ends = tokenizer.eos_token or ""
    stats = PairStats(source_name, max_length, rows=len(texts))
    stats.count_empty_prompts(rows, fields.prompt, refuse_all=True)
    pairs: List[Pair] = []
    for (_, c_text, r_text, margin), prompt, c, r in zip(texts, prompts, chosen, rejected):
        c = c + [eos] if not (templated and c_text.rstrip().endswith(ends)) else c
        r = r + [eos] if not (templated and r_text.rstrip().endswith(ends)) else r
        if c == r:
            stats.identical += 1
            continue
        head = fit_prompt(prefix, prompt, max(len(c), len(r)), stats)
        if head is None:
            continue
        pairs.append({"chosen": head + c, "rejected": head + r, "prompt_len": len(head),
                      "margin": margin})
        stats.kept += 1
        stats.longest = max(stats.longest, len(head) + max(len(c), len(r)))
    stats.check_some_kept()
    return pairs, stats


def fit_prompt(prefix: List[int], prompt: List[int], response: int,
               stats: PairStats) -> Optional[List[int]]:
    """[BOS] + the prompt's end that fits data.max_length beside the longest response
    (`response` tokens), or None (counted as dropped) when not even one prompt token does: the
    first response token needs one before it to be scored."""
    room = stats.max_length - len(prefix) - response  # tokens left for the prompt
    if room < (0 if prefix else 1):
        stats.dropped += 1
        return None
    if len(prompt) > room:
        prompt = prompt[len(prompt) - room:]  # keep the end, next to the response
        stats.truncated += 1
    head = prefix + prompt
    if not head:  # nothing before the response: its first token cannot be scored
        stats.dropped += 1
        return None
    return head


def encode_reward(rows: Sequence[Dict[str, Any]], tokenizer: Any, fields: PreferenceFields, *,
                  max_length: int, source_name: str = "data") -> Tuple[List[Pair], PairStats]:
    """Pairs for a reward model: each whole text as transformers' tokenizer(text) encodes it."""
    check_inputs(rows, max_length, source_name)
    texts, templated = preference_texts(rows, tokenizer, fields, source_name)
    specials = not templated  # a rendered chat holds its special tokens as text already
    chosen = tokenize_texts(tokenizer, [p + c for p, c, _, _ in texts], specials)
    rejected = tokenize_texts(tokenizer, [p + r for p, _, r, _ in texts], specials)
    stats = PairStats(source_name, max_length, rows=len(texts))
    stats.count_empty_prompts(rows, fields.prompt, refuse_all=False)  # texts may hold them
    pairs: List[Pair] = []
    for (_, _, _, margin), c, r in zip(texts, chosen, rejected):
        if c == r:
            stats.identical += 1
        elif max(len(c), len(r)) > max_length:
            stats.dropped += 1
        else:
            pairs.append({"chosen": c, "rejected": r, "prompt_len": 0, "margin": margin})
            stats.kept += 1
            stats.longest = max(stats.longest, len(c), len(r))
    stats.check_some_kept()
    return pairs, stats



def rows_from_preference_lists(prompts: Sequence[str], chosen: Sequence[str],
                               rejected: Sequence[str], *, what: str = "train") -> List[dict]:
    """Records from the Python API's parallel lists (train_prompts=, train_chosen=, ...)."""
    lists = {f"{what}_prompts": prompts, f"{what}_chosen": chosen, f"{what}_rejected": rejected}
    for name, values in lists.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise ConfigError(f"{name} must be a list of strings, got a {type(values).__name__}")
    if len({len(v) for v in lists.values()}) > 1:
        raise ConfigError(", ".join(f"{k} has {len(v)} items" for k, v in lists.items()) +
                          "; give one chosen and one rejected response per prompt")
    return [{"prompt": p, "chosen": c, "rejected": r}
            for p, c, r in zip(prompts, chosen, rejected)]


# ---- datasets and batches ----------------------------------------------------------------
def preference_dataset(pairs: Sequence[Pair]) -> RaggedDataset:
    """Encoded pairs as a map-style dataset; precomputed reference log-probs of (chosen,
    rejected) join it later as the column "reference" (N, 2)."""
    return RaggedDataset(pairs, what="preference pairs")


class PairCollate:
    """list of pairs -> (2B, T) rows, the B chosen first, right-padded to the longest
    (`sides`: the two sequence fields of an example, in the order they are stacked).

    `shift` (DPO): inputs are each sequence but its last token and `targets` the next tokens
    of the response (IGNORE_INDEX over the prompt and pads); else (a reward model) the whole
    sequences and each pair's `margin` (B,). A class, not a closure: DataLoader workers pickle
    it."""

    sides = ("chosen", "rejected")

    def __init__(self, pad_id: int, shift: bool):
        if pad_id is None or pad_id < 0:
            raise ConfigError(f"pad id {pad_id!r} is invalid; load the tokenizer with "
                              "load_tokenizer, which sets one")
        self.pad_id, self.shift = int(pad_id), shift

    def __call__(self, batch: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
        if isinstance(batch[0], list):  # rows of packed pairs (data.pack=true)
            from .packed_pairs import packed_pairs
            return packed_pairs(batch, self.sides, self.pad_id, self.shift)
        first, second = self.sides
        seqs = [p[first] for p in batch] + [p[second] for p in batch]  # 2B of (L_i,)
        if self.shift:
            seqs = [s[:-1] for s in seqs]  # the last token is only ever a target
        input_ids, attention_mask = pad_rows(seqs, self.pad_id)  # (2B, T), (2B, T)
        out = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.shift:  # targets[j] = seq[j + 1], counted from the response's first token
            targets = torch.full_like(input_ids, IGNORE_INDEX)  # (2B, T)
            full = [p[first] for p in batch] + [p[second] for p in batch]
            for b, (seq, start) in enumerate(zip(full, [p["prompt_len"] for p in batch] * 2)):
                targets[b, start - 1:len(seq) - 1] = seq[start:]
            out["targets"] = targets
        else:
            out["margin"] = torch.tensor([p["margin"] for p in batch], dtype=torch.float32)
        if "reference" in batch[0]:  # (2B,): chosen, then rejected
            ref = torch.as_tensor(np.stack([p["reference"] for p in batch]))  # (B, 2)
            out["reference"] = torch.cat([ref[:, 0], ref[:, 1]])
        return out
