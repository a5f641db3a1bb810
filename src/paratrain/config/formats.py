"""The record formats other tools write, recognised by their fields: `data.format=auto` reads the
first records of data.source once, when the config is built, and decides the data.format that
trains them, the field keys, and `data.records` (how rows are turned into paratrain's own before
encoding: data/record_formats.py). The decision is made here, once, and carried by the config;
its line (`format_line`) is logged when the run starts.

| records | fields | trains |
|---|---|---|
| ShareGPT | conversations: [{from, value}] (human / gpt / system) | chat |
| Alpaca | instruction, optional input, output | pairs |
| OpenAI / TRL conversational | messages: [{role, content}] | chat |
| TRL prompt-completion | prompt, completion (text) | pairs |
| TRL conversational prompt-completion | prompt, completion (messages) | chat |
| TRL preference | prompt, chosen, rejected (text or messages) | preference (DPO) |
| TRL unpaired preference | prompt, completion, label | preference (KTO) |
| paratrain pairs | input, output | pairs |
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..errors import ConfigError
from .hub import is_hub_dataset, load_hub_dataset

PEEK = 5  # records read to decide
RECORDS = ("native", "sharegpt", "alpaca", "prompt_completion")  # data.records' values


@dataclass(frozen=True)
class RecordFormat:
    name: str  # as log lines and errors name it
    fields: tuple[str, ...]  # the fields that mark it (all present in every record read)
    format: str  # the data.format that trains it
    keys: dict = field(default_factory=dict)  # data.* keys it sets
    records: str = "native"  # data.records: the conversion before encoding
    objective: Optional[str] = None  # trainer.objective when auto would pick another
    over: tuple[str, ...] = ()  # formats whose fields it holds too and that it wins over
    messages: Optional[bool] = None  # prompt is chat messages (True) / text (False) / either

    def settle(self) -> str:
        """The keys that choose this format without auto."""
        keys = {"data.format": self.format, **{f"data.{k}": v for k, v in self.keys.items()}}
        if self.records != "native":
            keys["data.records"] = self.records
        if self.objective:
            keys["trainer.objective"] = self.objective
        return " ".join(f"{k}={v}" for k, v in keys.items())


FORMATS = (
    RecordFormat("ShareGPT", ("conversations",), "chat", records="sharegpt"),
    RecordFormat("Alpaca", ("instruction", "output"), "pairs", records="alpaca",
                 over=("pairs",)),
    RecordFormat("conversational (messages)", ("messages",), "chat"),
    RecordFormat("preference", ("prompt", "chosen", "rejected"), "preference"),
    RecordFormat("unpaired preference", ("prompt", "completion", "label"), "preference",
                 objective="kto", over=("prompt-completion", "conversational prompt-completion")),
    RecordFormat("prompt-completion", ("prompt", "completion"), "pairs",
                 keys={"input_field": "prompt", "output_field": "completion"}, messages=False),
    RecordFormat("conversational prompt-completion", ("prompt", "completion"), "chat",
                 records="prompt_completion", messages=True),
    RecordFormat("pairs", ("input", "output"), "pairs"),
)


def matches(records: list[dict]) -> list[RecordFormat]:
    """The formats whose fields every record carries, less those a more specific one beats."""
    seen = set.intersection(*(set(r) for r in records)) if records else set()
    chat = isinstance(records[0].get("prompt"), (list, dict)) if records else False
    fits = [f for f in FORMATS if set(f.fields) <= seen and f.messages in (None, chat)]
    beaten = {name for f in fits for name in f.over}
    return [f for f in fits if f.name not in beaten]


def format_keys(records: list) -> Optional[list[str]]:
    """The keys that train records given in Python (Trainer(train_data=[...])) when exactly one
    format fits their first records; None otherwise (the registry's fields decide)."""
    fits = matches([r for r in records[:PEEK] if isinstance(r, dict)])
    return fits[0].settle().split() if len(fits) == 1 else None


def detect(records: list[dict], where: str) -> RecordFormat:
    """The one format whose fields every record read carries (the most specific one), or one
    ConfigError line: none fits (the fields seen and those known), or several do (the
    candidates and the keys that choose each)."""
    seen = set.intersection(*(set(r) for r in records)) if records else set()
    fits = matches(records)
    if len(fits) == 1:
        return fits[0]
    if not fits:
        known = "; ".join(f"{f.name}: {', '.join(f.fields)}" for f in FORMATS)
        raise ConfigError(f"data.format=auto: the records of {where} have fields "
                          f"{sorted(seen)}, none of the formats it knows ({known}); set "
                          "data.format and its field keys")
    choices = "; ".join(f"{f.name} ({', '.join(f.fields)}): {f.settle()}" for f in fits)
    raise ConfigError(f"data.format=auto: the records of {where} fit several formats, so "
                      f"say which: {choices}")


def resolve_format(cfg: Any) -> Optional[str]:
    """data.format=auto decided from data.source's first records: data.format, data.records,
    the field keys and (unpaired preference) trainer.objective set in cfg; returns the line
    that says what was chosen and from which fields (None: data.format was not auto)."""
    d = cfg.data
    if d.format != "auto":
        return None
    chosen = detect(first_records(d.source, d.subset, d.split), repr(str(d.source)))
    d.format, d.records = chosen.format, chosen.records
    for key, value in chosen.keys.items():
        setattr(d, key, value)
    if chosen.objective and cfg.trainer.objective == "auto":
        cfg.trainer.objective = chosen.objective
    return (f"data.format=auto: {chosen.name} records (fields {', '.join(chosen.fields)} in "
            f"the first records of {d.source}) -> {chosen.settle()}")


def first_records(source: Any, subset: Optional[str] = None, split: str = "train"
                  ) -> list[dict]:
    """Up to PEEK records from the start of a .jsonl / .json / .parquet file or a Hub
    dataset's split, torch-free."""
    if is_hub_dataset(source):
        dataset = load_hub_dataset(source, subset, split, "data.source")
        return [dict(r) for r in dataset.select(range(min(PEEK, len(dataset))))]
    path = Path(str(source)).expanduser()
    name = path.name.lower()
    if not path.is_file():
        raise ConfigError(f"data.format=auto reads the first records of data.source, and "
                          f"{str(source)!r} is not a file; set data.format")
    try:
        if name.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                lines = [ln for ln in (next(f, "") for _ in range(PEEK * 4)) if ln.strip()]
            rows = [json.loads(ln) for ln in lines[:PEEK]]
        elif name.endswith(".json"):
            rows = json.loads(path.read_text(encoding="utf-8"))[:PEEK]
        elif name.endswith(".parquet"):
            import pyarrow.parquet as pq
            rows = pq.ParquetFile(path).read_row_group(0).slice(0, PEEK).to_pylist()
        else:
            raise ConfigError(f"data.format=auto reads .jsonl, .json and .parquet files, not "
                              f"{str(source)!r}; set data.format")
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"data.format=auto cannot read the first records of {str(source)!r} "
                          f"({type(e).__name__}); set data.format") from None
    if not rows or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(f"data.format=auto: {str(source)!r} holds no records (JSON objects) "
                          "at its start; set data.format")
    return rows
