"""Packed rows keep examples apart (issue 38): an example's logits are the same (1e-6, fp32)
whether it shares a row with other examples, sits alone, or is padded, for our Llama, our GPT and
a Hugging Face Llama; and best-fit decreasing rows are deterministic and full."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paratrain.config.presets import ModelArgs
from paratrain.data.packing import (
    PackCollate,
    best_fit_decreasing,
    padding_share,
    restarting_positions,
)
from paratrain.models.gpt import GPT
from paratrain.models.llama import Llama

LENGTHS = (5, 9, 3)  # three examples packed into one row of 17 tokens


def _examples(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]


def _three_ways(model, vocab: int, pad_id: int = 0) -> None:
    """The middle example's logits alone, packed between two others, and right-padded."""
    model.eval()
    a, b, c = _examples(vocab)
    with torch.no_grad():
        alone = model(b[None])  # (1, 9, V)
        packed_ids = torch.cat([a, b, c])[None]  # (1, 17)
        positions = restarting_positions(LENGTHS)[None]  # (1, 17)
        packed = model(packed_ids, position_ids=positions)
        padded_ids = torch.full((2, 12), pad_id)  # (2, 12): b padded by 3
        padded_ids[0, :9], padded_ids[1, :12] = b, torch.cat([a, torch.zeros(7, dtype=torch.long)])
        mask = torch.zeros(2, 12, dtype=torch.long)
        mask[0, :9], mask[1, :5] = 1, 1
        padded = model(padded_ids, attention_mask=mask)
    logits = lambda out: out.logits if hasattr(out, "logits") else out  # noqa: E731
    start = LENGTHS[0]
    torch.testing.assert_close(logits(packed)[0, start:start + 9], logits(alone)[0],
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(logits(padded)[0, :9], logits(alone)[0], atol=1e-6, rtol=0)
    # and the first example (position 0 of the row) is not disturbed by those after it
    torch.testing.assert_close(logits(packed)[0, :start], logits(model(a[None]))[0],
                               atol=1e-6, rtol=0)


def _args(arch: str) -> ModelArgs:
    return ModelArgs(arch=arch, hidden_size=32, num_layers=2, num_heads=4,
                     num_kv_heads=2 if arch == "llama" else 4, intermediate_size=64,
                     vocab_size=50, max_seq_length=32, tie_embeddings=False)


@pytest.mark.parametrize("cls,arch", [(Llama, "llama"), (GPT, "gpt")])
def test_our_models_keep_packed_examples_apart(cls, arch):
    torch.manual_seed(0)
    _three_ways(cls(_args(arch)), 50)


def test_a_leak_would_be_seen():
    """The test can fail: without the position ids, the packed example reads its neighbour."""
    torch.manual_seed(0)
    model = Llama(_args("llama")).eval()
    a, b, _ = _examples(50)
    with torch.no_grad():
        leaky = model(torch.cat([a, b])[None])[0, 5:]
        alone = model(b[None])[0]
    assert (leaky - alone).abs().max() > 1e-3


def test_hf_llama_keeps_packed_examples_apart(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32,
                                      use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    _three_ways(model, 50)


def test_best_fit_decreasing_is_deterministic_and_fits():
    lengths = np.random.default_rng(1).integers(1, 100, size=500)
    rows = best_fit_decreasing(lengths, 128, seed=3)
    again = best_fit_decreasing(lengths, 128, seed=3)
    assert all((r == s).all() for r, s in zip(rows, again)) and len(rows) == len(again)
    assert sorted(np.concatenate(rows).tolist()) == list(range(500))  # each example once
    fills = np.array([lengths[r].sum() for r in rows])
    assert fills.max() <= 128
    assert fills.sum() / (128 * len(rows)) > 0.95  # nearly full rows


def test_pack_collate_restarts_positions_and_masks_pads():
    rows = [[{"input_ids": [1, 2, 3], "targets": [-100, 2, 3]}, {"input_ids": [4, 5],
                                                                  "targets": [5, 6]}],
            [{"input_ids": [7], "targets": [8]}]]
    out = PackCollate(pad_id=0)(rows)
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5], [7, 0, 0, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 0, 1, 2, 3]]
    assert out["targets"].tolist() == [[-100, 2, 3, 5, 6], [8, -100, -100, -100, -100]]


def test_padding_share_of_spread_lengths():
    lengths = np.array([100, 10] * 8)
    assert padding_share(lengths, 1, 0) == 0.0
    assert 0.3 < padding_share(lengths, 8, 0) < 0.5  # most batches mix long and short


