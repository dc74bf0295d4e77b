"""The fenced code blocks of the README, CONTRIBUTING.md and docs/, as the documentation tests read them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..environment import REPO_ROOT

DOC_FILES = sorted([REPO_ROOT / "README.md", REPO_ROOT / "CONTRIBUTING.md", *(REPO_ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^```(\S*)(.*)$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    options: frozenset[str]  # the words after the language on the opening fence (`runnable`, `serving`)
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO_ROOT)}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    blocks, opened, lines = [], None, []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = FENCE.match(line.strip())
        if opened is None and match:
            opened, lines = (number, match.group(1), frozenset(match.group(2).split())), []
        elif opened is not None and line.strip() == "```":
            blocks.append(Block(path, opened[0], opened[1], opened[2], "\n".join(lines)))
            opened = None
        elif opened is not None:
            lines.append(line)
    return blocks


ALL_BLOCKS = [block for path in DOC_FILES for block in code_blocks(path)]
