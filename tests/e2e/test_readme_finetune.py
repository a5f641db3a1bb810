"""The fine-tuning guide (docs/guides/fine-tuning.md) runs as printed: every command of its bash
blocks and every Python block, in a folder holding what they name (`my-model/`: a tiny local
Llama with a chat template, built here offline; train/val pairs, chat records and labelled
reviews), with the real CLI and real worker processes, as a new user would copy them."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.e2e._doc_blocks import doc_blocks
from tests.e2e._tiny_model import make_pairs, make_tiny_llama, write_jsonl

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = [pytest.mark.timeout(1800), pytest.mark.slow]

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def readme_blocks() -> tuple[list[list[str]], list[str]]:
    """(the fine-tuning guide's shell commands as argument lists, its Python blocks' code): the
    blocks docs/guides/fine-tuning.md marks as run by this file."""
    mine = [b for b in doc_blocks()
            if b.marker == "run by" and b.reason.startswith("tests/e2e/test_readme_finetune.py")]
    commands = [args for b in mine if b.lang == "bash" for args in b.commands()]
    return commands, [b.code for b in mine if b.lang == "python"]


def _reviews(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    good, bad = ("great", "works well", "good value"), ("broke", "poor", "stopped working")
    rows = []
    for i in range(n):
        label = "positive" if i % 2 else "negative"
        words = [rng.choice(("the", "a", "this", "cable", "lamp", "after", "one", "week"))
                 for _ in range(rng.randint(3, 6))]
        words.insert(rng.randrange(len(words) + 1), rng.choice(good if i % 2 else bad))
        rows.append({"text": " ".join(words), "label": label})
    return rows


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory) -> Path:
    """What the section's commands expect to find in the current directory."""
    here = tmp_path_factory.mktemp("readme")
    pairs = make_pairs(400)
    make_tiny_llama(here / "my-model", [r["input"] + " " + r["output"] for r in pairs],
                    chat_template=CHAT_TEMPLATE)
    write_jsonl(here / "train.jsonl", pairs[:320])
    write_jsonl(here / "val.jsonl", pairs[320:])
    write_jsonl(here / "chat.jsonl", [{"messages": [
        {"role": "user", "content": r["input"]},
        {"role": "assistant", "content": r["output"]}]} for r in pairs[:200]])
    write_jsonl(here / "reviews.jsonl", _reviews(256, 0))
    write_jsonl(here / "reviews-val.jsonl", _reviews(31, 1))
    return here


def test_the_blocks_are_found():
    commands, python = readme_blocks()
    assert sum(c[:2] == ["paratrain", "train"] for c in commands) >= 4, commands
    assert sum(c[:2] == ["paratrain", "generate"] for c in commands) >= 3, commands
    assert python and all("Trainer(" in p for p in python)


def test_every_command_and_python_block_runs_as_printed(user_folder):
    commands, python = readme_blocks()
    for args in commands:
        assert args[0] == "paratrain", args
        r = run_cli(args[1:], cwd=user_folder, timeout=420)
        assert r.returncode == 0, (args, r.stderr[-3000:])
        noise = r.stdout + r.stderr
        assert "Traceback" not in noise and "FutureWarning" not in noise, (args, noise[-3000:])
        assert "Loading weights" not in noise, (args, noise[-3000:])
        if args[1] == "generate":
            prompt = args[args.index("--prompt") + 1]
            lines = r.stdout.rstrip("\n").split("\n")
            if args[2].endswith("classify"):  # a classifier prints the label
                assert lines == [lines[0]] and lines[0] in ("positive", "negative"), r.stdout
            else:  # the prompt, then the reply on a line of its own
                assert lines[0] == prompt and len(lines) >= 2, r.stdout
        elif "model.lora.r=8" in args:
            assert "LoRA: adapters on 4 modules (q_proj x2, v_proj x2)" in r.stderr, r.stderr
        elif "data.pack=true" in args:  # the rows, what a batch counts, the pads left
            assert "examples per row on average" in r.stderr and "counts rows" in r.stderr
            assert "padding: about" in r.stderr, r.stderr[-3000:]
        elif "data.format=chat" in args:  # no val_source: the log says what was held out
            assert "validation: 4 of 200 examples held out (data.val_fraction=0.02)" in r.stderr
    runs = user_folder / "runs"
    names = {p.name for p in runs.iterdir()}
    assert {"my-model-pairs", "my-model-pairs-lora", "my-model-chat",
            "my-model-classify", "my-model-packed"} <= names, names
    assert json.loads((runs / "my-model-packed" / "summary.json").read_text()
                      )["padding_share"] < 0.25  # issue 38: packed rows are nearly full
    assert "system_prompt: Answer in one line." in (runs / "my-model-chat" / "config.yaml"
                                                    ).read_text()
    for i, code in enumerate(python):
        script = user_folder / f"readme_block_{i}.py"
        script.write_text(code)
        r = run_cli([str(script)], cwd=user_folder, timeout=600, launcher=[sys.executable])
        assert r.returncode == 0, (code, r.stderr[-3000:])
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert (runs / "api-lora" / "adapter" / "adapter_model.safetensors").is_file()
    # model/ as transformers 4.4x reads it too (docs/transformers-compat.md)
    model_dir = runs / "my-model-pairs" / "model"
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "PreTrainedTokenizerFast"
    assert json.loads((model_dir / "config.json").read_text())["rope_theta"] == 10000.0