def test_group_by_length_is_the_same_global_batches_on_one_and_two_workers():
    """HF's meaning: windows of the shuffled order sorted by length; rank r of W takes positions
    r, r+W, ... of each global batch, so 1 and 2 workers read the same global batches, and the
    micro-batches pad far less than in the plain shuffled order."""
    from paratrain.data.sampler import GlobalSampler, StepBatches
    lengths = np.random.default_rng(0).lognormal(np.log(300), 0.8, size=400).astype(int) + 1

    def steps(world: int, grouped: bool) -> list[list[int]]:
        per_rank = []
        for rank in range(world):
            s = GlobalSampler(400, world, rank, seed=7, global_batch=8,
                              lengths=lengths if grouped else None)
            per_rank.append(list(StepBatches(s, 8 // world, 1)))
        return [sorted(sum((r[k] for r in per_rank), [])) for k in range(len(per_rank[0]))]

    assert steps(1, True) == steps(2, True)
    assert steps(1, True) != steps(1, False)
    assert sorted(sum(steps(1, True), [])) == list(range(400))  # every sample once an epoch

    def waste(batches):
        return sum(8 * lengths[b].max() - lengths[b].sum() for b in batches)
    assert waste(steps(1, True)) < 0.3 * waste(steps(1, False))
    share = padding_share(lengths, 8, 7, grouped=True)
    assert share < 0.5 * padding_share(lengths, 8, 7)


def test_document_mask_keeps_a_windows_documents_apart():
    """data.document_mask=true (pretraining): positions restart after each [EOT], so the second
    document of a window gets the logits it gets alone (our Llama)."""
    from paratrain.data.packing import DocumentCollate, document_positions
    eot = 49
    window = torch.tensor([[3, 4, 5, eot, 7, 8, 9, 10]])
    assert document_positions(window, eot).tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    batch = DocumentCollate(eot)([{"input_ids": window[0], "targets": window[0]}])
    torch.manual_seed(0)
    model = Llama(_args("llama")).eval()
    with torch.no_grad():
        masked = model(batch["input_ids"], position_ids=batch["position_ids"])[0, 4:]
        alone = model(window[:, 4:])[0]
        crossing = model(window)[0, 4:]
    torch.testing.assert_close(masked, alone, atol=1e-6, rtol=0)
    assert (crossing - alone).abs().max() > 1e-3  # without it, the window attends across


def test_document_mask_and_packing_are_refused_where_they_do_not_apply(tmp_path):
    from paratrain.config import TrainConfig
    from paratrain.errors import ConfigError
    assert TrainConfig.from_yaml(None, ["data.document_mask=true"]).data.document_mask
    with pytest.raises(ConfigError, match="data.document_mask applies to data.format=packed"):
        TrainConfig.from_yaml(None, ["data.format=padded", "data.document_mask=true"])
    with pytest.raises(ConfigError, match="pipeline_parallel"):
        TrainConfig.from_yaml(None, ["data.document_mask=true", "trainer.pipeline_parallel=2",
                                     "trainer.devices=cpu:2"])


def test_hf_llama_with_paratrains_packed_attention_keeps_examples_apart():
    """data.pack=true switches an SDPA model to `paratrain_packed` (each example its own causal
    SDPA on the CPU): the same logits as alone or padded, and the gradients flow."""
    transformers = pytest.importorskip("transformers")
    from paratrain.models.hf import PACKED_ATTENTION, check_packed_attention, use_packed_attention
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    use_packed_attention(model)
    check_packed_attention(model)
    assert model.config._attn_implementation == PACKED_ATTENTION
    _three_ways(model, 50)
    model.train()
    ids = torch.cat(_examples(50))[None]
    model(ids, position_ids=restarting_positions(LENGTHS)[None]).logits.sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_a_model_that_leaks_is_refused_in_one_line():
    transformers = pytest.importorskip("transformers")
    from paratrain.errors import ConfigError
    from paratrain.models.hf import check_packed_attention
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    model.forward_plain = model.forward
    model.forward = lambda ids, position_ids=None, **kw: model.forward_plain(ids, **kw)  # drops
    with pytest.raises(ConfigError, match="lets packed examples see each other") as e:
        check_packed_attention(model)
    assert "\n" not in str(e.value) and "data.group_by_length=true" in str(e.value)


def test_neftune_noise_on_packed_rows_is_bounded_by_each_examples_length():
    """trainer.neftune_noise_alpha with data.pack=true: a token's noise is bounded by its own
    example's length (alpha / sqrt(L_i x C)), not the row's; without position ids, the padded
    bound (HF Trainer's)."""
    from paratrain.tasks.neftune import PackedNEFTune, example_lengths

    class Body(torch.nn.Module):  # a decoder: embeddings, reached with position_ids
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 64)

        def forward(self, ids, position_ids=None):
            return self.emb(ids)

    body = Body()
    PackedNEFTune(4.0).attach(body, body.emb)
    ids = torch.arange(40)[None]  # (1, 40): examples of 30 and 10 tokens
    positions = restarting_positions([30, 10])[None]  # (1, 40)
    assert example_lengths(positions).tolist() == [[30] * 30 + [10] * 10]
    noise = (body(ids, position_ids=positions) - body.emb.weight[ids]).detach()[0]  # (40, 64)
    for piece, n in ((noise[:30], 30), (noise[30:], 10)):
        bound = 4.0 / (n * 64) ** 0.5
        assert 0.9 * bound < float(piece.abs().max()) <= bound * (1 + 1e-6), (n, bound)
    padded = (body(ids) - body.emb.weight[ids]).detach()  # no positions: the row's 40 tokens
    assert float(padded.abs().max()) <= 4.0 / (40 * 64) ** 0.5 * (1 + 1e-6)
    body.eval()
    assert torch.equal(body(ids, position_ids=positions), body.emb.weight[ids])
