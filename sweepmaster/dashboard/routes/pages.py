"""The front end: its pages, its static files and plotly.js (not in the OpenAPI schema)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

from sweepmaster.dashboard.static import MEDIA_TYPES, plotly_js, resolve_static, web_dir

router = APIRouter(include_in_schema=False)

_NO_CACHE = {"Cache-Control": "no-cache"}


def _index() -> FileResponse:
    return FileResponse(web_dir() / "index.html", media_type=MEDIA_TYPES[".html"],
                        headers=_NO_CACHE)


@router.get("/")
def sweeps_page() -> FileResponse:
    """The sweeps page."""
    return _index()


@router.get("/sweeps/{name}")
def sweep_page(name: str) -> FileResponse:
    """A sweep's page (the front end reads the name from the address)."""
    return _index()


@router.get("/sweeps/{name}/trials/{number}")
def trial_page(name: str, number: str) -> FileResponse:
    """A trial's page."""
    return _index()


@router.get("/sweeps/{name}/devices")
def devices_page(name: str) -> FileResponse:
    """A sweep's devices page."""
    return _index()


@router.get("/vendor/plotly.min.js")
def plotly() -> FileResponse:
    """plotly.js from the installed ``plotly`` package."""
    return FileResponse(plotly_js(), media_type=MEDIA_TYPES[".js"],
                        headers={"Cache-Control": "public, max-age=86400"})


@router.get("/static/{path:path}")
def static_file(path: str) -> FileResponse:
    """A file of ``web/``; anything outside it, hidden or of another type is a 404."""
    found = resolve_static(web_dir(), path)
    if found is None:
        raise HTTPException(404, f"no such file: {path!r}")
    return FileResponse(found, media_type=MEDIA_TYPES[found.suffix], headers=_NO_CACHE)
