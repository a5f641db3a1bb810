"""A local Hugging Face model (`model.arch=hf model.path=DIR`; a causal LM unless the task loads
it with another auto class): built from its config, loaded from safetensors only (nothing from
the path is unpickled, nothing is downloaded), and saved as a `from_pretrained` folder."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..data.tokenizer import tokenizer_files
from ..errors import ConfigError
from ..fileio import atomic_dir


@dataclass(frozen=True)
class HFArgs:
    """`model.arch=hf`: a local Hugging Face causal LM (a directory with config.json, with or
    without weights). Nothing is downloaded: local files only."""
    path: str
    vocab_size: int
    arch: str = "hf"
    auto_class: str = "AutoModelForCausalLM"  # the transformers class the task loads with
    quantize: Optional[str] = None  # model.quantize: nf4 | int8 through bitsandbytes
    trust_remote_code: bool = False  # model.trust_remote_code: run the folder's own model code

    def to_dict(self) -> dict:
        return {"arch": self.arch, "path": self.path, "vocab_size": self.vocab_size}

    @classmethod
    def of(cls, model: Any, vocab_size: int, auto_class: str = "AutoModelForCausalLM",
           path: Optional[str] = None, quantized: bool = True) -> "HFArgs":
        """What a task loads with, from the config's model section (`model`), so that
        model.trust_remote_code and model.quantize reach every task alike. `path`: another
        folder than model.path (a reference model); `quantized=False`: full precision whatever
        model.quantize says (a frozen reference, or the base a quantized run's adapters are
        merged onto). The config refuses model.quantize where a task cannot take it."""
        return cls(str(path if path is not None else model.path), vocab_size,
                   auto_class=auto_class, quantize=model.quantize if quantized else None,
                   trust_remote_code=model.trust_remote_code)


def remote_code(trust: bool) -> dict:
    """transformers' `trust_remote_code` argument for model.trust_remote_code: every load of a
    run's folders passes it, so a model that ships its own code loads everywhere or nowhere."""
    return {"trust_remote_code": True} if trust else {}


def hf_config(path: Any, trust_remote_code: bool = False, **changes: Any) -> Any:
    """The folder's AutoConfig, local files only; `changes` override its fields."""
    import transformers
    return transformers.AutoConfig.from_pretrained(Path(str(path)).expanduser(),
                                                   local_files_only=True,
                                                   **remote_code(trust_remote_code), **changes)


def build_hf(args: HFArgs) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.arch=hf needs the transformers package: "
                          "pip install 'paratrain[hf]'") from None
    p = Path(args.path).expanduser()
    remote = remote_code(args.trust_remote_code)
    config = hf_config(p, args.trust_remote_code)
    if getattr(config, "vocab_size", args.vocab_size) < args.vocab_size:
        raise ConfigError(f"model.path={args.path!r} has vocab_size={config.vocab_size}, smaller "
                          f"than the tokenizer's {args.vocab_size}; raise it in config.json or "
                          "lower data.vocab_size")
    auto = getattr(transformers, args.auto_class)
    if loads_weights(p):  # safetensors only: nothing from the path is unpickled
        return auto.from_pretrained(p, local_files_only=True, use_safetensors=True,
                                    **quantized(args.quantize), **remote)
    return auto.from_config(config, **remote)


def quantized(quantize: Optional[str]) -> dict:
    """from_pretrained's arguments for model.quantize: the frozen base's linear layers stored by
    bitsandbytes in 4-bit NF4 (compute in fp32) or int8, quantized as they load on the CPU (the
    parallelism moves them to the device afterwards); {} when not quantized."""
    if not quantize:
        return {}
    import transformers
    config = (transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                              bnb_4bit_compute_dtype=torch.float32)
              if quantize == "nf4" else transformers.BitsAndBytesConfig(load_in_8bit=True))
    return {"quantization_config": config, "device_map": {"": "cpu"}}


def quiet_transformers() -> None:
    """transformers' own progress bars ("Loading weights" inside `generate`'s output), length
    warnings and the FutureWarning peft triggers on every worker (`is_gradient_checkpointing is
    deprecated`) would interleave with our log; the encoders report truncation themselves."""
    import warnings

    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.* is deprecated",
                            category=FutureWarning)


def make_portable(folder: Path) -> None:
    """Make the model folder transformers 5 wrote readable by transformers 4.4x as well (users
    still run them; DataDreamer pins 4.49): its config.json and tokenizer_config.json, where
    present. docs/transformers-compat.md has the check this was measured with."""
    folder = Path(folder)
    if (folder / "config.json").is_file():
        portable_config(folder)
    if (folder / "tokenizer_config.json").is_file():
        portable_tokenizer_config(folder)


