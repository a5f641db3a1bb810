"""Preference data and the DPO / reward / seq2seq choices, in-process: how pairs are encoded and
batched (responses scored, prompts and pads not), what truncation and bad records do (one line
naming the row, the field or the key), the DPO losses at known points, and which task a config
trains (or the one line that says why none)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from paratrain.config import TrainConfig
from paratrain.data.dataset import IGNORE_INDEX
from paratrain.tasks.preference.pairs import (
    PairCollate,
    preference_dataset,
    PreferenceFields,
    encode_dpo,
    encode_reward,
)
from paratrain.errors import ConfigError, DataError
from paratrain.config import registry
from tests.conftest import make_hf_tokenizer

pytest.importorskip("transformers")
ROWS = [{"prompt": "the red cat", "chosen": " sees a dog", "rejected": " eats"},
        {"prompt": "a small bird", "chosen": " runs", "rejected": " sits near the tree"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from paratrain.data.hf_tokenizer import load_tokenizer
    folder = make_hf_tokenizer(tmp_path_factory.mktemp("tok"), [
        "the red cat sees a dog", "a small bird runs near the tree", "eats sits"] * 20,
        vocab_size=300)
    return load_tokenizer(folder)[0]


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_dpo_pairs_score_the_responses_only(tok):
    pairs, stats = encode_dpo(ROWS, tok, PreferenceFields(), max_length=64)
    assert stats.kept == 2 and stats.truncated == stats.dropped == 0
    batch = PairCollate(tok.pad_token_id, shift=True)([preference_dataset(pairs)[i]
                                                       for i in range(2)])
    assert batch["input_ids"].shape[0] == 4  # chosen rows, then rejected rows
    eos = tok.eos_token_id
    for b, (row, side) in enumerate([(r, s) for s in ("chosen", "rejected") for r in ROWS]):
        counted = batch["targets"][b][batch["targets"][b] != IGNORE_INDEX].tolist()
        assert counted == _ids(tok, row[side]) + [eos], (b, side)
        n = int(batch["attention_mask"][b].sum())
        prompt = _ids(tok, row["prompt"])
        assert batch["input_ids"][b, :len(prompt)].tolist() == prompt
        assert n == len(prompt) + len(counted) - 1  # inputs: every token but the last


def test_long_pairs_lose_their_prompt_start_then_are_dropped(tok):
    rows = [{"prompt": "the red cat " * 10, "chosen": " runs", "rejected": " sits"},
            {"prompt": "a", "chosen": " sees a dog " * 10, "rejected": " eats"}]
    pairs, stats = encode_dpo(rows, tok, PreferenceFields(), max_length=12)
    assert (stats.kept, stats.truncated, stats.dropped) == (1, 1, 1)
    assert len(pairs[0]["chosen"]) <= 12 and pairs[0]["prompt_len"] >= 1
    assert "1 dropped as longer than data.max_length=12" in stats.summary()
    with pytest.raises(DataError, match=r"data.max_length=2 cuts away all 2 pairs of data"):
        encode_dpo(rows, tok, PreferenceFields(), max_length=2)


def test_empty_prompts_are_counted_and_all_empty_is_refused_naming_the_field(tok):
    """All prompts empty is almost always data.prompt_field naming the wrong field: refused for
    DPO in one line before training; some empty: counted in the summary line."""
    blank = [{"question": "the red cat", "prompt": "", "chosen": " runs", "rejected": " sits"},
             {"question": "a bird", "prompt": "  ", "chosen": " eats", "rejected": " runs"}]
    with pytest.raises(DataError, match=r"every prompt of train.jsonl is empty \(field 'prompt'"
                                        r"\).*set data.prompt_field to the field"):
        encode_dpo(blank, tok, PreferenceFields(), max_length=64, source_name="train.jsonl")
    _, stats = encode_dpo(blank + ROWS, tok, PreferenceFields(), max_length=64)
    assert stats.empty_prompts == 2 and "2 with an empty prompt" in stats.summary()
    _, stats = encode_reward(blank, tok, PreferenceFields(), max_length=64)  # texts hold it all
    assert stats.kept == 2 and "2 with an empty prompt" in stats.summary()


def test_bad_records_are_one_line_naming_what_to_fix(tok):
    same = [{"prompt": "a", "chosen": " runs", "rejected": " runs"}] * 3
    with pytest.raises(DataError, match="every pair of train.jsonl has chosen = rejected"):
        encode_dpo(same, tok, PreferenceFields(), max_length=64, source_name="train.jsonl")
    pairs, stats = encode_dpo(same + ROWS, tok, PreferenceFields(), max_length=64)
    assert stats.identical == 3 and stats.kept == 2  # skipped, and said so
    missing = ROWS + [{"prompt": "a", "chosen": " b"}]
    with pytest.raises(DataError, match=r"row 3 has no field 'rejected'.*data.rejected_field"):
        encode_dpo(missing, tok, PreferenceFields(), max_length=64)
    with pytest.raises(DataError, match="chat messages need a chat template"):
        encode_dpo([{"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}],
                     "rejected": "c"}], tok, PreferenceFields(chat_template="none"),
                   max_length=64)


def test_chat_prompts_are_rendered_with_the_template(tok, tmp_path):
    import copy
    tok = copy.deepcopy(tok)  # the template given is set on the tokenizer
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
                        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    rows = [{"prompt": [{"role": "user", "content": "the red cat"}],
             "chosen": [{"role": "assistant", "content": "sees a dog"}],
             "rejected": {"role": "assistant", "content": "eats"}}]
    pairs, _ = encode_dpo(rows, tok, PreferenceFields(chat_template=str(template)),
                          max_length=64)
    prompt = _ids(tok, "<user>the red cat\n<assistant>")
    assert pairs[0]["chosen"][:pairs[0]["prompt_len"]] == prompt
    assert pairs[0]["chosen"] == prompt + _ids(tok, "sees a dog\n") + [tok.eos_token_id]


def test_dpo_counts_what_sft_counts_of_a_templated_answer(tok, tmp_path):
    """A ChatML-like template writes EOS then a newline after each turn: SFT counts the answer
    through the EOS and not the newline after it; DPO's responses are the same tokens."""
    import copy

    from paratrain.data.finetune import encode_chat
    tok = copy.deepcopy(tok)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>\n"
                        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    user = {"role": "user", "content": "the red cat"}
    rows = [{"prompt": [user], "chosen": {"role": "assistant", "content": "sees a dog"},
             "rejected": {"role": "assistant", "content": "eats"}}]
    pairs, _ = encode_dpo(rows, tok, PreferenceFields(chat_template=str(template)),
                          max_length=64)
    for side in ("chosen", "rejected"):
        sft, _ = encode_chat([{"messages": [user, rows[0][side]]}], tok,
                             chat_template=str(template), max_length=64)
        counted = [t for t in sft[0]["targets"] if t != IGNORE_INDEX]
        assert pairs[0][side][pairs[0]["prompt_len"]:] == counted, side
        assert counted[-1] == tok.eos_token_id


