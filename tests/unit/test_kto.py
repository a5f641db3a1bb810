"""KTO's data and keys, in-process: pairs become a desirable and an undesirable example,
unpaired records keep their label, each example's mismatched sequence is its prompt with the
previous example's completion, and bad keys or labels are one line."""

from __future__ import annotations

import json

import pytest

from paratrain.tasks.preference.kto_records import KTOCollate, encode_kto
from paratrain.tasks.preference.pairs import PreferenceFields, preference_dataset
from paratrain.errors import ConfigError, DataError
from tests.unit.test_preference import ROWS, _cfg, _ids, _model_folder, tok  # noqa: F401

pytest.importorskip("transformers")


def test_pairs_give_a_desirable_and_an_undesirable_example(tok):  # noqa: F811
    examples, stats = encode_kto(ROWS, tok, PreferenceFields(), max_length=64)
    assert [ex["label"] for ex in examples] == [1, 1, 0, 0] and stats.kept == 2
    for ex, (row, side) in zip(examples, [(r, s) for s in ("chosen", "rejected") for r in ROWS]):
        start = ex["prompt_len"]
        assert ex["completion"][start:] == _ids(tok, row[side]) + [tok.eos_token_id]
    for i, ex in enumerate(examples):  # own prompt, the previous example's completion
        before = examples[i - 1]
        assert ex["mismatched"] == (ex["completion"][:ex["prompt_len"]] +
                                    before["completion"][before["prompt_len"]:])
    ds = preference_dataset(examples)
    batch = KTOCollate(tok.pad_token_id)([ds[i] for i in (0, 3)])
    assert batch["input_ids"].shape[0] == 4 and batch["label"].tolist() == [True, False]


def test_unpaired_records_keep_their_labels_and_bad_labels_are_one_line(tok):  # noqa: F811
    rows = [{"prompt": "the red cat", "completion": " sees a dog", "label": True},
            {"prompt": "a small bird", "completion": " eats", "label": 0}]
    examples, _ = encode_kto(rows, tok, PreferenceFields(), max_length=64)
    assert [ex["label"] for ex in examples] == [1, 0]
    assert examples[1]["completion"][examples[1]["prompt_len"]:] == \
        _ids(tok, " eats") + [tok.eos_token_id]
    with pytest.raises(DataError, match=r"row 2 has label 'yes'; an unpaired KTO record's "
                                        r"'label' is true"):
        encode_kto([rows[0], {**rows[1], "label": "yes"}], tok, PreferenceFields(),
                   max_length=64, source_name="train.jsonl")


@pytest.mark.parametrize("override,message", [
    ("kto.beta=0", "kto.beta=0.0 must be positive"),
    ("kto.undesirable_weight=0", "kto.undesirable_weight=0.0 must be positive"),
    ("dpo.precompute_reference=true", "dpo.precompute_reference applies to trainer.objective"
                                      "=dpo"),
])
def test_bad_kto_keys_are_one_line(tmp_path, override, message):
    llama = _model_folder(tmp_path, "llama", model_type="llama", vocab_size=300)
    with pytest.raises(ConfigError, match=message):
        _cfg(llama, "trainer.objective=kto", override)
    assert _cfg(llama, "trainer.objective=kto").task_spec.task.endswith("KTOTask")
    assert json.dumps(_cfg(llama, "trainer.objective=kto").kto.beta) == "0.1"


def test_every_example_of_one_label_is_warned(tok):  # noqa: F811
    rows = [{"prompt": "the red cat", "completion": " sees a dog", "label": True},
            {"prompt": "a small bird", "completion": " eats", "label": 1}]
    _, stats = encode_kto(rows, tok, PreferenceFields(), max_length=64)
    assert "; warning: every example is desirable: KTO then only raises" in stats.summary()
    _, stats = encode_kto([rows[0], {**rows[1], "label": False}], tok, PreferenceFields(),
                          max_length=64)
    assert "warning" not in stats.summary()
