"""The fenced `bash` and `python` blocks of README.md and docs/**/*.md, with the marker a block may
carry on the line before its fence:

    <!-- not run: WHY -->          the tests cannot run it here (GPUs, nodes, a download, ...)
    <!-- run by: TEST_FILE, ... --> a test of its own runs it in the folder it needs

Every other block is run as printed by tests/e2e/test_doc_blocks.py."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tests.conftest import REPO

_BLOCK = re.compile(r"(?:<!-- (not run|run by): (.*?) -->\n)?```(bash|python)\n(.*?)```",
                    re.DOTALL)


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int
    lang: str
    code: str
    marker: Optional[str]  # "not run" | "run by" | None
    reason: str

    def commands(self) -> list[list[str]]:
        """A bash block's commands as argument lists (continuations joined, comments dropped)."""
        out = []
        for line in self.code.replace("\\\n", " ").splitlines():
            args = shlex.split(line, comments=True)
            if args:
                out.append(args)
        return out


def pages() -> list[Path]:
    return [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))


def doc_blocks() -> list[Block]:
    blocks = []
    for page in pages():
        text = page.read_text()
        for m in _BLOCK.finditer(text):
            blocks.append(Block(str(page.relative_to(REPO)), text.count("\n", 0, m.start()) + 1,
                                m.group(3), m.group(4), m.group(1), m.group(2) or ""))
    return blocks
