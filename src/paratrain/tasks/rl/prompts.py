"""Prompt-only records for online RL (data.format=prompts): {"prompt": text or chat messages}
(one message dict counts as a list of one), and any other fields (the reward functions receive
them: rewards.py).

As TRL 1.16 does: a prompt of chat messages is rendered with the model's chat template (the
generation prompt added, data.system_prompt first); a text prompt stays as it is (after the
tokenizer's BOS), unless asked: data.chat_template=PATH or data.system_prompt make it one user
turn of the template. (data.chat_template=none refuses chat messages.)
A prompt longer than data.max_length - rl.max_new_tokens keeps its end. Each item carries the
prompt as the record gave it (what reward functions receive) and its index in the dataset (what
seeds its completions: rollout.py).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch
from torch.utils.data import Dataset

from ...errors import DataError
from ...data.finetune import check_inputs, messages_or_text, tokenize_texts
from ...data.hf_tokenizer import render_chat, special_prefix, use_chat_template
from ...data.ragged import RaggedColumn


def encode_prompts(rows: Sequence[Dict[str, Any]], tokenizer: Any, *, field: str,
                   chat_template: str, system_prompt: Any, room: int, source_name: str
                   ) -> tuple[List[Dict[str, Any]], str]:
    """([{"prompt_ids", "prompt"}], a note) for the records; `room`: the tokens a prompt may
    keep (the model's positions less rl.max_new_tokens)."""
    check_inputs(rows, room, source_name)
    prompts = [messages_or_text(row, field, "data.prompt_field", source_name, i)
               for i, row in enumerate(rows, start=1)]
    chat = [isinstance(p, list) for p in prompts]
    templated = use_chat_template(tokenizer, chat_template, required=any(chat))
    asked = templated and (chat_template not in ("auto", "none") or bool(system_prompt))
    head = [{"role": "system", "content": system_prompt}] if system_prompt else []
    prefix = special_prefix(tokenizer)
    texts = [render_chat(tokenizer, head + (p if is_chat else [{"role": "user", "content": p}]),
                         True, f"{source_name}: row {i}") if is_chat or asked else p
             for i, (p, is_chat) in enumerate(zip(prompts, chat), start=1)]
    plain = [not (is_chat or asked) for is_chat in chat]
    out, cut = [], 0
    for row, prompt, ids, bare in zip(rows, prompts, tokenize_texts(tokenizer, texts), plain):
        ids = prefix + ids if bare else ids
        if len(ids) > room:
            ids, cut = ids[len(ids) - room:], cut + 1
        if not ids:
            raise DataError(f"{source_name}: a prompt encodes to no tokens; give each record "
                            "some text")
        out.append({"prompt_ids": ids, "prompt": prompt, "fields": {
            k: v for k, v in row.items() if k not in (field, "completion", "completion_ids")}})
    rendered = len(out) - sum(plain)
    note = (f"{source_name}: {len(out)} prompts" +
            (f" ({rendered} with the chat template)" if rendered else "") +
            (f", {cut} cut to their last {room} tokens" if cut else ""))
    return out, note


class PromptDataset(Dataset):
    """Encoded prompts; an item is {"prompt_ids" (L,), "prompt", "fields", "index"} ("fields":
    the record's other fields, for the reward functions)."""

    def __init__(self, examples: Sequence[Dict[str, Any]]):
        if not examples:
            raise DataError("no prompts to train on; check the data source")
        self.ids = RaggedColumn([ex["prompt_ids"] for ex in examples])
        self.prompts = [ex["prompt"] for ex in examples]
        self.fields = [ex.get("fields", {}) for ex in examples]
        self.longest = max(len(ex["prompt_ids"]) for ex in examples)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} prompts")
        i %= len(self)
        return {"prompt_ids": self.ids[i], "prompt": self.prompts[i], "fields": self.fields[i],
                "index": i}


class PromptCollate:
    """Prompts left-padded to the longest (generation appends on the right):
    {"prompt_ids" (B, P), "prompt_mask" (B, P), "prompts": [B], "fields": [B], "index" (B,)}."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: List[Dict[str, Any]]) -> Dict[str, Any]:
        P = max(len(b["prompt_ids"]) for b in batch)
        ids = torch.full((len(batch), P), self.pad_id, dtype=torch.long)  # (B, P)
        mask = torch.zeros((len(batch), P), dtype=torch.long)  # (B, P)
        for r, b in enumerate(batch):
            n = len(b["prompt_ids"])
            ids[r, P - n:], mask[r, P - n:] = b["prompt_ids"], 1
        return {"prompt_ids": ids, "prompt_mask": mask, "prompts": [b["prompt"] for b in batch],
                "fields": [b.get("fields", {}) for b in batch],
                "index": torch.tensor([b["index"] for b in batch])}
