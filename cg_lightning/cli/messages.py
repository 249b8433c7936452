"""jsonargparse's errors as lines that name the full key, and the file each key came from.

jsonargparse words a bad value as a tree: ``Parser key "model": ... Problem with given class_path '...': Parser
key "n_layer": Expected a <class 'int'>. Got value: abc``, with the alternatives of every ``Union`` it tried.
:func:`translate` walks that tree to the innermost problem and its full key (``model.init_args.n_layer: expected
int, got 'abc'``). :class:`Reporter` adds the source of each key (:class:`~cg_lightning.cli.sources.Provenance`)
and raises the problems together as one :class:`~cg_lightning.errors.ConfigError`. Finding every problem of a
configuration, not only the first: :mod:`cg_lightning.cli.diagnosis`.
"""

from __future__ import annotations

import re
from typing import List, Optional, Sequence, Tuple, Union

from cg_lightning.errors import ConfigError
from cg_lightning.option_checks import join_key

from .keys import Problem
from .schema import ClassPathError, class_schema, resolve_class, suggest
from .sources import Provenance

#: alternatives of a Union that only say the value is not of that type
_MISMATCH = re.compile(r"^(Expected a |Not a valid subclass|Expected a path but|Expected a dot import path|Import path )")
_EXPECTED = re.compile(r"^Expected a (.+?)\. Got value: (.*)$", re.S)
_OPTION_KEY = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+): (.*)$", re.S)  # "graphs.backend: expected ..."
_PARSER_KEY = re.compile(r'^Parser key "([^"]+)"(?: element (\d+))?:?\s*(.*)$')
_CLASS_PATH = re.compile(r"^Problem with given class_path '([^']+)':\s*(.*)$")
_UNKNOWN = (re.compile(r"^Option '([^']+)' is not accepted"), re.compile(r"^Group '[^']*' does not accept option "
                                                                         r"'([^']+)'"),
            re.compile(r"^Key '([^']+)' is not expected"))


def _blocks(lines: List[str]) -> List[Tuple[str, List[str]]]:
    """Lines into ``(head, indented lines below it)`` pairs, by indentation; list dashes dropped from heads."""
    lines = [line for line in lines if line.strip()]
    out: List[Tuple[str, List[str]]] = []
    if not lines:
        return out
    base = min(len(line) - len(line.lstrip()) for line in lines)
    for line in lines:
        if len(line) - len(line.lstrip()) <= base or not out:
            head = line.strip()
            out.append((head[2:] if head.startswith("- ") else head, []))
        else:
            out[-1][1].append(line)
    return out


