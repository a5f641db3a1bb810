"""Hugging Face export: a tiny paratrain Llama (GQA, untied and tied) saved with save_model,
exported, and loaded back by transformers offline gives the same logits, the same greedy
continuation and the same token ids; folders that cannot be exported faithfully are refused."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from paratrain.checkpoint.hf_export import export_hf, interleaved_to_half
from paratrain.config import ModelConfig
from paratrain.data import Tokenizer
from paratrain.errors import ConfigError
from paratrain.models import build_model, generate
from paratrain.models import files as model_io
from paratrain.config.presets import resolve_model_config

transformers = pytest.importorskip("transformers")

TEXT = ("def greet(name):\n    return f'hello, {name}!'\n\n"
        "The quick brown fox jumps over the lazy dog. [EOT] is text here.\n")
SAMPLES = [TEXT, "hello, world\n", " leading space and [EOT][PAD] markers", "∑ ≠ 😀\t"]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    texts = [TEXT.replace("name", f"name_{i % 7}") for i in range(200)]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    Tokenizer.train_bpe(texts, vocab_size=320).save(path)
    return path


def _model(tok_path, tie: bool, seed: int = 0, **over):
    """A tiny llama with random (not near-zero) weights, so a wrong mapping shows."""
    tok = Tokenizer.load(tok_path)
    mc = ModelConfig(preset="tiny", num_layers=3, num_heads=4, num_kv_heads=2,
                     tie_embeddings=tie, rope_theta=500.0, norm_eps=1e-6, **over)
    args = resolve_model_config(mc, vocab_size=tok.vocab_size, seq_length=24)
    assert args.arch == "llama" and args.num_kv_heads < args.num_heads
    torch.manual_seed(seed)
    model = build_model(args)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.dim() == 1 else 0.2 * torch.randn_like(p))
    return model.eval(), args, tok


def _save(tmp_path, tok_path, tie: bool, **over):
    model, args, tok = _model(tok_path, tie, **over)
    run = tmp_path / "run"
    model_io.save_model(run / model_io.MODEL_DIR, model.state_dict(), args.to_dict(),
                          tok_path)
    return model, args, tok, run


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def exported(request, tmp_path_factory, tok_path):
    tmp = tmp_path_factory.mktemp("export")
    model, args, tok, run = _save(tmp, tok_path, tie=request.param)
    out = export_hf(run, tmp / "hf")  # a run dir: model_dir_of finds model/
    hf = transformers.LlamaForCausalLM.from_pretrained(out, local_files_only=True).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    return model, args, tok, out, hf, hf_tok


def test_files_and_config(exported):
    _, args, _, out, hf, _ = exported
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp folder left
    c = hf.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.vocab_size, c.max_position_embeddings) == \
        (args.hidden_size, args.intermediate_size, args.num_layers, args.num_heads,
         args.num_kv_heads, args.vocab_size, args.max_seq_length)
    assert c.rms_norm_eps == args.norm_eps and c.tie_word_embeddings == args.tie_embeddings
    raw = json.loads((out / "config.json").read_text())
    assert raw["rope_theta"] == 500.0  # top level too, where transformers 4.x reads it
    assert raw["torch_dtype"] == raw["dtype"] == "float32"
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (1, 2, 0)
    assert hf.generation_config.eos_token_id == 2
    from safetensors.torch import load_file
    names = set(load_file(str(out / "model.safetensors")))
    assert ("lm_head.weight" in names) != args.tie_embeddings
    assert "model.layers.2.self_attn.k_proj.weight" in names and "model.norm.weight" in names
    if args.tie_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


def test_logits_match(exported):
    model, args, _, _, hf, _ = exported
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, args.vocab_size, (3, args.max_seq_length), generator=g)
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits
    assert ours.abs().max() > 1.0  # logits far from uniform: a wrong mapping cannot hide
    assert (ours - theirs).abs().max().item() < 1e-4
    mask = torch.ones_like(idx)
    mask[1, 15:] = 0  # right padding: real positions must agree too
    with torch.no_grad():
        ours, theirs = model(idx, mask), hf(idx, attention_mask=mask).logits
    real = mask.bool()
    assert (ours[real] - theirs[real]).abs().max().item() < 1e-4


def test_greedy_generate_matches(exported):
    model, args, _, _, hf, _ = exported
    prompt = torch.randint(3, args.vocab_size, (2, 6), generator=torch.Generator().manual_seed(2))
    ours = generate(model, prompt, max_new_tokens=6, temperature=0.0, eos_id=2)
    with torch.no_grad():
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                             do_sample=False)
    assert theirs.shape[1] > prompt.shape[1]
    for a, b in zip(ours.tolist(), theirs.tolist()):
        # after [EOT] ours repeats it and HF pads (or stops): compare up to the first one
        cut = a.index(2, 6) + 1 if 2 in a[6:] else len(a)
        assert b[:cut] == a[:cut]


@pytest.mark.parametrize("text", SAMPLES)
def test_tokenizer_matches(exported, text):
    _, _, tok, _, _, hf_tok = exported
    ids = tok.encode(text)
    assert hf_tok.encode(text) == ids  # no special tokens added, "[EOT]" in text stays text
    assert hf_tok(text)["input_ids"] == ids
    assert hf_tok.decode(ids) == tok.decode(ids)
    assert (hf_tok.pad_token_id, hf_tok.bos_token_id, hf_tok.eos_token_id) == (0, 1, 2)


def test_char_tokenizer_exports(tmp_path):
    tok = Tokenizer.train_char(SAMPLES)
    tok.save(tmp_path / "char.json")
    _, _, _, run = _save(tmp_path, tmp_path / "char.json", tie=False)
    out = export_hf(run / model_io.MODEL_DIR, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    for text in SAMPLES + ["unseen: qz#"]:
        assert hf_tok.encode(text) == tok.encode(text)
    assert hf_tok.unk_token_id == 3


def test_permutation_maps_interleaved_rope_to_rotate_half():
    """Row order per head: evens, then odds (what turns our pairs (2i, 2i+1) into (i, i+D/2))."""
    w = torch.arange(2 * 8, dtype=torch.float32)[:, None].repeat(1, 3)  # 2 heads of D=8
    rows = interleaved_to_half(w, 2)[:, 0].long().tolist()
    assert rows == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]


# ---- refusals ----------------------------------------------------------------------------------
def test_refuses_gpt(tmp_path, tok_path):
    args = resolve_model_config(ModelConfig(arch="gpt", preset="tiny"), vocab_size=320,
                                seq_length=16)
    mdir = model_io.save_model(tmp_path / "m", build_model(args).state_dict(), args.to_dict(),
                                 tok_path)
    with pytest.raises(ConfigError, match="only llama exports to Hugging Face"):
        export_hf(mdir, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_refuses_missing_model_folder(tmp_path):
    with pytest.raises(ConfigError, match="holds no trained model"):
        export_hf(tmp_path / "nowhere", tmp_path / "hf")


def test_refuses_non_empty_out_dir_unless_overwrite(tmp_path, tok_path):
    _, _, _, run = _save(tmp_path, tok_path, tie=False)
    out = tmp_path / "hf"
    out.mkdir()
    export_hf(run, out)  # an empty folder is fine
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already exists and is not empty.*overwrite=True"):
        export_hf(run, out)
    assert (out / "keep.txt").is_file()
    export_hf(run, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        export_hf(run, tmp_path / "file", overwrite=True)
    with pytest.raises(ConfigError, match="holds what is being exported"):
        export_hf(run, run / model_io.MODEL_DIR, overwrite=True)


def test_refuses_without_transformers(tmp_path, tok_path, monkeypatch):
    _, _, _, run = _save(tmp_path, tok_path, tie=False)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'paratrain\[hf\]'"):
        export_hf(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_refuses_weights_hf_llama_lacks(tmp_path, tok_path):
    model, args, _ = _model(tok_path, tie=False)
    state = model.state_dict()
    state["layers.0.attention.wq.bias"] = torch.zeros(args.hidden_size)
    mdir = model_io.save_model(tmp_path / "m", state, args.to_dict(), tok_path)
    with pytest.raises(ConfigError, match=r"unexpected: \['layers.0.attention.wq.bias'\]"):
        export_hf(mdir, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_refuses_missing_tokenizer(tmp_path, tok_path):
    model, args, _ = _model(tok_path, tie=False)
    mdir = model_io.save_model(tmp_path / "m", model.state_dict(), args.to_dict(), None)
    with pytest.raises(ConfigError, match="holds no tokenizer.json"):
        export_hf(mdir, tmp_path / "hf")
