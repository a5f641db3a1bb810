"""The `data` section of the configuration tree: what is read, how it is tokenized, and how it
becomes rows and batches (its own module: the data keys are the most numerous). As in
sections.py, the docstring under each field is that key's one description (config/docs.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class DataConfig:
    """What is read, how it is tokenized, and how it becomes rows and batches."""
    source: str = "stdlib"
    """stdlib (the Python standard library's source files) | a text file | a directory | a glob
    ('data/*.txt') | a .jsonl / .parquet / .csv file | a `datasets.save_to_disk` folder |
    fine-tuning formats: a Hub dataset hf://datasets/org/name[@revision] (data.subset,
    data.split), read through huggingface_hub's and datasets' caches (offline: HF_HUB_OFFLINE=1) | a
    folder of token ids (.bin) with a meta.json: {"vocab_size": N, "eos_id": E}."""
    text_field: str = "text"
    """The field holding the text: .jsonl / .parquet / save_to_disk corpora, and the text to
    label for classify."""
    label_field: str = "label"
    """classify: the label's field (strings get ids in sorted order; integers are ids)."""
    seq_length: int = 256
    """packed / padded: tokens per row."""
    vocab_size: int = 4096
    """data.tokenizer=bpe: the vocabulary to train on the corpus."""
    tokenizer: str = "auto"
    """auto (model.path's own for model.arch=hf, else bpe) | bpe (byte-level, trained on the
    corpus) | char | DIR: a pretrained Hugging Face tokenizer folder, used as it is."""
    format: str = "packed"
    """What the data is and what is trained: packed (contiguous windows of text) | padded (one
    document per row, pads ignored by the loss) | pairs (input -> output) | chat (messages) |
    classify (text -> label) | preference (prompt, chosen, rejected: DPO or a reward model) |
    prompts (prompts alone: online RL, trainer.objective=grpo, rloo or ppo) | auto: decided from the
    fields of data.source's first records (ShareGPT, Alpaca, OpenAI / TRL conversational,
    prompt/completion, preference and unpaired preference records; the log says what it chose).
    """
    records: str = "native"
    """How the records are laid out when they are not paratrain's own fields (data.format=auto
    sets it): native | sharegpt (conversations of {from, value}: human / gpt / system become
    user / assistant / system) | alpaca (instruction, optional input -> output: the input after
    the instruction, a blank line between) | prompt_completion (prompt and completion as chat
    messages, one conversation)."""
    pack: bool = False
    """pairs / chat / preference (DPO, KTO): several examples per row of data.max_length tokens
    (best-fit decreasing, made from the seed before the data is split between workers), each
    with its own positions and attention kept inside it: the same losses as padded batches with
    far fewer pads. trainer.batch_size then counts rows. false: examples padded to the longest of
    each micro-batch."""
    document_mask: bool = False
    """packed: attention stays inside each document of a window and positions restart at each
    (torchtitan's block-causal attention); false: a window attends across the documents it
    spans, separated by [EOT] only."""
    group_by_length: bool = False
    """Micro-batches of examples of similar lengths (as Hugging Face's option): the epoch's
    shuffled order is sorted by length inside windows of 50 global batches, so pads shrink for
    the formats that cannot pack; the same batches on 1 and N workers."""
    padded_overflow: str = "truncate"
    """padded: a document longer than seq_length is cut to one row (truncate: the rest is
    dropped, the log counts it) or continues in as many rows as it needs (split)."""
    input_field: str = "input"
    """pairs: the prompt's field."""
    output_field: str = "output"
    """pairs: the answer's field; the loss counts only its tokens."""
    messages_field: str = "messages"
    """chat: the field with [{role, content}, ...]; the loss counts the assistant turns."""
    prompt_field: str = "prompt"
    """preference / prompts: the prompt's field (text, or chat messages)."""
    chosen_field: str = "chosen"
    """preference: the preferred response's field."""
    rejected_field: str = "rejected"
    """preference: the other response's field."""
    margin_field: Optional[str] = None
    """preference: a field with each pair's margin (reward models); null: none."""
    val_source: Optional[str] = None
    """pairs / chat / classify / preference: a validation file (or Hub dataset, as data.source);
    null: data.val_fraction of the records is held out."""
    subset: Optional[str] = None
    """data.source / data.val_source as a Hub dataset (hf://datasets/org/name[@revision]): its
    configuration (the `name` of datasets.load_dataset); null: its default."""
    split: str = "train"
    """A Hub dataset's split for training, with datasets' slicing (train[:10%], train[100:])."""
    val_split: str = "validation"
    """A Hub dataset's split for validation (data.val_source=hf://...)."""
    max_length: Optional[int] = None
    """pairs / chat / classify / preference: tokens per example (pairs lose the start of the
    input); null: the model's max_position_embeddings."""
    chat_template: str = "auto"
    """auto (the tokenizer's own, if any) | none | PATH to a jinja file."""
    system_prompt: Optional[str] = None
    """A system turn put first when a chat template renders an example (and by generate)."""
    val_fraction: float = 0.02
    """The share of documents (or records) held out for validation."""
    max_bytes: Optional[int] = None
    """Read at most this much text (documents in sorted order); null: all of it."""
    cache_dir: Optional[str] = None
    """Where tokenized data is cached; null: $XDG_CACHE_HOME/paratrain or ~/.cache/paratrain."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    shuffle: bool = True
    """A new seeded order every epoch (trainer.seed); false: the data's own order."""
    drop_last: bool = True
    """Drop an epoch's last, short global batch; false: it is one more, shorter step."""
