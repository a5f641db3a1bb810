"""The encoded fine-tuning records cache (data/encoded.py): a second preparation of the same
records reuses it and gives exactly what encoding again gives; whatever changes an example
(tokenizer, template, max length, the records) rebuilds it; what does not (the file's place, the
validation fraction) reuses it; a process that maps it never loads transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paratrain.config import TrainConfig
from paratrain.data.encoded import TokenizerFacts
from paratrain.data.examples import FinetuneDataset, split_validation
from paratrain.data.finetune import encode_pairs
from paratrain.data.hf_tokenizer import load_tokenizer
from paratrain.data.rows import read_rows
from paratrain.dist import DistEnv
from paratrain.config import registry
from paratrain.tasks.base import TaskRecords
from tests.conftest import REPO, make_hf_tokenizer

pytest.importorskip("transformers")

ROWS = [{"input": f"def f{i}(x, y{i}):", "output": f"Return x plus {i} times y{i}."}
        for i in range(40)]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A model folder as far as preparing the data reads it: the tokenizer and config.json."""
    texts = [r["input"] + " " + r["output"] for r in ROWS]
    out = make_hf_tokenizer(tmp_path_factory.mktemp("tok") / "tok", texts, vocab_size=300)
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return out


@pytest.fixture
def train(tmp_path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _cfg(tok_dir: Path, source: Path, cache: Path, *extra: str, fmt: str = "pairs"
         ) -> TrainConfig:
    return TrainConfig.from_yaml(None, [
        "model.arch=hf", f"model.path={tok_dir}", f"data.format={fmt}", f"data.source={source}",
        "data.max_length=96", "data.chat_template=none", "data.val_fraction=0.1",
        f"data.cache_dir={cache}", *extra])


def _prepare(cfg: TrainConfig, records: TaskRecords | None = None):
    lines: list[str] = []
    task = registry.get(cfg.data.format).load().prepare(cfg, DistEnv.single("cpu"), records,
                                                        lines.append)
    return task, lines


def _built(lines: list[str]) -> bool:
    assert any(x.startswith(("data: encoded records saved in", "data: reusing")) for x in lines)
    return any(x.startswith("data: encoded records saved in") for x in lines)


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in ((a[i], b[i]) for i in range(len(a))))


def test_a_second_preparation_reuses_the_cache_and_equals_encoding_again(tok_dir, train,
                                                                         tmp_path):
    cfg = _cfg(tok_dir, train, tmp_path / "cache")
    first, built = _prepare(cfg)
    second, reused = _prepare(cfg)
    assert _built(built) and not _built(reused)
    assert reused[0] == f"data: reusing the encoded records in {tmp_path / 'cache'}/encoded/" \
                        f"{first.data_fingerprint}"
    summary = [x for x in built if " rows -> " in x]
    assert len(summary) == 1 and summary == [x for x in reused if " rows -> " in x]
    # what encoding the records again, without any cache, gives
    tok, _ = load_tokenizer(tok_dir)
    examples, _ = encode_pairs(read_rows(str(train), what="x"), tok, max_length=96,
                               chat_template="none")
    train_ref, val_ref = split_validation(examples, 0.1, seed=cfg.trainer.seed)
    for task in (first, second):
        assert _same(task.train_ds, FinetuneDataset(train_ref))
        assert _same(task.val_ds, FinetuneDataset(val_ref))
    assert isinstance(second.tokenizer, TokenizerFacts)  # the tokenizer was never loaded
    assert (second.tokenizer.pad_token_id, len(second.tokenizer)) == (tok.pad_token_id, len(tok))
    assert second.data_fingerprint == first.data_fingerprint


@pytest.mark.parametrize("change", ["max_length", "template", "system_prompt", "tokenizer",
                                    "records"])
