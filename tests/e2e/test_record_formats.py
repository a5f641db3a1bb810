"""data.format=auto: one file per record format other tools write (ShareGPT, Alpaca, OpenAI /
TRL conversational, TRL prompt-completion as text and as messages, TRL preference with messages,
TRL unpaired preference, paratrain's pairs), each recognised from its first records, named in the
log line with the fields that decided it, recorded in config.yaml as the format it trains, and
trained 1 step on the tiny Llama. A file that fits two formats is one line naming both and the
keys that choose each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import cli_error, cli_run, read_metrics

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(600)]

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text: {"role": "assistant", "content": text}  # noqa: E731

# name -> (a record (i: its number), what the log names, the data.format it trains)
FORMATS = {
    "sharegpt": (lambda i: {"conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": f"Count to {i}"},
        {"from": "gpt", "value": " ".join(map(str, range(i)))}]}, "ShareGPT", "chat"),
    "alpaca": (lambda i: {"instruction": "Repeat the word", "input": "" if i % 2 else f"w{i}",
                          "output": f"w{i} w{i}"}, "Alpaca", "pairs"),
    "messages": (lambda i: {"messages": [U(f"hi {i}"), A(f"hello {i}")]},
                 "conversational (messages)", "chat"),
    "prompt_completion": (lambda i: {"prompt": f"def f{i}(", "completion": "x): pass"},
                          "prompt-completion", "pairs"),
    "prompt_completion_messages": (lambda i: {"prompt": [U(f"q{i}")], "completion": [A(f"a{i}")]},
                                   "conversational prompt-completion", "chat"),
    "preference_messages": (lambda i: {"prompt": [U(f"q{i}")], "chosen": [A("apple")],
                                       "rejected": [A("pebble")]}, "preference", "preference"),
    "unpaired_preference": (lambda i: {"prompt": f"q{i}", "completion": " apple" if i % 2 else
                                       " pebble", "label": bool(i % 2)},
                            "unpaired preference", "preference"),
    "pairs": (lambda i: {"input": f"x{i}", "output": f"y{i}"}, "pairs", "pairs"),
}


def _write(tmp: Path, name: str, rows: list[dict]) -> Path:
    f = tmp / f"{name}.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_is_recognised_and_trains(capsys, tmp_path, pairs_llama, name):
    make, shown, fmt = FORMATS[name]
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    source = _write(tmp_path, name, [make(i) for i in range(1, 9)])
    r = cli_run(capsys, ["train", "model.arch=hf", f"model.path={pairs_llama}",
                         "data.format=auto", f"data.source={source}", "data.max_length=64",
                         f"data.chat_template={template}", "trainer.devices=cpu:1",
                         "trainer.batch_size=2", "trainer.max_steps=1", "trainer.log_every=1",
                         "trainer.progress_bar=false", "log.report=false",
                         "log.tensorboard=false", f"run.dir={tmp_path / 'run'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in (r.stdout + r.stderr).splitlines() if "data.format=auto" in x)
    assert f": {shown} records (fields " in line and f"-> data.format={fmt}" in line, line
    recorded = (tmp_path / "run" / "config.yaml").read_text()
    assert f"format: {fmt}\n" in recorded
    metrics = read_metrics(tmp_path / "run")
    assert metrics and metrics[-1]["step"] == 1 and metrics[-1]["loss"] > 0
    if name == "unpaired_preference":
        assert "objective: kto" in recorded


def test_an_ambiguous_file_is_one_line_with_the_keys_that_settle_it(capsys, tmp_path,
                                                                    pairs_llama):
    source = _write(tmp_path, "both", [{"messages": [U("a"), A("b")], "conversations": [
        {"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}] * 3)
    line = cli_error(capsys, ["train", "model.arch=hf", f"model.path={pairs_llama}",
                              "data.format=auto", f"data.source={source}"])
    assert "ShareGPT (conversations): data.format=chat data.records=sharegpt" in line
    assert "conversational (messages) (messages): data.format=chat" in line
    unknown = _write(tmp_path, "odd", [{"question": "a", "answer": "b"}])
    line = cli_error(capsys, ["train", "model.arch=hf", f"model.path={pairs_llama}",
                              "data.format=auto", f"data.source={unknown}"])
    assert "['answer', 'question']" in line and "Alpaca: instruction, output" in line


def test_the_python_api_recognises_records_of_other_tools(tmp_path, pairs_llama):
    """Trainer(model=DIR, train_data=[ShareGPT records]): trained as chat from the converted
    records, config.yaml saying so."""
    from paratrain import Trainer
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    make = FORMATS["sharegpt"][0]
    result = Trainer(model=str(pairs_llama), train_data=[make(i) for i in range(1, 9)],
                     devices="cpu:1", max_steps=1, batch_size=2, run_dir=str(tmp_path / "api"),
                     overrides=[f"data.chat_template={template}", "data.max_length=64",
                                "log.report=false", "log.tensorboard=false"]).fit()
    recorded = (result.run_dir / "config.yaml").read_text()
    assert "format: chat\n" in recorded and "records: sharegpt\n" in recorded
    assert result.final_loss > 0
