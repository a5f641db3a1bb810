"""Context parallelism without processes: the head-tail split, how trainer.context_parallel turns
a strategy's sizes into CP groups, and the one-line refusals before any worker starts."""

from __future__ import annotations

import pytest
import torch

from paratrain.errors import ConfigError
from paratrain.parallel.context import SequenceSplit
from paratrain.parallel.dims import ParallelDims
from tests.conftest import cli_error


def test_head_tail_chunks_cover_the_sequence_once_with_equal_causal_work():
    T, C = 64, 4
    held = [SequenceSplit(C, r).indices(T) for r in range(C)]
    assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(T))
    assert held[0].tolist() == [*range(0, 8), *range(56, 64)]  # chunks 0 and 7 of 8
    work = [int((h + 1).sum()) for h in held]  # keys each rank's queries attend to
    assert len(set(work)) == 1, work
    batch = {"input_ids": torch.arange(2 * T).view(2, T), "n": 3}
    part = SequenceSplit(C, 1).batch(batch)
    assert part["input_ids"].tolist()[1] == [T + i for i in [*range(8, 16), *range(48, 56)]]
    assert part["n"] == 3


def test_cp_groups_are_taken_from_the_data_parallel_ranks():
    assert ParallelDims(dp_replicate=4).with_context(2) == ParallelDims(2, 1, 1, cp=2)
    assert ParallelDims(dp_shard=4).with_context(4) == ParallelDims(1, 1, 1, cp=4)
    assert ParallelDims(2, 2).with_context(4) == ParallelDims(1, 1, 1, cp=4)
    cp = ParallelDims(1, 2, 2, cp=2)  # dp 2 x cp 2 x tp 2: rank = ((shard * 2) + cp) * 2 + tp
    assert [cp.data_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [cp.cp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [cp.reports_sums(r) for r in range(4)] == [True, False, True, False]
    assert (cp.dp, cp.dp_cp, cp.world) == (2, 4, 8)
    assert cp.to_dict() == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2}
    assert ParallelDims(dp_shard=2).to_dict() == {"pp": 1, "dp_replicate": 1, "dp_shard": 2,
                                                  "tp": 1}  # no cp key without CP
    with pytest.raises(ConfigError, match=r"context_parallel=2 does not divide the 3 "):
        ParallelDims(dp_replicate=3).with_context(2)


@pytest.mark.parametrize("extra, message", [
    (["trainer.devices=cpu:3", "trainer.context_parallel=2"],
     "trainer.context_parallel=2 needs a world divisible by 2 processes, but this run has 3; "
     "use trainer.context_parallel in 1, 3, or more devices"),
    (["trainer.devices=cpu:2", "trainer.context_parallel=2", "data.seq_length=102"],
     "trainer.context_parallel=2 cuts each sequence into 2 x 2 equal chunks (head-tail "
     "balancing), which data.seq_length=102 is not a multiple of; use a multiple of 4, or "
     "trainer.context_parallel in 1, 3, 17, 51"),
    (["trainer.devices=cpu:2", "trainer.context_parallel=2", "trainer.strategy=dp"],
     "trainer.context_parallel=2 cannot run under trainer.strategy=dp (one process drives every "
     "GPU); use trainer.strategy=ddp or fsdp"),
    (["trainer.devices=cpu:2", "trainer.context_parallel=2", "data.format=padded"],
     "trainer.context_parallel=2 takes packed windows (data.format=packed), not "
     "data.format=padded: use data.format=packed or trainer.context_parallel=1"),
    (["trainer.devices=cpu:2", "trainer.context_parallel=2", "trainer.pipeline_parallel=2"],
     "trainer.context_parallel=2 needs a world divisible by 2 x trainer.pipeline_parallel=2 = 4 "
     "processes, but this run has 2; use trainer.context_parallel in 1, or more devices"),
    (["trainer.devices=cpu:2", "trainer.context_parallel=2", "data.document_mask=true"],
     "trainer.context_parallel=2 cannot split windows with data.document_mask=true yet (each "
     "rank would need every document's bounds); set one of them off"),
])
def test_bad_context_parallel_is_one_line_before_anything_runs(tmp_path, monkeypatch, capsys,
                                                                 corpus_dir, extra, message):
    monkeypatch.chdir(tmp_path)
    line = cli_error(capsys, ["train", "model.preset=tiny", "run.name=cp",
                              f"data.source={corpus_dir}", *extra], only_line=True)
    assert line == f"paratrain: error: {message}"
    assert not (tmp_path / "runs").exists()


def test_a_hugging_face_model_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "architectures": '
                                        '["LlamaForCausalLM"]}')
    line = cli_error(capsys, ["train", "model.arch=hf", f"model.path={folder}",
                              "trainer.devices=cpu:2", "trainer.context_parallel=2"])
    assert "splits the built-in llama / gpt only; a Hugging Face model (model.arch=hf) cannot " \
           "take it yet" in line, line


