"""Corpus resolution: every kind of data.source, and the one-line errors users see."""

import json
import os

import pytest

from paratrain.data import resolve_corpus
from paratrain.errors import DataError


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_single_text_file(tmp_path):
    f = write(tmp_path / "a.txt", "hello wörld\n")
    c = resolve_corpus(str(f))
    assert c.kind == "text" and c.files == (str(f),)
    assert list(c.documents()) == ["hello wörld\n"]


def test_directory_recursive_sorted_skips_hidden_and_unknown(tmp_path):
    write(tmp_path / "b.py", "print(1)\n")
    write(tmp_path / "sub" / "a.md", "# title\n")
    write(tmp_path / ".git" / "config.txt", "hidden\n")
    write(tmp_path / "image.bin", "not text")
    write(tmp_path / "empty.txt", "")
    c = resolve_corpus(str(tmp_path))
    assert c.kind == "text"
    assert c.files == tuple(sorted([str(tmp_path / "b.py"), str(tmp_path / "empty.txt"),
                                    str(tmp_path / "sub" / "a.md")]))
    assert list(c.documents()) == ["print(1)\n", "# title\n"]  # empty documents are skipped


def test_glob_with_double_star(tmp_path):
    write(tmp_path / "x" / "1.txt", "one")
    write(tmp_path / "x" / "y" / "2.txt", "two")
    write(tmp_path / "x" / "3.md", "three")
    c = resolve_corpus(str(tmp_path / "x" / "**" / "*.txt"))
    assert [os.path.basename(f) for f in c.files] == ["1.txt", "2.txt"]
    assert list(c.documents()) == ["one", "two"]


def test_jsonl(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate(["a", "β"]))
                 + "\n\n")
    c = resolve_corpus(str(f), text_field="body")
    assert c.kind == "jsonl" and list(c.documents()) == ["a", "β"]


def test_parquet_directory(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["r1", None, "r2"]}), tmp_path / "p1.parquet")
    pq.write_table(pa.table({"text": ["r3"]}), tmp_path / "p2.parquet")
    c = resolve_corpus(str(tmp_path))
    assert c.kind == "parquet" and list(c.documents()) == ["r1", "r2", "r3"]


def test_stdlib_is_python_source_without_site_packages():
    c = resolve_corpus("stdlib", max_bytes=20_000)
    assert len(c.files) > 100 and all(f.endswith(".py") for f in c.files)
    assert not any("site-packages" in f or "__pycache__" in f for f in c.files)
    docs = list(c.documents())
    assert sum(len(d.encode()) for d in docs) == 20_000  # cut exactly at max_bytes


def test_max_bytes_is_deterministic_and_respects_utf8(tmp_path):
    write(tmp_path / "a.txt", "ééé")  # 6 bytes
    write(tmp_path / "b.txt", "zzz")
    c = resolve_corpus(str(tmp_path), max_bytes=5)
    assert list(c.documents()) == ["éé"]  # the split character is dropped, not mangled
    c = resolve_corpus(str(tmp_path), max_bytes=7)
    assert list(c.documents()) == ["ééé", "z"]


def test_fingerprint_tracks_files_and_options(tmp_path):
    f = write(tmp_path / "a.txt", "abc")
    fp = resolve_corpus(str(f)).fingerprint()
    assert resolve_corpus(str(f)).fingerprint() == fp
    assert resolve_corpus(str(f), max_bytes=2).fingerprint() != fp
    f.write_text("abcd")
    assert resolve_corpus(str(f)).fingerprint() != fp


@pytest.mark.parametrize("case", ["missing", "empty_dir", "glob"])
def test_source_errors_name_the_key(tmp_path, case):
    source = {"missing": str(tmp_path / "nope"), "empty_dir": str(tmp_path),
              "glob": str(tmp_path / "*.txt")}[case]
    write(tmp_path / "data.bin", "x")
    with pytest.raises(DataError) as e:
        resolve_corpus(source)
    msg = str(e.value)
    assert "data.source=" in msg and source in msg and "\n" not in msg
    assert {"missing": "does not exist", "empty_dir": "no text files",
            "glob": "matches no files"}[case] in msg


def test_jsonl_missing_field_and_bad_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"content": "x"}\n')
    with pytest.raises(DataError, match=r"data.source=.*no field 'text'.*data.text_field"):
        list(resolve_corpus(str(f)).documents())
    f.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"data.source=.*d.jsonl: line 2 is not valid JSON"):
        list(resolve_corpus(str(f)).documents())


def test_parquet_missing_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"data.source=.*no column 'text'.*data.text_field"):
        list(resolve_corpus(str(tmp_path / "p.parquet")).documents())


def test_a_folder_that_mixes_text_with_metadata_says_which_files_it_read(tmp_path):
    write(tmp_path / "a.txt", "one")
    write(tmp_path / "b.txt", "two")
    write(tmp_path / "notes.json", "{}")
    write(tmp_path / "weights.bin", "x")
    assert resolve_corpus(str(tmp_path)).describe() == \
        "3 text files (2 .txt, 1 .json: a.txt, b.txt, notes.json; 1 other files left out)"


def test_a_save_to_disk_folder_is_streamed_as_a_dataset(tmp_path):
    """Its .arrow rows, in order, never its state.json / dataset_info.json ("2 documents")."""
    datasets = pytest.importorskip("datasets")
    rows = [{"body": f"row {i} " * (i + 1), "id": i} for i in range(30)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"), max_shard_size=200)
    c = resolve_corpus(str(tmp_path / "saved"), text_field="body")
    assert c.kind == "arrow" and len(c.files) > 1 and c.describe().startswith(f"{len(c.files)} arrow")
    assert list(c.documents()) == [r["body"] for r in rows]
    with pytest.raises(DataError, match="has no column 'text'.*set data.text_field"):
        list(resolve_corpus(str(tmp_path / "saved")).documents())
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"holds the splits train; point it at one of them, "
                                        r"e\.g\. .*dict/train"):
        resolve_corpus(str(tmp_path / "dict"))
