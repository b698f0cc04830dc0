"""The planner's frozen records (job plans, memory plans, model profiles) as JSON, for caches.

One codec for every record: :func:`record_to_json` writes :func:`dataclasses.asdict`;
:func:`record_from_json` reads it back through pydantic's ``TypeAdapter``
(https://docs.pydantic.dev/latest/concepts/type_adapter/), which rebuilds nested dataclasses
and tuples from the record's annotations and gives a field the stored JSON lacks (a field
added after it was cached) its default.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any, TypeVar

from pydantic import TypeAdapter

__all__ = ["record_from_json", "record_to_json"]

Record = TypeVar("Record")


def record_to_json(record: Any) -> str:
    """A dataclass record (nested records and tuples included) as a JSON string."""
    return json.dumps(asdict(record))


def record_from_json(cls: type[Record], text: str) -> Record:
    """The ``cls`` record :func:`record_to_json` wrote.

    Raises:
        pydantic.ValidationError: ``text`` does not hold a ``cls`` (a field of the wrong type,
            or one without a default missing).
        json.JSONDecodeError: ``text`` is not JSON.
    """
    return TypeAdapter(cls).validate_python(json.loads(text))
