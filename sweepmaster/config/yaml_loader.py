"""Reading YAML text for sweep files: safe, strict, and bounded.

:func:`load_yaml` is ``yaml.safe_load`` with three differences that matter for hand-written
sweep files, and every failure turned into a one-line
:class:`~sweepmaster.errors.ConfigError`:

- ``1e-4`` is a float (YAML 1.1 wants ``1.0e-4``; everyone writes ``1e-4``);
- a key given twice in one mapping is an error (YAML would keep the last one silently, e.g.
  a second ``train:`` section replacing the first);
- the document must be a tree of bounded size: at most :data:`MAX_CHARS` characters, at most
  :data:`MAX_DEPTH` levels of nesting, at most :data:`MAX_NODES` values once aliases are
  expanded, and no alias cycles. Deeper documents would exhaust Python's recursion limit,
  "billion laughs" alias bombs would expand to billions of values in the checks that follow,
  and a document of millions of values takes minutes to parse: the parser stops at the
  :data:`MAX_NODES` th value it reads.

Example:
    >>> load_yaml("lr: 1e-4", "sweep.yaml")
    {'lr': 0.0001}
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from sweepmaster.errors import ConfigError

__all__ = ["MAX_CHARS", "MAX_DEPTH", "MAX_NODES", "load_yaml"]

#: Longest document (characters; a sweep file takes a few thousand): PyYAML parses about
#: 250,000 characters a second.
MAX_CHARS = 262_144

#: Deepest nesting of mappings and lists a sweep file may have (sweep.yaml needs about 5).
MAX_DEPTH = 32
#: Most values (scalars, mappings, lists) a document may hold once its aliases are expanded.
MAX_NODES = 100_000


class _TooManyNodes(Exception):
    """The parser read more than :data:`MAX_NODES` values."""


class _Loader(yaml.SafeLoader):
    """SafeLoader reading ``1e-4`` as a float, refusing duplicate keys, counting values."""

    num_nodes = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        """Compose one value; past :data:`MAX_NODES` of them, stop with ``_TooManyNodes``."""
        self.num_nodes += 1
        if self.num_nodes > MAX_NODES:
            raise _TooManyNodes
        return super().compose_node(parent, index)  # type: ignore[no-untyped-call]

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """Build a mapping; a key that occurs twice raises ``ConstructorError``."""
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: SafeLoader reports it below
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r} (first at line "
                    f"{seen[key].start_mark.line + 1})", key_node.start_mark)
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?(?:[0-9][0-9_]*)[eE][-+]?[0-9]+
                   |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def load_yaml(text: str, source: str, key: str = "") -> Any:
    """Parse YAML text into plain Python values (dicts, lists, str, int, float, bool, None).

    Args:
        text: The YAML document.
        source: Where it came from, for error messages (a file name).
        key: The key path it is the value of, for error messages (``--set`` values); empty
            for a whole file.

    Returns:
        The parsed document.

    Raises:
        ConfigError: Invalid YAML (with line:column where the parser knows it), a duplicate
            key, a document longer than :data:`MAX_CHARS`, nested deeper than
            :data:`MAX_DEPTH`, of (or expanding to) more than :data:`MAX_NODES` values, or an
            alias that contains itself.
    """
    if len(text) > MAX_CHARS:
        raise ConfigError(source, key, f"a YAML document of at most {MAX_CHARS} characters, got "
                          f"{len(text)}")
    try:
        document = yaml.load(text, Loader=_Loader)  # a SafeLoader: plain values only
    except _TooManyNodes:
        raise ConfigError(source, key, f"a YAML document of at most {MAX_NODES} values") \
            from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = exc.problem or exc.context or "cannot parse"
        raise ConfigError(source, key, f"invalid YAML{where}: {problem}") from None
    except yaml.reader.ReaderError as exc:
        raise ConfigError(source, key, f"invalid YAML: {exc.reason} U+{exc.character:04X} at "
                          f"character {exc.position + 1}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, key, f"invalid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(source, key, f"invalid YAML: nested more than {MAX_DEPTH} levels "
                          "deep") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise ConfigError(source, key, f"invalid YAML: {str(exc).split(';')[0]}") from None
    _check_tree(document, source, key)
    return document


def _check_tree(document: Any, source: str, key: str) -> None:
    """Check depth, expanded size and acyclicity without expanding aliases (memoized)."""
    sizes: dict[int, tuple[int, int]] = {}  # id -> (depth, expanded size) of a container
    on_path: set[int] = set()
    # An explicit stack of (node, children still to visit): no recursion, however deep.
    stack: list[tuple[Any, list[Any]]] = []

    def children(node: Any) -> list[Any] | None:
        if isinstance(node, dict):
            return [*node.keys(), *node.values()]
        if isinstance(node, list):
            return list(node)
        return None

    def enter(node: Any) -> None:
        if id(node) in on_path:
            raise ConfigError(source, key, "a YAML document without an alias that contains "
                              "itself (an anchor used inside its own value)")
        if len(stack) >= MAX_DEPTH:
            raise ConfigError(source, key, f"a YAML document nested at most {MAX_DEPTH} "
                              "levels deep")
        on_path.add(id(node))
        stack.append((node, children(node) or []))

    if children(document) is None:
        return
    enter(document)
    while stack:
        node, todo = stack[-1]
        if todo:
            child = todo.pop()
            if children(child) is None:
                continue
            if id(child) not in sizes:
                enter(child)
            elif len(stack) + sizes[id(child)][0] > MAX_DEPTH:  # a shared subtree, seen before
                raise ConfigError(source, key, f"a YAML document nested at most {MAX_DEPTH} "
                                  "levels deep")
            continue
        stack.pop()
        on_path.discard(id(node))
        depth, size = 1, 1
        for child in children(node) or []:
            child_depth, child_size = sizes.get(id(child), (0, 1))
            depth, size = max(depth, child_depth + 1), size + child_size
        if size > MAX_NODES:
            raise ConfigError(source, key, f"a YAML document of at most {MAX_NODES} values "
                              "once its aliases are expanded")
        sizes[id(node)] = (depth, size)