def type_names(text: str) -> str:
    """``[<class 'int'>, <class 'NoneType'>]`` -> ``int or null``; module prefixes dropped."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    text = re.sub(r"<class '([\w.]+)'>", r"\1", text)
    text = re.sub(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)", r"\1", text).replace("NoneType", "null")
    text = re.sub(r"Literal\[([^\]]*)\]", r"one of (\1)", text)
    parts = [p.strip() for p in re.split(r",\s*(?![^\[(]*[\])])", text) if p.strip()]
    order = ("bool", "int", "float", "str")  # jsonargparse's order of Union members differs between versions
    parts.sort(key=lambda p: (p == "null", order.index(p) if p in order else len(order), p.lower()))
    return " or ".join(parts)


def translate(message: str, key: str = "") -> Tuple[str, str]:
    """``(full key, what is wrong)`` for a jsonargparse error message (see the module docstring)."""
    key, text, _ = translate_through(message, key, None)
    return key, text


def translate_through(message: str, key: str, class_path: Optional[str]) -> Tuple[str, str, Optional[str]]:
    """:func:`translate` below ``key``, also returning the innermost ``class_path`` the key went through (to place
    list items)."""
    blocks = _blocks(message.splitlines())
    for i, (head, body) in enumerate(blocks):
        m = _PARSER_KEY.match(head)
        if m:
            sub = m.group(1) + (f"[{int(m.group(2)) - 1}]" if m.group(2) else "")
            return translate_through("\n".join(([m.group(3)] if m.group(3) else []) + body), join_key(key, sub), class_path)
        m = _CLASS_PATH.match(head)
        if m:
            inner = "\n".join(([m.group(2)] if m.group(2) else []) + body)
            sub_key, text, inner_class = translate_through(inner, join_key(key, "init_args"), m.group(1))
            return sub_key, _with_suggestion(text, sub_key, m.group(1)), inner_class or m.group(1)
        if head.startswith("Does not validate against any of the Union subtypes"):
            return _union(blocks[i + 1:], key, class_path)
        if _MISMATCH.match(head) and any(h.startswith("Does not validate") for h, _ in blocks[i + 1:]):
            continue  # the alternatives below say more
        for pattern in _UNKNOWN:
            m = pattern.match(head)
            if m:
                return join_key(key, m.group(1)), "unknown key", class_path
        m = _EXPECTED.match(" ".join([head, *[b.strip() for b in body]]))
        if m:
            got = m.group(2).strip()
            if got == "???":
                return key, f"missing value ('???'); expected {type_names(m.group(1))}", class_path
            return key, f"expected {type_names(m.group(1))}, got {got!r}", class_path
        m = _OPTION_KEY.match(head)
        if m:
            return join_key(key, m.group(1)), " ".join([m.group(2), *[b.strip() for b in body]]), class_path
        return key, " ".join([head, *[b.strip() for b in body]]).strip(), class_path
    return key, message.strip() or "rejected", class_path


def _union(blocks: List[Tuple[str, List[str]]], key: str, class_path: Optional[str]) -> Tuple[str, str, Optional[str]]:
    """The telling alternative of a failed ``Union`` (a class's own problem), else what the Union accepts."""
    subtypes, given, errors = "", "", []
    for head, body in blocks:
        if head.startswith("Subtypes:"):
            subtypes = head[len("Subtypes:"):]
        elif head.startswith("Given value:"):
            given = head[len("Given value:"):].strip()
        elif head.startswith("Errors:"):
            errors = _blocks(body)
    telling = [(h, b) for h, b in errors if not _MISMATCH.match(h)]
    if telling:
        head, body = telling[0]
        return translate_through("\n".join([head, *body]), key, class_path)
    accepted = type_names(subtypes)
    hint = ""
    if re.search(r"\b[A-Z]\w+", accepted.replace("Literal", "").replace("Iterable", "")):
        hint = " (a class is given as {class_path: package.module.Class, init_args: {...}})"
    if given == "???":
        return key, f"missing value ('???'); expected {accepted}{hint}", class_path
    return key, f"expected {accepted}, got {given!r}{hint}", class_path


def union_reason(message: str) -> Optional[str]:
    """The telling alternative of a failed ``Union`` (a constructor's own words), as it was raised; or ``None``."""
    for head, body in _blocks(message.splitlines()):
        if head.startswith("Errors:"):
            for item, lines in _blocks(body):
                if not _MISMATCH.match(item):
                    return "\n".join([item, *(line.strip() for line in lines)])
    return None


def _with_suggestion(text: str, key: str, class_path: str) -> str:
    if text != "unknown key":
        return text
    try:
        schema = class_schema(resolve_class(class_path, ()))
    except ClassPathError:
        schema = None
    if schema is None:
        return f"unknown key: not an argument of {class_path}"
    valid = sorted(schema.fields)
    close = suggest(key.rsplit(".", 1)[-1], valid)
    hint = f" (did you mean '{close}'?)" if close else ""
    return f"unknown key{hint}: not an argument of {class_path}, which takes {', '.join(valid) or 'none'}"


class Reporter:
    """Turns :class:`~cg_lightning.cli.keys.Problem` lists into a :class:`ConfigError` whose lines name each key's
    source: ``<source>: <key>: <what is wrong>``."""

    def __init__(self, provenance: Provenance) -> None:
        self.provenance = provenance

    def line(self, problem: Union[Problem, str]) -> str:
        if isinstance(problem, str):
            return problem
        if not problem.key:
            return problem.text
        source = self.provenance.source_of(problem.key)
        text = problem.text
        for other in [] if not problem.cite_others else sorted(set(re.findall(r"\b(?:model|data|trainer)\.[\w.]+\w", text)) - {problem.key}):
            other_source = self.provenance.source_of(other)
            if other_source and other_source != source:
                text += f" ({other} from {other_source})"
        return f"{source}: {problem.key}: {text}" if source else f"{problem.key}: {text}"

    def error(self, problems: Sequence[Union[Problem, str]]) -> ConfigError:
        """One :class:`ConfigError` of all ``problems``; their ``details`` (tracebacks) in its ``details``."""
        error = ConfigError("\n".join(self.line(p) for p in problems))
        error.details = "\n".join(p.details for p in problems if isinstance(p, Problem) and p.details)
        return error

    def raise_if(self, problems: Sequence[Union[Problem, str]], cause: Optional[BaseException] = None) -> None:
        """Raise :meth:`error` of ``problems`` (from ``cause``), if there are any."""
        if problems:
            raise self.error(problems) from cause


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
