"""Fine-tuning data: what the loss counts, how examples are cut, where rows come from, batches."""

import json
import pickle
import sys

import pytest
import torch

pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from paratrain.data.classify import encode_classify  # noqa: E402
from paratrain.data.dataset import IGNORE_INDEX  # noqa: E402
from paratrain.data.examples import FinetuneDataset, PadCollate, split_validation  # noqa: E402
from paratrain.data.finetune import encode_chat, encode_pairs  # noqa: E402
from paratrain.data.hf_tokenizer import (  # noqa: E402
    _tokens_by_piece,
    assistant_spans,
    load_tokenizer,
    tokens_in_spans,
)
from paratrain.data.rows import read_rows, rows_from_lists  # noqa: E402
from paratrain.data.stdlib_pairs import stdlib_pairs  # noqa: E402
from paratrain.errors import ConfigError, DataError  # noqa: E402

EOS = "[EOT]"
SPECIALS = ["[BOT]", EOS, "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|im_start|>"]
# Assistant turns end with EOS; every other turn with <|end|>.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{% if m['role'] == 'assistant' %}[EOT]{% else %}<|end|>{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# ChatML-like: turns end with <|end|> and a newline, so EOS is not the last token.
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                   "<|end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                   "{% endif %}")
TEXT = ["def add(a, b):\n    return a + b\n", "Return the sum of two numbers.",
        "the quick brown fox jumps over the lazy dog", "Translate to French: cheese -> fromage"]
ROWS = [{"input": "def add(a, b):", "output": "Return the sum."},
        {"input": "def hello():", "output": "Say hello to the world."},
        {"input": "Translate: dog", "output": "chien"}]


@pytest.fixture(scope="module")
def bpe_json():
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(TEXT * 20, trainer=trainer)
    return hf.to_str()


