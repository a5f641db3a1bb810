"""A prompt/answer set that every Python installation already has on disk.

Tests and examples of fine-tuning need real (input, output) pairs without a download; a
function's signature and the first line of its docstring are such a pair, and the standard
library holds thousands of them. Files are visited in a seeded permutation of their sorted
paths and parsing stops once enough pairs are found, so a small request reads a few files.
"""

from __future__ import annotations

import ast
import os
import sysconfig
import warnings
from typing import Dict, List

import numpy as np

from ..errors import DataError

# Vendored packages and tests: large, repetitive, and mostly without docstrings.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests",
                        "idle_test", "lib2to3"})


def stdlib_pairs(max_pairs: int, seed: int = 0) -> List[Dict[str, str]]:
    """Up to max_pairs {"input": "def name(args):", "output": first docstring line} dicts.

    Deterministic for a given Python installation, max_pairs and seed; functions without a
    docstring are skipped, and a (signature, line) pair seen before is not repeated."""
    if max_pairs <= 0:
        return []
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    if not files:
        raise DataError(f"no Python source files under {root}; this Python has no standard "
                        "library source to build pairs from")
    files.sort()
    pairs: List[Dict[str, str]] = []
    seen = set()
    for index in np.random.default_rng(seed).permutation(len(files)):
        for pair in _file_pairs(files[index]):
            key = (pair["input"], pair["output"])
            if key not in seen:
                seen.add(key)
                pairs.append(pair)
                if len(pairs) == max_pairs:
                    return pairs
    return pairs


def _file_pairs(path: str) -> List[Dict[str, str]]:
    try:
        with open(path, "r", encoding="utf-8") as f:
            source = f.read()
        with warnings.catch_warnings():  # invalid escape sequences in old modules
            warnings.simplefilter("ignore")
            tree = ast.parse(source, filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []  # deliberately broken test inputs, non-UTF-8 files
    pairs = []
    for node in ast.walk(tree):  # breadth-first, in source order within each level
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        first_line = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""
        if not first_line:
            continue
        keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
        pairs.append({"input": f"{keyword} {node.name}({ast.unparse(node.args)}):",
                      "output": first_line})
    return pairs