def test_reward_texts_are_what_the_tokenizer_gives_transformers(tok):
    pairs, stats = encode_reward(ROWS, tok, PreferenceFields(), max_length=64)
    for pair, row in zip(pairs, ROWS):
        assert pair["chosen"] == tok(row["prompt"] + row["chosen"])["input_ids"]
        assert pair["rejected"] == tok(row["prompt"] + row["rejected"])["input_ids"]
    batch = PairCollate(tok.pad_token_id, shift=False)([preference_dataset(pairs)[i]
                                                        for i in range(2)])
    assert batch["margin"].tolist() == [0.0, 0.0] and "targets" not in batch
    longest = max(len(p[k]) for p in pairs for k in ("chosen", "rejected"))
    _, stats = encode_reward(ROWS, tok, PreferenceFields(), max_length=longest - 1)
    assert (stats.kept, stats.dropped) == (1, 1)


def test_dpo_losses_at_known_points():
    from paratrain.tasks.preference.dpo import DPO_LOSSES
    z = torch.tensor([0.0, 2.0])
    assert DPO_LOSSES["sigmoid"](z, 0.1, 0.0)[0].item() == pytest.approx(math.log(2), abs=1e-7)
    expected = -math.log(1 / (1 + math.exp(-0.2)))
    assert DPO_LOSSES["sigmoid"](z, 0.1, 0.0)[1].item() == pytest.approx(expected, rel=1e-6)
    smoothed = 0.8 * expected + 0.2 * -math.log(1 / (1 + math.exp(0.2)))
    assert DPO_LOSSES["sigmoid"](z, 0.1, 0.2)[1].item() == pytest.approx(smoothed, rel=1e-6)
    assert DPO_LOSSES["ipo"](z, 0.1, 0.0).tolist() == pytest.approx([25.0, 9.0])
    assert DPO_LOSSES["ipo_sum"](z, 0.1, 0.0).tolist() == pytest.approx([25.0, 9.0])
    assert DPO_LOSSES["hinge"](z, 0.1, 0.0).tolist() == pytest.approx([1.0, 0.8])


