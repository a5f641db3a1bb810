"""Multi-node inputs checked in-process: where a rank comes from under torchrun and Slurm, and
the bad inputs that need no second node to detect (one line, exit code 2, nothing started)."""

from __future__ import annotations

import pytest

from paratrain import cli
from paratrain.errors import ConfigError
from paratrain.launch.environment import detect_launcher, worker_dist_env
from paratrain.launch.nodes import _compare
from tests.conftest import tiny_overrides


def test_torchrun_rank_and_store():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
           "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "2"}
    le = detect_launcher(env)
    d = worker_dist_env(le, "cpu:2", "auto", 30)
    assert (d.rank, d.local_rank, d.node_rank, d.nnodes, d.world_size) == (3, 1, 1, 2, 4)
    assert (d.init_method, d.master_addr, d.master_port, d.job_id) == \
        ("env://", "10.0.0.1", 29500, "job7/2")


def test_slurm_joins_over_tcp_at_the_first_host():
    """No agent sets MASTER_ADDR under srun: rank 0 hosts the store at the derived address."""
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
           "SLURM_NODEID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_NAME": "train",
           "SLURM_NODELIST": "gpu[003-004]", "SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0"}
    d = worker_dist_env(detect_launcher(env), "cpu", "auto", 30)
    assert (d.rank, d.node_rank, d.nnodes, d.init_method) == (5, 1, 2, "tcp://gpu003:11234")
    assert d.job_id == "slurm-1234.0"


def _info(nnodes=2, nproc=1, **config):
    return {"host": "h", "nnodes": nnodes, "nproc": nproc, "config": config}


@pytest.mark.parametrize("them, words", [
    (_info(nnodes=3), "distributed.nnodes=2 here, 3 there"),
    (_info(nproc=2), "1 device(s) in trainer.devices here, 2 there"),
    (_info(**{"trainer.batch_size": 8}), "trainer.batch_size=4 here, 8 there"),
])
def test_nodes_that_disagree(them, words):
    with pytest.raises(ConfigError, match="node 0 and node 1 .* disagree") as e:
        _compare(0, _info(**{"trainer.batch_size": 4}), 1, them)
    assert words in str(e.value)


@pytest.mark.parametrize("overrides, words", [
    (["distributed.master_addr=no-such-host.invalid"],
     "distributed.master_addr='no-such-host.invalid' does not resolve"),
    (["distributed.node_rank=2"], "distributed.node_rank=2 must be in 0..nnodes-1"),
    (["trainer.devices=[3]"], "GPU 3 does not exist"),
    (["distributed.rdzv=etcd"], "distributed.rdzv='etcd' is not one of"),
])
def test_bad_multinode_input(tmp_path, monkeypatch, capsys, corpus_dir, cache_dir, overrides,
                             words):
    monkeypatch.chdir(tmp_path)
    argv = ["train"] + tiny_overrides(corpus_dir, cache_dir) + [
        "distributed.nnodes=2", "distributed.master_port=29400"] + overrides
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if not x.startswith("[paratrain] ")]
    assert len(lines) == 1 and words in lines[0], err
    assert not (tmp_path / "runs").exists()
