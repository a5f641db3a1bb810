"""model.quantize=nf4 (QLoRA) on CPU through bitsandbytes' CPU backend: the frozen base's linear
weights take about a quarter of their bf16 bytes (measured, quantization constants included);
2 DDP workers train LoRA adapters on it and the loss falls; model/ (the adapters merged onto the
full-precision base) loads in plain transformers with no quantization and equals peft's own merge
of adapter/ onto model.path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import cli_error, read_metrics, run_cli

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
pytestmark = [pytest.mark.timeout(600)]


def _linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of the blocks' linear weights, with bitsandbytes' quantization constants."""
    total = 0
    for name, module in model.named_modules():
        if "layers" in name and isinstance(module, torch.nn.Linear):
            w = module.weight
            total += w.numel() * w.element_size()
            state = getattr(w, "quant_state", None)
            if state is not None:
                total += state.absmax.numel() * state.absmax.element_size()
    return total


def test_the_nf4_base_holds_a_quarter_of_bf16(pairs_llama):
    from paratrain.models.hf import HFArgs, build_hf
    nf4 = build_hf(HFArgs(str(pairs_llama), 400, quantize="nf4"))
    full = build_hf(HFArgs(str(pairs_llama), 400))
    bf16 = _linear_bytes(full) // 2  # fp32 on disk: the same weights in bf16
    ratio = _linear_bytes(nf4) / bf16
    assert 0.24 <= ratio <= 0.33, ratio  # 0.25 + fp32 absmax per 64 values (measured: ~0.28)


@pytest.mark.slow
def test_qlora_trains_on_two_ddp_workers_and_merges_onto_the_full_base(tmp_path, pairs_llama):
    import peft
    import transformers

    from tests.e2e._tiny_model import make_pairs, write_jsonl
    data = write_jsonl(tmp_path / "pairs.jsonl", make_pairs(64))
    run = tmp_path / "run"
    r = run_cli(["train", "model.arch=hf", f"model.path={pairs_llama}", "model.quantize=nf4",
                 "model.lora.r=8", "data.format=pairs", f"data.source={data}",
                 "data.max_length=64", "trainer.devices=cpu:2", "trainer.strategy=ddp",
                 "trainer.batch_size=4", "trainer.max_steps=12", "trainer.log_every=1",
                 "trainer.progress_bar=false", "optim.lr=3e-2", "optim.warmup_steps=0",
                 "log.report=false", "log.tensorboard=false", f"run.dir={run}"],
                cwd=tmp_path, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [m["loss"] for m in read_metrics(run) if "loss" in m]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    auto = transformers.AutoModelForCausalLM
    merged = auto.from_pretrained(run / "model", local_files_only=True).eval()
    assert getattr(merged.config, "quantization_config", None) is None
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    base = auto.from_pretrained(pairs_llama, local_files_only=True)
    theirs = peft.PeftModel.from_pretrained(base, run / "adapter").merge_and_unload().eval()
    ids = torch.arange(3, 40).view(1, -1)  # (1, 37) token ids of the tiny vocabulary
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, theirs(ids).logits, atol=1e-5)


def test_quantize_is_refused_without_lora_or_under_fsdp(capsys, tmp_path, pairs_llama):
    data = tmp_path / "p.jsonl"
    data.write_text('{"input": "a", "output": "b"}\n')
    args = ["train", "model.arch=hf", f"model.path={pairs_llama}", "model.quantize=nf4",
            "data.format=pairs", f"data.source={data}"]
    assert "model.lora.r=N" in cli_error(capsys, args)
    line = cli_error(capsys, args + ["model.lora.r=4", "trainer.strategy=fsdp"])
    assert "FSDP2 cannot shard" in line
    odd = [a if a != "model.quantize=nf4" else "model.quantize=fp4" for a in args]
    assert "not one of: nf4, int8" in cli_error(capsys, odd + ["model.lora.r=4"])