def save_tokenizer(bpe_json, directory, *, chat_template=None, bos=False, pad=None, eos=EOS):
    hf = Tokenizer.from_str(bpe_json)
    if bos:  # a Llama-style tokenizer that puts BOS before every text
        hf.post_processor = processors.TemplateProcessing(
            single="[BOT] $A", special_tokens=[("[BOT]", hf.token_to_id("[BOT]"))])
    kwargs = {"bos_token": "[BOT]"} if bos else {}
    tok = PreTrainedTokenizerFast(tokenizer_object=hf, eos_token=eos, pad_token=pad,
                                  additional_special_tokens=SPECIALS[2:], **kwargs)
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def dirs(bpe_json, tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {"plain": save_tokenizer(bpe_json, root / "plain"),
            "chat": save_tokenizer(bpe_json, root / "chat", chat_template=CHAT_TEMPLATE),
            "bos": save_tokenizer(bpe_json, root / "bos", bos=True)}


@pytest.fixture
def tok(dirs):  # fresh per test: a chat_template=PATH sets the template on the object
    return load_tokenizer(dirs["plain"])[0]


@pytest.fixture
def chat_tok(dirs):
    return load_tokenizer(dirs["chat"])[0]


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def counted(example):
    return [t for t in example["targets"] if t != IGNORE_INDEX]


def check_shifted(example):
    ids, targets = example["input_ids"], example["targets"]
    assert len(ids) == len(targets)
    for i, t in enumerate(targets[:-1]):
        assert t in (IGNORE_INDEX, ids[i + 1])


# ---- tokenizer ---------------------------------------------------------------------------
def test_load_tokenizer_reuses_eos_as_pad(dirs, bpe_json, tmp_path):
    tok, note = load_tokenizer(dirs["plain"])
    assert tok.pad_token == EOS and tok.pad_token_id == tok.eos_token_id
    assert "no pad token" in note and EOS in note
    padded = save_tokenizer(bpe_json, tmp_path / "padded", pad="[BOT]")
    tok, note = load_tokenizer(padded)
    assert tok.pad_token == "[BOT]" and note == ""


def test_load_tokenizer_errors(bpe_json, tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    with pytest.raises(ConfigError, match="has no tokenizer .*pass data.tokenizer=DIR"):
        load_tokenizer(tmp_path / "model")
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    no_eos = save_tokenizer(bpe_json, tmp_path / "no_eos", eos=None)
    with pytest.raises(ConfigError, match="neither a pad token nor an EOS"):
        load_tokenizer(no_eos)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ConfigError, match=r"pip install 'paratrain\[hf\]'"):
        load_tokenizer(tmp_path / "model")


# ---- pairs -------------------------------------------------------------------------------
def test_pairs_count_only_output_and_eos(tok):
    examples, stats = encode_pairs(ROWS, tok, input_field="input", output_field="output",
                                   max_length=128, source_name="rows")
    assert (stats.kept, stats.truncated, stats.dropped) == (3, 0, 0)
    for row, ex in zip(ROWS, examples):
        check_shifted(ex)
        assert decode(tok, counted(ex)) == row["output"] + EOS
        whole = decode(tok, ex["input_ids"] + ex["targets"][-1:])
        assert whole == row["input"] + row["output"] + EOS
    assert stats.longest == max(len(ex["input_ids"]) + 1 for ex in examples)
    assert "3 rows -> 3 examples" in stats.summary()


def test_left_truncation_keeps_the_output(dirs):
    tok = load_tokenizer(dirs["bos"])[0]
    row = {"input": "the quick brown fox jumps over the lazy dog " * 5, "output": "chien"}
    full_input = tok(row["input"], add_special_tokens=False)["input_ids"]
    answer = tok(row["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    max_length = 1 + len(answer) + 7
    (ex,), stats = encode_pairs([row], tok, max_length=max_length, source_name="rows")
    assert stats.truncated == 1 and stats.longest == max_length
    seq = ex["input_ids"] + ex["targets"][-1:]
    assert seq[0] == tok.convert_tokens_to_ids("[BOT]")  # BOS stays first
    assert seq[1:8] == full_input[-7:]  # the END of the input survives
    assert decode(tok, counted(ex)) == "chien" + EOS
    # room for the output only: the input disappears, the example is still kept
    (ex,), stats = encode_pairs([row], tok, max_length=1 + len(answer), source_name="rows")
    assert stats.truncated == 1 and decode(tok, counted(ex)) == "chien" + EOS


def test_dropped_and_all_dropped(tok):
    long_output = {"input": "x", "output": "the quick brown fox jumps over the lazy dog " * 8}
    rows = ROWS + [long_output, long_output]
    examples, stats = encode_pairs(rows, tok, max_length=40, source_name="rows")
    assert (stats.kept, stats.dropped) == (3, 2) and len(examples) == 3
    n_answer = len(tok(long_output["output"], add_special_tokens=False)["input_ids"]) + 1
    assert stats.longest_target == n_answer
    with pytest.raises(DataError, match=f"all 2 examples from rows .*longest answer: "
                                        f"{n_answer} tokens.*raise data.max_length"):
        encode_pairs([long_output] * 2, tok, max_length=40, source_name="rows")


def test_missing_field_names_file_and_row(tok, tmp_path):
    jsonl = tmp_path / "train.jsonl"
    lines = [json.dumps(ROWS[0]), "", json.dumps({"input": "a", "answer": "b"})]
    jsonl.write_text("\n".join(lines) + "\n")  # the blank line is not a row
    rows = read_rows(str(jsonl), what="data.train")
    with pytest.raises(DataError, match=rf"{jsonl}: row 2 has no field 'output' \(its fields: "
                                        r"input, answer\); set data.output_field"):
        encode_pairs(rows, tok, max_length=64, source_name=str(jsonl))
    csv_path = tmp_path / "train.csv"
    csv_path.write_text('question,output\n"def f(x, y):","Adds, with a comma."\n')
    rows = read_rows(csv_path, what="data.train")
    assert rows == [{"question": "def f(x, y):", "output": "Adds, with a comma."}]
    with pytest.raises(DataError, match=rf"{csv_path}: row 1 has no field 'input' .*question"):
        encode_pairs(rows, tok, max_length=64, source_name=str(csv_path))
    examples, _ = encode_pairs(rows, tok, input_field="question", max_length=64,
                               source_name=str(csv_path))
    assert decode(tok, counted(examples[0])) == "Adds, with a comma." + EOS


def test_sources_parquet_list_and_errors(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert read_rows(str(path), what="data.train") == ROWS
    assert read_rows(ROWS, what="train") == ROWS
    assert read_rows(tuple(ROWS), what="train") == ROWS
    assert rows_from_lists(["a", "b"], ["x", "y"], "q", "a") == [{"q": "a", "a": "x"},
                                                                 {"q": "b", "a": "y"}]
    with pytest.raises(ConfigError, match="train_input has 2 items but train_output has 1"):
        rows_from_lists(["a", "b"], ["x"], "input", "output")
    with pytest.raises(DataError, match="does not exist"):
        read_rows(str(tmp_path / "nope.jsonl"), what="data.train")
    with pytest.raises(DataError, match="item 2 is a str"):
        read_rows([ROWS[0], "text"], what="train")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="has no rows"):
        read_rows(str(tmp_path / "empty.jsonl"), what="data.train")
    (tmp_path / "bad.jsonl").write_text('{"input": 1}\n{oops\n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        read_rows(str(tmp_path / "bad.jsonl"), what="data.train")


def test_datasets_folder(tmp_path, monkeypatch):
    folder = tmp_path / "saved"
    folder.mkdir()
    (folder / "notes.txt").write_text("{}")
    with pytest.raises(DataError, match="not a datasets.save_to_disk folder"):
        read_rows(str(folder), what="data.train")
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_list(ROWS)
    dataset.save_to_disk(str(tmp_path / "real"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # read with pyarrow alone
    assert read_rows(str(tmp_path / "real"), what="data.train") == ROWS
    monkeypatch.undo()
    assert read_rows(dataset, what="train") == ROWS


# ---- templates and chat ------------------------------------------------------------------
def test_pairs_with_chat_template(chat_tok, tok):
    examples, _ = encode_pairs(ROWS, chat_tok, max_length=128, chat_template="auto",
                               system_prompt="Be brief.", source_name="rows")
    for row, ex in zip(ROWS, examples):
        check_shifted(ex)
        assert decode(chat_tok, counted(ex)) == row["output"] + EOS  # rendered EOS, not a 2nd
        assert decode(chat_tok, ex["input_ids"]).startswith(
            f"<|system|>Be brief.<|end|><|user|>{row['input']}<|end|><|assistant|>")
    # "auto" without a template in the tokenizer: plain concatenation, same as "none"
    plain, _ = encode_pairs(ROWS, tok, max_length=128, chat_template="none", source_name="r")
    auto, _ = encode_pairs(ROWS, tok, max_length=128, chat_template="auto", source_name="r")
    assert plain == auto


def test_pairs_with_template_truncate_input_from_the_left(chat_tok):
    row = {"input": "the quick brown fox jumps over the lazy dog " * 6, "output": "chien"}
    (full,), _ = encode_pairs([row], chat_tok, max_length=512, chat_template="auto",
                              source_name="rows")
    max_length = len(full["input_ids"]) + 1 - 10
    (ex,), stats = encode_pairs([row], chat_tok, max_length=max_length, chat_template="auto",
                                source_name="rows")
    assert stats.truncated == 1 and len(ex["input_ids"]) + 1 <= max_length
    text = decode(chat_tok, ex["input_ids"])
    assert text.startswith("<|user|>") and text.endswith("lazy dog <|end|><|assistant|>chien")
    assert decode(chat_tok, counted(ex)) == "chien" + EOS


CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "def add(a, b):"},
                {"role": "assistant", "content": "Return the sum."},
                {"role": "user", "content": "and hello?"},
                {"role": "assistant", "content": "Say hello to the world."}]


def test_chat_counts_assistant_turns_only(chat_tok):
    (ex,), stats = encode_chat([{"messages": CONVERSATION}], chat_tok, max_length=256,
                               source_name="chats")
    check_shifted(ex)
    assert decode(chat_tok, counted(ex)) == f"Return the sum.{EOS}Say hello to the world.{EOS}"
    assert chat_tok.decode(counted(ex), skip_special_tokens=True) == \
        "Return the sum.Say hello to the world."
    assert stats.kept == 1 and stats.longest == len(ex["input_ids"]) + 1


def test_chat_template_path_with_end_of_turn_and_appended_eos(tok, tmp_path):
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML_TEMPLATE)
    (ex,), _ = encode_chat([{"messages": CONVERSATION}], tok, max_length=256,
                           chat_template=str(template), source_name="chats")
    # the end-of-turn marker is counted, the newline after it is not, EOS is appended
    assert decode(tok, counted(ex)) == \
        f"Return the sum.<|end|>Say hello to the world.<|end|>{EOS}"
    assert ex["targets"][-1] == tok.eos_token_id


def test_chat_template_that_is_not_prefix_stable(tok):
    # The message count up front makes every prefix render differently: the search fallback.
    tok.chat_template = "{{ messages | length }}" + CHAT_TEMPLATE
    (ex,), _ = encode_chat([{"messages": CONVERSATION}], tok, max_length=256, source_name="c")
    assert decode(tok, counted(ex)) == f"Return the sum.{EOS}Say hello to the world.{EOS}"


def test_chat_system_prompt_and_length_limit(chat_tok):
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rows = [{"messages": short}, {"messages": CONVERSATION}, {"messages": short[:1]},
            {"messages": []}]
    examples, stats = encode_chat(rows, chat_tok, max_length=24, system_prompt="Be brief.",
                                  source_name="chats")
    assert (stats.kept, stats.dropped, stats.skipped) == (1, 1, 2)
    assert decode(chat_tok, examples[0]["input_ids"]).startswith("<|system|>Be brief.<|end|>")
    with pytest.raises(DataError, match="all 1 conversations from chats .*data.max_length=8"):
        encode_chat(rows[1:2], chat_tok, max_length=8, source_name="chats")


def test_chat_errors(chat_tok, tok):
    tool = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"}]
    rows = [{"messages": CONVERSATION}, {"messages": tool}]
    with pytest.raises(DataError, match="chats: row 2 has a message with role 'tool'"):
        encode_chat(rows, chat_tok, max_length=64, source_name="chats")
    with pytest.raises(DataError, match=r"row 1 has no field 'messages' \(its fields: chat\)"):
        encode_chat([{"chat": CONVERSATION}], chat_tok, max_length=64, source_name="chats")
    with pytest.raises(ConfigError, match="has no chat template; pass data.chat_template=PATH"):
        encode_chat(rows[:1], tok, max_length=64, source_name="chats")
    with pytest.raises(ConfigError, match="is not a file"):
        encode_chat(rows[:1], tok, max_length=64, chat_template="nope.jinja", source_name="c")


def test_chat_template_errors_name_the_row(tok):
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}"
                         + CHAT_TEMPLATE)
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(DataError, match=r"chats: row 1: the chat template rejects this "
                                        r"conversation \(System role not supported\)"):
        encode_chat([{"messages": short}], tok, max_length=64, system_prompt="Be brief.",
                    source_name="chats")


def test_masks_without_offsets_match_masks_with_offsets(chat_tok):
    text = chat_tok.apply_chat_template(CONVERSATION, tokenize=False)
    spans = assistant_spans(chat_tok, CONVERSATION, text, "row 1")
    assert [text[a:b] for a, b in spans] == [f"Return the sum.{EOS}",
                                             f"Say hello to the world.{EOS}"]
    assert tokens_in_spans(chat_tok, [text], [spans])[0] == _tokens_by_piece(chat_tok, text, spans)


# ---- classification ----------------------------------------------------------------------
def test_classify_labels_and_truncation(tok):
    rows = [{"text": "the quick brown fox", "label": "pos"}, {"text": "lazy dog", "label": "neg"},
            {"text": "cheese", "label": "meh"}, {"text": "fox " * 40, "label": "pos"}]
    examples, stats, names = encode_classify(rows, tok, max_length=12, source_name="rows")
    assert names == ["meh", "neg", "pos"] and [ex["label"] for ex in examples] == [2, 1, 0, 2]
    full = tok(rows[3]["text"])["input_ids"]
    assert examples[3]["input_ids"] == full[:12] and stats.truncated == 1
    # validation data reuses the training names; unknown names are an error
    val, _, val_names = encode_classify(rows[1:2], tok, max_length=12, labels=names,
                                        source_name="val")
    assert val_names == names and val[0]["label"] == 1
    with pytest.raises(DataError, match="label 'neu', which is not one of"):
        encode_classify([{"text": "x", "label": "neu"}], tok, max_length=12, labels=names,
                        source_name="val")
    ints, _, int_names = encode_classify([{"text": "a", "label": 2}, {"text": "b", "label": 0}],
                                         tok, max_length=12, source_name="rows")
    assert [ex["label"] for ex in ints] == [2, 0] and int_names == ["0", "1", "2"]
    csv_like, _, _ = encode_classify([{"text": "a", "label": "10"}, {"text": "b", "label": "2"}],
                                     tok, max_length=12, source_name="rows")
    assert [ex["label"] for ex in csv_like] == [10, 2]  # numbers, not sorted strings
    batch = PadCollate(tok.pad_token_id)([FinetuneDataset(examples)[i] for i in (0, 1)])
    assert batch["labels"].tolist() == [2, 1] and batch["input_ids"].shape[0] == 2
    assert set(batch) == {"input_ids", "attention_mask", "labels"}


# ---- batches and splits ------------------------------------------------------------------
def test_pad_collate_pads_to_the_micro_batch_longest(tok):
    examples = [{"input_ids": [5] * n, "targets": [7] * (n - 1) + [IGNORE_INDEX]}
                for n in (3, 5, 50, 4)]
    dataset = pickle.loads(pickle.dumps(FinetuneDataset(examples)))
    collate = pickle.loads(pickle.dumps(PadCollate(pad_id=2)))
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, collate_fn=collate)
    first, second = list(loader)
    assert first["input_ids"].shape == (2, 5)  # not 50
    assert second["input_ids"].shape == (2, 50)
    assert first["input_ids"][0].tolist() == [5, 5, 5, 2, 2]
    assert first["attention_mask"][0].tolist() == [1, 1, 1, 0, 0]
    assert first["targets"][0].tolist() == [7, 7] + [IGNORE_INDEX] * 3
    assert first["input_ids"].dtype == first["targets"].dtype == torch.long
    assert PadCollate(2, pad_to_multiple_of=8)(examples[:2])["input_ids"].shape == (2, 8)


def test_split_validation_is_deterministic():
    examples = [{"input_ids": [i], "targets": [i]} for i in range(100)]
    train, val = split_validation(examples, 0.1, seed=3)
    assert len(val) == 10 and len(train) == 90
    assert sorted(ex["input_ids"][0] for ex in train + val) == list(range(100))
    assert (train, val) == split_validation(examples, 0.1, seed=3)
    assert val != split_validation(examples, 0.1, seed=4)[1]
    with pytest.raises(ConfigError):
        split_validation(examples, 1.0, seed=0)


def test_stdlib_pairs_are_deterministic_and_encode(tok):
    pairs = stdlib_pairs(40)
    assert len(pairs) == 40 and pairs == stdlib_pairs(40)
    assert pairs[:10] == stdlib_pairs(10)
    for pair in pairs:
        assert pair["input"].startswith(("def ", "async def ")) and pair["input"].endswith(":")
        assert pair["output"] and "\n" not in pair["output"]
    examples, stats = encode_pairs(pairs, tok, max_length=256, source_name="stdlib")
    assert stats.kept + stats.dropped == 40 and stats.kept > 0