def _model_folder(tmp_path: Path, name: str, **config) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _cfg(model: Path, *more: str) -> TrainConfig:
    return TrainConfig.from_yaml(None, ["model.arch=hf", f"model.path={model}",
                                        "data.format=preference", *more])


def test_which_task_a_config_trains(tmp_path):
    llama = _model_folder(tmp_path, "llama", model_type="llama", vocab_size=300)
    t5 = _model_folder(tmp_path, "t5", model_type="t5", is_encoder_decoder=True)
    assert registry.for_config(_cfg(llama)).task.endswith("DPOTask")
    assert registry.for_config(_cfg(llama, "trainer.objective=reward")).task.endswith(
        "RewardTask")
    pairs = ["data.format=pairs"]
    assert registry.for_config(_cfg(llama, *pairs)).task.endswith("PairsTask")
    assert registry.for_config(_cfg(t5, *pairs)).task.endswith("Seq2SeqTask")
    with pytest.raises(ConfigError, match="trainer.objective='reward' does not apply to "
                                          "data.format=pairs; it trains: sft, seq2seq"):
        _cfg(llama, *pairs, "trainer.objective=reward")
    with pytest.raises(ConfigError, match="trainer.objective=seq2seq trains an encoder-decoder "
                                          "model .* is a decoder-only model"):
        _cfg(llama, *pairs, "trainer.objective=seq2seq")
    with pytest.raises(ConfigError, match="is an encoder-decoder model .t5.; data.format="
                                          "preference with trainer.objective=auto trains "
                                          "decoder-only models; .* data.format=pairs"):
        _cfg(t5)
    with pytest.raises(ConfigError, match="data.format=chat"):
        _cfg(t5, "data.format=chat")


@pytest.mark.parametrize("override,message", [
    ("dpo.beta=0", "dpo.beta=0.0 must be positive"),
    ("dpo.beta=-1", "dpo.beta=-1.0 must be positive"),
    ("dpo.loss=kto", "dpo.loss='kto' is not one of: sigmoid, ipo, ipo_sum, hinge"),
    ("dpo.label_smoothing=0.5", r"dpo.label_smoothing=0.5 must be in \[0, 0.5\)"),
    ("dpo.loss=ipo dpo.label_smoothing=0.1", "dpo.label_smoothing applies to dpo.loss=sigmoid"),
    ("dpo.reference=/no/such", "dpo.reference='/no/such' is not a model folder"),
    ("data.chosen_field=prompt", "needs three different record fields"),
])
def test_bad_dpo_keys_are_one_line(tmp_path, override, message):
    llama = _model_folder(tmp_path, "llama", model_type="llama", vocab_size=300)
    with pytest.raises(ConfigError, match=message):
        _cfg(llama, *override.split())


