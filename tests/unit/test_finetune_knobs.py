"""What a new fine-tuning user tripped on (issue 22), checked in-process on a tiny local Llama:
run names, data.max_length from the model, damaged weights and LoRA targets refused in one line
before anything is read or started, peft's options passed through, the lines a user reads
(LoRA summary, the stopped-run and unloadable-snapshot lines), label smoothing and NEFTune,
model.init=torch, generation prompts with the system prompt, load_model on a fine-tuned folder
and a config.json transformers 4.x reads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from paratrain.config import TrainConfig
from paratrain.errors import ConfigError

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(pairs_llama) -> Path:
    return pairs_llama  # the session's my-model/ (conftest): read only


def _pairs(tiny: Path, *extra: str) -> TrainConfig:
    return TrainConfig.from_yaml(None, ["model.arch=hf", f"model.path={tiny}", "data.format=pairs",
                                        "data.source=train.jsonl", *extra])


def test_fine_tuning_runs_are_named_after_the_model_and_task(tiny):
    assert TrainConfig.from_yaml(None, []).run.name == "stdlib-llama"  # pretraining: as before
    assert _pairs(tiny).run.name == "my-model-pairs"
    assert _pairs(tiny, "model.lora.r=8").run.name == "my-model-pairs-lora"
    assert _pairs(tiny, "data.format=classify").run_dir == Path("runs/my-model-classify")
    assert _pairs(tiny, "run.name=mine").run.name == "mine"
    # a derived name follows keys changed later; a chosen one stays
    assert _pairs(tiny).with_overrides(["data.format=chat"]).run.name == "my-model-chat"
    assert _pairs(tiny, "run.name=mine").with_overrides(["model.lora.r=4"]).run.name == "mine"
    from paratrain import Trainer
    t = Trainer(model=str(tiny), train_input=["a"], train_output=["b"])
    assert t.cfg.run.name == "my-model-pairs"


def test_max_length_defaults_to_the_models_positions_and_is_bounded_by_them(tiny):
    assert _pairs(tiny).max_length == 256  # max_position_embeddings of the tiny model
    assert _pairs(tiny, "data.max_length=64").max_length == 64
    with pytest.raises(ConfigError) as e:
        _pairs(tiny, "data.max_length=100000")
    msg = str(e.value)
    assert "data.max_length=100000" in msg and "max_position_embeddings=256" in msg
    assert "\n" not in msg


def test_damaged_weights_are_refused_before_launch_naming_the_file(tiny, tmp_path):
    cut = tmp_path / "cut"
    shutil.copytree(tiny, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # a copy cut short
    with pytest.raises(ConfigError, match=r"model.safetensors are damaged.*cut short") as e:
        _pairs(cut)
    assert str(weights) in str(e.value)
    weights.write_bytes(b"\x10\x00")  # not even a header
    with pytest.raises(ConfigError, match="too short for its header"):
        _pairs(cut)


def test_lora_targets_checked_before_the_data_and_options_passed_to_peft(tiny):
    peft = pytest.importorskip("peft")
    from paratrain.tasks.sft import PairsTask
    from paratrain.tasks.lora import apply_lora, describe_lora, lora_config
    cfg = _pairs(tiny, "model.lora.r=4", "model.lora.target_modules=q_proj")  # a bare name
    assert cfg.model.lora.target_modules == "q_proj"
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    PairsTask.check_fits(cfg, tok)  # no data.source exists: nothing is read
    mixed = _pairs(tiny, "model.lora.r=4", "model.lora.target_modules=[q_proj,value]")
    with pytest.raises(ConfigError) as e:
        PairsTask.check_fits(mixed, tok)
    assert "'value' matches no module" in str(e.value) and "v_proj" in str(e.value)
    full = _pairs(tiny, "model.lora.r=4", "model.lora.use_dora=true", "model.lora.use_rslora=true",
                  "model.lora.bias=lora_only", "model.lora.layers_to_transform=[1]",
                  "model.lora.init_lora_weights=gaussian",
                  "model.lora.target_modules=[q_proj,v_proj]")
    config = lora_config(full.model.lora, "CAUSAL_LM")
    assert isinstance(config, peft.LoraConfig)
    assert (config.use_dora, config.use_rslora, config.bias, config.layers_to_transform,
            config.init_lora_weights) == (True, True, "lora_only", [1], "gaussian")
    model = apply_lora(PairsTask.meta_model(full), full.model.lora)
    line = describe_lora(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert line.startswith("LoRA: adapters on 2 modules (q_proj x1, v_proj x1)"), line
    # q_proj (64 -> 64) and v_proj (64 -> 32) at r=4, plus DoRA's magnitudes: 512 + 384 + 96
    assert trainable == 992 and "; 992 of " in line, (line, trainable)


def test_lora_targets_are_checked_before_reused_records_are_said(tiny, tmp_path, monkeypatch):
    """The encoded-records cache is keyed by the data and tokenizer, not the model's modules: a
    typo in the targets is refused before any line about the data, cached or not."""
    pytest.importorskip("peft")
    from paratrain.dist import DistEnv
    from paratrain.tasks.sft import PairsTask
    from tests.e2e._tiny_model import make_pairs, write_jsonl
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "train.jsonl", make_pairs(40))
    cache = [f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0"]
    lines: list[str] = []
    PairsTask.prepare(_pairs(tiny, *cache, "model.lora.r=4"), DistEnv.single("cpu"), None,
                      lines.append)
    assert any("rows ->" in line for line in lines)  # encoded and cached
    lines.clear()
    with pytest.raises(ConfigError, match="'value' matches no module"):
        PairsTask.prepare(_pairs(tiny, *cache, "model.lora.r=4",
                                 "model.lora.target_modules=[q_proj,value]"),
                          DistEnv.single("cpu"), None, lines.append)
    assert not any("rows ->" in line or "reusing" in line for line in lines), lines


def test_trainer_keyword_of_another_section_points_to_overrides(tiny):
    from paratrain import Trainer
    with pytest.raises(ConfigError, match=r'pass overrides=\["model.lora.r=8"\]'):
        Trainer(model=str(tiny), train_input=["a"], train_output=["b"], lora=8)
    with pytest.raises(ConfigError, match=r'overrides=\["data.pack=true"\]'):
        Trainer(model=str(tiny), train_input=["a"], train_output=["b"], pack=True)
    t = Trainer(model=str(tiny), train_input=["a"], train_output=["b"], shuffle=False,
                drop_last=False, optimizer="sgd")  # keywords of their own
    assert (t.cfg.data.shuffle, t.cfg.data.drop_last, t.cfg.optim.name) == (False, False, "sgd")


def test_the_stopped_line_names_the_snapshots_step_once(tmp_path):
    from paratrain.checkpoint.rundir import stopped_message
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(REPO / "tests/fixtures/snapshot_v1/step-0000004",
                    run / "checkpoints" / "step-0000004")
    (run / "metrics.jsonl").write_text('{"step": 3, "loss": 5.0}\n')  # logged one step earlier
    cfg = TrainConfig.from_yaml(None, [f"run.dir={run}", "trainer.max_steps=10"])
    line = stopped_message(cfg)
    assert line.startswith("after step 4 of 10; last committed snapshot: ") and \
        "step-0000004; run the same command to resume from it" in line, line
    assert "step 3" not in line


def test_an_unloadable_snapshot_names_the_setting_that_changed(tmp_path):
    from paratrain.checkpoint.rundir import unloadable_message
    marker = json.loads((REPO / "tests/fixtures/snapshot_v1/step-0000004/committed.json"
                         ).read_text())
    cfg = TrainConfig.from_yaml(None, [])
    marker = {**marker, "config": {**cfg.to_dict(),
                                   "model": {**cfg.to_dict()["model"], "num_layers": 3}}}
    line = unloadable_message([("runs/x/checkpoints/step-0000052", marker)], cfg)
    assert "model.num_layers=3 in the snapshot, None now" in line
    assert "another run.name" in line and "snapshot's settings" in line and "\n" not in line
    same = {**marker, "config": cfg.to_dict()}
    assert "remove the damaged ones" in unloadable_message([("u", same)], cfg)


def test_label_smoothing_is_torchs_and_applies_while_training_only(tiny):
    import contextlib

    from paratrain.tasks.base import TokenLoss
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny)
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4]]), "targets": torch.tensor([[2, 3, -100, 5]])}

    class Task(TokenLoss):
        cfg = _pairs(tiny, "trainer.label_smoothing=0.1")
    task, cpu, amp = Task(), torch.device("cpu"), contextlib.nullcontext()
    model.train()
    s, n = task.loss(model, batch, cpu, amp)
    with torch.no_grad():
        logp = model(batch["input_ids"]).logits.float().log_softmax(-1)[0]  # (T, V)
    keep = batch["targets"][0] != -100
    nll = -logp[keep].gather(1, batch["targets"][0][keep][:, None]).squeeze(1)
    want = (0.9 * nll + 0.1 * -logp[keep].mean(-1)).sum()
    assert n == 3 and float(s.detach()) == pytest.approx(float(want), rel=1e-5)
    model.eval()
    plain, _ = task.loss(model, batch, cpu, amp)
    assert float(plain) == pytest.approx(float(nll.sum()), rel=1e-5)


def test_neftune_noise_is_bounded_and_off_in_eval():
    from functools import partial

    from paratrain.tasks.finetuning import neftune_noise
    emb = torch.nn.Embedding(10, 8)
    emb.register_forward_hook(partial(neftune_noise, 5.0))
    ids = torch.arange(6)[None]  # (1, 6)
    clean = emb.weight[ids].detach()
    noisy = emb(ids).detach() - clean
    bound = 5.0 / (6 * 8) ** 0.5
    assert noisy.abs().max() <= bound and noisy.abs().max() > bound / 4
    emb.eval()
    assert torch.equal(emb(ids).detach(), clean)


def test_model_init_torch_keeps_each_layers_own_default():
    from paratrain.config import ModelConfig
    from paratrain.models import build_model, resolve_model_config, torch_default_init
    args = resolve_model_config(ModelConfig(arch="gpt", preset="tiny"), vocab_size=300,
                                seq_length=16)
    torch.manual_seed(0)
    gpt2 = build_model(args)
    model = torch_default_init(build_model(args))
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear)
                  and m is not model.lm_head)
    bound = 1 / linear.in_features ** 0.5  # kaiming_uniform(a=sqrt(5)): U(-1/sqrt(fan_in), ..)
    assert linear.weight.abs().max() <= bound and linear.weight.std() > 0.03
    assert model.lm_head.weight is model.wte.weight  # tied, and the embedding's N(0, 1) won
    assert 0.9 < float(model.wte.weight.std()) < 1.1
    assert float(gpt2.wte.weight.std()) == pytest.approx(0.02, rel=0.1)


def test_generate_renders_the_training_system_prompt(tiny, tmp_path):
    from paratrain.models.hf import prompt_ids
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    text = tok.decode(prompt_ids(tok, "def f():", "Be terse.", template=True))
    assert text == "<system>Be terse.\n<user>def f():\n<assistant>"
    assert tok.decode(prompt_ids(tok, "def f():", "Be terse.", template=False)).endswith(
        "def f():")


def test_load_model_on_a_fine_tuned_folder_and_its_portable_config(tiny, tmp_path):
    """What transformers 4.4x needs (docs/transformers-compat.md has the check with 4.49): the
    config's rope_theta at the top level, torch_dtype, a tokenizer class name it knows."""
    from paratrain import load_model
    from paratrain.models.hf import make_portable
    model, tok = load_model(tiny)
    assert isinstance(model, transformers.LlamaForCausalLM) and not model.training
    assert tok("def f():")["input_ids"]
    out = tmp_path / "out"
    shutil.copytree(tiny, out)
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "TokenizersBackend"  # what 5.x writes, and 4.x cannot load
    make_portable(out)
    cfg = json.loads((out / "config.json").read_text())
    # transformers 5 keeps rope_theta in rope_parameters only; 4.x reads the top-level key
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 10000.0
    assert cfg["torch_dtype"] == cfg["dtype"] == "float32"
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "PreTrainedTokenizerFast"
    assert (out / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()
    again, tok2 = load_model(out)  # 5.x still reads it, to the same weights and ids
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 again.state_dict().values()))
    assert tok2("def f():")["input_ids"] == tok("def f():")["input_ids"]


