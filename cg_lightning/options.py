"""Options dataclasses: turning user arguments into them, and reading their fields' one-line docstrings.

Every field of an options dataclass (``GraphOptions``, ``DDPOptions``) carries its documentation as a string
literal on the line after it. Python keeps no such string at run time, so :func:`field_docs` reads them back
from the module's source; ``scripts/gen_options_doc.py`` writes ``docs/options.md`` from them.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Any, Dict, Mapping, Optional, Type, TypeVar

from .option_checks import check_options, join_key, unknown_key_text

T = TypeVar("T")


def as_options(cls: Type[T], value: Any, what: str) -> T:
    """``cls()`` for ``None``, a copy of ``value`` if it is a ``cls``, ``cls(**value)`` for a mapping.

    Both are checked field by field (:func:`~cg_lightning.option_checks.check_options`), so that a
    problem reads as in a YAML file: ``graphs.warmup_steps: expected int, got 'two'``. The copy keeps an
    instance given by the user, or as a signature's default (what ``--print_config`` shows), apart from the
    options a front end changes in place (``CUDAGraphCallback``'s schedule).

    Args:
        cls: an options dataclass (``GraphOptions``, ``DDPOptions``).
        value: what the user passed.
        what: the argument's name, the section in messages (``"graphs"``).

    Raises:
        TypeError: ``value`` of another type, a mapping with a key that is not a field (the message suggests
            the closest field and lists them all), a field value of the wrong type.
        ValueError: a field value out of range or not one of its choices.
    """
    if value is None:
        return cls()
    if isinstance(value, cls):
        check_options(value, what)  # its fields may have been set after construction
        return dataclasses.replace(value)
    if isinstance(value, Mapping):
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in value if k not in known]
        if unknown:
            raise TypeError("\n".join(f"{join_key(what, k)}: {unknown_key_text(k, what, known)}" for k in unknown))
        return cls(**value)
    raise TypeError(f"{what}: expected a {cls.__name__}, a mapping of its fields or None, got {value!r}")


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    """One field of an options dataclass as written in its source.

    Attributes:
        name: the field's name.
        annotation: its type annotation as written (``"Optional[List[str]]"``).
        doc: the string literal right under the field, or ``None`` when there is none.
    """

    name: str
    annotation: str
    doc: Optional[str]


def field_docs(cls: type) -> Dict[str, FieldDoc]:
    """The fields of dataclass ``cls`` in declaration order, each with the docstring written under it.

    Reads the class's source with :mod:`ast`: an annotated assignment followed directly by a string
    expression statement is a documented field.

    Raises:
        TypeError: ``cls`` is not a dataclass.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    out: Dict[str, FieldDoc] = {}
    body = node.body
    for i, stmt in enumerate(body):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        nxt = body[i + 1] if i + 1 < len(body) else None
        doc = None
        if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            doc = inspect.cleandoc(nxt.value.value)
        out[stmt.target.id] = FieldDoc(stmt.target.id, ast.unparse(stmt.annotation), doc)
    return out
