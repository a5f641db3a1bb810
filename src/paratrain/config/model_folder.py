"""What a local Hugging Face model folder holds, read before any worker starts: its tokenizer,
its weights (whole or cut short), its embedding rows and the longest sequence it takes. One home
for these, so the config checks, the tasks and the model builders ask the same questions.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Optional

from ..errors import ConfigError
from .hub import hub_origin, resolve_folder

# Files any one of which makes a folder loadable by transformers' AutoTokenizer.from_pretrained.
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                     "spiece.model", "vocab.txt")
# The context length a transformers config.json states, under the names models use for it.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length",
                 "n_ctx")
FALLBACK_MAX_LENGTH = 1024  # data.max_length when the model's config states no limit


def model_config(path: Optional[str]) -> dict:
    """A model folder's config.json (or that file) as a dict; {} when there is none (the config
    checks say what model.path lacks). A file that is there but not a JSON object is refused
    (one ConfigError line) the first time anything asks, before anything starts; each version
    of a file is read once."""
    file = Path(str(path)).expanduser()
    file = file / "config.json" if file.is_dir() else file
    try:
        st = file.stat()
    except OSError:
        return {}
    return dict(_read_model_config(str(file), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=16)
def _read_model_config(file: str, mtime_ns: int, size: int) -> dict:
    try:
        info = json.loads(Path(file).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{file} cannot be read as a model's config.json ({e}); restore it "
                          "from the model's source (from_pretrained reads it)") from None
    if not isinstance(info, dict):
        raise ConfigError(f"{file} holds {type(info).__name__}, not the JSON object a model's "
                          "config.json is; restore it from the model's source")
    return info


def resolve_models(cfg: Any) -> None:
    """Every model folder a config names, as a local folder, decided once when the config is
    built (before any worker): model.path (a Hub id at model.revision -> its snapshot folder in
    huggingface_hub's cache; model.revision then records the commit), dpo.reference and each of
    rl.reward_models (their main revision). One resolver for all: config/hub.py."""
    m = cfg.model
    if m.path and m.arch == "hf":
        m.path = resolve_folder(m.path, m.revision, "model.path")
        origin = hub_origin(m.path)
        if origin is not None:
            m.revision = origin.commit
    if cfg.dpo.reference:
        cfg.dpo.reference = resolve_folder(cfg.dpo.reference, None, "dpo.reference")
    cfg.rl.reward_models = [resolve_folder(str(f), None, "rl.reward_models")
                            for f in cfg.rl.reward_models]


def check_remote_code(cfg: Any) -> None:
    """A model whose config.json names its own code (auto_map) is refused, in one line, unless
    model.trust_remote_code=true: from_pretrained would run that code with the user's rights."""
    auto_map = model_config(cfg.model.path).get("auto_map") if cfg.model.path else None
    if auto_map and not cfg.model.trust_remote_code:
        raise ConfigError(f"model.path={cfg.model.path!r} ships its own Python code (auto_map in "
                          "its config.json), which loading would run with your rights; read it, "
                          "then set model.trust_remote_code=true to allow it")


def refuse_encoder_decoder(path: Optional[str], trains: str) -> None:
    """One ConfigError line when model.path holds an encoder-decoder model (T5, BART) and the
    task cannot train one; `trains` says what it trains instead."""
    info = model_config(path)
    if info.get("is_encoder_decoder"):
        raise ConfigError(f"model.path={path!r} is an encoder-decoder model "
                          f"({info.get('model_type', '?')}); {trains}")


def model_positions(path: Optional[str]) -> Optional[int]:
    """The longest sequence model.path's config.json says the model takes (None: not stated)."""
    info = model_config(path) if path else {}
    for key in POSITION_KEYS:
        if isinstance(info.get(key), int) and not isinstance(info.get(key), bool):
            return info[key]
    return None


def has_tokenizer(folder: str | os.PathLike) -> bool:
    """The folder holds a tokenizer saved with save_pretrained (one of TOKENIZER_MARKERS)."""
    p = Path(folder).expanduser()
    return p.is_dir() and any((p / name).is_file() for name in TOKENIZER_MARKERS)


def check_embeddings(cfg: Any, vocab_size: int) -> None:
    """A tokenizer with more ids than model.path's embeddings (vocab_size in its config.json)
    is refused in one line, before any worker starts (building the model would fail in each)."""
    model_vocab = model_config(cfg.model.path).get("vocab_size")
    if isinstance(model_vocab, int) and vocab_size > model_vocab:
        where = (f"data.tokenizer={cfg.data.tokenizer}" if cfg.data.tokenizer != "auto"
                 else "model.path's tokenizer")
        raise ConfigError(f"{where} has {vocab_size} tokens but model.path's embeddings hold "
                          f"{model_vocab} (vocab_size in its config.json): ids beyond that have "
                          "no embedding; use the tokenizer the model was trained with")


def check_weights(folder: str | os.PathLike) -> None:
    """Refuse, before any worker starts, a safetensors file in model.path that cannot be read
    whole: its header must parse and its tensors must end within the file (a download or copy
    cut short fails here, naming the file, not in a worker)."""
    p = Path(folder).expanduser()
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ConfigError(f"{index} is damaged (not a safetensors index with a weight_map); "
                              "copy the model folder again") from None
        files = [p / name for name in shards]
    else:
        files = [p / "model.safetensors"] if (p / "model.safetensors").exists() else []
    for f in files:
        problem = _safetensors_problem(f)
        if problem:
            raise ConfigError(f"model.path's weights {f} are damaged: {problem}; copy or "
                              "download the model folder again")


def _safetensors_problem(f: Path) -> Optional[str]:
    """What is wrong with one safetensors file, from its header alone (None: nothing)."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                return f"the file is {size:,} bytes, too short for its header (cut short?)"
            header = json.loads(fh.read(n))
    except FileNotFoundError:
        return "the file is missing"
    except (OSError, ValueError) as e:
        return f"its header cannot be read ({type(e).__name__})"
    ends = [v["data_offsets"][1] for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v]
    need = 8 + n + max(ends, default=0)
    if need > size:
        return f"the file is {size:,} bytes but its tensors need {need:,} (cut short?)"
    return None


def has_weights(folder: str | os.PathLike) -> bool:
    """A Hugging Face model folder with safetensors weights (else it is built from config)."""
    p = Path(folder).expanduser()
    return p.is_dir() and any((p / n).exists() for n in
                              ("model.safetensors", "model.safetensors.index.json"))