def test_trainer_with_a_model_folder_and_a_data_file_reads_the_file(tiny, tmp_path):
    """Trainer(model=DIR, train_data="x.jsonl"): the records of data.source, not a user model."""
    from paratrain import Trainer
    t = Trainer(model=str(tiny), train_data="reviews.jsonl", val_data="reviews-val.jsonl",
                task="classify")
    assert t.given is None
    assert (t.cfg.data.source, t.cfg.data.val_source, t.cfg.data.format) == \
        ("reviews.jsonl", "reviews-val.jsonl", "classify")


def test_a_tokenizer_larger_than_the_embeddings_is_refused_before_launch(tiny, tmp_path):
    """data.tokenizer=DIR with more ids than the model's vocab_size: one line from the task's
    preparation (the launching process), not a failure in every worker's model build."""
    from paratrain.tasks.sft import PairsTask
    from tests.conftest import make_hf_tokenizer
    from tests.e2e._tiny_model import make_pairs
    big = make_hf_tokenizer(tmp_path / "big", [r["input"] + " " + r["output"]
                                               for r in make_pairs(200)], vocab_size=600)
    cfg = _pairs(tiny, f"data.tokenizer={big}")
    tok = transformers.AutoTokenizer.from_pretrained(big)
    assert len(tok) > 402
    with pytest.raises(ConfigError, match=rf"data.tokenizer={big} has {len(tok)} tokens but "
                                          r"model.path's embeddings hold 402"):
        PairsTask.check_fits(cfg, tok)
