"""docs/options.md against the one-line docstrings of the option fields (CPU, fast)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

from cg_lightning.ddp.options import DDPOptions
from cg_lightning.graphs.options import GraphOptions
from cg_lightning.options import field_docs

REPO = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_options_doc", REPO / "scripts" / "gen_options_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cls", [GraphOptions, DDPOptions], ids=lambda c: c.__name__)
def test_every_field_has_a_one_line_docstring(cls):
    docs = field_docs(cls)
    assert list(docs) == [f.name for f in dataclasses.fields(cls)]
    for name, entry in docs.items():
        assert entry.doc, f"{cls.__name__}.{name} has no docstring"
        assert "\n" not in entry.doc, f"{cls.__name__}.{name}: docstring is not one line"


def test_options_md_matches_the_docstrings():
    gen = _generator()
    assert gen.problems() == []
    text = (REPO / "docs" / "options.md").read_text(encoding="utf-8")
    assert text == gen.render(), "docs/options.md is stale: run python scripts/gen_options_doc.py"
    for cls, _, _ in gen.SECTIONS:
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text


def test_field_docs_reads_the_string_under_each_field(tmp_path, monkeypatch):
    source = tmp_path / "opts_example.py"
    source.write_text(textwrap.dedent('''
        from dataclasses import dataclass
        from typing import Optional

        @dataclass
        class Opts:
            """Class docstring."""

            a: int = 1
            """The a."""

            b: Optional[str] = None

            c: bool = False
            """
            The c.
            """

            def method(self) -> None:
                """Not a field."""
    '''))
    spec = importlib.util.spec_from_file_location("opts_example", source)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "opts_example", module)  # where inspect looks up the class's file
    spec.loader.exec_module(module)
    docs = field_docs(module.Opts)
    assert list(docs) == ["a", "b", "c"]
    assert (docs["a"].annotation, docs["a"].doc) == ("int", "The a.")
    assert (docs["b"].annotation, docs["b"].doc) == ("Optional[str]", None)
    assert docs["c"].doc == "The c."
    with pytest.raises(TypeError):
        field_docs(int)
