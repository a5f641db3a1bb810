"""The token cache: built once, keyed correctly, never seen half-written, split deterministic."""

import json
import os
import time

import numpy as np
import pytest

from paratrain.config import DataConfig
from paratrain.data import (
    data_fingerprint,
    load_prepared,
    prepare_data,
    resolve_corpus,
    wait_for_data,
)
from paratrain.errors import DataError


def make_corpus(root, n=40):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"doc{i:03d}.py").write_text(
            f"def function_{i}(x):\n    return x * {i} + len('héllo {i}')\n" * (1 + i % 5))
    return root


def cfg_for(src, **kw):
    return DataConfig(source=str(src), vocab_size=kw.pop("vocab_size", 300), **kw)


def quiet(_msg):
    pass


def test_build_layout_and_round_trip(tmp_path):
    src = make_corpus(tmp_path / "src")
    p = prepare_data(cfg_for(src, val_fraction=0.1), tmp_path / "cache", log=quiet)
    m = p.meta
    assert p.dir.parent == tmp_path / "cache" / "data" and m["fingerprint"] == p.dir.name
    assert m["num_docs"] == {"train": 36, "val": 4} and m["dtype"] == "uint16"
    assert m["vocab_size"] == p.tokenizer().vocab_size == 300
    tok = p.tokenizer()
    docs = []
    for split in ("train", "val"):
        tokens = p.tokens(split)[:]
        offsets = np.load(p.offsets_path(split))
        assert len(offsets) == m["num_docs"][split] + 1 and offsets[-1] == len(tokens)
        assert len(tokens) == m["num_tokens"][split]
        for a, b in zip(offsets[:-1], offsets[1:]):
            assert tokens[b - 1] == tok.eot_id  # each document ends with exactly one [EOT]
            assert tok.eot_id not in tokens[a:b - 1]
            docs.append(tok.decode(tokens[a:b].tolist()))
    assert sorted(docs) == sorted(resolve_corpus(str(src)).documents())  # disjoint, complete


def test_second_call_reuses(tmp_path):
    cfg = cfg_for(make_corpus(tmp_path / "src"))
    p1 = prepare_data(cfg, tmp_path / "cache", log=quiet)
    mtime = os.stat(p1.dir / "meta.json").st_mtime_ns
    logs = []
    t0 = time.perf_counter()
    p2 = prepare_data(cfg, tmp_path / "cache", log=logs.append)
    assert time.perf_counter() - t0 < 0.5
    assert p2.dir == p1.dir and os.stat(p2.dir / "meta.json").st_mtime_ns == mtime
    assert any("reusing" in line for line in logs)
    assert load_prepared(p1.dir).meta == p1.meta
    assert wait_for_data(cfg, tmp_path / "cache", timeout_s=1).dir == p1.dir


def test_fingerprint_keys(tmp_path):
    src = make_corpus(tmp_path / "src")
    cfg = cfg_for(src)
    corpus = resolve_corpus(cfg.source)
    fp = data_fingerprint(cfg, corpus)
    assert data_fingerprint(cfg_for(src, seq_length=17, format="padded", num_workers=3),
                            corpus) == fp  # windows are cut at load time
    assert data_fingerprint(cfg_for(src, vocab_size=512), corpus) != fp
    assert data_fingerprint(cfg_for(src, tokenizer="char"), corpus) != fp
    assert data_fingerprint(cfg_for(src, val_fraction=0.5), corpus) != fp
    (src / "doc000.py").write_text("changed = True\n")
    assert data_fingerprint(cfg, resolve_corpus(cfg.source)) != fp


def test_leftover_temp_dir_is_ignored(tmp_path):
    cfg = cfg_for(make_corpus(tmp_path / "src"))
    fp = data_fingerprint(cfg, resolve_corpus(cfg.source))
    debris = tmp_path / "cache" / "data" / f"{fp}.tmp-999-dead"
    debris.mkdir(parents=True)
    (debris / "train.bin").write_bytes(b"\x00" * 10)  # a crashed build: no meta.json
    with pytest.raises(DataError, match="did not appear"):
        wait_for_data(cfg, tmp_path / "cache", timeout_s=0.3, poll_s=0.05)
    p = prepare_data(cfg, tmp_path / "cache", log=quiet)
    assert p.dir.name == fp and p.meta["num_tokens"]["train"] > 0


def test_split_is_deterministic(tmp_path):
    src = make_corpus(tmp_path / "src")
    a = prepare_data(cfg_for(src, val_fraction=0.2), tmp_path / "c1", log=quiet)
    b = prepare_data(cfg_for(src, val_fraction=0.2), tmp_path / "c2", log=quiet)
    for split in ("train", "val"):
        assert (a.tokens(split)[:] == b.tokens(split)[:]).all()


def test_tiny_corpus_still_gets_a_val_doc_and_char_tokenizer(tmp_path):
    src = tmp_path / "s"
    src.mkdir()
    (src / "a.txt").write_text("abc abc")
    (src / "b.txt").write_text("xyz")
    p = prepare_data(cfg_for(src, tokenizer="char", val_fraction=0.01), tmp_path / "c",
                     log=quiet)
    assert p.meta["num_docs"] == {"train": 1, "val": 1}
    assert p.meta["tokenizer"] == "char" and p.tokenizer().kind == "char"


