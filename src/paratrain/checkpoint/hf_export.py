"""Export a paratrain Llama to a Hugging Face folder, so a model pretrained here can be loaded
(offline) by `transformers.LlamaForCausalLM` / `AutoTokenizer` and fine-tuned or served with the
HF ecosystem.

Our Llama is Meta's reference layout, which HF Llama reproduces exactly but for two spellings:
names (wq -> q_proj, w1 -> gate_proj, ...) and rotary embeddings. We rotate interleaved channel
pairs (x0, x1), (x2, x3), ... of each head; HF's `rotate_half` pairs channel i with channel
i + head_dim/2. So the rows of q_proj and k_proj are reordered within each head, evens first
then odds: the permutation of HF's convert_llama_weights_to_hf.py (which converts Meta's
interleaved checkpoints too). q·k is unchanged because q and k get the same order; v and o are
not rotated and stay as they are.

Anything our model has that HF Llama would silently compute differently (an unknown option, an
extra or missing tensor, a wrong shape) is refused with a ConfigError instead of exported.
Dropout is a training-time option and is not carried over (HF's attention_dropout is 0).

The tokenizer: ours (tokenizer.json alone) becomes a transformers fast tokenizer with [BOT], [EOT],
[PAD] as its BOS, EOS and pad tokens; a pretrained one (`data.tokenizer=DIR`, whose files model/
carries) is copied as it is, and the model's BOS/EOS/pad ids are its own.

transformers is imported inside the functions: it is an optional extra (`paratrain[hf]`), and
a missing one is reported as a ConfigError that says how to install it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..data.tokenizer import TOKENIZER_FILE as TOKENIZER
from ..data.tokenizer import copy_tokenizer_files
from ..errors import ConfigError, ParatrainError
from ..models.files import MODEL_CONFIG, WEIGHTS, model_dir_of
from .export_target import check_out, export_target

if TYPE_CHECKING:
    import torch

    from ..data import Tokenizer
    from ..models import ModelArgs

# Every ModelArgs field and what becomes of it in HF; a field not listed here is an option this
# exporter does not know how to map, so the export refuses rather than guess.
_MAPPED_ARGS = {"arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                "intermediate_size", "vocab_size", "max_seq_length", "tie_embeddings",
                "rope_theta", "norm_eps", "dropout"}

# paratrain per-layer name -> HF per-layer name
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
EMBED, HEAD = "tok_embeddings.weight", "lm_head.weight"


def export_hf(model_dir: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Write `out_dir` (atomically) as a Hugging Face Llama folder: config.json,
    generation_config.json, model.safetensors (float32) and the tokenizer files, from a
    paratrain model folder or a run dir. Returns `out_dir`."""
    from ..models import ModelArgs

    try:
        mdir = model_dir_of(model_dir)
    except ParatrainError as e:
        raise ConfigError(str(e)) from None
    try:
        raw = json.loads((mdir / MODEL_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {mdir / MODEL_CONFIG} ({e}); pass a model folder "
                          f"written by paratrain") from None
    if "model_type" in raw:  # a fine-tuning run's model/: written by transformers already
        raise ConfigError(f"{mdir} is a Hugging Face folder already (from_pretrained loads it "
                          "as it is); `checkpoint export` of a fine-tuning run exports its "
                          "snapshots (checkpoints/step-NNNNNNN), and this run has none")
    if raw.get("arch") != "llama":
        raise ConfigError(f"{mdir} holds a model.arch={raw.get('arch')!r} model; only llama "
                          f"exports to Hugging Face format for now (train with model.arch=llama)")
    args = ModelArgs.from_dict(raw)
    unknown = sorted(set(args.to_dict()) - _MAPPED_ARGS)
    if unknown:
        raise ConfigError(f"model option(s) {', '.join(unknown)} have no known Hugging Face "
                          f"Llama equivalent; this export cannot map them (update hf_export.py)")
    tok_path = mdir / TOKENIZER
    if not tok_path.is_file():
        raise ConfigError(f"{mdir} holds no {TOKENIZER}; copy the run's tokenizer.json into it "
                          f"before exporting")
    check_out(Path(out_dir), overwrite=overwrite, source=mdir)
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError("exporting to Hugging Face format needs the transformers package; "
                          "pip install 'paratrain[hf]'") from None

    from safetensors.torch import load_file, save_file
    tensors = hf_state_dict(load_file(str(mdir / WEIGHTS), device="cpu"), args)
    ours = _our_tokenizer(tok_path, args)
    with export_target(Path(out_dir), overwrite=overwrite, source=mdir) as tmp:
        _hf_config(args, ours).save_pretrained(str(tmp))
        _generation_config(ours).save_pretrained(str(tmp))
        save_file(tensors, str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "producer": "paratrain"})
        if ours.kind == "pretrained":  # its own files, as they are
            copy_tokenizer_files(mdir, tmp)
        else:
            _hf_tokenizer(tok_path, ours, args).save_pretrained(str(tmp))
        _portable(tmp, args, tokenizer_class=ours.kind != "pretrained")
    return Path(out_dir)


