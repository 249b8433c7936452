"""YAML read as the parser reads it (PyYAML's safe loader), refusing what that loader lets through.

PyYAML keeps the last of two equal keys in one mapping, which YAML 1.2 forbids: ``trainer: {max_steps: 3,
max_steps: 5}``, or two ``trainer:`` sections in one file, would train with the later value without a word. It
expands aliases without a bound: a few lines of lists of aliases of lists (``&b [*a, *a, ...]``) make millions of
values, which every later walk of the configuration visits. And it builds nested collections by recursion, so a
deep enough document ends in a ``RecursionError``.

:func:`load` checks the text before any value is built: the nesting depth on PyYAML's event stream (no recursion),
then, on its composed node graph (where an alias is a shared node, so each node is visited once), the size and
depth once aliases are expanded, aliases that contain themselves, and duplicate keys. Each problem is one line
naming the key, and the line(s) of the text, where it has them.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import yaml

from cg_lightning.option_checks import join_key

#: mappings and lists inside each other; a configuration uses a handful (trainer.strategy.init_args.graphs.layers)
MAX_DEPTH = 32
#: keys, values and list items, an alias counted at every use; a configuration has a few hundred
MAX_NODES = 100_000
_MERGE = "tag:yaml.org,2002:merge"  # '<<: *base' takes the keys of *base; later keys of the mapping win over them
_OPEN = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_CLOSE = (yaml.MappingEndEvent, yaml.SequenceEndEvent)


def load(text: str, where: Callable[[Any], str], key: str = "") -> Tuple[Any, List[str]]:
    """``(value, [])``, or ``(None, problems)`` for a document that is too deep, too large once its aliases are
    expanded, contains itself through an alias, or repeats a key in a mapping.

    Args:
        text: the YAML text.
        where: a PyYAML mark -> the place it names, in the caller's words (``FILE:LINE``).
        key: the full key of the document's value (an override's: ``trainer``), which the problems' keys extend.

    Raises:
        yaml.YAMLError: the text is not YAML, as ``yaml.safe_load`` raises it.
    """
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        depth += isinstance(event, _OPEN) - isinstance(event, _CLOSE)
        if depth > MAX_DEPTH:
            return None, [f"mappings and lists nested deeper than {MAX_DEPTH} levels (at {where(event.start_mark)}); "
                          f"the command line reads at most {MAX_DEPTH} levels"]
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        problems = _Walk(where).problems(node, key)
        if problems:
            return None, problems
        return (loader.construct_document(node) if node is not None else None), []
    finally:
        loader.dispose()


class _Walk:
    """One pass over a composed node graph: size and height after alias expansion (memoized per node), cycles,
    duplicate keys (each mapping checked once, under the first key that reaches it)."""

    def __init__(self, where: Callable[[Any], str]) -> None:
        self.where = where
        self.seen: Dict[int, Tuple[int, int]] = {}  #: id(node) -> (nodes below and including it, its height)
        self.open: Dict[int, Any] = {}  #: the collections being walked: an alias to one of them is a cycle
        self.duplicates: List[str] = []
        self.cycle: Optional[str] = None

    def problems(self, root: Any, key: str) -> List[str]:
        if root is None:
            return []
        size, height = self.visit(root, key)
        if self.cycle:
            return [self.cycle]
        if size > MAX_NODES:
            return [f"{size:,} values once its aliases (*name) are expanded, more than the {MAX_NODES:,} the "
                    "command line reads; write the values out, or use fewer aliases of aliases"]
        if height > MAX_DEPTH:
            return [f"mappings and lists nested {height} levels deep once its aliases (*name) are expanded; the "
                    f"command line reads at most {MAX_DEPTH} levels"]
        return self.duplicates

    def visit(self, node: Any, path: str) -> Tuple[int, int]:
        known = self.seen.get(id(node))
        if known is not None:
            return known
        if id(node) in self.open:
            self.cycle = self.cycle or (f"{path or 'the document'}: the collection anchored at "
                                        f"{self.where(node.start_mark)} holds an alias of itself; its value would be "
                                        "infinite")
            return 1, 0
        if isinstance(node, yaml.ScalarNode):
            return 1, 0
        self.open[id(node)] = node
        if isinstance(node, yaml.MappingNode):
            self._duplicates(node, path)
            parts = [part for key, value in node.value  # in the order of the text: an alias follows its anchor
                     for part in (self.visit(key, path), self.visit(value, join_key(path, _name(key))))]
        else:
            parts = [self.visit(item, f"{path}[{i}]") for i, item in enumerate(node.value)]
        del self.open[id(node)]
        result = 1 + sum(s for s, _ in parts), 1 + max((h for _, h in parts), default=0)
        self.seen[id(node)] = result
        return result

    def _duplicates(self, node: Any, path: str) -> None:
        first: Dict[Tuple[str, str], Any] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == _MERGE:
                continue
            earlier = first.setdefault((key.tag, key.value), key)
            if earlier is not key:
                at, again = self.where(earlier.start_mark), self.where(key.start_mark)
                if at == again:  # one line: {max_steps: 3, max_steps: 5}
                    at, again = (f"{at}, column {k.start_mark.column + 1}" for k in (earlier, key))
                self.duplicates.append(f"{join_key(path, key.value)}: given twice in one mapping, at {at} and at "
                                       f"{again}; a key may appear once in a mapping (YAML 1.2): keep one")


def _name(key: Any) -> str:
    return key.value if isinstance(key, yaml.ScalarNode) else "?"
