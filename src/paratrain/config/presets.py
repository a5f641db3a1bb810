"""Model sizes by name, and the one function that turns `model.*` config keys into ModelArgs.

No torch import here: `checks.validate()` calls `resolve_model_config` so that a bad shape is
reported before any process starts, and that check should cost milliseconds.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, NoReturn, Optional

from ..errors import ConfigError

ARCHS = ("llama", "gpt")

# Sizes only. vocab_size comes from the tokenizer and max_seq_length from data.seq_length, so
# a preset is a shape, not a checkpoint (the llama3-* presets, published shapes, carry their
# vocabulary and RoPE base too). num_kv_heads applies to llama only (gpt has no GQA);
# intermediate_size is derived from hidden_size per arch unless set (see _default_intermediate).
# Parameter counts below are llama with untied embeddings (gpt ties its head: fewer).
PRESETS: dict[str, dict] = {
    # for unit tests: a forward pass in a millisecond
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2),
    # the default CPU job: ~6.5M params at vocab 4096 (gpt: 5.9M); ~1 s per step of
    # 8 x 256 tokens on 2 CPU cores
    "small": dict(hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=4),
    # ~16M params at vocab 4096 (gpt: same)
    "medium": dict(hidden_size=384, num_layers=8, num_heads=6, num_kv_heads=3),
    # GPT-2-small-like: ~134M params at vocab 32000 (gpt, tied: ~110M)
    "base": dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12),
    # GPT-2-medium-like: ~345M params at vocab 32000
    "large": dict(hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=8),
    # Llama-3.2-1B's blocks (its vocabulary left to the tokenizer): ~1.1B params at vocab 32000;
    # the GPU throughput bench's (benchmarks/gpu_throughput.py)
    "1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
               intermediate_size=8192),
    # Meta's Llama 3 / 3.1 shapes as published (model cards, params.json): for `paratrain plan`
    # at scale; their vocabulary and RoPE base are part of the shape (a smaller tokenizer's ids
    # fit in the embeddings; the rest go unused)
    "llama3-8b": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                      intermediate_size=14336, vocab_size=128256, rope_theta=500000.0),
    "llama3-70b": dict(hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                       intermediate_size=28672, vocab_size=128256, rope_theta=500000.0),
    "llama3-405b": dict(hidden_size=16384, num_layers=126, num_heads=128, num_kv_heads=8,
                        intermediate_size=53248, vocab_size=128256, rope_theta=500000.0),
}

_SIZE_KEYS = ("hidden_size", "num_layers", "num_heads")


@dataclass(frozen=True)
class ModelArgs:
    """Everything needed to build a model; saved as model/config.json next to the weights."""

    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_seq_length: int
    tie_embeddings: bool
    dropout: float = 0.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelArgs":
        """Strict on keys: a config.json from another tool or version should fail loudly."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ConfigError(f"model config has unknown key(s) {', '.join(unknown)}; "
                              f"expected keys: {', '.join(names)}")
        required = [f.name for f in fields(cls) if f.default is MISSING]
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"model config is missing key(s) {', '.join(missing)}")
        args = cls(**d)
        validate_args(args)
        return args


