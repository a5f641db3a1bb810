"""Unpaired preference examples for KTO: a prompt, one completion, and whether it is desirable.

Two kinds of records give them (TRL's KTOTrainer reads the same two):
- preference pairs {prompt, chosen, rejected} (`data.*_field` name them): each pair gives a
  desirable example (prompt, chosen) and an undesirable one (prompt, rejected), as TRL's
  `unpair_preference_dataset` does: all desirable examples first, then all undesirable ones;
- unpaired records {prompt, completion, label} (label true / false, or 1 / 0).

Prompt and completion are encoded as for DPO (tasks/preference/pairs.py: tokenized apart, EOS after the
completion, the prompt cut from the left to fit data.max_length, a chat template's turns
rendered the same way). Each example also carries its *mismatched* sequence for KTO's KL
estimate: its own prompt followed by the completion of the example before it (the first takes
the last's), TRL's rotation by one, made once over the whole source instead of per device
batch, so every world size sees the same sequences; cut to data.max_length from the right, as
TRL's collator cuts.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from ...errors import DataError
from ...data.finetune import check_inputs, tokenize_texts
from ...data.hf_tokenizer import eos_id, special_prefix
from .pairs import (PairCollate, PairStats, PreferenceFields, encode_dpo, fit_prompt,
                         preference_texts)

# {"completion": [ids] (prompt + completion), "mismatched": [ids], "prompt_len": int,
#  "label": 1 (desirable) or 0}
Example = Dict[str, Any]
UNPAIRED = ("completion", "label")  # the fields of an unpaired record, beside the prompt


def encode_kto(rows: Sequence[Dict[str, Any]], tokenizer: Any, fields: PreferenceFields, *,
               max_length: int, source_name: str = "data") -> Tuple[List[Example], PairStats]:
    """KTO examples from preference pairs or unpaired records (module docstring)."""
    check_inputs(rows, max_length, source_name)
    if all(k in rows[0] for k in UNPAIRED) and fields.chosen not in rows[0]:
        examples, stats = _unpaired(rows, tokenizer, fields, max_length, source_name)
    else:
        pairs, stats = encode_dpo(rows, tokenizer, fields, max_length=max_length,
                                  source_name=source_name)
        examples = [{"completion": p[side], "prompt_len": p["prompt_len"], "label": label}
                    for side, label in (("chosen", 1), ("rejected", 0)) for p in pairs]
    labels = {ex["label"] for ex in examples}
    if len(labels) == 1:  # TRL warns too: the loss then only moves one way
        kind = "desirable" if labels == {1} else "undesirable"
        stats.warning = (f"every example is {kind}: KTO then only raises (or lowers) each "
                         "completion's log-ratio against the KL estimate, with nothing to "
                         "contrast it with; give both labels (kto.desirable_weight and "
                         "kto.undesirable_weight balance unequal shares)")
    return with_mismatched(examples, max_length), stats


def _unpaired(rows: Sequence[Dict[str, Any]], tokenizer: Any, fields: PreferenceFields,
              max_length: int, source_name: str) -> Tuple[List[Example], PairStats]:
    labels = [_label(row.get("label"), source_name, i) for i, row in enumerate(rows, start=1)]
    as_pairs = [{fields.prompt: row[fields.prompt], fields.chosen: row["completion"],
                 fields.rejected: row["completion"]} for row in rows]
    texts, templated = preference_texts(as_pairs, tokenizer, fields, source_name)
    eos, ends = eos_id(tokenizer), tokenizer.eos_token or ""
    prefix = [] if templated else special_prefix(tokenizer)
    prompts = tokenize_texts(tokenizer, [t[0] for t in texts])
    completions = tokenize_texts(tokenizer, [t[1] for t in texts])
    stats = PairStats(source_name, max_length, rows=len(texts))
    stats.count_empty_prompts(rows, fields.prompt, refuse_all=True)
    examples: List[Example] = []
    for (_, text, _, _), prompt, c, label in zip(texts, prompts, completions, labels):
        c = c + [eos] if not (templated and text.rstrip().endswith(ends)) else c
        head = fit_prompt(prefix, prompt, len(c), stats)
        if head is not None:
            examples.append({"completion": head + c, "prompt_len": len(head), "label": label})
            stats.kept += 1
            stats.longest = max(stats.longest, len(head) + len(c))
    stats.check_some_kept()
    return examples, stats


def _label(value: Any, source_name: str, row: int) -> int:
    if value in (True, False, 0, 1):
        return int(value)
    raise DataError(f"{source_name}: row {row} has label {value!r}; an unpaired KTO record's "
                    "'label' is true (a desirable completion) or false")


def with_mismatched(examples: List[Example], max_length: int) -> List[Example]:
    """Each example with its own prompt and the previous example's completion (the first: the
    last's), cut to max_length: the sequences KTO's KL estimate scores."""
    out = []
    for i, ex in enumerate(examples):
        other = examples[i - 1]
        tail = other["completion"][other["prompt_len"]:]
        out.append({**ex, "mismatched": (ex["completion"][:ex["prompt_len"]] + tail)[:max_length]})
    return out


class KTOCollate(PairCollate):
    """list of examples -> (2B, T) rows: the B completions, then the B mismatched sequences,
    inputs and shifted targets as DPO's (the prompt's tokens not counted); `label` (B,)."""
    sides = ("completion", "mismatched")

    def __init__(self, pad_id: int):
        super().__init__(pad_id, shift=True)

    def __call__(self, batch: List[Dict[str, Any]]) -> Dict[str, Any]:
        import torch
        out = super().__call__(batch)
        examples = [ex for row in batch for ex in row] if isinstance(batch[0], list) else batch
        out["label"] = torch.tensor([int(ex["label"]) for ex in examples], dtype=torch.bool)
        return out