def test_what_changes_an_example_rebuilds_the_cache(tok_dir, train, tmp_path, change):
    cache = tmp_path / "cache"
    assert _built(_prepare(_cfg(tok_dir, train, cache))[1])
    extra: list[str] = []
    tokenizer, source = tok_dir, train
    if change == "max_length":
        extra = ["data.max_length=80"]
    elif change in ("template", "system_prompt"):
        template = tmp_path / "chat.jinja"
        template.write_text(TEMPLATE)
        extra = [f"data.chat_template={template}"]
        if change == "system_prompt":
            assert _built(_prepare(_cfg(tok_dir, train, cache, *extra))[1])
            extra.append("data.system_prompt=Be brief.")
    elif change == "tokenizer":  # the same folder name elsewhere, one special token changed
        tokenizer = tmp_path / "other" / tok_dir.name
        shutil.copytree(tok_dir, tokenizer)
        config = json.loads((tokenizer / "tokenizer_config.json").read_text())
        config["pad_token"] = config["bos_token"]
        (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    else:
        source = tmp_path / "more.jsonl"
        source.write_text(train.read_text() + json.dumps({"input": "a", "output": "b"}) + "\n")
    task, lines = _prepare(_cfg(tokenizer, source, cache, *extra))
    assert _built(lines)
    assert len(list((cache / "encoded").iterdir())) == 2 + (change == "system_prompt")
    if change == "tokenizer":
        assert task.collate.pad_id == load_tokenizer(tokenizer)[0].pad_token_id


def test_the_same_records_elsewhere_and_another_split_reuse_the_cache(tok_dir, train, tmp_path):
    cache = tmp_path / "cache"
    first, _ = _prepare(_cfg(tok_dir, train, cache))
    moved = tmp_path / "elsewhere" / "copy.jsonl"
    moved.parent.mkdir()
    shutil.copy(train, moved)
    task, lines = _prepare(_cfg(tok_dir, moved, cache, "data.val_fraction=0.25",
                                "trainer.seed=7"))
    assert not _built(lines)
    assert any(x.startswith(f"{moved}: 40 rows -> ") for x in lines)  # said with this name
    tok, _ = load_tokenizer(tok_dir)
    examples, _ = encode_pairs(ROWS, tok, max_length=96, chat_template="none")
    train_ref, val_ref = split_validation(examples, 0.25, seed=7)
    assert _same(task.train_ds, FinetuneDataset(train_ref))
    assert _same(task.val_ds, FinetuneDataset(val_ref))


def test_records_handed_to_the_api_are_keyed_by_content(tok_dir, tmp_path):
    cfg = _cfg(tok_dir, tmp_path / "unused.jsonl", tmp_path / "cache")
    assert _built(_prepare(cfg, TaskRecords(list(ROWS), None))[1])
    assert not _built(_prepare(cfg, TaskRecords([dict(r) for r in ROWS], None))[1])
    assert _built(_prepare(cfg, TaskRecords(ROWS[:-1], None))[1])


def test_a_classifier_keeps_its_label_names(tok_dir, tmp_path):
    source = tmp_path / "texts.jsonl"
    source.write_text("".join(json.dumps({"text": r["output"], "label": ["no", "yes"][i % 2]})
                              + "\n" for i, r in enumerate(ROWS)))
    cfg = _cfg(tok_dir, source, tmp_path / "cache", fmt="classify")
    first, built = _prepare(cfg)
    second, reused = _prepare(cfg)
    assert _built(built) and not _built(reused)
    assert list(second.label_names) == list(first.label_names) == ["no", "yes"]
    assert "labels: 0=no, 1=yes" in reused
    assert _same(second.train_ds, first.train_ds) and _same(second.val_ds, first.val_ds)


def test_a_cache_that_cannot_be_written_is_said_and_the_run_goes_on(tok_dir, train, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    task, lines = _prepare(_cfg(tok_dir, train, blocked))
    assert any(x.startswith(f"data: cannot save the encoded records in {blocked}/encoded/")
               for x in lines), lines
    assert len(task.train_ds) == 36 and len(task.val_ds) == 4


def test_a_process_that_maps_the_cache_never_imports_transformers(tok_dir, train, tmp_path):
    cfg = _cfg(tok_dir, train, tmp_path / "cache")
    _prepare(cfg)  # built here
    code = f"""
import sys
from paratrain.config import TrainConfig
from paratrain.dist import DistEnv
from paratrain.config import registry
cfg = TrainConfig.from_yaml(None, {_cfg_args(cfg)!r})
task = registry.get("pairs").load().prepare(cfg, DistEnv.single("cpu"), None, print)
batch = task.collate([task.train_ds[0], task.train_ds[1]])
print(len(task.tokenizer), sorted(batch), "transformers" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == \
        f"{len(load_tokenizer(tok_dir)[0])} ['attention_mask', 'input_ids', 'targets'] False"


def _cfg_args(cfg: TrainConfig) -> list[str]:
    d = cfg.data
    return ["model.arch=hf", f"model.path={cfg.model.path}", "data.format=pairs",
            f"data.source={d.source}", "data.max_length=96", "data.chat_template=none",
            "data.val_fraction=0.1", f"data.cache_dir={d.cache_dir}"]
