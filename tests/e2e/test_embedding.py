"""Embedding models end to end: the embedding guide (docs/guides/embeddings.md) runs as printed
in a folder holding a tiny local Llama (my-model/) and anchor / positive / hard-negative records.
1 worker and 2 DDP workers with the same global batch run the same steps and end with the same
weights (the candidates gathered from both workers with their gradients) and the same validation
figures (retrieval ranked in the same blocks of held-out pairs); the two-worker run, killed
after its step-3 snapshot and rerun by the same command, ends bit-identical; the run's model/
folder loads with sentence-transformers and embeds texts as paratrain does; `paratrain generate`
prints the same embedding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_runs_agree, read_summary, run_cli
from tests.distributed._snapshot_helpers import assert_bit_identical, interrupted_copy
from tests.e2e._doc_blocks import doc_blocks
from tests.e2e._preference_data import preference_rows
from tests.e2e._tiny_model import write_jsonl

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(900)]


def _records(n: int, seed: int) -> list[dict]:
    return [{"anchor": r["prompt"], "positive": r["chosen"], "negative": r["rejected"]}
            for r in preference_rows(n, seed)]


def _guide() -> tuple[list[list[str]], list[str]]:
    """(the guide's commands as argument lists, its Python blocks' code)."""
    mine = [b for b in doc_blocks()
            if b.marker == "run by" and b.reason.startswith("tests/e2e/test_embedding.py")]
    return ([args for b in mine if b.lang == "bash" for args in b.commands()],
            [b.code for b in mine if b.lang == "python"])


@pytest.mark.slow
def test_the_guide_runs_and_one_and_two_workers_agree(tmp_path, preference_llama, monkeypatch):
    import shutil
    shutil.copytree(preference_llama, tmp_path / "my-model")
    write_jsonl(tmp_path / "pairs.jsonl", _records(96, 0))
    write_jsonl(tmp_path / "pairs-val.jsonl", _records(21, 1))
    commands, python = _guide()
    assert [a[:2] for a in commands] == [["paratrain", "train"]] * 2 + [["paratrain", "generate"]]
    outputs = []
    for args in commands:  # a loss every step; snapshots and the samples each step read
        more = _MORE if args[1] == "train" else []
        r = run_cli(args[1:] + more, cwd=tmp_path)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stderr[-3000:])
        outputs.append(r.stdout)
    one, two = tmp_path / "runs" / "emb-one", tmp_path / "runs" / "emb-two"
    assert len(assert_runs_agree(one, two)) == 5
    summary, on_two = read_summary(one), read_summary(two)
    assert 0 <= summary["val_accuracy"] <= summary["val_mrr@10"] <= 1
    assert summary["val_samples"] == on_two["val_samples"] == 21  # every pair once
    for key in ("val_accuracy", "val_mrr@10"):  # the same blocks of candidates on 1 and 2
        assert summary[key] == on_two[key], (key, summary[key], on_two[key])
    assert abs(summary["val_loss"] - on_two["val_loss"]) <= 1e-5
    _resume_after_a_kill(tmp_path, commands[1], two)

    texts = ["Say: red cat"] + [r["anchor"] for r in _records(4, 2)]
    ours = _paratrain_embeddings(one / "model", texts)
    st = pytest.importorskip("sentence_transformers")
    theirs = st.SentenceTransformer(str(one / "model"), device="cpu").encode(
        texts, convert_to_tensor=True, batch_size=2)
    assert (ours - theirs).abs().max().item() <= 1e-5
    printed = torch.tensor(json.loads(outputs[-1].strip().splitlines()[-1]))
    assert torch.allclose(printed, ours[0], atol=1e-5)  # generate: the guide's prompt
    monkeypatch.chdir(tmp_path)
    for code in python:
        exec(compile(code, "docs/guides/embeddings.md", "exec"), {})


_MORE = ["trainer.log_every=1", "checkpoint.every_steps=3", "checkpoint.record_samples=true"]


def _resume_after_a_kill(tmp_path: Path, command: list[str], straight: Path) -> None:
    """A copy of `straight` that died after its step-3 snapshot; the same command, its run.dir
    the copy, resumes it and ends bit-identical, with the same validation figures."""
    died = interrupted_copy(straight, tmp_path / "runs" / "emb-died", keep_until=3)
    args = [a if not a.startswith("run.dir=") else "run.dir=runs/emb-died" for a in command]
    r = run_cli(args[1:] + _MORE, cwd=tmp_path)
    assert r.returncode == 0 and "resumed from step 3" in r.stderr, r.stderr[-3000:]
    assert_bit_identical(died, straight)
    keys = ("val_loss", "val_accuracy", "val_mrr@10")
    assert [read_summary(died)[k] for k in keys] == [read_summary(straight)[k] for k in keys]


def _paratrain_embeddings(model_dir: Path, texts: list[str]) -> torch.Tensor:
    """The texts embedded as training embedded them: paratrain's encoder, collate, pooling."""
    import transformers

    from paratrain.tasks.embedding.records import EmbeddingCollate, embedding_dataset, encode_embedding
    from paratrain.data.hf_tokenizer import load_tokenizer
    from paratrain.tasks.embedding.embedder import pool
    tok, _ = load_tokenizer(model_dir)
    rows = [{"anchor": t, "positive": t} for t in texts]
    ds = embedding_dataset(encode_embedding(rows, tok, max_length=64)[0])
    batch = EmbeddingCollate(tok.pad_token_id)([ds[i] for i in range(len(texts))])
    model = transformers.AutoModel.from_pretrained(model_dir, local_files_only=True).eval()
    with torch.no_grad():
        hidden = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"]).last_hidden_state
    return pool(hidden, batch["attention_mask"], "mean")[:len(texts)]
