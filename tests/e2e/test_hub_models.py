"""model.path=org/name, offline: a tiny Llama put into a huggingface_hub cache laid out as `hf
download` leaves it (tests/_hub.py), HF_HUB_OFFLINE=1. A full fine-tune (a real CLI process, a
fake HF_TOKEN in its environment that no file or line of the run shows), LoRA, DPO, GRPO and an
embedding model each train 2 steps from the id; the summary and config.yaml name the commit; `checkpoint export` of a
LoRA snapshot (merged, base given as the id) loads in plain transformers; `generate org/name`
reads the cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests._hub import COMMIT, offline_env, put_in_hub_cache
from tests.conftest import cli_run, read_summary, run_cli

pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

HUB_ID = "tiny-org/tiny-llama"
FAKE_TOKEN = "hf_FAKEtoken0123456789abcdefghijklmnop"


@pytest.fixture(scope="module")
def hub(tmp_path_factory, pairs_llama) -> Path:
    """The hub cache, with pairs_llama as HUB_ID at COMMIT (refs/main)."""
    cache = tmp_path_factory.mktemp("hf-hub")
    put_in_hub_cache(pairs_llama, cache, HUB_ID)
    return cache


@pytest.fixture
def offline(hub, monkeypatch) -> Path:
    """This process reads `hub` offline (for the in-process CLI runs)."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for k, v in offline_env(hub).items():
        monkeypatch.setenv(k, v)
    return hub


def _args(tmp: Path, run: str, data: dict, **extra) -> list[str]:
    base = {"model.arch": "hf", "model.path": HUB_ID, "data.max_length": 64,
            "trainer.devices": "cpu:1", "trainer.batch_size": 2, "trainer.max_steps": 2,
            "trainer.log_every": 1, "trainer.eval_every": 1000, "trainer.progress_bar": False,
            "log.report": False, "log.tensorboard": False, "distributed.timeout_s": 60,
            "run.dir": tmp / run, **data, **extra}
    return ["train"] + [f"{k}={v}" for k, v in base.items()]


def _pairs(tmp: Path) -> dict:
    from tests.e2e._tiny_model import make_pairs, write_jsonl
    return {"data.format": "pairs", "data.source": write_jsonl(tmp / "pairs.jsonl", make_pairs(8))}


def _hub_record(run_dir: Path) -> None:
    assert read_summary(run_dir)["hub_model"] == {"id": HUB_ID, "revision": COMMIT}
    recorded = (run_dir / "config.yaml").read_text()
    assert f"revision: {COMMIT}" in recorded and f"models--tiny-org--tiny-llama/snapshots/" \
        f"{COMMIT}" in recorded


