"""Where the front end's files are, and a resolver that never leaves that directory.

The front end lives in the repository's top-level ``web/``; the wheel installs it as the
package ``sweepmaster.web``. plotly.js is the copy inside the installed ``plotly`` package, so
the dashboard needs no network at all.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path, PurePosixPath

__all__ = ["MEDIA_TYPES", "plotly_js", "resolve_static", "web_dir"]

MEDIA_TYPES: dict[str, str] = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".json": "application/json",
}
"""The only file types served from ``web/``, with their media types."""


def web_dir() -> Path:
    """Locate the front end's directory.

    Returns:
        The installed package ``sweepmaster.web`` when there is one, else ``web/`` of the
        source checkout this module was imported from.
    """
    try:
        installed = importlib.resources.files("sweepmaster.web")
    except ModuleNotFoundError:
        installed = None
    if installed is not None and installed.joinpath("index.html").is_file():
        return Path(str(installed))
    checkout = Path(__file__).resolve().parents[2] / "web"
    assert (checkout / "index.html").is_file(), f"no dashboard front end at {checkout}"
    return checkout


def plotly_js() -> Path:
    """Return the path of ``plotly.min.js`` shipped inside the installed ``plotly`` package."""
    path = Path(str(importlib.resources.files("plotly") / "package_data" / "plotly.min.js"))
    assert path.is_file(), f"the installed plotly package has no {path}"
    return path


def resolve_static(root: Path, relative: str) -> Path | None:
    """Resolve a requested path inside ``root``, or refuse it.

    Refused: empty or absolute paths, ``.``/``..`` or hidden segments, backslashes, NUL
    bytes, file types outside :data:`MEDIA_TYPES`, anything that resolves (through symbolic
    links too) outside ``root``, and anything that is not a regular file.

    Args:
        root: The directory files are served from.
        relative: The path the request named, relative to ``root``.

    Returns:
        The file's resolved path, or ``None`` when the request is refused.
    """
    if not relative or "\\" in relative or "\x00" in relative:
        return None
    pure = PurePosixPath(relative)
    if pure.is_absolute() or any(part in ("", ".", "..") or part.startswith(".")
                                 for part in relative.split("/")):
        return None
    if pure.suffix not in MEDIA_TYPES:
        return None
    base = root.resolve()
    path = (base / pure).resolve()
    if not path.is_relative_to(base) or not path.is_file():
        return None
    return path