def test_a_reference_must_read_the_same_token_ids(tmp_path):
    mine = make_hf_tokenizer(tmp_path / "policy", ["the red cat sees a dog"] * 5, vocab_size=280)
    (mine / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300}))
    other = make_hf_tokenizer(tmp_path / "other", ["completely other words here"] * 5,
                              vocab_size=280)
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300}))
    with pytest.raises(ConfigError, match="has another tokenizer than the policy's"):
        _cfg(mine, f"dpo.reference={other}")
    bigger = _model_folder(tmp_path, "bigger", model_type="llama", vocab_size=512)
    with pytest.raises(ConfigError, match="has vocab_size=512, model.path 300"):
        _cfg(mine, f"dpo.reference={bigger}")
    same = _model_folder(tmp_path, "same", model_type="llama", vocab_size=300)
    (same / "tokenizer.json").write_bytes((mine / "tokenizer.json").read_bytes())
    assert _cfg(mine, f"dpo.reference={same}").dpo.reference == str(same)


def test_the_api_lists_must_line_up(tmp_path):
    from paratrain import Trainer
    llama = _model_folder(tmp_path, "llama", model_type="llama", vocab_size=300)
    with pytest.raises(ConfigError, match="train_prompts has 2 items, train_chosen has 2 items, "
                                          "train_rejected has 1 items"):
        Trainer(model=str(llama), train_prompts=["a", "b"], train_chosen=["c", "d"],
                train_rejected=["e"])
    t = Trainer(model=str(llama), train_prompts=["a"], train_chosen=["c"], train_rejected=["e"],
                objective="reward")
    assert (t.cfg.data.format, t.cfg.trainer.objective) == ("preference", "reward")
    assert t.given.train == [{"prompt": "a", "chosen": "c", "rejected": "e"}]


def test_reward_figures_have_tensorboard_tags_of_their_own():
    from paratrain.records.loggers import scalars
    record = {"step": 3, "loss": 0.6, "rewards/chosen": 0.5, "accuracy": 0.75,
              "val_rewards/margin": 1.0, "val_accuracy": 0.9, "val_samples": 41}
    assert scalars(record) == {"train/loss": 0.6, "train/rewards/chosen": 0.5,
                               "train/accuracy": 0.75, "val/rewards/margin": 1.0,
                               "val/accuracy": 0.9, "val/samples": 41.0}


def test_a_reward_model_needs_a_model_that_can_get_a_score_head(tmp_path):
    from paratrain.dist import DistEnv
    from paratrain.runtime.rank import prepare_task
    t5 = make_hf_tokenizer(tmp_path / "t5", ["the red cat"] * 5, vocab_size=280, pad=True)
    (t5 / "config.json").write_text(json.dumps({
        "model_type": "t5", "is_encoder_decoder": True, "vocab_size": 300, "d_model": 8,
        "d_kv": 4, "d_ff": 8, "num_layers": 1, "num_heads": 2}))
    cfg = _cfg(t5, "trainer.objective=reward", f"data.source={tmp_path / 'none.jsonl'}")
    with pytest.raises(ConfigError, match=r"\(t5\) is an encoder-decoder model; paratrain "
                                          r"trains reward models on decoder-only or encoder-only"):
        prepare_task(cfg, DistEnv.single("cpu"), quiet=True)


def test_run_names_say_an_objective_that_is_not_the_formats_default(tmp_path):
    llama = _model_folder(tmp_path, "my-model", model_type="llama", vocab_size=300)
    t5 = _model_folder(tmp_path, "t5-small", model_type="t5", is_encoder_decoder=True)
    assert _cfg(llama).run.name == "my-model-preference"
    assert _cfg(llama, "trainer.objective=dpo").run.name == "my-model-preference"
    assert _cfg(llama, "trainer.objective=reward").run.name == "my-model-preference-reward"
    assert _cfg(t5, "data.format=pairs", "model.lora.r=4").run.name == "t5-small-pairs-seq2seq-lora"
