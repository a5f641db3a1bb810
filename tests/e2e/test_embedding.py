"""Embedding models end to end: the embedding guide (docs/guides/embeddings.md) runs as printed
in a folder holding a tiny local Llama (my-model/) and anchor / positive / hard-negative records;
the run's model/ folder loads with sentence-transformers and embeds texts as paratrain does;
`paratrain generate` prints the same embedding. 1 worker and 2 DDP workers with the same global
batch run the same steps and end with the same weights (the candidates gathered from both
workers with their gradients) and the same validation figures, and a killed run resumes
bit-identical: the task contract's embedding row (tests/e2e/test_task_contract.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import read_summary, run_cli
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
def test_the_guide_runs_and_sentence_transformers_embeds_as_paratrain(tmp_path,
                                                                       preference_llama,
                                                                       monkeypatch):
    import shutil
    shutil.copytree(preference_llama, tmp_path / "my-model")
    write_jsonl(tmp_path / "pairs.jsonl", _records(96, 0))
    write_jsonl(tmp_path / "pairs-val.jsonl", _records(21, 1))
    commands, python = _guide()
    assert [a[:2] for a in commands] == [["paratrain", "train"], ["paratrain", "generate"]]
    outputs = []
    for args in commands:
        r = run_cli(args[1:], cwd=tmp_path)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stderr[-3000:])
        outputs.append(r.stdout)
    one = tmp_path / "runs" / "emb-one"
    summary = read_summary(one)
    assert summary["steps"] == 5 and summary["val_samples"] == 21  # every pair once
    assert 0 <= summary["val_accuracy"] <= summary["val_mrr@10"] <= 1

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
