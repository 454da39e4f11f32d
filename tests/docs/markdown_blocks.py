"""Fenced code blocks of the Markdown docs, with the marker comment on their first line.

A block whose first line is `# cpu-test` is run by tests/docs/test_doc_commands.py; a Python block
whose first line is `# doc-test: NAME.py` is saved as NAME.py and exercised by the tests of the
page it belongs to.
"""

import re
from dataclasses import dataclass
from pathlib import Path

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
SHELL_LANGUAGES = ("bash", "sh", "shell", "console", "zsh")


@dataclass
class FencedBlock:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str  # "bash", "python", "" ...
    body: str  # the text between the fences, indentation of the fence removed

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"

    def marker(self, name: str) -> str | None:
        """For a first line `# name` -> "", `# name: value` -> "value"; None without the marker."""
        first = self.body.split("\n", 1)[0].strip()
        match = re.fullmatch(rf"#\s*{re.escape(name)}\s*(?::\s*(.*))?", first)
        if match is None:
            return None
        return (match.group(1) or "").strip()

    @property
    def is_shell(self) -> bool:
        return self.language in SHELL_LANGUAGES


def fenced_blocks(path: Path) -> list[FencedBlock]:
    """Every fenced block of the Markdown file at `path`, in order. An unclosed fence is an error."""
    blocks, lines = [], Path(path).read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence, language = opening.groups()
        body = []
        j = i + 1
        while j < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: the fenced block opened here is never closed")
        blocks.append(FencedBlock(Path(path), i + 1, language.lower(), "\n".join(body) + "\n"))
        i = j + 1
    return blocks
