"""Problems the parser, the constructors, the Trainer and the run report, as lines that name the key and its file.

jsonargparse words a bad value as a tree: ``Parser key "model": ... Problem with given class_path '...': Parser
key "n_layer": Expected a <class 'int'>. Got value: abc``, with the alternatives of every ``Union`` it tried.
:func:`translate` walks that tree to the innermost problem and its full key (``model.init_args.n_layer: expected
int, got 'abc'``). :func:`parse_problems` finds every such problem of a configuration, not only the first: it
parses again without each value found bad, until the rest parses. :class:`Reporter` adds the source of each key
(:class:`~cg_lightning.cli.sources.Provenance`) and raises them together as one
:class:`~cg_lightning.errors.ConfigError`.
"""

from __future__ import annotations

import re
import typing
from typing import Any, List, Optional, Sequence, Tuple, Union

import yaml

from cg_lightning.errors import ConfigError
from cg_lightning.option_checks import expected_type, join_key

from .keys import Problem
from .schema import ClassPathError, class_schema, resolve_class, suggest
from .sources import Invocation, Provenance, merge

MAX_PROBLEMS = 20
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
    key, text, _ = _translate(message, key, None)
    return key, text


def _translate(message: str, key: str, class_path: Optional[str]) -> Tuple[str, str, Optional[str]]:
    """:func:`translate`, also returning the innermost ``class_path`` the key went through (to place list items)."""
    blocks = _blocks(message.splitlines())
    for i, (head, body) in enumerate(blocks):
        m = _PARSER_KEY.match(head)
        if m:
            sub = m.group(1) + (f"[{int(m.group(2)) - 1}]" if m.group(2) else "")
            return _translate("\n".join(([m.group(3)] if m.group(3) else []) + body), join_key(key, sub), class_path)
        m = _CLASS_PATH.match(head)
        if m:
            inner = "\n".join(([m.group(2)] if m.group(2) else []) + body)
            sub_key, text, inner_class = _translate(inner, join_key(key, "init_args"), m.group(1))
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
        return _translate("\n".join([head, *body]), key, class_path)
    accepted = type_names(subtypes)
    hint = ""
    if re.search(r"\b[A-Z]\w+", accepted.replace("Literal", "").replace("Iterable", "")):
        hint = " (a class is given as {class_path: package.module.Class, init_args: {...}})"
    if given == "???":
        return key, f"missing value ('???'); expected {accepted}{hint}", class_path
    return key, f"expected {accepted}, got {given!r}{hint}", class_path


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


def _value_at(data: Any, key: str) -> Any:
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", key):
        if part.startswith("[") and isinstance(data, list) and int(part[1:-1]) < len(data):
            data = data[int(part[1:-1])]
        elif isinstance(data, dict) and part in data:
            data = data[part]
        else:
            return None
    return data


def _from_annotation(key: str, merged: Any, class_path: str) -> Optional[str]:
    """``expected <type>, got <value>`` from the constructor's annotation, where jsonargparse's own words say less
    (some versions answer a ``Literal`` mismatch with "Cannot take a Union of no types.")."""
    try:
        hints = typing.get_type_hints(resolve_class(class_path, ()).__init__)
    except Exception:  # noqa: BLE001 - no annotation to go by
        return None
    tp, value = hints.get(key.rsplit(".", 1)[-1]), _value_at(merged, key)
    expected = expected_type(tp, value) if tp is not None else None
    return f"expected {expected}, got {value!r}" if expected else None


def place_list_items(key: str, merged: Any, class_path: Optional[str]) -> str:
    """``trainer.callbacks.init_args.mode`` -> ``trainer.callbacks[1].init_args.mode``: jsonargparse does not say
    which item of a list of classes failed; the item with the failing ``class_path`` is named."""
    parts, node, out = key.split("."), merged, []
    for part in parts:
        if isinstance(node, list):
            matches = [i for i, item in enumerate(node) if isinstance(item, dict) and item.get("class_path") == class_path]
            index = matches[0] if matches else 0
            out[-1] += f"[{index}]"
            node = node[index] if node else None
        out.append(part)
        name, _, index = part.partition("[")
        node = node.get(name) if isinstance(node, dict) else None
        if index and isinstance(node, list):
            node = node[int(index.rstrip("]"))] if int(index.rstrip("]")) < len(node) else None
    return ".".join(out)


def _without(data: Any, key: str) -> Any:
    """``data`` less the value at ``key`` (``a.b[1].c``): the diagnosis goes on without a value found bad."""
    parts = re.findall(r"[^.\[\]]+|\[\d+\]", key)
    if not parts:
        return data
    head, rest = parts[0], ".".join(parts[1:]).replace(".[", "[")
    if head.startswith("["):
        index = int(head[1:-1])
        if not isinstance(data, list) or index >= len(data):
            return data
        if not rest:
            return data[:index] + data[index + 1:]
        return data[:index] + [_without(data[index], rest)] + data[index + 1:]
    if not isinstance(data, dict) or head not in data:
        return data
    if not rest:
        return {k: v for k, v in data.items() if k != head}
    return {**data, head: _without(data[head], rest)}


def describe(exc: BaseException, subcommand: Optional[str] = None) -> Tuple[str, str, Optional[str]]:
    """``(full key, what is wrong, innermost class_path)`` for a parse failure: a jsonargparse error
    (:func:`translate`) or an OmegaConf interpolation that does not resolve (its ``full_key``, without the
    subcommand's section)."""
    full_key = getattr(exc, "full_key", None)
    if full_key is not None and type(exc).__module__.startswith("omegaconf"):
        key = str(full_key)
        if subcommand and key.startswith(subcommand + "."):
            key = key[len(subcommand) + 1:]
        text = first_line(exc).replace(f"'{subcommand}.", "'") if subcommand else first_line(exc)
        text = re.sub(r"Interpolation key '[^']*' not found \(resolved to '([^']*)'\)", r"no key '\1'", text)
        return key, f"interpolation does not resolve: {text}", None
    return _translate(str(exc), "", None)


def parse_problems(parser: Any, invocation: Invocation, first: Optional[BaseException], subcommand: Optional[str],
                   skip: Sequence[str] = ()) -> List[Problem]:
    """Every value of the configuration the parser rejects, each with its full key (see the module docstring).

    Args:
        parser: the subcommand's parser.
        invocation: the sources, in order (canonical data).
        first: the error of the real parse, translated alone when the diagnosis does not reproduce it.
        subcommand: the subcommand, whose section interpolation errors name first.
        skip: keys already reported, left out of every parse.
    """
    sources = [s.data for s in invocation.sources]
    for key in skip:
        sources = [_without(data, key) for data in sources]
    problems: List[Problem] = []
    for _ in range(MAX_PROBLEMS):
        args: List[str] = []
        for data in sources:
            args += ["--config", yaml.safe_dump(data, default_flow_style=True, width=10**9).strip()]
        try:
            parser.parse_args(args)
            break
        except Exception as exc:  # noqa: BLE001 - every parse failure is reported, whatever its type
            key, text, class_path = describe(exc, subcommand)
            merged: dict = {}
            for data in sources:
                merged = merge(merged, data)
            key = place_list_items(key, merged, class_path)
            if not text.startswith(("expected", "unknown key", "missing", "interpolation")) and class_path:
                text = _from_annotation(key, merged, class_path) or text
            if not key or any(p.key == key for p in problems):
                break
            problems.append(Problem(key, text, value=True))
            sources = [_without(data, key) for data in sources]
    if not problems and first is not None:
        key, text, _ = describe(first, subcommand)
        problems.append(Problem(key or "configuration", text))
    return problems


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
