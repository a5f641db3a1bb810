"""Data preparation at scale: paratrain's token cache against a plain `tokenizers` script that keeps
every core busy, on a corpus of a few large files and on one of many small files; the memory of
one very large document; and the proof on the whole standard library that cutting documents
into pieces keeps every token id.

    python benchmarks/data_prepare.py --mb 24            # results in benchmarks/results/data
    python benchmarks/data_prepare.py --only prove       # the stdlib proof alone

Rates are MB of UTF-8 text per wall-clock second of encoding (paratrain's "tokenized ... in T s"
line: reading, encoding and writing the shards; the baseline: reading, `encode_batch_fast` over
16 files per call, writing one flat file), with the same tokenizer (the one paratrain trained on
the corpus). The 1-minute load average is recorded before and after every run: on a shared
machine, other work takes cores from both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable

BASELINE = r"""
import sys, time, numpy as np
from pathlib import Path
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
files = sorted(p for p in Path(sys.argv[2]).rglob("*") if p.is_file())
eot = tok.token_to_id("[EOT]")
t0, size = time.perf_counter(), 0
with open(sys.argv[3], "wb") as out:
    for i in range(0, len(files), 16):
        texts = [f.read_text(encoding="utf-8", errors="replace") for f in files[i:i + 16]]
        size += sum(len(t.encode()) for t in texts)
        for enc in tok.encode_batch_fast(texts, add_special_tokens=False):
            np.asarray(enc.ids + [eot], dtype=np.uint16).tofile(out)
print(size / 1e6 / (time.perf_counter() - t0))
"""

PREPARE = r"""
import resource, sys, time
from paratrain.config import DataConfig
from paratrain.data import prepare_data
from paratrain.data import cache, units
if len(sys.argv) > 4:
    units.PIECE_BYTES = int(sys.argv[4])
    cache.plan_units = lambda c, pieces: units.plan_units(c, pieces, int(sys.argv[4]))
procs = int(sys.argv[3]) or None
p = prepare_data(DataConfig(source=sys.argv[1], vocab_size=4096, val_fraction=0.0),
                 sys.argv[2], processes=procs)
kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"rss_kib {me} {kids}")
"""


def load() -> float:
    return os.getloadavg()[0]


def stdlib_text(mb: int) -> str:
    """About `mb` MB of the standard library's source, repeated when it is smaller."""
    sys.path.insert(0, str(REPO / "src"))
    from paratrain.data import resolve_corpus
    docs = list(resolve_corpus("stdlib").documents())
    parts, size = [], 0
    while size < mb * 1e6:
        for d in docs:
            parts.append(d)
            size += len(d)
            if size >= mb * 1e6:
                break
    return "\n".join(parts)


def make_corpora(root: Path, mb: int) -> dict:
    text = stdlib_text(mb)
    few, many = root / "few_large", root / "many_small"
    few.mkdir(parents=True)
    many.mkdir(parents=True)
    n_large = 8
    step = len(text) // n_large
    for i in range(n_large):  # cut after a line, so every file is whole lines
        (few / f"part{i}.txt").write_text(text[i * step:(i + 1) * step], encoding="utf-8")
    lines, buf, k = text.split("\n"), [], 0
    for line in lines:
        buf.append(line)
        if sum(len(b) for b in buf) > 8000:
            (many / f"doc{k:06d}.txt").write_text("\n".join(buf), encoding="utf-8")
            buf, k = [], k + 1
    if buf:
        (many / f"doc{k:06d}.txt").write_text("\n".join(buf), encoding="utf-8")
    big = root / "one_document"
    big.mkdir()
    (big / "huge.txt").write_text(text, encoding="utf-8")
    return {"few_large": few, "many_small": many, "one_document": big}


def prepare(source: Path, cache: Path, processes: int, piece_bytes: int | None = None) -> dict:
    args = [PY, "-c", PREPARE, str(source), str(cache), str(processes)]
    if piece_bytes:
        args.append(str(piece_bytes))
    before = load()
    t0 = time.perf_counter()
    out = subprocess.run(args, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO / "src")}).stdout
    wall = time.perf_counter() - t0
    m = re.search(r"tokenized ([\d.]+) MB -> ([\d.]+)M tokens in ([\d.]+) s", out)
    rss = re.search(r"rss_kib (\d+) (\d+)", out)
    return {"mb": float(m.group(1)), "encode_s": float(m.group(3)),
            "rate_mb_s": float(m.group(1)) / float(m.group(3)), "wall_s": round(wall, 1),
            "rss_parent_mb": int(rss.group(1)) / 1024, "rss_child_max_mb": int(rss.group(2)) / 1024,
            "load_before": before, "load_after": load(), "log": out.splitlines()}


