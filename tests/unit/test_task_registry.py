"""The task registry: one table answers every format question, unknown names list the
registered ones, the API recognises records by their fields, and a new task is one module plus
one registration."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from paratrain.config import TrainConfig
from paratrain.dist import DistEnv
from paratrain.errors import ConfigError
from paratrain.runtime.rank import prepare_task
from paratrain.config import registry
from paratrain.tasks.user import UserTask


def test_the_built_in_formats_and_what_they_are():
    assert registry.names() == ("packed", "padded", "pairs", "chat", "classify", "preference",
                                "embedding", "prompts")
    assert registry.names(pretrained=True) == ("pairs", "chat", "classify", "preference",
                                               "embedding", "prompts")
    assert [registry.get(n).packed for n in ("packed", "padded")] == [True, False]
    from paratrain.tasks.sft import ChatTask, PairsTask
    from paratrain.tasks.classify import ClassifyTask
    from paratrain.tasks.pretraining import LMTask
    from paratrain.tasks.preference.dpo import DPOTask
    from paratrain.tasks.embedding.embedder import EmbeddingTask
    from paratrain.tasks.rl.grpo import GRPOTask
    assert [registry.get(n).load() for n in registry.names()] == \
        [LMTask, LMTask, PairsTask, ChatTask, ClassifyTask, DPOTask, EmbeddingTask, GRPOTask]


def test_an_unknown_format_names_the_registered_ones():
    with pytest.raises(ConfigError, match="data.format='dpo' is not one of: packed, padded, "
                                          "pairs, chat, classify, preference, embedding, "
                                          "prompts"):
        TrainConfig.from_yaml(None, ["data.format=dpo"])


def test_records_are_recognised_by_their_fields():
    assert registry.recognize({"messages": []}).name == "chat"
    assert registry.recognize({"text": "a", "label": 1}).name == "classify"
    assert registry.recognize({"input": "a", "output": "b"}).name == "pairs"
    assert registry.recognize({"prompt": "a", "chosen": "b", "rejected": "c"}).name == \
        "preference"
    assert registry.recognize({"anchor": "a", "positive": "b"}).name == "embedding"
    assert registry.recognize({"prompt": "a"}).name == "prompts"  # online RL
    assert registry.recognize({"question": "a"}).name == "pairs"  # the default: its encoder says


def test_the_registry_is_free_of_torch():
    code = ("import sys; from paratrain.config import registry; registry.get('pairs'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stderr


@dataclass
class _Numbers(UserTask):
    """A task from outside the package: prepared from the config alone."""

    @classmethod
    def prepare(cls, cfg, env, records, say):
        import torch
        say("numbers: 64 samples")
        return cls(lambda: torch.nn.Linear(2, 1), [torch.zeros(2)] * 64)


def test_a_new_task_is_one_registration(monkeypatch):
    spec = registry.TaskSpec("numbers", f"{__name__}:_Numbers", summary="test numbers")
    monkeypatch.setitem(registry._TASKS, "numbers", spec)
    cfg = TrainConfig.from_yaml(None, ["data.format=numbers"])  # config accepts it
    lines: list[str] = []
    monkeypatch.setattr("paratrain.runtime.rank.log", lambda env, m: lines.append(m))
    task = prepare_task(cfg, DistEnv.single("cpu"))
    assert isinstance(task, _Numbers) and len(task.train_ds) == 64
    assert lines == ["numbers: 64 samples"]
    with pytest.raises(ValueError, match="registered already"):
        registry.register(spec)


def test_the_task_is_decided_once_and_travels_with_the_config(monkeypatch):
    """Building a config decides its task (registry.for_config, once); a pickled copy (what a
    worker gets) carries the decision, and a run's config.yaml records it for `generate`."""
    import pickle

    import paratrain.config.tree as tree
    calls = []
    monkeypatch.setattr(tree, "for_config", lambda cfg: calls.append(cfg) or
                        registry.for_config(cfg))
    cfg = TrainConfig.from_yaml(None, ["data.format=padded"])
    clone = pickle.loads(pickle.dumps(cfg))
    assert clone.task_spec == cfg.task_spec == registry.get("padded") and len(calls) == 1
    assert "objective: lm" in cfg.to_yaml(record_task=True)
    assert "objective: auto" in cfg.to_yaml()
    assert registry.recorded("preference", "reward").task.endswith("RewardTask")
    assert registry.recorded("pairs", "auto") == registry.get("pairs")
    with pytest.raises(ConfigError, match="data.format=pairs trains no trainer.objective='dpo'"):
        registry.recorded("pairs", "dpo")


def test_a_task_object_must_be_a_task_subclass_and_gets_every_default():
    """Trainer(task=) takes a paratrain.Task (the loop reads the contract's defaults from it);
    anything else is refused in one line. A UserTask has every optional seam's default."""
    import torch

    from paratrain import Task, Trainer
    with pytest.raises(ConfigError, match=r"^task= must be a paratrain.Task \(or UserTask\) "
                                          r"subclass; object is not one$"):
        Trainer(task=object())
    task = _Numbers(lambda: torch.nn.Linear(2, 1), [torch.zeros(2)] * 64)
    assert isinstance(task, Task) and task.build_frozen() == {} and task.memory_probe() is None
    assert task.progress_keys == () and task.eval_block is None and not task.reads_corpus
    assert task.pipeline_blocks is None and task.rollout(None, ["mb"], 0, None, None) == (
        ["mb"], {})
