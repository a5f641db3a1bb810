"""Every config key is described once, under its field in config.py, and what a user reads about
keys (the reference page, `paratrain config show`, the unknown-key error) is made from that."""

from __future__ import annotations

import pytest
import yaml

from paratrain.config import docs as config_docs
from paratrain.cli import main
from paratrain.config import TrainConfig
from paratrain.errors import ConfigError


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "storage_options":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def test_every_key_has_a_description():
    keys = config_docs.all_keys(TrainConfig)
    assert {k.key for k in keys} == set(_flat(TrainConfig().to_dict())), "keys missed by the walk"
    missing = [k.key for k in keys if len(k.help) < 8]
    assert not missing, f"config keys without a description (add a docstring under the field " \
                        f"in src/paratrain/config.py): {missing}"


def test_groups_and_common_keys_name_real_keys():
    names = {k.key for k in config_docs.all_keys(TrainConfig)}
    assert config_docs.COMMON <= names, config_docs.COMMON - names
    for section, groups in config_docs.GROUPS.items():
        for _, members in groups:
            assert {f"{section}.{m}" for m in members} <= names
    trainer = dict(config_docs.grouped(TrainConfig, "trainer"))
    assert "trainer.tensor_parallel" in {k.key for k in trainer["Parallelism and memory"]}


def test_reference_page_shows_every_key_once():
    page = config_docs.reference_markdown(TrainConfig)
    for k in config_docs.all_keys(TrainConfig):
        assert page.count(f"| `{k.key}` |") == 1, k.key
    # the drift the generated page ends: every format, and hf is not only a causal LM
    row = next(line for line in page.splitlines() if line.startswith("| `data.format`"))
    assert all(f in row for f in ("packed", "padded", "pairs", "chat", "classify", "preference"))


def test_config_show_common_and_all(capsys):
    assert main(["config", "show", "trainer.max_steps=7"]) == 0
    common = capsys.readouterr().out
    shown = _flat(yaml.safe_load(common))
    assert set(shown) == config_docs.COMMON and shown["trainer.max_steps"] == 7
    assert "# Optimizer steps to train" in common
    assert main(["config", "show", "data.num_workers=1"]) == 0  # a key set is shown too
    assert _flat(yaml.safe_load(capsys.readouterr().out))["data.num_workers"] == 1
    assert main(["config", "show", "--all"]) == 0
    every = _flat(yaml.safe_load(capsys.readouterr().out))
    assert every == _flat(TrainConfig.from_yaml(None).to_dict())


def test_unknown_key_names_the_closest_keys_with_their_meaning():
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_yaml(None, ["trainer.max_stepz=3"])
    msg = str(e.value)
    assert "unknown config key 'trainer.max_stepz'" in msg
    assert "trainer.max_steps (Optimizer steps to train)" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match=r"did you mean optim\.lr \(The peak learning rate"):
        TrainConfig.from_yaml(None, ["trainer.lr=0.1"])
