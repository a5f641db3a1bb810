"""Prompt records as TRL 1.16 reads them (tasks/rl/prompts.py): a text prompt stays plain even
when the tokenizer has a chat template (unless data.chat_template=PATH or data.system_prompt
ask for it), a list of messages is templated, one message dict counts as a list of one; the
records' other fields ride along for the reward functions."""

from __future__ import annotations

import pytest

from paratrain.tasks.rl.prompts import PromptCollate, PromptDataset, encode_prompts

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from tests.conftest import make_hf_tokenizer
    out = make_hf_tokenizer(tmp_path_factory.mktemp("tok"), ["hello world what is two"] * 20)
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    tok.chat_template = TEMPLATE
    return tok


def _encode(tokenizer, rows, **kw):
    args = {"field": "prompt", "chat_template": "auto", "system_prompt": None, "room": 200,
            "source_name": "p.jsonl", **kw}
    return encode_prompts(rows, tokenizer, **args)


def test_a_text_prompt_stays_plain_under_a_tokenizer_with_a_template(tokenizer):
    (ex,), note = _encode(tokenizer, [{"prompt": "what is two"}])
    from paratrain.data.hf_tokenizer import special_prefix
    plain = special_prefix(tokenizer) + tokenizer("what is two", add_special_tokens=False)[
        "input_ids"]
    assert ex["prompt_ids"] == plain
    assert "chat template" not in note


def test_messages_and_one_message_dict_are_templated(tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "what is two"}]},
            {"prompt": {"role": "user", "content": "what is two"}}]
    out, note = _encode(tokenizer, rows)
    rendered = tokenizer("[user] what is two\n[assistant] ", add_special_tokens=False)
    assert out[0]["prompt_ids"] == out[1]["prompt_ids"] == rendered["input_ids"]
    assert "2 with the chat template" in note


def test_a_text_prompt_is_templated_when_asked(tokenizer, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    (ex,), _ = _encode(tokenizer, [{"prompt": "what is two"}], chat_template=str(path))
    assert tokenizer.decode(ex["prompt_ids"]) == "[user] what is two\n[assistant] "
    (ex,), _ = _encode(tokenizer, [{"prompt": "what is two"}], system_prompt="be brief")
    assert tokenizer.decode(ex["prompt_ids"]).startswith("[system] be brief\n[user] what")


def test_the_records_other_fields_reach_the_batch(tokenizer):
    out, _ = _encode(tokenizer, [{"prompt": "what is two", "answer": "2", "tests": [1]},
                                 {"prompt": "hello", "answer": "0"}])
    batch = PromptCollate(0)([PromptDataset(out)[i] for i in range(2)])
    assert batch["fields"] == [{"answer": "2", "tests": [1]}, {"answer": "0"}]
