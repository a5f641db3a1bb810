"""Pipeline parallelism without real processes: how `trainer.pipeline_parallel` resolves into one
ParallelDims and a split of the blocks, the one-line refusals, and that the stages of a real
model, run one after the other, compute the model's own logits under the model's own names."""

from __future__ import annotations

import pytest
import torch

from paratrain import TrainConfig
from paratrain.config.checks import pipeline_split
from paratrain.errors import ConfigError
from paratrain.models import build_model, resolve_model_config
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.pipeline import ModelPart, check_schedule, resolve_pipeline_parallel
from paratrain.runplan import pipeline_blocks

CPU = torch.device("cpu")


def resolve(pp=2, world=4, schedule="1f1b", split=None, layers=4, requested="auto", tp=1,
            local=None):
    return resolve_pipeline_parallel(requested, pp, schedule=schedule, split=split,
                                     num_layers=layers, world_size=world,
                                     local_world_size=local or world, device=CPU, tp=tp)


def test_the_pipeline_is_the_outermost_dimension():
    dims = ParallelDims(dp_replicate=2, pp=2)  # ranks (0, 1): stage 0; (2, 3): stage 1
    assert dims.world == 4 and dims.dp == 2 and dims.stage_world == 2
    assert [dims.pp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [dims.data_rank(r) for r in range(4)] == [0, 1, 0, 1]  # stages read the same
    assert [dims.reports_sums(r) for r in range(4)] == [False, False, True, True]  # the loss's stage
    assert dims.to_dict() == {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "tp": 1}
    assert dims.label == "pp=2 x dp_replicate=2"


def test_pipeline_parallel_resolves_stages_and_data_parallelism():
    p, why = resolve(pp=2, world=4)
    assert p.name == "ddp+pp" and p.dims == ParallelDims(dp_replicate=2, pp=2)
    assert p.split == (2, 2) and p.blocks_of(1) == [2, 3] and "pipeline of 2" in why
    assert p.stages_of(0) == [0] and p.stages_of(3) == [1]
    alone, _ = resolve(pp=2, world=2)
    assert alone.name == "pp" and alone.dims.dp == 1
    # interleaved: 2 stages per process, stage s on pipeline rank s mod P
    inter, _ = resolve(pp=2, world=2, schedule="interleaved-1f1b", layers=8)
    assert inter.split == (2, 2, 2, 2)
    assert inter.stages_of(0) == [0, 2] and inter.stages_of(1) == [1, 3]
    assert inter.blocks_of(2) == [4, 5]


@pytest.mark.parametrize("requested, tp, world, local, name, dims", [
    ("fsdp", 1, 4, 4, "fsdp+pp", ParallelDims(dp_shard=2, pp=2)),
    # 4 nodes of 2: a stage is 2 nodes, sharded within each, replicated across
    ("hsdp", 1, 8, 2, "hsdp+pp", ParallelDims(dp_replicate=2, dp_shard=2, pp=2)),
    ("auto", 2, 4, 4, "tp+pp", ParallelDims(tp=2, pp=2)),
    ("fsdp", 2, 8, 8, "fsdp+tp+pp", ParallelDims(dp_shard=2, tp=2, pp=2)),
])
def test_a_stage_is_parallelized_as_a_world_of_its_processes(requested, tp, world, local, name,
                                                             dims):
    p, why = resolve(pp=2, world=world, local=local, requested=requested, tp=tp)
    assert p.name == name and p.dims == dims and "pipeline of 2 stages" in why
    assert p.stages_of(world - 1) == [1]  # the pipeline stays outermost


def test_blocks_are_split_evenly_or_as_given():
    assert pipeline_split(5, 2, "1f1b") == (3, 2)
    assert pipeline_split(4, 2, "gpipe", [3, 1]) == (3, 1)
    assert pipeline_split(8, 2, "interleaved-1f1b") == (2, 2, 2, 2)


@pytest.mark.parametrize("call, message", [
    (lambda: pipeline_split(2, 4, "1f1b"), r"needs 4 stages .* more than the 2 blocks"),
    (lambda: pipeline_split(4, 2, "1f1b", [4, 0]), r"leaves stage 1 empty"),
    (lambda: pipeline_split(4, 2, "1f1b", [2, 1]), r"adds up to 3 blocks, but the model has 4"),
    (lambda: pipeline_split(4, 2, "1f1b", [1, 1, 2]), r"has 3 entries; the pipeline has 2"),
    (lambda: pipeline_split(4, 2, "1f1b", [4]), r"has 1 entry; the pipeline has 2"),
    (lambda: resolve(pp=2, world=3), r"pipeline_parallel=2 does not divide the world of 3 "),
    # a stage of 2 processes cannot hold a tensor-parallel group of 4
    (lambda: resolve(pp=2, world=4, tp=4), r"tensor_parallel=4 is more than the 2 process"),
    (lambda: check_schedule(resolve(pp=2, world=2, schedule="interleaved-1f1b", layers=8)[0], 5),
     r"runs the 5 micro-batches of a step in rounds of 2"),
    # torch's schedules need a micro-batch per stage: said before launch, with the batch that works
    (lambda: check_schedule(resolve(pp=2, world=2, layers=4)[0], 1, 8),
     r"pipeline_parallel=2 needs at least 2 micro-batches per step \(one per stage\), this run "
     r"has 1 .*; set trainer.global_batch_size=16 \(or a larger multiple of 8\)"),
])
def test_a_pipeline_that_cannot_be_built_is_one_line(call, message):
    with pytest.raises(ConfigError, match=message):
        call()


@pytest.mark.parametrize("overrides, message", [
    (["trainer.pipeline_parallel=0"], r"pipeline_parallel=0 must be >= 1"),
    (["trainer.pipeline_parallel=2", "trainer.pipeline_schedule=zigzag"],
     r"pipeline_schedule='zigzag' is not one of: 1f1b, gpipe, interleaved-1f1b"),
    (["trainer.pipeline_split=[1,1]"], r"set trainer.pipeline_parallel > 1 too"),
    (["trainer.pipeline_parallel=2", "trainer.strategy=dp"], r"ddp, fsdp, hsdp or auto .* not dp"),
    (["trainer.pipeline_parallel=2", "model.arch=gpt"], r"model.tie_embeddings=false"),
    (["trainer.pipeline_parallel=2", "data.format=padded"], r"cannot split data.format=padded"),
    (["trainer.pipeline_parallel=2", "data.drop_last=false"], r"set data.drop_last=true"),
    (["trainer.pipeline_parallel=4", "model.num_layers=2"], r"more than the 2 blocks"),
    (["trainer.pipeline_parallel=2", "model.num_layers=2", "trainer.pipeline_split=[2,0]"],
     r"leaves stage 1 empty"),
])
def test_bad_pipeline_config_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_yaml(None, ["model.preset=tiny"] + overrides)


def test_a_hugging_face_or_users_model_is_refused(hf_llama):
    with pytest.raises(ConfigError, match=r"cannot split a Hugging Face model"):
        TrainConfig.from_yaml(None, ["model.arch=hf", f"model.path={hf_llama}",
                                     "trainer.pipeline_parallel=2"])

    from paratrain.tasks.user import UserTask
    users = UserTask.__new__(UserTask)  # Trainer(model=...): any module of the user's own
    with pytest.raises(ConfigError, match=r"your own nn.Module \(Trainer\(model=...\)\) cannot "
                                          r"be cut into stages"):
        pipeline_blocks(users, 2)


@pytest.mark.parametrize("arch, checkpointing", [("llama", False), ("gpt", False),
                                                  ("llama", True)])
def test_stages_in_a_row_are_the_model_under_its_names(arch, checkpointing):
    from paratrain.parallel.parallelize import apply_activation_checkpointing
    cfg = TrainConfig.from_yaml(None, [f"model.arch={arch}", "model.preset=tiny",
                                       "model.num_layers=3", "model.tie_embeddings=false"])
    torch.manual_seed(0)
    model = build_model(resolve_model_config(cfg.model, vocab_size=96, seq_length=16)).eval()
    parts = [ModelPart(model, [0, 1], first=True, last=False),
             ModelPart(model, [2], first=False, last=True)]
    for part in parts if checkpointing else ():  # a part's blocks wrapped, as Pipeline does
        apply_activation_checkpointing(part)
    idx = torch.randint(0, 96, (2, 16))  # (B, T)
    x = idx
    for part in parts:
        x = part(x)
    torch.testing.assert_close(x, model(idx), rtol=0, atol=0)  # the same ops, in order
    names = [set(p.state_dict()) for p in parts]
    assert not names[0] & names[1] and names[0] | names[1] == set(model.state_dict())
    assert "layers.2.attention_norm.weight" in names[1] or "layers.2.ln_1.weight" in names[1]


def _plan_rows(*overrides):
    from paratrain.parallel.simulate import simulate_at_scale
    cfg = TrainConfig.from_yaml(None, ["model.preset=tiny", "model.num_layers=4",
                                       "trainer.devices=cpu:4", "trainer.batch_size=2",
                                       "trainer.global_batch_size=16", "plan.device_memory_gb=1",
                                       "trainer.pipeline_parallel=2", *overrides])
    rows = simulate_at_scale(cfg)[0]
    return {r.label: r for r in rows}


def test_the_plan_counts_a_stage_and_the_micro_batches_in_flight():
    """P=2 x DDP 2: rank 0 holds the embedding and half the blocks; GPipe keeps all 4
    micro-batches of a step in flight, 1F1B at most P=2 of them."""
    one_f_one_b, gpipe = _plan_rows()["ddp+pp2"], _plan_rows("trainer.pipeline_schedule=gpipe")
    ddp = gpipe["ddp"]
    assert one_f_one_b.asked and 0.45 < one_f_one_b.params_bytes / ddp.params_bytes < 0.55
    assert gpipe["ddp+pp2"].activation_bytes == 2 * one_f_one_b.activation_bytes
    assert one_f_one_b.sent["pp"]["send"] == 4 * 2 * 256 * 64 * 4  # M x (B, T, C) fp32


def test_the_plan_counts_a_stage_sharded_and_split():
    """P=2 x FSDP 2 x TP 2 on 8 devices: rank 0 holds half the blocks, a quarter of that by
    FSDP's shards and TP's slices (the norms' gains stay whole under TP: a few hundred bytes),
    its stage parallelized on the fake world's mesh as the run does it. (Each of FSDP and TP
    alone is checked against a real run's bytes: tests/distributed/test_pipeline.py.)"""
    rows = _plan_rows("trainer.strategy=fsdp", "trainer.tensor_parallel=2",
                      "plan.devices_per_node=8")
    row, ddp = rows["fsdp+tp2+pp2"], rows["ddp"]
    assert row.asked and row.dims == "pp=2 x dp_shard=2 x tp=2"
    assert abs(row.params_bytes / ddp.params_bytes * 8 - 1) < 0.04, row


def test_bench_has_a_pipeline_row_per_schedule_with_its_ideal_bubble():
    from paratrain.tools.bench import choose_variants
    cfg = TrainConfig.from_yaml(None, ["model.preset=tiny", "trainer.batch_size=2",
                                       "trainer.global_batch_size=8"])  # 2 blocks
    runs, skipped = choose_variants(cfg, [CPU, CPU], ["pp", "pp-gpipe", "pp-interleaved"], False)
    assert [v.label for v in runs] == ["pp2", "pp2-gpipe"]
    assert runs[0].ideal_bubble == 1 / 5  # P=2, M=4 micro-batches: (P - 1) / (M + P - 1)
    assert "trainer.pipeline_schedule=gpipe" in runs[1].overrides
    [skip] = skipped  # interleaved: 4 stages of the 2 blocks
    assert skip["label"] == "pp-interleaved" and "more than the 2 blocks" in skip["reason"]


def test_a_stalled_rank_is_named_with_its_pipeline_stage(tmp_path):
    """Two watchdogs over one in-memory store: rank 1 (the last stage) never leaves data
    loading while rank 0 waits in the schedule of the same step."""
    import torch.distributed as dist

    from paratrain.dist import DistEnv
    from paratrain.launch.watchdog import Watchdog
    p, _ = resolve(pp=2, world=2, schedule="interleaved-1f1b", layers=4)
    store = dist.HashStore()
    dogs = [Watchdog(DistEnv(rank=r, world_size=2, local_world_size=2, timeout_s=20.0),
                     tmp_path, 20.0, store) for r in (0, 1)]
    for dog, phase in zip(dogs, ("forward", "data")):
        dog.watch(dog.progress, p.roles(2))
        dog.progress.at(5, phase)
    for beat in (1, 2):
        for dog in dogs:
            dog._beat(beat)
        dogs[0]._observe()
    verdict = dogs[0]._diagnose(dead_after=10, collective=True)
    assert "rank 1 (pipeline stage 1, 3) stalled at step 5" in verdict["message"]


def test_zero_bubble_runs_two_stages_per_process_with_a_third_of_the_bubble():
    from paratrain.parallel.pipeline_schedules import ideal_bubble, in_flight, schedule_class
    from paratrain.tools.bench import choose_variants
    p, why = resolve(pp=2, world=2, schedule="zero-bubble", layers=8)
    assert p.split == (2, 2, 2, 2) and p.stages_of(0) == [0, 2] and "zero-bubble" in why
    assert schedule_class("zero-bubble").__name__ == "ScheduleInterleavedZeroBubble"
    assert in_flight("zero-bubble", 2, 4) == in_flight("1f1b", 2, 4) == 2  # 1F1B's memory
    with pytest.raises(ConfigError, match=r"rounds of 2"):  # interleaved's rule
        check_schedule(p, 5)
    cfg = TrainConfig.from_yaml(None, ["model.preset=tiny", "model.num_layers=4",
                                       "trainer.batch_size=2", "trainer.global_batch_size=8"])
    runs, skipped = choose_variants(cfg, [CPU, CPU], ["pp-interleaved", "pp-zb"], False)
    assert not skipped and [v.label for v in runs] == ["pp2-interleaved", "pp2-zb"]
    # P=2, M=4, V=2: (P - 1) / (V x M + P - 1), and with F = B = W a third of the work idles
    assert runs[0].ideal_bubble == 1 / 9 and runs[1].ideal_bubble == 1 / 25
    assert ideal_bubble("1f1b", 2, 4) == 1 / 5 and "trainer.pipeline_schedule=zero-bubble" in \
        runs[1].overrides
    with pytest.raises(ConfigError, match=r"zero-bubble splits each backward .* "
                                          r"trainer.compile=false"):
        TrainConfig.from_yaml(None, ["model.preset=tiny", "trainer.pipeline_parallel=2",
                                     "model.num_layers=4", "trainer.compile=true",
                                     "trainer.pipeline_schedule=zero-bubble"])


def test_an_elastic_range_must_split_into_stages_at_every_node_count(tmp_path, monkeypatch,
                                                                   capsys, corpus_dir, cache_dir):
    from paratrain.runplan import check_elastic_layout
    from tests.conftest import cli_error, tiny_overrides
    check_elastic_layout(2, 1, 2, 1, 4)  # 2 processes per node: every world is even
    check_elastic_layout(4, 1, 1, 4, 4)
    with pytest.raises(ConfigError, match=r"pipeline_parallel=2 x trainer.tensor_parallel=2 "
                                          r"needs a world divisible by 4, .* allows 3 node"):
        check_elastic_layout(2, 2, 2, 2, 4)
    monkeypatch.chdir(tmp_path)
    line = cli_error(capsys, ["train"] + tiny_overrides(corpus_dir, cache_dir, **{
        "distributed.nnodes": "1:3", "distributed.master_port": 29999, "trainer.devices": "cpu:1",
        "model.num_layers": 4, "trainer.batch_size": 2, "trainer.global_batch_size": 12,
        "trainer.pipeline_parallel": 2}))
    assert ("trainer.pipeline_parallel=2 needs a world divisible by 2, but "
            "distributed.nnodes=1:3 allows 1, 3 node(s) of 1 process(es) (1, 3 processes); "
            "keep the node counts that fit (2) or use trainer.pipeline_parallel in 1") in line
    assert not (tmp_path / "runs").exists()


def test_too_few_micro_batches_for_the_stages_is_refused_before_launch(tmp_path, monkeypatch,
                                                                      capsys, corpus_dir,
                                                                      cache_dir):
    """The default batch plan (no global batch: one micro-batch a step) on two stages: one line
    naming the global batch that works, before any worker starts (torch says it in a worker)."""
    from tests.conftest import cli_error, tiny_overrides
    monkeypatch.chdir(tmp_path)
    line = cli_error(capsys, ["train"] + tiny_overrides(corpus_dir, cache_dir, **{
        "trainer.devices": "cpu:2", "model.num_layers": 4, "trainer.pipeline_parallel": 2,
        "model.tie_embeddings": "false"}))
    assert "trainer.pipeline_parallel=2 needs at least 2 micro-batches per step" in line, line
    assert "set trainer.global_batch_size=8 " in line, line  # 2 stages x batch_size 4 x 1 dp
    assert not (tmp_path / "runs").exists()


def test_auto_picks_the_smallest_pipeline_only_when_nothing_else_fits(tmp_path, corpus_dir,
                                                                      cache_dir):
    """auto's memory plan for a real language-model task on 4 processes. The model's blocks are
    wide and its micro-batch short, so FSDP's gathered blocks and whole-model activations weigh
    more than a quarter of its state: P=4 needs less per device than fsdp+ac, P=2 (half the
    state on each replica) more. On a device that fits P=4 and nothing else, auto picks P=4,
    says why, and the run plan is that pipeline; on one that also fits fsdp+ac, fsdp+ac."""
    from paratrain.dist import DistEnv
    from paratrain.parallel.memory_estimate import MARGIN, estimate
    from paratrain.runplan import auto_choice, auto_pipelines, make_plan
    from paratrain.runtime.rank import prepare_task
    from tests.conftest import tiny_overrides
    cfg = TrainConfig.from_yaml(None, tiny_overrides(corpus_dir, cache_dir, **{
        "model.num_layers": 4, "model.hidden_size": 256, "data.seq_length": 16,
        "trainer.batch_size": 1, "trainer.global_batch_size": 4}))
    task = prepare_task(cfg, DistEnv(), quiet=True)
    probe = task.memory_probe()
    rows = estimate(probe.build_model, world=4, precision="fp32", micro_batch=1,
                    seq_length=probe.seq_length, vocab_size=probe.vocab_size,
                    shard_group_size=4)  # what auto_choice measures for one node of 4
    dp = {r.label: r.device_bytes for r in rows if not r.parallelism.offloads_to_host}
    assert list(dp) == ["ddp", "fsdp", "fsdp+ac"]
    pp2, pp4 = auto_pipelines(cfg, task, world_size=4, local_world_size=4, device=CPU)
    assert (pp2.label, pp4.label) == ("ddp+pp2", "pp4")
    assert pp4.device_bytes < min(dp.values()) < pp2.device_bytes, (pp2, pp4, dp)

    def pick(fits_bytes):  # a device on which `fits_bytes` just fits
        return auto_choice(cfg, task, world_size=4, device=CPU, local_world_size=4,
                           capacity=int(fits_bytes / MARGIN) + 1)
    got = pick(pp4.device_bytes)
    assert got.label == "pp4" and "the only layout on the device that fits (fsdp+ac, the " \
        "smallest without a pipeline," in got.why and "blocks per stage [1, 1, 1, 1]" in got.why
    plan = make_plan(cfg, task, devices=[CPU] * 4, world_size=4, local_world_size=4,
                     choice=got)
    assert plan.dims.pp == 4 and plan.dims.dp == 1 and plan.accum == 4
    assert plan.parallelism.name == "pp" and plan.parallelism_reason == got.why
    assert pick(dp["fsdp+ac"]).label == "fsdp+ac"