def baseline(tokenizer: Path, source: Path, out: Path) -> dict:
    before = load()
    rate = float(subprocess.run([PY, "-c", BASELINE, str(tokenizer), str(source), str(out)],
                                capture_output=True, text=True, check=True).stdout.strip())
    return {"rate_mb_s": rate, "load_before": before, "load_after": load()}


def compare(source: Path, root: Path) -> dict:
    """paratrain (one process per core), the plain script, and paratrain in this process alone
    (how the cache was prepared before), interleaved A B C C B A so that the machine's drifting
    load falls on each alike; the best of each pair."""
    cache = root / "cache"
    runs: dict = {"paratrain": [], "plain_tokenizers": [], "paratrain_1_process": []}
    for order in (("paratrain", "plain_tokenizers", "paratrain_1_process"),
                  ("paratrain_1_process", "plain_tokenizers", "paratrain")):
        for variant in order:
            if variant == "plain_tokenizers":
                if not cache.exists():
                    prepare(source, cache, 1)  # the tokenizer both use
                tok = next(cache.glob("data/*/tokenizer.json"))
                runs[variant].append(baseline(tok, source, root / "flat.bin"))
                continue
            shutil.rmtree(cache, ignore_errors=True)
            cores = len(os.sched_getaffinity(0))
            runs[variant].append(prepare(source, cache, cores if variant == "paratrain" else 1))
    shutil.rmtree(cache, ignore_errors=True)
    row = {k: max(v, key=lambda r: r["rate_mb_s"]) for k, v in runs.items()}
    for k, v in runs.items():
        row[k]["all_rates"] = [r["rate_mb_s"] for r in v]
    row["ratio"] = row["paratrain"]["rate_mb_s"] / row["plain_tokenizers"]["rate_mb_s"]
    return row


def prove_stdlib() -> dict:
    """Every stdlib file cut every ~4 KB where units.py cuts: the pieces' ids joined are the
    file's ids, with a BPE trained on the stdlib (vocabulary 4096)."""
    sys.path.insert(0, str(REPO / "src"))
    from paratrain.data import resolve_corpus
    from paratrain.data.tokenizer import Tokenizer
    from paratrain.data.units import Unit, cut_checker, unit_fragments
    corpus = resolve_corpus("stdlib")
    tok = Tokenizer.train_bpe(corpus.documents(), 4096)
    checker = cut_checker(tok.hf.pre_tokenizer)
    files = pieces = 0
    for i, path in enumerate(corpus.files):
        n = max(1, -(-os.path.getsize(path) // 4096))
        parts = [t for k in range(n) for t, _ in
                 unit_fragments(corpus, Unit(i, k, n, 4096, 4096), checker)]
        whole = Path(path).read_bytes().decode("utf-8", errors="replace")
        assert "".join(parts) == whole, path
        assert sum(tok.encode_batch(parts), []) == tok.encode(whole), path
        files, pieces = files + 1, pieces + len(parts)
    return {"files": files, "pieces": pieces, "bytes": sum(map(os.path.getsize, corpus.files))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=24, help="size of each corpus (MB)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "data"))
    ap.add_argument("--only", choices=["rates", "prove"], default=None)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"cores": len(os.sched_getaffinity(0)), "mb": args.mb}
    if args.only in (None, "prove"):
        t0 = time.perf_counter()
        results["stdlib_proof"] = {**prove_stdlib(), "s": round(time.perf_counter() - t0, 1)}
        print(json.dumps(results["stdlib_proof"]))
    if args.only in (None, "rates"):
        root = Path(tempfile.mkdtemp(prefix="paratrain-data-bench-"))
        try:
            corpora = make_corpora(root / "src", args.mb)
            for name in ("few_large", "many_small"):
                results[name] = row = compare(corpora[name], root)
                print(name, json.dumps({k: v["rate_mb_s"] for k, v in row.items()
                                        if isinstance(v, dict)}), "ratio", row["ratio"])
            # memory: one document of args.mb MB, in pieces of 1 MiB (the default) and of 4 MiB
            for piece in (2**20, 4 * 2**20):
                cache = root / "cache-one"
                results[f"one_document_piece_{piece >> 20}mb"] = r = \
                    prepare(corpora["one_document"], cache, len(os.sched_getaffinity(0)), piece)
                shutil.rmtree(cache)
                print("one document, pieces of", piece >> 20, "MB:", r["rss_child_max_mb"],
                      "MB per process,", r["rate_mb_s"], "MB/s")
        finally:
            shutil.rmtree(root, ignore_errors=True)
    (out / "data_prepare.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
