"""Memory on a GPU: the verbose table and summary.json read CUDA's allocator counters, and
`paratrain plan`'s predicted peak for one device is within 15% of the `max_memory_allocated` a
real run measures, for a small and a large (~350M) Llama."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import read_summary, run_cli
from tests.gpu.conftest import gpu_overrides, train_on_gpu

pytestmark = pytest.mark.timeout(400)

ROW = re.compile(r"^\s+0\s+cuda:0\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)$",
                 re.M)


def test_verbose_memory_table_from_cuda_counters(tmp_path, corpus_dir, cache_dir):
    run = tmp_path / "run"
    r = run_cli(["train", *gpu_overrides(corpus_dir, cache_dir, **{"trainer.verbose": "true"}),
                 f"run.dir={run}"], cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    m = read_summary(run)["memory"][0]
    assert m["device"] == "cuda:0"
    assert 0 < m["params_bytes"] <= m["peak_bytes"] <= m["reserved_bytes"], m
    # AdamW's two fp32 moments (and fused AdamW's one-value step counters)
    assert abs(m["optimizer_bytes"] - 2 * m["params_bytes"]) < 0.01 * m["params_bytes"], m
    table = r.stderr.split("memory at end:")[-1]
    assert "memory at end:" in r.stderr, r.stderr[-3000:]
    params_mb, _, _, _, peak_mb = map(float, ROW.findall(table)[-1])
    assert abs(params_mb - m["params_bytes"] / 2**20) < 0.1
    assert abs(peak_mb - m["peak_bytes"] / 2**20) < 0.1


# per preset: the batch and length a user would plan; 3 steps are enough for the peak
PLANNED = {"small": {"trainer.batch_size": 8, "data.seq_length": 256},
           "large": {"trainer.batch_size": 4, "data.seq_length": 256}}


@pytest.mark.parametrize("preset", list(PLANNED))
def test_plan_predicts_the_measured_peak(tmp_path, corpus_dir, cache_dir, preset):
    over = {"model.preset": preset, "trainer.precision": "bf16-mixed", "trainer.max_steps": 3,
            "trainer.global_batch_size": "null", **PLANNED[preset]}
    plan = run_cli(["plan", "--json", *gpu_overrides(corpus_dir, cache_dir, **over)],
                   cwd=tmp_path, timeout=240)
    assert plan.returncode == 0, plan.stderr[-3000:]
    predicted = json.loads(plan.stdout)["rows"][0]  # one device: the single row
    assert predicted["strategy"] == "single", predicted
    run = train_on_gpu(tmp_path, corpus_dir, cache_dir, **over)
    entry = read_summary(run)["memory"][0]
    measured = entry["peak_bytes"]  # torch.cuda.max_memory_allocated
    error = predicted["device_bytes"] / measured - 1
    assert abs(error) <= 0.15, (f"{preset}: plan says {predicted['device_bytes'] / 2**20:.0f} "
                                f"MiB, the run peaked at {measured / 2**20:.0f} MiB "
                                f"({100 * error:+.1f}%); plan {predicted}; run {entry}")


def test_plan_predicts_a_lora_fine_tunes_peak(tmp_path):
    """A LoRA pairs fine-tune of a 12-block Llama (hidden 1024, vocab 32000: ~210M parameters,
    random weights from its config) in bf16-mixed on one GPU: `paratrain plan`'s peak, from the
    model cut to one block and two (tasks/probe.py), within 15% of max_memory_allocated."""
    pytest.importorskip("peft")
    from paratrain.data.stdlib_pairs import stdlib_pairs
    from tests.e2e._preference_data import make_preference_llama, small_run_args
    model = make_preference_llama(tmp_path / "small")
    info = json.loads((model / "config.json").read_text())
    info.update(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=32000)
    (model / "config.json").write_text(json.dumps(info))
    (model / "model.safetensors").unlink()  # fresh weights of the new shape
    rows = stdlib_pairs(80)
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:64]))
    val.write_text("".join(json.dumps(r) + "\n" for r in rows[64:]))
    args = small_run_args(model, train, val, tmp_path / "run", **{
        "trainer.devices": "cuda:0", "trainer.precision": "bf16-mixed", "trainer.max_steps": 3,
        "trainer.batch_size": 8, "trainer.global_batch_size": "null", "data.format": "pairs",
        "data.max_length": 128, "model.lora.r": 8})
    plan = run_cli(["plan", "--json", *args[1:]], cwd=tmp_path, timeout=240)
    assert plan.returncode == 0, plan.stderr[-3000:]
    predicted = json.loads(plan.stdout)["rows"][0]
    r = run_cli(args, cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    entry = read_summary(tmp_path / "run")["memory"][0]
    error = predicted["device_bytes"] / entry["peak_bytes"] - 1
    assert abs(error) <= 0.15, (f"plan {predicted['device_bytes'] / 2**20:.0f} MiB, the run "
                                f"{entry['peak_bytes'] / 2**20:.0f} MiB ({100 * error:+.1f}%); "
                                f"plan {predicted}; run {entry}")
