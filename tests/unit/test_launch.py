"""Device specs and launcher detection: what a user's devices argument means on a given box."""

import pytest
import torch

from paratrain.errors import ConfigError
from paratrain.launch.environment import detect_launcher, parse_devices, slurm_master
from paratrain.runplan import batch_plan


def cpu(n):
    return [torch.device("cpu")] * n


@pytest.mark.parametrize("spec, gpus, expected", [
    ("auto", 0, cpu(2)),
    ("auto", 4, [torch.device("cuda", i) for i in range(4)]),
    ("cpu", 0, cpu(1)),
    ("cpu:3", 0, cpu(3)),
    ("cpu:2", 8, cpu(2)),
    ([0, 1], 2, [torch.device("cuda", 0), torch.device("cuda", 1)]),
    ("cuda:0,1", 2, [torch.device("cuda", 0), torch.device("cuda", 1)]),
    ("1,3", 4, [torch.device("cuda", 1), torch.device("cuda", 3)]),
    ("cuda", 2, [torch.device("cuda", 0), torch.device("cuda", 1)]),
    (2, 0, cpu(2)),
    ("gpu:2", 4, [torch.device("cuda", 0), torch.device("cuda", 1)]),  # two GPUs, as cpu:2
    ("cuda:2", 4, [torch.device("cuda", 2)]),  # torch's spelling: GPU 2
])
def test_parse_devices(spec, gpus, expected):
    assert parse_devices(spec, gpus_visible=gpus, cores=2) == expected


def test_auto_on_one_core_is_one_worker():
    assert parse_devices("auto", gpus_visible=0, cores=1) == cpu(1)


@pytest.mark.parametrize("spec, gpus, words", [
    ("cpu:0", 0, ["trainer.devices='cpu:0'", "cpu:1 or more"]),
    ([0, 5], 2, ["GPU 5 does not exist", "2 visible GPU"]),
    ([0], 0, ["GPU 0 does not exist", "cpu:2"]),
    ("cuda", 0, ["no CUDA GPU"]),
    ([0, 0], 2, ["twice"]),
    ("tpu:1", 0, ["not understood", "gpu:N"]),
    ("gpu:2", 1, ["asks for 2 GPUs", "1 visible GPU"]),
    ("gpu:0", 2, ["gpu:1 or more"]),
    ("cuda:2", 2, ["GPU 2 does not exist", "for 2 GPUs write gpu:2"]),
    ([], 0, ["non-empty"]),
])
def test_bad_devices(spec, gpus, words):
    with pytest.raises(ConfigError) as e:
        parse_devices(spec, gpus_visible=gpus, cores=2)
    for w in words:
        assert w in str(e.value)


def test_detect_torchrun():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    le = detect_launcher(env)
    assert (le.kind, le.rank, le.local_rank, le.world_size, le.node_rank, le.nnodes) == \
        ("torchelastic", 3, 1, 4, 1, 2)


def test_detect_slurm_and_plain():
    assert detect_launcher({}) is None
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
           "SLURM_NODEID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_NAME": "train",
           "SLURM_NODELIST": "gpu[003-004]", "SLURM_JOB_ID": "1234"}
    le = detect_launcher(env)
    assert (le.kind, le.rank, le.local_rank, le.world_size, le.local_world_size, le.node_rank) \
        == ("slurm", 5, 1, 8, 4, 1)
    assert slurm_master(env) == ("gpu003", 11234)
    # an interactive allocation (salloc + bash) is not a launch
    assert detect_launcher({**env, "SLURM_JOB_NAME": "bash"}) is None


def test_batch_plan():
    assert batch_plan(4, 2, None) == (1, 8)
    assert batch_plan(4, 2, 32) == (4, 32)
    assert batch_plan(4, 1, 32) == (8, 32)
    with pytest.raises(ConfigError, match="trainer.global_batch_size=30 is not divisible"):
        batch_plan(4, 2, 30)