def hf_state_dict(state: dict[str, "torch.Tensor"], args: "ModelArgs") -> dict[str, "torch.Tensor"]:
    """paratrain Llama state dict -> HF LlamaForCausalLM state dict (float32, contiguous).
    Refuses (ConfigError) any tensor it does not expect, a missing one, or a wrong shape."""
    C, I, V = args.hidden_size, args.intermediate_size, args.vocab_size
    D, H, KV = args.head_dim, args.num_heads, args.num_kv_heads
    shapes = {"attention.wq.weight": (H * D, C), "attention.wk.weight": (KV * D, C),
              "attention.wv.weight": (KV * D, C), "attention.wo.weight": (C, H * D),
              "feed_forward.w1.weight": (I, C), "feed_forward.w3.weight": (I, C),
              "feed_forward.w2.weight": (C, I), "attention_norm.weight": (C,),
              "ffn_norm.weight": (C,)}
    state = dict(state)
    if args.tie_embeddings:  # save_model stores a tied matrix once, under either name
        if EMBED not in state and HEAD in state:
            state[EMBED] = state[HEAD]
        state.pop(HEAD, None)
    expected = {EMBED: (V, C), "norm.weight": (C,)}
    if not args.tie_embeddings:
        expected[HEAD] = (V, C)
    for i in range(args.num_layers):
        expected.update({f"layers.{i}.{k}": s for k, s in shapes.items()})
    extra = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state))
    if extra or missing:
        raise ConfigError(f"the weights do not match paratrain's Llama as HF Llama defines it "
                          f"(unexpected: {extra[:3]}, missing: {missing[:3]}); biases or other "
                          f"extra tensors cannot be exported")
    for k, shape in expected.items():
        if tuple(state[k].shape) != shape:
            raise ConfigError(f"weight {k} has shape {tuple(state[k].shape)}, expected {shape} "
                              f"from {MODEL_CONFIG}; the folder's files do not belong together")

    out = {"model.embed_tokens.weight": state[EMBED], "model.norm.weight": state["norm.weight"]}
    if not args.tie_embeddings:
        out["lm_head.weight"] = state[HEAD]
    for i in range(args.num_layers):
        for ours, theirs in _LAYER_NAMES.items():
            w = state[f"layers.{i}.{ours}"]
            if ours == "attention.wq.weight":
                w = interleaved_to_half(w, H)
            elif ours == "attention.wk.weight":
                w = interleaved_to_half(w, KV)
            out[f"model.layers.{i}.{theirs}"] = w
    return {k: v.float().contiguous() for k, v in out.items()}


def interleaved_to_half(w: "torch.Tensor", n_heads: int) -> "torch.Tensor":
    """Reorder the output rows of a q or k projection within each head from interleaved RoPE
    pairs (2i, 2i+1) to rotate_half pairs (i, i + D/2): rows 0, 2, 4, ..., then 1, 3, 5, ...
    The `permute` of HF's convert_llama_weights_to_hf.py."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim,
                                                                                      in_dim)


def _hf_config(args: "ModelArgs", tokenizer: "Tokenizer"):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        head_dim=args.head_dim, hidden_act="silu", max_position_embeddings=args.max_seq_length,
        rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta,
        tie_word_embeddings=args.tie_embeddings, attention_bias=False, mlp_bias=False,
        attention_dropout=0.0, bos_token_id=tokenizer.bot_id, eos_token_id=tokenizer.eot_id,
        pad_token_id=tokenizer.pad_id, architectures=["LlamaForCausalLM"])


def _portable(folder: Path, args: "ModelArgs", tokenizer_class: bool) -> None:
    """Readable by transformers 4.x as well as 5.x: 5.x writes rope_theta only inside
    rope_parameters (4.x would ignore it and use 10000), `dtype` for `torch_dtype` and names the
    tokenizer class TokenizersBackend (unknown to 4.x); 5.x reads the older spellings too.
    `tokenizer_class`: the tokenizer was written here (a pretrained one is left as it is)."""
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", args.rope_theta)
    cfg.setdefault("torch_dtype", "float32")
    cfg.setdefault("dtype", "float32")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if not tokenizer_class:
        return
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")


def _generation_config(tokenizer: "Tokenizer"):
    from transformers import GenerationConfig
    return GenerationConfig(bos_token_id=tokenizer.bot_id, eos_token_id=tokenizer.eot_id,
                            pad_token_id=tokenizer.pad_id)


def _our_tokenizer(tok_path: Path, args: "ModelArgs") -> "Tokenizer":
    """model/'s tokenizer (ours, its special ids checked, or a pretrained one), refused when it
    has more tokens than the model."""
    from ..data import Tokenizer
    ours = Tokenizer.load(tok_path)
    if ours.vocab_size > args.vocab_size:
        raise ConfigError(f"{tok_path} has {ours.vocab_size} tokens but the model only "
                          f"{args.vocab_size}; the folder's files do not belong together")
    return ours


def _hf_tokenizer(tok_path: Path, ours: "Tokenizer", args: "ModelArgs"):
    """Our tokenizer.json as a transformers fast tokenizer. Like ours it adds no special tokens
    when encoding (no post-processor) and never matches "[EOT]" written in text as the special
    token (split_special_tokens, our `encode_special_tokens`)."""
    from transformers import PreTrainedTokenizerFast

    from ..data.tokenizer import BOT, EOT, PAD, UNK
    extra = {"unk_token": UNK} if ours.hf.token_to_id(UNK) is not None else {}
    return PreTrainedTokenizerFast(
        tokenizer_file=str(tok_path), bos_token=BOT, eos_token=EOT, pad_token=PAD,
        split_special_tokens=True, clean_up_tokenization_spaces=False,
        model_max_length=args.max_seq_length, **extra)

