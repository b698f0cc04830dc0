"""Package exports imported on first use (PEP 562 module ``__getattr__``).

A light command (``--help``, ``validate``, ``status``) then pays only for the modules it reads:
importing :mod:`sweepmaster.runtime` does not import torch until a name that needs it is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` that import each exported name on first use.

    Example:
        >>> space: dict[str, Any] = {}
        >>> getattr_, dir_ = lazy_exports("pkg", {"sqrt": "math"}, space)
        >>> getattr_("sqrt")(4.0), "sqrt" in space
        (2.0, True)

    Args:
        package: The package's ``__name__`` (for messages).
        exports: Each exported name -> the absolute name of the module that defines it.
        namespace: The package's ``globals()``; a name, once imported, is kept there so later
            lookups do not come back here.

    Returns:
        ``(__getattr__, __dir__)``, to assign at the package's top level. ``__getattr__`` raises
        ``AttributeError`` for a name that is not exported.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
