"""Small text helpers shared by the CLI, the config tree and the log: one home each."""

from __future__ import annotations

from typing import Any, Mapping, Sequence


def first_line(e: BaseException) -> str:
    """An exception's first line (libraries raise multi-line messages; we report one line)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: the dotted keys of the config tree."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def one_of(items: Sequence[str]) -> str:
    """["a", "b", "c"] -> "a, b or c": a choice named in a sentence."""
    items = list(items)
    return " or ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)


def human_count(n: float) -> str:
    """641 -> "641", 12_345 -> "12.3K", 6_520_000 -> "6.52M": readable at every size."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{int(n)}" if float(n).is_integer() else f"{n:.3g}"


def human_bytes(n: float) -> str:
    """Bytes in G or M (binary units), as the memory tables show them."""
    return f"{n / 2**30:.2f}G" if n >= 2**30 else f"{n / 2**20:.1f}M"


def count_of(n: int, noun: str, plural: str = "") -> str:
    """'1 entry', '3 entries': a count with its noun in the right number."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
