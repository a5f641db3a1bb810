"""Parallel sharded preparation gives the token stream of one process encoding the documents one
after another (bitwise), whatever the work units: many small files, one very large document cut
in pieces; and a preparation killed half-way publishes nothing."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from paratrain.config import DataConfig
from paratrain.data import prepare_data, resolve_corpus
from paratrain.data import units as units_mod
from paratrain.data.cache import _split_mask
from paratrain.data.units import Unit, cut_checker, unit_fragments

STDLIB_SLICE = 3_000_000  # bytes of the standard library's source: ~1 s to encode


def single_pass(corpus, tokenizer, val_fraction):
    """The stream as the cache was built before shards: every document in order, its ids and
    [EOT] appended to its split's one file."""
    docs = list(corpus.documents())
    is_val = _split_mask(len(docs), val_fraction)
    ids = {"train": [], "val": []}
    lengths = {"train": [], "val": []}
    for doc, encoded, val in zip(docs, tokenizer.encode_batch(docs), is_val):
        split = "val" if val else "train"
        ids[split] += encoded + [tokenizer.eot_id]
        lengths[split].append(len(encoded) + 1)
    return {s: (np.asarray(ids[s]), np.concatenate([[0], np.cumsum(lengths[s])]).astype(np.int64))
            for s in ids}


def assert_same_stream(prepared, corpus, val_fraction):
    expected = single_pass(corpus, prepared.tokenizer(), val_fraction)
    for split, (ids, offsets) in expected.items():
        got = prepared.tokens(split)[:]
        assert got.dtype == prepared.dtype and np.array_equal(got, ids), split
        assert np.array_equal(np.load(prepared.offsets_path(split)), offsets), split


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory):
    cfg = DataConfig(source="stdlib", vocab_size=1024, max_bytes=STDLIB_SLICE)
    logs = []
    prepared = prepare_data(cfg, tmp_path_factory.mktemp("c"), log=logs.append, processes=2)
    return cfg, prepared, logs


def test_two_processes_write_the_single_pass_stream_in_shards(stdlib_cache):
    cfg, prepared, logs = stdlib_cache
    assert len(prepared.meta["shards"]["train"]) >= 8  # the work was split
    assert any("shards, 2 processes)" in line for line in logs), logs
    assert_same_stream(prepared, resolve_corpus("stdlib", max_bytes=STDLIB_SLICE),
                       cfg.val_fraction)


def test_cuts_give_the_whole_documents_ids_on_the_stdlib(stdlib_cache):
    """Every stdlib document of the slice cut every ~1 KB: the pieces' ids joined are the
    document's ids."""
    tok = stdlib_cache[1].tokenizer()
    checker = cut_checker(tok.hf.pre_tokenizer)
    corpus = resolve_corpus("stdlib", max_bytes=STDLIB_SLICE)
    pieces = 0
    for i, path in enumerate(corpus.files[:80]):
        n = max(1, -(-os.path.getsize(path) // 1024))
        parts = [t for k in range(n) for t, _ in
                 unit_fragments(corpus, Unit(i, k, n, 1024, 1024), checker)]
        whole = Path(path).read_bytes().decode("utf-8", errors="replace")
        assert "".join(parts) == whole
        assert sum(tok.encode_batch(parts), []) == tok.encode(whole), path
        pieces += len(parts)
    assert pieces > 200


def test_one_very_large_document_in_pieces(tmp_path, monkeypatch):
    """A 2 MB document among small ones, read in ~40 pieces on two processes."""
    stdlib = resolve_corpus("stdlib", max_bytes=2_000_000)
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.py").write_text("\n".join(stdlib.documents()), encoding="utf-8")
    for i in range(20):
        (src / f"small{i:02d}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * (i + 1))
    monkeypatch.setattr(units_mod, "PIECE_BYTES", 50_000)
    cfg = DataConfig(source=str(src), vocab_size=512, val_fraction=0.1)
    corpus = resolve_corpus(str(src))
    assert len(units_mod.plan_units(corpus, pieces=True, piece_bytes=50_000)) > 50
    monkeypatch.setattr("paratrain.data.cache.plan_units",
                        lambda c, pieces: units_mod.plan_units(c, pieces, 50_000))
    prepared = prepare_data(cfg, tmp_path / "c", log=lambda m: None, processes=2)
    assert_same_stream(prepared, corpus, cfg.val_fraction)


KILLED_AFTER_ONE_SHARD = textwrap.dedent("""
    import os, signal, sys
    from paratrain.config import DataConfig
    from paratrain.data import cache, prepare_data, shards
    real = shards.Workers.unordered
    def one_then_die(self, fn, args):
        for item in real(self, fn, args):
            print("one shard written", flush=True)
            os.killpg(0, signal.SIGKILL)  # the whole preparation, its pool included
            yield item
    shards.Workers.unordered = one_then_die
    prepare_data(DataConfig(source="stdlib", vocab_size=300, max_bytes=1_000_000),
                 sys.argv[1], processes=2)
""")


@pytest.mark.slow
def test_a_killed_preparation_publishes_nothing(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_AFTER_ONE_SHARD, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == -signal.SIGKILL and "one shard written" in out, out
    data = tmp_path / "data"
    left = sorted(p.name for p in data.iterdir())
    assert len(left) == 1 and ".tmp-" in left[0]  # only the private temp dir, never published
    assert list((data / left[0]).glob("train-*.bin"))  # killed half-way through encoding
    assert not (data / left[0] / "meta.json").exists()


def test_a_long_jsonl_file_in_parts(tmp_path, monkeypatch):
    """A 400 KB .jsonl read in ~20 parts cut between lines (\\r\\n ones too), on two processes."""
    stdlib = resolve_corpus("stdlib", max_bytes=350_000)
    src = tmp_path / "corpus.jsonl"
    with open(src, "w", encoding="utf-8", newline="") as f:
        for i, doc in enumerate(stdlib.documents()):
            f.write(json.dumps({"text": doc}) + ("\r\n" if i % 2 else "\n"))
            f.write("\n" if i % 7 == 0 else "")  # blank lines are skipped, wherever they fall
    monkeypatch.setattr("paratrain.data.cache.plan_units",
                        lambda c, pieces: units_mod.plan_units(c, pieces, 20_000))
    cfg = DataConfig(source=str(src), vocab_size=512, val_fraction=0.1)
    assert len(units_mod.plan_units(resolve_corpus(str(src)), False, 20_000)) >= 18
    prepared = prepare_data(cfg, tmp_path / "c", log=lambda m: None, processes=2)
    assert_same_stream(prepared, resolve_corpus(str(src)), cfg.val_fraction)
