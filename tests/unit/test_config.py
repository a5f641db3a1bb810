"""The config tree: YAML + overrides, and every rejection a user can hit before a launch."""

from pathlib import Path

import pytest

from paratrain.config import TrainConfig
from paratrain.errors import ConfigError
from paratrain.redact import redact_secrets


def test_defaults_are_the_default_job():
    cfg = TrainConfig.from_yaml()
    assert cfg.model.arch == "llama"
    assert cfg.data.source == "stdlib"
    assert cfg.trainer.devices == "auto"
    assert str(cfg.run_dir) == "runs/stdlib-llama"


def test_yaml_then_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("trainer:\n  max_steps: 50\n  batch_size: 4\nmodel:\n  preset: tiny\n")
    cfg = TrainConfig.from_yaml(p, ["trainer.max_steps=7", "optim.lr=0.01",
                                    "trainer.devices=[0,1]"])
    assert cfg.trainer.max_steps == 7  # the override wins over the file
    assert cfg.trainer.batch_size == 4  # the file wins over the default
    assert cfg.optim.lr == 0.01
    assert list(cfg.trainer.devices) == [0, 1]


def test_round_trip_through_dict():
    cfg = TrainConfig.from_yaml(None, ["run.name=x", "data.format=padded"])
    again = TrainConfig.from_dict(cfg.to_dict())
    assert again == cfg


