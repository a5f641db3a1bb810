"""Workers forked from the preloaded server (launch/forkserver.py): when a command opens one,
what it imports, and when a launch forks from it rather than spawning its workers cold. (Every
multi-process CLI test of the suite trains with forked workers; test_startup_cache checks that
they still leave with a killed launcher.)"""

import importlib.util
import json
import os

import pytest

from paratrain.config import TrainConfig
from paratrain.launch import forkserver


def _cfg(*overrides: str) -> TrainConfig:
    return TrainConfig.from_yaml(None, list(overrides))


@pytest.mark.parametrize("overrides, starts", [
    (["trainer.devices=cpu:2"], True),
    (["trainer.devices=2"], True),  # an int: that many devices
    (["trainer.devices=[0,1]"], True),
    (["trainer.devices=cuda:0,1"], True),
    (["trainer.devices=cpu"], False),
    (["trainer.devices=cpu:1"], False),
    (["trainer.devices=1"], False),
    (["trainer.devices=[3]"], False),
    (["trainer.devices=cuda:0"], False),
    (["trainer.devices=gpu:2"], True),  # two GPUs (cuda:2 is GPU 2 alone)
    (["trainer.devices=gpu:1"], False),
    (["trainer.devices=cuda:2"], False),
    (["trainer.devices=cpu:1", "distributed.nnodes=2", "distributed.master_port=29500"],
     True),  # one worker on each of 2 nodes
    (["trainer.devices=cuda:0,1", "trainer.strategy=dp"], False),  # one process drives both
])
def test_a_server_is_opened_only_where_workers_will_start(monkeypatch, overrides, starts):
    for var in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    assert forkserver.may_start_workers(_cfg(*overrides)) is starts


def test_no_server_under_a_launcher_that_made_this_process_a_rank(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    assert not forkserver.may_start_workers(_cfg("trainer.devices=cpu:2"))


def test_the_server_imports_what_the_task_needs(tmp_path):
    lm = forkserver.worker_modules(_cfg("model.preset=tiny"))
    assert lm == ["paratrain.trainer", *forkserver.EVERY_WORKER, "paratrain.tasks.pretraining",
                  "paratrain.models.llama"]
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    hf = forkserver.worker_modules(_cfg("model.arch=hf", f"model.path={model}",
                                        "data.format=pairs", "model.lora.r=8"))
    assert "paratrain.tasks.sft" in hf and "transformers.models.llama.modeling_llama" in hf
    assert "peft" in hf
    # the server skips a name that does not import: a typo here would silently cost speed
    assert all(importlib.util.find_spec(name) is not None for name in lm + hf)


def test_a_launch_forks_only_while_the_environment_is_the_servers(monkeypatch):
    monkeypatch.setattr(forkserver, "_server_environ", None)
    assert forkserver.worker_start() == forkserver.SPAWN  # no server here
    monkeypatch.setenv("PARATRAIN_TEST_KEPT", "1")
    monkeypatch.delenv("PARATRAIN_TEST_ADDED", raising=False)
    monkeypatch.setattr(forkserver, "_server_environ", dict(os.environ))
    same = forkserver.worker_start()
    assert same.method == "forkserver" and dict(same.environ) == {}
    monkeypatch.setenv("PARATRAIN_TEST_ADDED", "yes")  # added since: handed to the workers
    added = forkserver.worker_start()
    assert added.method == "forkserver" and dict(added.environ) == {"PARATRAIN_TEST_ADDED": "yes"}
    monkeypatch.setenv("PARATRAIN_TEST_KEPT", "2")  # changed since: imports may have read it
    assert forkserver.worker_start() == forkserver.SPAWN
    monkeypatch.delenv("PARATRAIN_TEST_KEPT")  # gone since
    assert forkserver.worker_start() == forkserver.SPAWN


def test_a_forked_worker_sets_the_added_variables_but_keeps_the_agents(monkeypatch):
    monkeypatch.setenv("RANK", "1")  # as the agent set it
    monkeypatch.delenv("PARATRAIN_TEST_ADDED", raising=False)
    seen = forkserver.with_environ({"RANK": "0", "PARATRAIN_TEST_ADDED": "yes"},
                                   lambda a, b: (a, b, dict(os.environ)), 1, 2)
    assert seen[:2] == (1, 2)
    assert seen[2]["RANK"] == "1" and seen[2]["PARATRAIN_TEST_ADDED"] == "yes"
