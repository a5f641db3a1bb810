"""The memory plan's activations and peak for one device, on the CPU: autocast's weight copies
count once per forward (not once per sample), and one process that steps after every micro-batch
holds the larger of its gradients and its activations, not both. On an H100 the plan had counted
a 280M Llama's weight copies four times over (a micro-batch of 4) and added its gradients to its
activations: 49% over the measured peak (tests/gpu/test_memory.py)."""

from __future__ import annotations

import torch

from paratrain import TrainConfig
from paratrain.models import build_model, resolve_model_config
from paratrain.parallel.memory import SavedTensorMeter
from paratrain.parallel.memory_estimate import CUDA_WORKSPACE_BYTES, device_workspace, estimate

T, VOCAB = 16, 384


def _factory():
    # weights large against 16 tokens' activations: a wrong count of their copies shows
    cfg = TrainConfig.from_yaml(None, ["model.preset=null", "model.hidden_size=256",
                                       "model.num_layers=2", "model.num_heads=4"])
    args = resolve_model_config(cfg.model, vocab_size=VOCAB, seq_length=T)
    return lambda: build_model(args)


def _measured(factory, batch: int) -> int:
    """What autograd saves in a real bf16-autocast forward and loss of `batch` samples."""
    torch.manual_seed(0)
    model = factory()
    idx = torch.randint(0, VOCAB, (batch, T))  # (B, T)
    with SavedTensorMeter(model) as meter, torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(idx)  # (B, T, V)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx.flatten())
    return meter.bytes


def test_activations_of_a_micro_batch_match_a_real_forward_of_it():
    factory = _factory()
    for batch in (1, 4):
        row = estimate(factory, world=1, precision="bf16-mixed", micro_batch=batch,
                       seq_length=T, vocab_size=VOCAB)[0]
        measured = _measured(factory, batch)
        assert abs(row.activation_bytes / measured - 1) < 0.02, (batch, row, measured)


def test_one_process_holds_the_larger_of_gradients_and_activations_unless_accumulating():
    factory = _factory()
    kw = dict(world=1, precision="bf16-mixed", micro_batch=1, seq_length=T, vocab_size=VOCAB)
    stepping, = estimate(factory, **kw)
    accumulating, = estimate(factory, accumulation=2, **kw)
    p, g, o, a = (stepping.params_bytes, stepping.grads_bytes, stepping.optimizer_bytes,
                  stepping.activation_bytes)
    assert g > a  # this model's gradients outweigh 16 tokens' activations
    assert stepping.device_bytes == p + o + max(g, a)
    assert accumulating.device_bytes == p + g + o + a  # the gradients outlive a forward
    on_gpu, = estimate(factory, workspace=device_workspace(torch.device("cuda")), **kw)
    assert on_gpu.device_bytes == stepping.device_bytes + CUDA_WORKSPACE_BYTES


def test_a_fine_tunes_activations_from_one_and_two_blocks_are_the_whole_models(tmp_path):
    """A fine-tune's model is measured cut to one block and to two and extrapolated (an 8B
    model is never built whole on the CPU): the same bytes as the whole 4-block model's forward,
    full and with LoRA, in fp32 and under bf16 autocast."""
    import types

    import pytest
    transformers = pytest.importorskip("transformers")
    from paratrain.config.sections import LoraConfig
    from paratrain.parallel.activations import activation_bytes_per_sample
    from paratrain.tasks.probe import CausalProbe
    transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64).save_pretrained(tmp_path)
    for r in (0, 4):
        lora = LoraConfig()
        lora.r = r
        probe = CausalProbe(types.SimpleNamespace(model=types.SimpleNamespace(
            path=str(tmp_path), trust_remote_code=False, lora=lora)))
        assert probe.blocks == 4
        for precision in ("fp32", "bf16-mixed"):
            whole = activation_bytes_per_sample(probe, T, VOCAB, precision, False)
            cut = activation_bytes_per_sample(probe, T, VOCAB, precision, False,
                                              shallow=(probe, probe.blocks))
            assert cut == whole, (r, precision, cut, whole)