def _plan(*overrides):
    from paratrain import TrainConfig
    from paratrain.parallel.simulate import format_simulation, simulate_at_scale
    rows, target, pick, work = simulate_at_scale(TrainConfig.from_yaml(None, list(overrides)))
    return {r.label: r for r in rows}, format_simulation(rows, target, pick, work, "plan")


def test_the_plan_counts_a_cp_ranks_activations():
    by, text = _plan("model.preset=tiny", "plan.nodes=1", "plan.devices_per_node=4",
                     "plan.device_memory_gb=80", "data.seq_length=2048",
                     "trainer.context_parallel=2")
    asked = by["ddp+cp2"]
    assert asked.asked and not by["ddp"].asked and asked.dims == "dp_replicate=2 x cp=2"
    # half of every token's activations, and the whole sequence's keys and values besides
    ratio = asked.activation_bytes / by["ddp"].activation_bytes
    assert 0.5 < ratio < 0.6, ratio
    assert set(asked.sent["cp"]) == {"all-gather", "reduce-scatter"}
    assert "ddp+cp2 *" in text and "auto picks ddp " in text  # auto never picks CP itself


@pytest.mark.slow
def test_the_plan_proposes_cp_for_a_sequence_that_fits_no_other_layout():
    """Llama 3 8B at 131,072 tokens on 8 x 80 GB: every layout without CP needs more than the
    device (recomputing blocks, tensor parallelism or offloading included); CP fits."""
    by, text = _plan("model.preset=llama3-8b", "model.vocab_size=128256", "plan.nodes=1",
                     "plan.devices_per_node=8", "plan.device_memory_gb=80",
                     "trainer.precision=bf16-mixed", "trainer.batch_size=1",
                     "data.seq_length=131072")
    budget = 0.8 * 80e9
    assert all(r.device_bytes > budget for r in by.values() if r.cp == 1)
    assert by["fsdp+cp8+ac"].device_bytes < budget
    mask = 131072 * 131072 // 8 * 2  # the causal mask, bf16, held beside the block inputs
    cp8 = by["fsdp+cp8+ac"].activation_bytes
    assert abs((cp8 - mask) * 8 / by["fsdp+ac"].activation_bytes - 1) < 0.05
    assert ("a sequence of 131072 tokens fits no layout without context parallelism; fsdp+cp4+ac "
            "fits") in text and "trainer.context_parallel=4" in text


def test_the_tp_x_cp_layout_names_both_and_an_elastic_range_must_fit_its_groups():
    from paratrain.parallel.strategies import FSDP
    from paratrain.parallel.tensor import TensorParallel
    from paratrain.runplan import check_elastic_layout
    both = TensorParallel(dims=ParallelDims(1, 1, 2, cp=2))  # FSDP2 shards over the CP group
    assert (both.name, both.label) == ("fsdp+tp+cp", "fsdp+tp2+cp2")
    data = TensorParallel(dims=ParallelDims(1, 2, 2, cp=2), data=FSDP())
    assert (data.name, data.label) == ("fsdp+tp+cp", "fsdp+tp2+cp2")
    assert TensorParallel(dims=ParallelDims(1, 1, 2)).label == "tp2"  # without CP as before
    check_elastic_layout(1, 1, 2, 1, 4, cp=2)  # 2 processes per node: every world is even
    with pytest.raises(ConfigError, match=r"^trainer.context_parallel=2 needs a world divisible "
                                          r"by 2, but distributed.nnodes=1:3 allows 1, 3 node"
                                          r".*keep the node counts that fit \(2\)"):
        check_elastic_layout(1, 1, 1, 1, 3, cp=2)
