"""The package stays readable at a glance (the project's style, DESIGN.md): no source file over 400
lines (a module per concept), and no function in runtime/ over 60 (the rank's run and its loop
read top to bottom, a phase or a step per function)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "src" / "paratrain"
MAX_FILE_LINES = 400
MAX_RUNTIME_FUNCTION_LINES = 60


def test_no_source_file_over_400_lines():
    long = [f"{p.relative_to(PKG.parent)}: {n} lines" for p in sorted(PKG.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, (f"files over {MAX_FILE_LINES} lines (split them along a concept line):\n"
                      + "\n".join(long))


def test_no_function_in_runtime_over_60_lines():
    long = []
    for path in sorted((PKG / "runtime").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # decorators aside, docstring included
                if n > MAX_RUNTIME_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name}: "
                                f"{n} lines")
    assert not long, (f"functions over {MAX_RUNTIME_FUNCTION_LINES} lines in runtime/:\n"
                      + "\n".join(long))