def resolve_model_config(mc: Any, vocab_size: int, seq_length: int) -> ModelArgs:
    """Preset fills what the user left unset; explicit keys win; then the shape is checked. `mc`
    is the model.* section (config.ModelConfig), read by attribute: this module sits below config.

    `vocab_size` is the tokenizer's (mc.vocab_size overrides it, e.g. to pad to a multiple of
    64, and so does a preset that carries its own); `seq_length` is data.seq_length, the
    default and the minimum max_seq_length.
    """
    arch = mc.arch
    if arch not in ARCHS:
        raise ConfigError(f"model.arch={arch!r} is not one of: {', '.join(ARCHS)}")
    preset: dict = {}
    if mc.preset is not None:
        if mc.preset not in PRESETS:
            raise ConfigError(f"model.preset={mc.preset!r} is not a known preset; choose one of: "
                              f"{', '.join(PRESETS)} (or null and set every size key)")
        preset = PRESETS[mc.preset]
    source: dict[str, str] = {}  # key -> where its value came from, for error messages

    def pick(key: str) -> Any:
        value = getattr(mc, key)
        if value is not None:
            return value
        if key in preset:
            source[key] = f" comes from preset {mc.preset!r}"
            return preset[key]
        return None

    sizes = {}
    for key in _SIZE_KEYS:
        sizes[key] = pick(key)
        if sizes[key] is None:
            raise ConfigError(f"model.{key} is not set and model.preset is null; set model.{key} "
                              f"or choose a preset ({', '.join(PRESETS)})")
    hidden, heads = sizes["hidden_size"], sizes["num_heads"]

    if arch == "gpt":
        if mc.num_kv_heads is not None and mc.num_kv_heads != heads:
            raise ConfigError(f"model.num_kv_heads={mc.num_kv_heads} is not supported with "
                              f"model.arch='gpt' (no grouped-query attention); remove it or "
                              f"set it to model.num_heads={heads}")
        kv_heads = heads
    else:
        kv_heads = pick("num_kv_heads")
        if kv_heads is None:
            kv_heads = heads

    intermediate = pick("intermediate_size")
    if intermediate is None:
        intermediate = _default_intermediate(arch, hidden)
    tie = mc.tie_embeddings if mc.tie_embeddings is not None else (arch == "gpt")
    vocab = pick("vocab_size") or vocab_size
    rope_theta = pick("rope_theta") or 10000.0
    max_seq = mc.max_seq_length if mc.max_seq_length is not None else seq_length
    if max_seq < seq_length:
        raise ConfigError(f"model.max_seq_length={max_seq} is shorter than data.seq_length="
                          f"{seq_length}; raise model.max_seq_length or lower data.seq_length")

    args = ModelArgs(arch=arch, hidden_size=hidden, num_layers=sizes["num_layers"],
                     num_heads=heads, num_kv_heads=kv_heads, intermediate_size=intermediate,
                     vocab_size=vocab, max_seq_length=max_seq, tie_embeddings=bool(tie),
                     dropout=float(mc.dropout), rope_theta=float(rope_theta),
                     norm_eps=float(mc.norm_eps))
    validate_args(args, source)
    return args


def validate_args(args: ModelArgs, source: Optional[dict[str, str]] = None) -> None:
    """Shape checks with one-line messages that name the `model.*` key and a fix."""
    src = source or {}

    def at(key: str) -> str:
        return f"model.{key}={getattr(args, key)}"

    def fail(message: str, culprit: str) -> NoReturn:
        """If the value to fix came from the preset, say so: the user never typed it."""
        raise ConfigError(message + (f" (model.{culprit}{src[culprit]})" if culprit in src
                                     else ""))

    if args.arch not in ARCHS:
        raise ConfigError(f"model.arch={args.arch!r} is not one of: {', '.join(ARCHS)}")
    for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                "vocab_size", "max_seq_length"):
        value = getattr(args, key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            fail(f"{at(key)} must be a positive integer", key)
    if args.hidden_size % args.num_heads:
        fail(f"{at('num_heads')} does not divide {at('hidden_size')}; pick a divisor of "
             f"{args.hidden_size} such as {_near_divisors(args.hidden_size, args.num_heads)}",
             "num_heads")
    if args.num_heads % args.num_kv_heads:
        fail(f"{at('num_kv_heads')} does not divide {at('num_heads')}; pick a divisor of "
             f"{args.num_heads} such as {_near_divisors(args.num_heads, args.num_kv_heads)}",
             "num_kv_heads")
    if args.arch == "gpt" and args.num_kv_heads != args.num_heads:
        raise ConfigError(f"{at('num_kv_heads')} is not supported with model.arch='gpt' "
                          f"(no grouped-query attention); set it to {at('num_heads')}")
    if args.arch == "llama" and args.head_dim % 2:
        fail(f"{at('hidden_size')} / {at('num_heads')} gives head_dim={args.head_dim}, but "
             f"rotary embeddings need an even head_dim; change model.num_heads or "
             f"model.hidden_size", "num_heads")
    if not 0.0 <= args.dropout < 1.0:
        raise ConfigError(f"model.dropout={args.dropout} must be in [0, 1)")
    if args.rope_theta <= 0 or args.norm_eps <= 0:
        raise ConfigError(f"model.rope_theta={args.rope_theta} and model.norm_eps="
                          f"{args.norm_eps} must be positive")


def _default_intermediate(arch: str, hidden: int) -> int:
    """GPT: 4x. Llama: SwiGLU has three matrices, so 2/3 of 4x keeps the MLP's parameter count
    (and FLOPs) equal to GPT's; rounded up to a multiple of 64 for efficient matmuls."""
    if arch == "gpt":
        return 4 * hidden
    return -(-int(8 * hidden / 3) // 64) * 64


def _near_divisors(n: int, wanted: int) -> str:
    """The two divisors of n closest to what the user asked for, as 'a or b'."""
    divs = sorted((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - wanted), -d))
    return " or ".join(str(d) for d in sorted(divs[:2]))