def portable_tokenizer_config(folder: Path) -> None:
    """5.x names a plain fast tokenizer's class TokenizersBackend, which 4.x does not know
    (`Tokenizer class TokenizersBackend does not exist`); PreTrainedTokenizerFast is the same
    class under the name both read. Any other class name is left as it is."""
    import json
    path = Path(folder) / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def portable_config(folder: Path) -> None:
    """Make the config.json transformers 5 wrote in `folder` readable by 4.x as it reads 5.x's:
    5.x keeps rope_theta (and any rope scaling) only inside rope_parameters, which 4.x ignores
    (it would use its default theta, silently), and writes `dtype` for 4.x's `torch_dtype`. The
    older spellings are added beside the new ones; 5.x reads either."""
    import json
    path = Path(folder) / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def loads_weights(folder: Path) -> bool:
    """Whether building the model reads the folder's weights: when it has safetensors, unless
    the model is being built on the meta device (a check or a plan that needs its structure
    only; transformers refuses `from_pretrained` there)."""
    import torch

    from ..config.model_folder import has_weights
    return has_weights(folder) and torch.get_default_device().type != "meta"


def save_hf(model: nn.Module, out_dir: Path, state: dict, tokenizer_path: Optional[Path]) -> None:
    """A `save_pretrained` folder (safetensors), written atomically like every output."""
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        if tokenizer_path is not None:
            for name, f in tokenizer_files(tokenizer_path).items():
                shutil.copyfile(f, tmp / name)
        make_portable(tmp)


