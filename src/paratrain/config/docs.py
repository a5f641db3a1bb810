"""The config keys' descriptions, read from the one place they are written: the docstring under
each field of the dataclasses in config/sections.py (as torchtitan's JobConfig keeps them).

Everything that tells a user what a key means is made from here: `paratrain config show`'s
comments, the "unknown config key" error's suggestions and the docs site's reference page
(docs/hooks.py). tests/unit/test_config_docs.py fails on a key without a description.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import re
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator, Optional

import yaml

# Sections of the reference page that split a long dataclass where the split helps the reader;
# keys not named here stay in the section's first group.
GROUPS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "trainer": [
        ("Devices, batch and length", ()),
        ("Parallelism and memory", (
            "strategy", "precision", "activation_checkpointing", "compile", "cpu_offload",
            "reshard_after_forward", "shard_group_size", "tensor_parallel", "pipeline_parallel",
            "pipeline_schedule", "pipeline_split")),
        ("Evaluation and fine-tuning", (
            "eval_every", "eval_samples", "early_stopping_patience", "early_stopping_threshold",
            "keep_best", "label_smoothing", "neftune_noise_alpha", "objective")),
    ],
    "data": [
        ("Source, format and tokenizer", ()),
        ("Record field names", (
            "text_field", "label_field", "input_field", "output_field", "messages_field",
            "prompt_field", "chosen_field", "rejected_field", "margin_field")),
        ("Fine-tuning examples", (
            "val_source", "max_length", "chat_template", "system_prompt", "pack",
            "group_by_length")),
    ],
}

# What `paratrain config show` prints without --all: the keys a first run changes.
COMMON = frozenset("""
run.name run.dir model.arch model.path model.preset model.lora.r data.source data.format
data.seq_length data.tokenizer data.val_source trainer.devices trainer.strategy
trainer.precision trainer.batch_size trainer.global_batch_size trainer.max_steps trainer.epochs
trainer.objective optim.lr optim.schedule optim.warmup_steps checkpoint.every_steps
checkpoint.resume distributed.nnodes distributed.node_rank distributed.master_addr
distributed.master_port
""".split())


@dataclass(frozen=True)
class KeyDoc:
    """One config key: its dotted name, its default and the description under its field."""
    key: str
    default: Any
    help: str

    @property
    def section(self) -> str:
        return self.key.split(".")[0]

    @property
    def summary(self) -> str:
        """The description's first clause, at most 90 characters (what an error line shows)."""
        first = re.split(r"\. |; |: ", self.help)[0].rstrip(".")
        return first if len(first) <= 90 else first[:87] + "..."


def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring, as one paragraph} of a dataclass, from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _walk(cls: type, prefix: str) -> Iterator[KeyDoc]:
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        default = _default(f)
        if dataclasses.is_dataclass(default):
            yield from _walk(type(default), f"{prefix}{f.name}.")
            continue
        yield KeyDoc(prefix + f.name, default, docs.get(f.name, ""))


@lru_cache(maxsize=4)
def all_keys(root: type) -> tuple[KeyDoc, ...]:
    """Every key of the config tree `root` (config.TrainConfig: passed in, as config.py itself
    asks this module for its error messages), in the order of config.py."""
    return tuple(k for f in dataclasses.fields(root)
                 for k in _walk(type(_default(f)), f.name + "."))


def section_docs(root: type) -> dict[str, str]:
    """{section name: the class docstring of its dataclass}."""
    return {f.name: inspect.cleandoc(type(_default(f)).__doc__ or "")
            for f in dataclasses.fields(root)}


def lookup(root: type, key: str) -> Optional[KeyDoc]:
    return next((k for k in all_keys(root) if k.key == key), None)


def closest(root: type, key: str, n: int = 3) -> list[KeyDoc]:
    """The keys a mistyped `key` most likely meant: the same name in another section first (a
    right name in the wrong place), then near spellings in the same section, then anywhere."""
    keys = all_keys(root)
    section, _, name = key.rpartition(".")
    same_name = [k.key for k in keys if k.key.rsplit(".", 1)[-1] == name]
    siblings = {k.key.rsplit(".", 1)[-1]: k.key for k in keys
                if k.key.rpartition(".")[0] == section}
    near_name = [siblings[m] for m in difflib.get_close_matches(name, list(siblings), cutoff=0.75)]
    near_key = difflib.get_close_matches(key, [k.key for k in keys], cutoff=0.85)
    picked = dict.fromkeys(same_name + near_name + near_key)
    return [d for d in (lookup(root, k) for k in list(picked)[:n]) if d is not None]


