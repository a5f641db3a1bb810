"""What the Hugging Face Hub would have given, made offline: a local model folder (or a parquet
dataset repo, `put_dataset_in_hub_cache`) put into a huggingface_hub cache as `hf download` lays
it out (models--org--name/blobs/<sha256>,
snapshots/<commit>/<file> -> ../../blobs/<sha256>, refs/main holding the commit), checked by the
library's own `scan_cache_dir`, and read back by its `snapshot_download` with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def put_in_hub_cache(folder: Path, cache: Path, repo_id: str, commit: str = COMMIT,
                     ref: str = "main") -> Path:
    """Copy `folder`'s files into `cache` as the snapshot `commit` of `repo_id` (and `ref` ->
    commit); returns the snapshot folder."""
    return _put(folder, cache, repo_id, commit, "model", ref)


def _put(folder: Path, cache: Path, repo_id: str, commit: str, repo_type: str,
         ref: str = "main") -> Path:
    from huggingface_hub.file_download import repo_folder_name
    storage = cache / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        blob = storage / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(f, blob)
        link = snapshot / f.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / ref).write_text(commit)
    from huggingface_hub import scan_cache_dir
    report = scan_cache_dir(cache)
    assert not report.warnings, report.warnings
    assert any(r.repo_id == repo_id for r in report.repos)
    return snapshot


def offline_env(cache: Path, **extra: str) -> dict:
    """The environment of a CLI process that reads only `cache`: HF_HUB_OFFLINE=1."""
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", **extra}


def put_dataset_in_hub_cache(cache: Path, repo_id: str, splits: dict, commit: str = COMMIT,
                             subset: str = "default") -> Path:
    """A dataset repo as the Hub serves a parquet dataset (data/<split>-00000-of-00001.parquet
    and a README whose `configs` name the files), put into `cache` like a model."""
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        (repo / "data").mkdir()
        files = []
        for split, rows in splits.items():
            pq.write_table(pa.Table.from_pylist(rows),
                           repo / "data" / f"{split}-00000-of-00001.parquet")
            files.append(f"  - split: {split}\n    path: data/{split}-*\n")
        (repo / "README.md").write_text(f"---\nconfigs:\n- config_name: {subset}\n"
                                        f"  data_files:\n{''.join(files)}---\n")
        return _put(repo, cache, repo_id, commit, "dataset")