def test_a_full_fine_tune_from_an_id_offline_never_shows_the_token(tmp_path, hub):
    """A real process: HF_HUB_OFFLINE=1, HF_TOKEN set; the run names the commit, and the token
    is in no line it printed and no file it wrote."""
    r = run_cli(_args(tmp_path, "sft", _pairs(tmp_path)), cwd=tmp_path,
                env=offline_env(hub, HF_TOKEN=FAKE_TOKEN), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    _hub_record(tmp_path / "sft")
    assert FAKE_TOKEN not in r.stdout + r.stderr
    for f in (tmp_path / "sft").rglob("*"):
        assert not f.is_file() or FAKE_TOKEN.encode() not in f.read_bytes(), f
    shown = run_cli(["config", "show", "model.arch=hf", f"model.path={HUB_ID}", "data.format=pairs",
                     f"data.source={tmp_path / 'pairs.jsonl'}"], cwd=tmp_path,
                    env=offline_env(hub, HF_TOKEN=FAKE_TOKEN), timeout=120)
    assert shown.returncode == 0 and COMMIT in shown.stdout, shown.stderr[-2000:]
    assert FAKE_TOKEN not in shown.stdout + shown.stderr


def test_lora_then_its_export_with_the_base_as_an_id(capsys, tmp_path, offline):
    import transformers
    r = cli_run(capsys, _args(tmp_path, "lora", _pairs(tmp_path), **{
        "model.lora.r": 4, "checkpoint.every_steps": 1}))
    assert r.returncode == 0, r.stderr[-3000:]
    _hub_record(tmp_path / "lora")
    snapshot = sorted((tmp_path / "lora" / "checkpoints").glob("step-*"))[-1]
    out = tmp_path / "merged"
    e = cli_run(capsys, ["checkpoint", "export", snapshot, out, "--merge", "--model-path", HUB_ID])
    assert e.returncode == 0, e.stderr[-3000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.config.model_type == "llama"


def test_dpo_and_grpo_from_an_id(capsys, tmp_path, offline):
    from tests.e2e._preference_data import preference_rows
    from tests.e2e._tiny_model import write_jsonl
    prefs = write_jsonl(tmp_path / "prefs.jsonl", preference_rows(8, 0))
    r = cli_run(capsys, _args(tmp_path, "dpo", {"data.format": "preference",
                                                "data.source": prefs}))
    assert r.returncode == 0, r.stderr[-3000:]
    _hub_record(tmp_path / "dpo")
    prompts = write_jsonl(tmp_path / "prompts.jsonl",
                          [{"prompt": f"def function_{i}("} for i in range(8)])
    r = cli_run(capsys, _args(tmp_path, "grpo", {
        "data.format": "prompts", "data.source": prompts, "trainer.objective": "grpo",
        "rl.reward_functions": "[tests.e2e._grpo_rewards:digits]", "rl.num_generations": 2,
        "rl.max_new_tokens": 4, "trainer.global_batch_size": 2}))
    assert r.returncode == 0, r.stderr[-3000:]
    _hub_record(tmp_path / "grpo")
    g = cli_run(capsys, ["generate", HUB_ID, "--prompt", "def ", "--max-new-tokens", "3"])
    assert g.returncode == 0, g.stderr[-3000:]
    rows = [{"anchor": f"q{i}", "positive": f"a{i}"} for i in range(8)]
    r = cli_run(capsys, _args(tmp_path, "emb", {
        "data.format": "embedding", "data.source": write_jsonl(tmp_path / "emb.jsonl", rows),
        "embedding.pooling": "last"}))
    assert r.returncode == 0, r.stderr[-3000:]
    _hub_record(tmp_path / "emb")


def test_reward_models_and_the_reference_by_id(tmp_path, offline):
    """rl.reward_models and dpo.reference go through the same resolver as model.path."""
    from paratrain.config import TrainConfig
    from tests.e2e._tiny_model import write_jsonl
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])
    snapshot = str(offline / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT)
    # a reward model is a one-label sequence classifier (the config refuses a causal LM):
    # the tiny Llama's files with that head's config.json, as its own repo
    scorer = tmp_path / "scorer"
    shutil.copytree(snapshot, scorer)
    config = json.loads((scorer / "config.json").read_text())
    config.update(architectures=["LlamaForSequenceClassification"], num_labels=1,
                  id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    (scorer / "config.json").write_text(json.dumps(config))
    scorer_snapshot = str(put_in_hub_cache(scorer, offline, "tiny-org/tiny-scorer"))
    cfg = TrainConfig.from_yaml(None, [
        "model.arch=hf", f"model.path={HUB_ID}", "data.format=prompts", f"data.source={prompts}",
        "trainer.objective=grpo", "rl.reward_models=[tiny-org/tiny-scorer]",
        f"dpo.reference={HUB_ID}"])
    assert cfg.rl.reward_models == [scorer_snapshot] and cfg.dpo.reference == snapshot


def test_a_missing_id_is_one_line(capsys, tmp_path, offline):
    from tests.conftest import cli_error
    line = cli_error(capsys, _args(tmp_path, "x", _pairs(tmp_path), **{
        "model.path": "tiny-org/absent"}))
    assert "tiny-org/absent" in line and str(offline) in line and "HF_HUB_OFFLINE=1" in line


def test_a_hub_dataset_by_id_with_subset_and_split(capsys, tmp_path, offline, monkeypatch):
    """hf://datasets/org/name with data.subset and a sliced data.split, read offline through
    datasets' own loading of the cached parquet repo (prepared into HF_DATASETS_CACHE once):
    Alpaca records recognised by data.format=auto; config.yaml pins the commit."""
    import datasets

    from tests._hub import put_dataset_in_hub_cache
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    rows = lambda n, s: [{"instruction": f"Repeat {s}{i}", "input": "",  # noqa: E731
                          "output": f"{s}{i} {s}{i}"} for i in range(n)]
    put_dataset_in_hub_cache(offline, "tiny-org/repeat", {"train": rows(20, "w"),
                                                          "validation": rows(6, "v")},
                             subset="plain")
    source = "hf://datasets/tiny-org/repeat"
    r = cli_run(capsys, _args(tmp_path, "ds", {
        "data.format": "auto", "data.source": source, "data.val_source": source,
        "data.subset": "plain", "data.split": "train[:50%]", "data.val_split": "validation"}))
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "Alpaca records" in out and "10 rows -> 10 examples" in out, out[-3000:]
    assert "6 rows -> 6 examples" in out
    recorded = (tmp_path / "ds" / "config.yaml").read_text()
    assert f"source: {source}@{COMMIT}" in recorded and "format: pairs" in recorded
    from tests.conftest import cli_error
    line = cli_error(capsys, _args(tmp_path, "x", {"data.format": "pairs",
                                                   "data.source": "hf://datasets/tiny-org/none"}))
    assert "tiny-org/none" in line and "HF_HUB_OFFLINE=1" in line and "--repo-type dataset" in line


def test_the_guides_offline_command_runs_as_printed(tmp_path, pairs_llama):
    """docs/guides/fine-tuning.md's offline block, as printed (HF_HUB_OFFLINE=1 included), in a
    folder holding alpaca.jsonl, with a cache holding the tiny Llama under the id it names."""
    from tests.e2e._doc_blocks import doc_blocks
    from tests.e2e._tiny_model import make_pairs, write_jsonl
    mine = [b for b in doc_blocks() if b.marker == "run by"
            and b.reason.startswith("tests/e2e/test_hub_models.py")]
    assert len(mine) == 1 and len(mine[0].commands()) == 1, mine
    args = mine[0].commands()[0]
    env = {}
    while "=" in args[0]:  # VAR=value before the command
        key, value = args.pop(0).split("=", 1)
        env[key] = value
    assert env == {"HF_HUB_OFFLINE": "1"} and args[:2] == ["paratrain", "train"], args
    repo_id = next(a.split("=", 1)[1] for a in args if a.startswith("model.path="))
    cache = tmp_path / "hub"
    put_in_hub_cache(pairs_llama, cache, repo_id)
    write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": r["input"], "input": "",
                                             "output": r["output"]} for r in make_pairs(64)])
    r = run_cli(args[1:], cwd=tmp_path, env={**env, "HF_HUB_CACHE": str(cache)}, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "data.format=auto: Alpaca records" in r.stdout + r.stderr
    run_dir = tmp_path / "runs" / f"{repo_id.split('/')[1]}-pairs-lora"
    assert read_summary(run_dir)["hub_model"] == {"id": repo_id, "revision": COMMIT}


_CONFIG_CODE = '''from transformers import LlamaConfig


class TinyCodeConfig(LlamaConfig):
    model_type = "tiny-code"
'''
_MODEL_CODE = '''from torch import nn
from transformers import (LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel,
                          LlamaPreTrainedModel)

from .configuration_tiny import TinyCodeConfig


class TinyCodeForCausalLM(LlamaForCausalLM):
    config_class = TinyCodeConfig


class TinyCodeForSequenceClassification(LlamaForSequenceClassification):
    config_class = TinyCodeConfig

    def __init__(self, config):  # its own body (transformers' AutoModel does not know the config)
        LlamaPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = LlamaModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()
'''


def _model_with_its_own_code(tmp_path, pairs_llama):
    """A copy of the tiny Llama whose config.json names classes of its own (auto_map): a causal
    LM and a one-score sequence classifier."""
    import shutil
    model = tmp_path / "custom"
    shutil.copytree(pairs_llama, model)
    (model / "configuration_tiny.py").write_text(_CONFIG_CODE)
    (model / "modeling_tiny.py").write_text(_MODEL_CODE)
    info = json.loads((model / "config.json").read_text())
    info.update(model_type="tiny-code", architectures=["TinyCodeForCausalLM"], num_labels=1,
                auto_map={"AutoConfig": "configuration_tiny.TinyCodeConfig",
                          "AutoModelForCausalLM": "modeling_tiny.TinyCodeForCausalLM",
                          "AutoModelForSequenceClassification":
                              "modeling_tiny.TinyCodeForSequenceClassification"})
    (model / "config.json").write_text(json.dumps(info))
    return model


# every loader a task runs on its folders, given model.trust_remote_code=true
_LOADERS = '''
import sys, types
from paratrain.tasks.classify import load_classifier
from paratrain.tasks.preference.dpo import _FrozenProbe
from paratrain.tasks.preference.reward import RewardTask
from paratrain.tasks.probe import CausalProbe
from paratrain.tasks.rl.memory import FrozenProbe, GenerationCache
from paratrain.tasks.rl.reward_models import load_reward_model
folder = sys.argv[1]
ns = types.SimpleNamespace
cfg = ns(model=ns(path=folder, trust_remote_code=True, lora=ns(r=0)),
         rl=ns(reward_models=[folder], num_generations=2, max_new_tokens=4),
         trainer=ns(precision="fp32"))
RewardTask.check_model(cfg)
GenerationCache.of(cfg, 8)
built = [load_classifier(folder, ["a", "b"], 0, 8, True), load_reward_model(folder, True),
         CausalProbe(cfg, 2)().model, CausalProbe(cfg)(1).model,
         *FrozenProbe(cfg, True)().values(), *_FrozenProbe(cfg, folder)().values()]
print(" ".join(type(m).__name__ for m in built))
'''


def test_a_model_with_its_own_code_trains_only_when_trusted(capsys, tmp_path, pairs_llama):
    """A folder whose config.json names its own classes (auto_map): one line without
    model.trust_remote_code=true; with it, a real process loads that code and trains."""
    from tests.conftest import cli_error
    model = _model_with_its_own_code(tmp_path, pairs_llama)
    args = _args(tmp_path, "code", _pairs(tmp_path), **{"model.path": model})
    assert "model.trust_remote_code=true" in cli_error(capsys, args)
    r = run_cli(args + ["model.trust_remote_code=true"], cwd=tmp_path, timeout=300,
                env={"HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "modules").is_dir()  # transformers ran the folder's code


def test_every_tasks_loaders_run_a_trusted_folders_own_code(tmp_path, pairs_llama):
    """model.trust_remote_code reaches every loader a task runs on its folders (classifier,
    reward model check and load, the plan's probes whole and cut to one block, online RL's
    KV-cache shape, the frozen models' probes), not only the fine-tuning model's: each builds the
    folder's own classes."""
    import subprocess
    import sys

    from tests.conftest import cli_env
    model = _model_with_its_own_code(tmp_path, pairs_llama)
    r = subprocess.run([sys.executable, "-c", _LOADERS, str(model)], capture_output=True,
                       text=True, timeout=240,
                       env=cli_env({"HF_MODULES_CACHE": str(tmp_path / "modules")}))
    assert r.returncode == 0, r.stderr[-3000:]
    built = r.stdout.split()
    assert len(built) == 7 and all(name.startswith("TinyCode") for name in built), built
