"""Hub model ids resolved through huggingface_hub's cache (config/hub.py), offline: the config
holds the snapshot folder and the commit, a missing id is one line naming the id, the cache and
the offline switch, a model with its own code is refused unless allowed, and a token never
reaches a config dump."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratrain.config import TrainConfig
from paratrain.config.hub import hub_origin, looks_like_hub_id, resolve_folder
from paratrain.errors import ConfigError
from tests._hub import COMMIT, put_in_hub_cache

pytest.importorskip("huggingface_hub")


@pytest.fixture
def offline_cache(tmp_path, monkeypatch, pairs_llama) -> Path:
    """A hub cache holding pairs_llama as `tiny-org/tiny-llama`, read offline."""
    from huggingface_hub import constants
    cache = tmp_path / "hub"
    put_in_hub_cache(pairs_llama, cache, "tiny-org/tiny-llama")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _pairs_cfg(tmp_path: Path, path: str, *extra: str) -> TrainConfig:
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"input": "a", "output": "b"}) + "\n")
    return TrainConfig.from_yaml(None, ["model.arch=hf", f"model.path={path}",
                                        "data.format=pairs", f"data.source={data}", *extra])


def test_id_resolves_to_the_cached_snapshot_and_records_the_commit(tmp_path, offline_cache):
    cfg = _pairs_cfg(tmp_path, "tiny-org/tiny-llama")
    assert Path(cfg.model.path) == offline_cache / "models--tiny-org--tiny-llama" / \
        "snapshots" / COMMIT
    assert cfg.model.revision == COMMIT
    assert cfg.run.name == "tiny-llama-pairs"  # named after the id, not the commit
    assert hub_origin(cfg.model.path).repo_id == "tiny-org/tiny-llama"
    # config.yaml read again (with_overrides, generate, export): the same folder, no look-up
    again = TrainConfig.from_yaml(None, [f"{k}={v}" for k, v in [
        ("model.arch", "hf"), ("model.path", cfg.model.path), ("data.format", "pairs"),
        ("data.source", cfg.data.source)]])
    assert again.model.path == cfg.model.path and again.run.name == cfg.run.name


def test_an_explicit_revision_and_a_snapshot_path_from_elsewhere(tmp_path, offline_cache):
    assert _pairs_cfg(tmp_path, "tiny-org/tiny-llama", f"model.revision={COMMIT}"
                      ).model.revision == COMMIT
    moved = f"/elsewhere/hub/models--tiny-org--tiny-llama/snapshots/{COMMIT}"
    assert resolve_folder(moved) == str(offline_cache / "models--tiny-org--tiny-llama" /
                                        "snapshots" / COMMIT)


def test_a_missing_id_is_one_line_naming_the_cache_and_the_switch(tmp_path, offline_cache):
    with pytest.raises(ConfigError) as e:
        _pairs_cfg(tmp_path, "tiny-org/not-there")
    line = str(e.value)
    assert "\n" not in line
    assert "'tiny-org/not-there'" in line and str(offline_cache) in line
    assert "HF_HUB_OFFLINE=1" in line
    with pytest.raises(ConfigError, match=r"tiny-org/tiny-llama@v2"):
        _pairs_cfg(tmp_path, "tiny-org/tiny-llama", "model.revision=v2")


def test_local_paths_are_never_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert looks_like_hub_id("org/name") and not looks_like_hub_id("./org/name")
    assert not looks_like_hub_id("/abs/name") and not looks_like_hub_id("~/x")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not looks_like_hub_id("org/name")  # a local folder of that name wins


def test_remote_code_is_refused_unless_allowed(tmp_path, pairs_llama):
    import shutil
    model = tmp_path / "custom"
    shutil.copytree(pairs_llama, model)
    info = json.loads((model / "config.json").read_text())
    info["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (model / "config.json").write_text(json.dumps(info))
    with pytest.raises(ConfigError, match="model.trust_remote_code=true"):
        _pairs_cfg(tmp_path, str(model))
    assert _pairs_cfg(tmp_path, str(model), "model.trust_remote_code=true").model.trust_remote_code


def test_every_task_loads_with_the_model_sections_remote_code_and_quantize():
    """HFArgs.of(cfg.model, ...): model.trust_remote_code (and model.quantize, for the model a
    task trains) reach every task that loads a Hugging Face model; a frozen reference, or the
    full-precision base of a quantized run's merge, is loaded unquantized. No task builds its
    HFArgs another way (a new task's would miss them)."""
    import types
    from pathlib import Path

    import paratrain.tasks
    from paratrain.models.hf import HFArgs
    model = types.SimpleNamespace(path="my-model", quantize="nf4", trust_remote_code=True)
    trained = HFArgs.of(model, 320, auto_class="AutoModelForSeq2SeqLM")
    assert (trained.path, trained.vocab_size, trained.auto_class, trained.quantize,
            trained.trust_remote_code) == ("my-model", 320, "AutoModelForSeq2SeqLM", "nf4", True)
    reference = HFArgs.of(model, 320, path="ref", quantized=False)
    assert (reference.path, reference.quantize, reference.trust_remote_code) == \
        ("ref", None, True)
    tasks = Path(paratrain.tasks.__file__).parent
    direct = [str(f.relative_to(tasks)) for f in tasks.rglob("*.py") if "HFArgs(" in f.read_text()]
    assert direct == [], direct
    # a folder's config likewise, through models.hf.hf_config (model.trust_remote_code)
    raw = [str(f.relative_to(tasks)) for f in tasks.rglob("*.py")
           if "AutoConfig.from_pretrained" in f.read_text()]
    assert raw == [], raw


def test_a_token_never_reaches_a_config_dump(tmp_path, offline_cache, monkeypatch):
    fake = "hf_FAKEtoken0123456789abcdefghijklmnop"
    monkeypatch.setenv("HF_TOKEN", fake)
    cfg = _pairs_cfg(tmp_path, "tiny-org/tiny-llama")
    assert fake not in cfg.to_yaml(record_task=True) and fake not in cfg.to_yaml(redact=False)