def test_no_text_raises(tmp_path):
    src = tmp_path / "s"
    src.mkdir()
    (src / "a.txt").write_text("")
    with pytest.raises(DataError, match=r"data.source=.* holds no text"):
        prepare_data(cfg_for(src), tmp_path / "c", log=quiet)
    assert not [p for p in (tmp_path / "c" / "data").iterdir()]  # nothing left behind


def test_jsonl_source_builds(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"text": f"sample {i} " * 20}) for i in range(30)))
    p = prepare_data(cfg_for(f), tmp_path / "c", log=quiet)
    assert p.meta["num_docs"]["train"] + p.meta["num_docs"]["val"] == 30


def test_a_save_to_disk_folder_is_trained_on_its_rows(tmp_path):
    """The cache holds the dataset's rows (text_field), and the log names the .arrow files."""
    datasets = pytest.importorskip("datasets")
    rows = [{"content": f"def row_{i}(): return {i}\n" * (1 + i % 3), "n": i} for i in range(40)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"), max_shard_size=500)
    logs = []
    p = prepare_data(cfg_for(tmp_path / "saved", text_field="content"), tmp_path / "c",
                     log=logs.append)
    assert p.meta["kind"] == "arrow" and sum(p.meta["num_docs"].values()) == 40
    assert any(line.startswith("data: 40 documents") and " arrow files (" in line
               and ".arrow" in line for line in logs), logs
    tok, docs = p.tokenizer(), []
    for split in ("train", "val"):
        tokens, offsets = p.tokens(split)[:], np.load(p.offsets_path(split))
        docs += [tok.decode(tokens[a:b - 1].tolist()) for a, b in zip(offsets[:-1], offsets[1:])]
    assert sorted(docs) == sorted(r["content"] for r in rows)


def test_stdlib_slice(tmp_path):
    cfg = DataConfig(source="stdlib", vocab_size=1024, max_bytes=1_500_000)
    logs = []
    p = prepare_data(cfg, tmp_path / "c", log=logs.append)
    assert p.meta["text_bytes"] == 1_500_000 and p.meta["vocab_size"] == 1024
    assert any(line.startswith("tokenizer: trained") for line in logs)
    assert any(line.startswith("tokenized") for line in logs)
    assert p.meta["num_docs"]["val"] >= 1


def test_racing_builders_both_end_up_with_one_cache(tmp_path, monkeypatch):
    """While we build, another process finishes first: our rename fails, we use theirs."""
    import paratrain.data.cache as cache

    cfg = cfg_for(make_corpus(tmp_path / "src"))
    real_build = cache._build
    calls = []

    def build_while_another_wins(*args):
        calls.append(1)
        if len(calls) == 1:
            prepare_data(cfg, tmp_path / "cache", log=quiet)  # the "other process"
        real_build(*args)

    monkeypatch.setattr(cache, "_build", build_while_another_wins)
    logs = []
    p = prepare_data(cfg, tmp_path / "cache", log=logs.append)
    assert len(calls) == 2 and any("another process" in line for line in logs)
    assert [d.name for d in (tmp_path / "cache" / "data").iterdir()] == [p.dir.name]


def test_tokenizer_subsample_spreads_over_the_corpus():
    from paratrain.data.cache import _spread_subsample

    sizes = np.full(100, 10)
    allowed = np.ones(100, dtype=bool)
    allowed[::10] = False
    keep = _spread_subsample(sizes, allowed, budget=300)
    assert not (keep & ~allowed).any() and 200 <= sizes[keep].sum() <= 300
    assert np.flatnonzero(keep).max() > 80  # the end of the corpus is represented
    assert (_spread_subsample(sizes, allowed, budget=10**6) == allowed).all()


def test_a_killed_preparations_temporary_folder_goes_at_the_next_one(tmp_path):
    """A preparation killed mid-build leaves its `<fingerprint>.tmp-<pid>-*` folder (no cleanup
    runs in a killed process); the next preparation removes it once its process is gone, and
    leaves the folder of a live process (or of another host) alone."""
    import subprocess
    import sys

    from paratrain.data.stale_temps import temp_name
    cfg = cfg_for(make_corpus(tmp_path / "src"))
    fp = data_fingerprint(cfg, resolve_corpus(cfg.source))
    data = tmp_path / "cache" / "data"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True, timeout=60)
    name = temp_name("0" * 24)  # this process, this host
    stale = data / name.replace(f".tmp-{os.getpid()}-", f".tmp-{int(dead.stdout)}-")
    live = data / name
    elsewhere = data / (stale.name.rpartition("@")[0] + "@another-host")
    for folder in (stale, live, elsewhere):
        folder.mkdir(parents=True)
        (folder / "train.bin").write_bytes(b"\x00" * 10)
    logs: list = []
    p = prepare_data(cfg, tmp_path / "cache", log=logs.append)
    assert p.dir.name == fp
    assert not stale.exists() and live.is_dir() and elsewhere.is_dir()
    assert any("removed 1 temporary folder" in line for line in logs)
