"""Every value of a configuration the parser rejects, not only the first.

jsonargparse stops at its first problem. :func:`parse_problems` parses the sources again without each value found
bad, until the rest parses (at most :data:`MAX_PROBLEMS` rounds), and words each with :func:`describe`: a
jsonargparse error through :func:`~cg_lightning.cli.messages.translate`, an OmegaConf interpolation that does not
resolve through its own ``full_key``. Where jsonargparse does not say which item of a list failed, or says too
little, the item and the constructor's annotation are found from the merged sources.
"""

from __future__ import annotations

import re
import typing
from typing import Any, List, Optional, Sequence, Tuple

import yaml

from cg_lightning.option_checks import expected_type

from .keys import Problem
from .messages import translate_through, first_line
from .schema import resolve_class
from .sources import Invocation, merge

MAX_PROBLEMS = 20


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
    return translate_through(str(exc), "", None)


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