def suggest_key(root: type, name: str) -> Optional[str]:
    """The key a misspelt or section-less `name` most likely means ("max_steps" ->
    trainer.max_steps, "trainer.max_step" -> trainer.max_steps), or None."""
    near = closest(root, name, n=1)
    return near[0].key if near else None


def unknown_key_message(root: type, key: str) -> str:
    """The one line for an unknown key: the closest keys with what they mean."""
    near = closest(root, key)
    hint = "; ".join(f"{k.key} ({k.summary})" for k in near)
    did_you_mean = f"; did you mean {hint}?" if near else ";"
    return (f"unknown config key {key!r}{did_you_mean} `paratrain config show --all` lists "
            "every key")


def grouped(root: type, section: str) -> list[tuple[str, list[KeyDoc]]]:
    """A section's keys in the reference page's groups (one unnamed group when not split)."""
    keys = [k for k in all_keys(root) if k.section == section]
    groups = GROUPS.get(section)
    if not groups:
        return [("", keys)]
    claimed = {name for _, names in groups for name in names}
    out = []
    for title, names in groups:
        if names:
            members = [k for k in keys if k.key.split(".", 1)[1] in names]
        else:
            members = [k for k in keys if k.key.split(".", 1)[1] not in claimed]
        out.append((title, members))
    return out


def format_value(value: Any) -> str:
    """A value as YAML writes it inline (null, true, [0.9, 0.95], 'cpu:2')."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix(
        "\n...").removesuffix("...").strip()


def annotated_yaml(root: type, values: dict, everything: bool) -> str:
    """`values` (a resolved config as a dict) as YAML with each key's description as a comment
    above it: the common keys (COMMON) and those set to other than their default, or every key
    (`everything`)."""
    lines: list[str] = []
    current: list[str] = []
    for doc in all_keys(root):
        parts = doc.key.split(".")
        value = values
        for part in parts:
            value = value[part]
        if not (everything or doc.key in COMMON or value != doc.default):
            continue
        for depth, part in enumerate(parts[:-1]):  # open the sections this key is in
            if current[:depth + 1] != parts[:depth + 1]:
                if depth == 0 and lines:
                    lines.append("")
                lines.append("  " * depth + part + ":")
        current = parts[:-1]
        indent = "  " * (len(parts) - 1)
        lines += textwrap.wrap(doc.help, 100, initial_indent=indent + "# ",
                               subsequent_indent=indent + "# ")
        lines.append(f"{indent}{parts[-1]}: {format_value(value)}")
    return "\n".join(lines) + "\n"


def _markdown_cell(text: str) -> str:
    """A description in a table cell: pipes escaped, and < > outside `code` shown, not read as
    HTML (runs/<run.name>)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts).replace("|", "\\|")


def reference_markdown(root: type) -> str:
    """The Reference page of every config key, generated when the docs are built."""
    out = ["# Config keys", "",
           "Every key, its default and what it means: generated from the docstrings in "
           "`src/paratrain/config.py`, the one place each key is described. Set a key in a YAML "
           "file (`trainer:` then `  max_steps: 100`), as a dotted override "
           "(`paratrain train trainer.max_steps=100`) or, from Python, "
           "`TrainConfig.from_yaml(path, overrides=[...])`. `paratrain config show` prints the "
           "common keys and those you set, with their values; `paratrain config show --all` "
           "every key.", ""]
    sections = section_docs(root)
    for section, intro in sections.items():
        out += [f"## `{section}`", "", intro, ""]
        for title, keys in grouped(root, section):
            if title:
                out += [f"### {title}", ""]
            out += ["| key | default | meaning |", "|---|---|---|"]
            for k in keys:
                cell = _markdown_cell(k.help)
                default = format_value(k.default).replace("|", "\\|")
                out.append(f"| `{k.key}` | `{default}` | {cell} |")
            out.append("")
    return "\n".join(out)
