"""Relative links between the docs (and to scripts/, examples/) point to files that exist."""

import re
from pathlib import Path

import pytest

DOCS = sorted((Path(__file__).resolve().parents[2] / "docs").glob("*.md"))


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_relative_links_point_to_files_that_exist(path):
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        if not (path.parent / target.split("#", 1)[0]).exists():
            missing.append(target)
    assert missing == [], f"{path.name} links to missing files: {missing}"
