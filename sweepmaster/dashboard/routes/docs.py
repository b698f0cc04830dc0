"""The API's interactive documentation: Swagger UI served from the ``fastapi-offline`` package.

FastAPI's own ``/docs`` loads Swagger UI from a CDN and starts it with an inline script; the
dashboard's Content-Security-Policy (``script-src 'self'``) blocks both, and offline the CDN is
unreachable anyway. Here the page, its script and its stylesheet all come from this server: the
Swagger UI 5 files that ``fastapi-offline`` ships (Swagger UI 5 reads FastAPI's OpenAPI 3.1), and
a start script in ``web/js/docs.js``.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse, HTMLResponse

from sweepmaster.dashboard.static import MEDIA_TYPES

router = APIRouter(include_in_schema=False)

#: The Swagger UI files the page loads, served from the installed package.
_ASSETS = {"swagger-ui-bundle.js": ".js", "swagger-ui.css": ".css"}

_PAGE = """<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>sweepmaster dashboard API</title>
  <link rel="icon" href="data:,">
  <link rel="stylesheet" href="/docs/swagger-ui.css">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="/docs/swagger-ui-bundle.js"></script>
  <script src="/static/js/docs.js"></script>
</body>
</html>
"""


def _swagger_ui_dir() -> Path:
    import fastapi_offline

    return Path(fastapi_offline.__file__).parent / "static"


@router.get("/docs")
def docs_page() -> HTMLResponse:
    """Swagger UI on ``/openapi.json``."""
    return HTMLResponse(_PAGE, headers={"Cache-Control": "no-cache"})


@router.get("/docs/{name}")
def docs_asset(name: str) -> FileResponse:
    """Swagger UI's script or stylesheet; anything else is a 404."""
    suffix = _ASSETS.get(name)
    if suffix is None:
        raise HTTPException(404, f"no such file: {name!r}")
    return FileResponse(_swagger_ui_dir() / name, media_type=MEDIA_TYPES[suffix],
                        headers={"Cache-Control": "public, max-age=86400"})