def is_hf_folder(model_dir: Path) -> bool:
    """A `from_pretrained` folder (its config.json names a model_type), not one of ours."""
    import json
    try:
        return "model_type" in json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def load_hf(model_dir: Path, device: Any = "cpu") -> tuple[nn.Module, Any]:
    """(model, tokenizer) of a `from_pretrained` folder, offline, safetensors only: the model
    class its config.json names (AutoModelForCausalLM when it names none transformers has), in
    eval mode."""
    import json

    import transformers
    quiet_transformers()
    names = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or []
    cls = next((getattr(transformers, n) for n in names if hasattr(transformers, n)),
               transformers.AutoModelForCausalLM)
    model = cls.from_pretrained(model_dir, local_files_only=True, use_safetensors=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model.to(device).eval(), tokenizer


def load_for_prompt(model_dir: Path, auto_class: str, prompt: str, device: str
                    ) -> tuple[Any, nn.Module, Any]:
    """(tokenizer, model in eval mode on `device`, the prompt encoded as tensors) for a trained
    folder (local safetensors only), loaded with the transformers class `auto_class`; a prompt
    with no tokens is one ConfigError line."""
    import transformers
    transformers.logging.set_verbosity_error()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = getattr(transformers, auto_class).from_pretrained(
        model_dir, local_files_only=True, use_safetensors=True).to(device).eval()
    ids = tokenizer(prompt, return_tensors="pt").to(device)
    if ids["input_ids"].numel() == 0:
        raise ConfigError("--prompt encodes to no tokens; give some text")
    return tokenizer, model, ids


def generate_hf_chat(model_dir: Path, prompt: str, opts: Any) -> str:
    """A chat run: the prompt is a user turn (after the run's system prompt) rendered with its
    chat template; the prompt, then the reply on a line of its own."""
    return _prompt_and_reply(prompt, generate_hf(model_dir, prompt, opts, template=True))


def generate_hf_reply(model_dir: Path, prompt: str, opts: Any) -> str:
    """A run on input->output pairs: the prompt rendered as training rendered its inputs (with
    the chat template and system prompt when the run used them), then the reply on a line of
    its own."""
    return _prompt_and_reply(prompt, generate_hf(model_dir, prompt, opts,
                                                 template=opts.chat_template))


def _prompt_and_reply(prompt: str, reply: str) -> str:
    return f"{prompt}\n{reply.strip()}"


def prompt_ids(tokenizer: Any, prompt: str, system_prompt: Optional[str],
               template: bool) -> list[int]:
    """`prompt`'s token ids as training saw an input: with `template` (and a chat template on the
    tokenizer), a user turn after the system prompt, ready for the assistant's reply; else the
    text as the tokenizer encodes it."""
    if template and getattr(tokenizer, "chat_template", None):
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        ids = tokenizer.apply_chat_template(system + [{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tokenizer(prompt)["input_ids"])


def generate_hf(model_dir: Path, prompt: str, opts: Any, template: Optional[bool] = None) -> str:
    """Sample from a Hugging Face causal LM folder (local files only). `template` None: continue
    `prompt` as text and return prompt + continuation (a language model); else return the
    continuation alone, the prompt rendered as a user turn with the chat template (and
    `opts.system_prompt` first) when `template` is true and the tokenizer has one.
    `opts`: generate.GenerateOptions."""
    import torch
    import transformers
    quiet_transformers()
    device, temperature, top_k = opts.device, opts.temperature, opts.top_k
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, local_files_only=True, use_safetensors=True).to(device).eval()
    ids = prompt_ids(tokenizer, prompt, opts.system_prompt, bool(template))
    if not ids:
        raise ConfigError("--prompt encodes to no tokens; give some text")
    torch.manual_seed(opts.seed)
    idx = torch.tensor([ids], device=device)  # (1, T0)
    sample = temperature > 0
    out = model.generate(idx, attention_mask=torch.ones_like(idx),
                         max_new_tokens=opts.max_new_tokens,
                         do_sample=sample, temperature=temperature if sample else None,
                         top_k=top_k if sample else None,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    text = tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
    return text if template is not None else prompt + text


def check_packed_attention(model: nn.Module) -> None:
    """data.pack=true: the model must keep packed examples apart when given per-example position
    ids and no attention mask. transformers detects packed rows from position ids that restart
    (masking_utils.find_packed_sequence_indices for sdpa / eager / flex_attention; the
    flash-attention paths read them as cumulative lengths), but only with no cache (use_cache is
    switched off here) and only in models built on its masking utilities. So this tries it: two
    pieces of 3 and 2 tokens in one row, against the second alone, in eval mode and fp32-exact
    within 1e-4, on the last hidden states (a causal LM's and a sequence classifier's alike: the
    heads act per token); a model that leaks is refused in one line."""
    import torch
    model.config.use_cache = False  # a cache turns transformers' packed-row detection off
    impl = getattr(model.config, "_attn_implementation", None)
    vocab = model.get_input_embeddings().num_embeddings
    param = next(model.parameters())
    ids = torch.arange(5, device=param.device)[None] % vocab  # (1, 5)
    positions = torch.tensor([[0, 1, 2, 0, 1]], device=param.device)  # (1, 5)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = _last_hidden(model(ids, position_ids=positions,
                                        output_hidden_states=True))[0, 3:]  # (2, C)
            alone = _last_hidden(model(ids[:, 3:], output_hidden_states=True))[0]  # (2, C)
        leaks = float((packed - alone).abs().max()) > 1e-4 * max(1.0, float(alone.abs().max()))
    except (TypeError, ValueError, RuntimeError) as e:
        leaks, impl = True, f"{impl} ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
    finally:
        model.train(was_training)
    if leaks:
        raise ConfigError(
            f"data.pack=true: {type(model).__name__} with attention {impl} lets packed examples "
            "see each other (it does not honour per-example position ids without a mask); use "
            "a model transformers builds on its masking utilities (Llama, Qwen2, Mistral, "
            "Gemma, ...) with attn_implementation sdpa, eager, flex_attention or "
            "flash_attention_2, or leave data.pack=false and set data.group_by_length=true")


def _last_hidden(out: Any) -> Any:
    """(B, T, C) the last layer's hidden states of a transformers output, in fp32."""
    return out.hidden_states[-1].float()


PACKED_ATTENTION = "paratrain_packed"  # the attention implementation packed runs register


def use_packed_attention(model: nn.Module) -> None:
    """Packed rows on a model that runs SDPA: attention computed example by example on the CPU
    (`packed_sdpa`: each example's own causal SDPA, so a row of several examples costs the sum
    of their squares, not the row's square), transformers' SDPA with the block mask it builds
    from the position ids elsewhere. Other implementations (eager, flex, flash) are kept: they
    honour the position ids themselves (`check_packed_attention` tries it)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    AttentionInterface.register(PACKED_ATTENTION, packed_sdpa)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
    model.set_attn_implementation(PACKED_ATTENTION)


def packed_sdpa(module: nn.Module, query: Any, key: Any, value: Any, attention_mask: Any,
                dropout: float = 0.0, scaling: Optional[float] = None, **kwargs: Any) -> Any:
    """transformers' attention interface: q (B, H, T, D), k / v (B, KV, T, D) -> (B, T, H, D).
    On the CPU with packed position ids, each example (a run of positions restarting at 0) gets
    its own causal SDPA; otherwise (on CUDA, or a step that reads a KV cache: keys longer than
    the queries, as online RL's sampling does) transformers' SDPA with `attention_mask`."""
    import torch
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    positions = kwargs.get("position_ids")
    if (query.is_cuda or positions is None or positions.shape[0] != query.shape[0]
            or key.shape[2] != query.shape[2]):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    p = dropout if module.training else 0.0
    rows = []
    for b, starts in enumerate((positions == 0).tolist()):
        cuts = [t for t, s in enumerate(starts) if s or t == 0] + [len(starts)]
        rows.append(torch.cat([F.scaled_dot_product_attention(
            query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e],
            dropout_p=p, is_causal=True, scale=scaling, enable_gqa=True)  # (1, H, e-s, D)
            for s, e in zip(cuts, cuts[1:])], dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None  # (B, T, H, D)
