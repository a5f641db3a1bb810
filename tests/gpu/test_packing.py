"""Packed rows on CUDA (issue 38): our Llama's block-diagonal mask runs as a flex-attention
BlockMask there (blocks across examples skipped) and keeps examples apart as SDPA does on the
CPU; a packed bf16 fine-tune of a Hugging Face Llama trains on GPU 0."""

from __future__ import annotations

import json

import pytest
import torch

from paratrain.config.presets import ModelArgs
from paratrain.data.packing import restarting_positions
from paratrain.models.llama import Llama, document_mask
from tests.conftest import run_cli

pytestmark = pytest.mark.timeout(400)


def test_flex_block_mask_keeps_examples_apart_on_cuda():
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import BlockMask
    args = ModelArgs(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                     intermediate_size=128, vocab_size=100, max_seq_length=512,
                     tie_embeddings=False)
    torch.manual_seed(0)
    model = Llama(args).cuda().eval()
    lengths = (130, 200, 90)
    ids = torch.randint(0, 100, (1, sum(lengths)), device="cuda")
    positions = restarting_positions(lengths)[None].cuda()
    assert isinstance(document_mask(positions, None), BlockMask)
    with torch.no_grad():
        packed = model(ids, position_ids=positions)[0, 130:330]
        alone = model(ids[:, 130:330])[0]
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=1e-4)


def test_a_packed_bf16_fine_tune_trains_on_gpu(tmp_path):
    pytest.importorskip("transformers")
    from tests.e2e._tiny_model import make_pairs, make_tiny_llama, write_jsonl
    pairs = make_pairs(200)
    make_tiny_llama(tmp_path / "my-model", [r["input"] + " " + r["output"] for r in pairs])
    write_jsonl(tmp_path / "train.jsonl", pairs)
    r = run_cli(["train", "model.arch=hf", "model.path=./my-model", "data.format=pairs",
                 "data.source=train.jsonl", "data.pack=true", "data.max_length=256",
                 "trainer.devices=cuda:0", "trainer.precision=bf16-mixed",
                 "trainer.batch_size=4", "trainer.max_steps=12", "trainer.log_every=1",
                 "trainer.progress_bar=false"], cwd=tmp_path, timeout=360)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "my-model-pairs" / "summary.json").read_text())
    assert summary["padding_share"] < 0.25 and summary["steps"] == 12
    losses = [json.loads(x)["loss"] for x in
              (tmp_path / "runs" / "my-model-pairs" / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0]
