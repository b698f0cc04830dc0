"""Error responses the routes document in the OpenAPI schema (all ``{"detail": message}``)."""

from __future__ import annotations

from typing import Any

from sweepmaster.dashboard.schemas import ErrorResponse

__all__ = ["ERRORS", "error"]


def error(description: str) -> dict[str, Any]:
    """One documented error response."""
    return {"model": ErrorResponse, "description": description}


ERRORS: dict[int | str, dict[str, Any]] = {
    404: error("No such sweep or trial."),
    422: error("A parameter is invalid."),
    503: error("The database cannot be read."),
}
