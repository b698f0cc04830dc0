"""Package exports imported on first use (PEP 562 module ``__getattr__``).

A light command (``--help``, ``validate``, ``status``) then pays only for the modules it reads:
importing :mod:`sweepmaster.runtime` does not import torch until a name that needs it is used.

A package declares its exports once, as the imports of its ``if TYPE_CHECKING:`` block, which
type checkers read as they are and :func:`lazy_exports` reads from the package's source::

    from typing import TYPE_CHECKING

    from sweepmaster.lazy_exports import lazy_exports

    if TYPE_CHECKING:
        from sweepmaster.store.engine import create_store_engine

    __getattr__, __dir__, __all__ = lazy_exports(globals())
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["declared_exports", "lazy_exports"]


def declared_exports(source: str, package: str) -> dict[str, tuple[str, str]]:
    r"""The names a package's ``if TYPE_CHECKING:`` block imports -> their modules.

    Example:
        >>> text = "if TYPE_CHECKING:\n    from .engine import create_engine\n"
        >>> declared_exports(text, "pkg")
        {'create_engine': ('pkg.engine', 'create_engine')}

    Args:
        source: The package's ``__init__.py`` text.
        package: The package's ``__name__``; a relative import (``from .x import y``) is taken
            relative to it.

    Returns:
        Each exported name (its ``as`` name where it has one) -> the absolute name of the
        module that defines it, and its name there.

    Raises:
        ValueError: The block imports a whole module (``import x``) or ``*``: only
            ``from <module> import <name>`` declares an export.
    """
    exports: dict[str, tuple[str, str]] = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
                and node.test.id == "TYPE_CHECKING"):
            continue
        for statement in node.body:
            if not isinstance(statement, ast.ImportFrom):
                raise ValueError(f"{package}: the TYPE_CHECKING block declares exports as "
                                 f"'from <module> import <name>' only, line {statement.lineno}")
            module = statement.module or ""
            if statement.level:
                base = package.rsplit(".", statement.level - 1)[0]
                module = f"{base}.{module}" if module else base
            for alias in statement.names:
                if alias.name == "*":
                    raise ValueError(f"{package}: cannot export '*' (line {statement.lineno})")
                exports[alias.asname or alias.name] = (module, alias.name)
    return exports


def lazy_exports(
    namespace: dict[str, Any],
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """A package's ``__getattr__``, ``__dir__`` and ``__all__`` from its one declaration.

    The declaration is the package's ``if TYPE_CHECKING:`` block of ``from <module> import
    <name>`` lines (:func:`declared_exports`); each name is imported on first use.

    Args:
        namespace: The package's ``globals()`` (its ``__name__`` and ``__file__`` are read);
            a name, once imported, is kept there so later lookups do not come back here.

    Returns:
        ``(__getattr__, __dir__, __all__)``, to assign at the package's top level.
        ``__getattr__`` raises ``AttributeError`` for a name that is not exported; ``__all__``
        is the exported names, sorted.
    """
    package = namespace["__name__"]
    exports = declared_exports(Path(namespace["__file__"]).read_text(encoding="utf-8"), package)

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, original = exports[name]
        value = getattr(importlib.import_module(module), original)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__, sorted(exports)