@pytest.mark.parametrize("override, words", [
    (["trainer.max_stepz=3"], ["unknown config key", "trainer.max_stepz"]),
    (["nosuchsection.x=1"], ["unknown config key", "nosuchsection"]),
    (["trainer.max_steps=abc"], ["trainer.max_steps='abc' is not a whole number"]),
    (["data.shuffle=maybe"], ["data.shuffle='maybe' is not true or false"]),
    (["optim.lr=fast"], ["optim.lr='fast' is not a number"]),
    (["trainer.strategy=foo"], ["trainer.strategy='foo'", "ddp"]),
    (["trainer.precision=fp8"], ["trainer.precision"]),
    (["model.preset=tiny", "model.hidden_size=64", "model.num_heads=5"],
     ["model.num_heads", "model.hidden_size"]),
    (["model.preset=tiny", "model.num_heads=4", "model.num_kv_heads=3"],
     ["model.num_kv_heads", "model.num_heads"]),
    (["trainer.batch_size=0"], ["trainer.batch_size=0", "positive"]),
    (["distributed.node_rank=2", "distributed.nnodes=2", "distributed.master_port=29500"],
     ["distributed.node_rank=2"]),
    (["data.val_fraction=1.5"], ["data.val_fraction"]),
    (["run.name=a/b"], ["run.name"]),
    (["trainer.max_steps"], ["key=value"]),
])
def test_bad_values_are_one_clear_line(override, words):
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_yaml(None, override)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_missing_or_broken_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        TrainConfig.from_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        TrainConfig.from_yaml(bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("trainer:\n  learning_rate: 1\n")
    with pytest.raises(ConfigError, match="unknown config key 'trainer.learning_rate'"):
        TrainConfig.from_yaml(unknown)


def test_secrets_never_dumped():
    d = {"checkpoint": {"dir": "s3://AKIAXXX:verysecret@bucket/x",
                        "storage_options": {"secret_access_key": "hunter2", "region": "eu"}},
         "x": {"api_token": "abc"}}
    out = redact_secrets(d)
    text = repr(out)
    assert "hunter2" not in text and "verysecret" not in text and "abc" not in text
    assert out["checkpoint"]["storage_options"]["region"] == "eu"
    assert out["checkpoint"]["dir"].endswith("bucket/x")
    assert redact_secrets({"tokenizer": "bpe", "keep_last": 2}) == {"tokenizer": "bpe",
                                                                      "keep_last": 2}
    cfg = TrainConfig.from_yaml(None, ["checkpoint.dir=s3://user:pw@bucket/ck"])
    assert TrainConfig.from_yaml(None, []).to_yaml() == TrainConfig.from_yaml(None, []).to_yaml(
        redact=False)  # nothing in the defaults looks like a secret
    assert "pw@" not in cfg.to_yaml() and "bucket/ck" in cfg.to_yaml()


def test_classify_and_packing_of_examples(tmp_path):
    """data.format=classify needs a pretrained model; packing is refused, with why and what to
    use instead, for the formats that cannot pack exactly (pairs and chat pack: issue 38)."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    hf = ["model.arch=hf", f"model.path={tmp_path}"]
    cfg = TrainConfig.from_yaml(None, hf + ["data.format=classify", "data.label_field=y"])
    assert cfg.data.label_field == "y" and cfg.data.text_field == "text"
    with pytest.raises(ConfigError, match="data.format=classify fine-tunes a pretrained"):
        TrainConfig.from_yaml(None, ["data.format=classify"])
    with pytest.raises(ConfigError, match="needs data.text_field and data.label_field"):
        TrainConfig.from_yaml(None, hf + ["data.format=classify", "data.label_field=''"])
    for fmt in ("pairs", "chat"):
        assert TrainConfig.from_yaml(None, hf + [f"data.format={fmt}", "data.pack=true"]).data.pack
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_yaml(None, hf + ["data.format=classify", "data.pack=true"])
    msg = str(e.value)
    assert "\n" not in msg and "one output per row" in msg and "data.group_by_length=true" in msg
    with pytest.raises(ConfigError, match="already packs"):
        TrainConfig.from_yaml(None, ["data.pack=true"])


def test_a_broken_config_json_in_model_path_is_refused_before_anything_starts(tmp_path, capsys):
    """model.path's config.json is read strictly, once, by the checks: a file that is not a JSON
    object is one line naming it (exit 2), not a failure in rank 0 after the data was encoded."""
    from tests.conftest import cli_error
    (tmp_path / "config.json").write_text('{"model_type": "llama",')  # cut short
    line = cli_error(capsys, ["train", "model.arch=hf", f"model.path={tmp_path}",
                              "data.format=pairs", "trainer.devices=cpu:1"])
    assert f"{tmp_path / 'config.json'} cannot be read as a model's config.json" in line, line
    (tmp_path / "config.json").write_text('["llama"]')
    with pytest.raises(ConfigError, match="holds list, not the JSON object"):
        TrainConfig.from_yaml(None, ["model.arch=hf", f"model.path={tmp_path}"])


def test_a_near_miss_gets_the_key_that_works():
    """A key without its section, an HF TrainingArguments name, a space for '=': each answered
    with the spelling that works; configs/tiny.yaml runs without a warning of its own."""
    from paratrain.config.docs import suggest_key
    from paratrain.runtime.optim import schedule_warnings
    from paratrain.trainer import Trainer
    with pytest.raises(ConfigError, match=r"unknown config key 'max_steps'; did you mean "
                                          r"trainer.max_steps \("):
        TrainConfig.from_yaml(None, ["max_steps=10"])
    assert suggest_key(TrainConfig, "trainer.max_step") == "trainer.max_steps"
    with pytest.raises(ConfigError, match=r"'trainer.max_steps' is read as a config file, which "
                                          r"does not exist; to set trainer.max_steps, write "
                                          r"trainer.max_steps=VALUE"):
        TrainConfig.from_yaml("trainer.max_steps", [])
    with pytest.raises(ConfigError, match=r"unknown argument 'learning_rate'; did you mean lr=\?"):
        Trainer(learning_rate=0.1)
    tiny = TrainConfig.from_yaml(str(Path(__file__).parents[2] / "configs" / "tiny.yaml"), [])
    assert schedule_warnings(tiny.optim, tiny.trainer.max_steps) == []


def test_epochs_set_alone_win_over_the_max_steps_default(tmp_path):
    """trainer.epochs=1 used to do nothing: max_steps' default (200) won without a word."""
    assert TrainConfig.from_yaml(None, ["trainer.epochs=1"]).trainer.max_steps is None
    assert TrainConfig.from_yaml(None, ["trainer.epochs=2"]).with_overrides(
        ["optim.lr=0.01"]).trainer.max_steps is None  # and stays so through later layers
    both = TrainConfig.from_yaml(None, ["trainer.epochs=3", "trainer.max_steps=50"])
    assert (both.trainer.max_steps, both.trainer.epochs) == (50, 3)  # both set: max_steps caps
    p = tmp_path / "c.yaml"
    p.write_text("trainer:\n  max_steps: 50\n")
    assert TrainConfig.from_yaml(p, ["trainer.epochs=2"]).trainer.max_steps is None  # later
    assert TrainConfig.from_yaml(None).trainer.max_steps == 200
    cfg = TrainConfig.from_yaml(None).with_overrides(["trainer.epochs=2"])  # Trainer(epochs=2)
    assert cfg.trainer.max_steps is None


def test_eval_every_zero_switches_evaluation_off():
    assert TrainConfig.from_yaml(None, ["trainer.eval_every=0"]).trainer.eval_every == 0
    with pytest.raises(ConfigError, match=r"trainer.eval_every=-1 must be >= 0 \(0: no eval"):
        TrainConfig.from_yaml(None, ["trainer.eval_every=-1"])
    with pytest.raises(ConfigError, match="switches evaluation off, but trainer.keep_best"):
        TrainConfig.from_yaml(None, ["trainer.eval_every=0", "trainer.keep_best=true"])
