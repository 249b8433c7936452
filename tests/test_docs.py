"""The documents: every relative link of the README, the changelog and docs/ reaches a file of the repository, and
the changelog, linked from the README, opens with the release the package is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import cg_lightning

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
#: the target of a markdown link, without its #anchor
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file(document: Path):
    targets = [t for t in LINK.findall(document.read_text()) if "://" not in t and not t.startswith("mailto:")]
    assert [t for t in targets if not (document.parent / t).exists()] == []


def test_changelog_is_linked_and_opens_with_this_release():
    assert "](CHANGELOG.md)" in (ROOT / "README.md").read_text()
    text = (ROOT / "CHANGELOG.md").read_text()
    heading, section = re.search(r"^## \[([^\]]+)\](.*?)(?=^## |\Z)", text, re.M | re.S).groups()
    assert heading in ("Unreleased", cg_lightning.__version__)
    assert cg_lightning.__version__ in heading + section
