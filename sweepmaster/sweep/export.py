"""A sweep's results as JSON or CSV, for ``sweepmaster status --format json|csv``.

Every column the results table may show, none left out whatever the width, with raw values:
bytes as integers, seconds as floats, parameters under their dotted paths. Non-finite numbers
(a diverged loss) are written as JSON ``null`` and an empty CSV field.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sweepmaster.runtime.events import TRIAL_STATISTICS
from sweepmaster.store.workers import WorkerInfo
from sweepmaster.sweep.results import SweepResults, TrialRow

__all__ = ["CSV_COLUMNS", "results_csv", "results_json"]

#: The CSV's columns before the parameters (``param:<dotted path>``, sorted), in order.
CSV_COLUMNS = (
    "sweep", "number", "state", "objective", "eval_loss", "eval_perplexity", "step",
    "total_steps", "tokens_per_s", "duration_s", "devices", "retried_by",
    *(stat.name for stat in TRIAL_STATISTICS), "checkpoint_path", "reason",
)


def _plain(value: Any) -> Any:
    """``value`` as JSON takes it: non-finite floats ``None``, datetimes ISO 8601, tuples lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _trial(row: TrialRow) -> dict[str, Any]:
    fields = dataclasses.asdict(row)
    stats = {stat.name: fields.pop(stat.name) for stat in TRIAL_STATISTICS}  # after the rest
    return {**fields, **stats, "eval_perplexity": row.eval_perplexity, "spilled": row.spilled}


def results_json(sweeps: Sequence[tuple[SweepResults, Sequence[WorkerInfo]]]) -> str:
    """The sweeps with their trials (best first), unfinished grid cells and workers, as JSON.

    Args:
        sweeps: ``(results, workers)`` per sweep, in the order to write them.

    Returns:
        ``{"sweeps": [{"name", "status", "direction", "metric", "trials": [...],
        "unfinished": [...], "workers": [...]}]}``, indented, ending with a newline.
    """
    document = {"sweeps": [
        {"name": results.name, "status": results.status, "direction": results.direction,
         "metric": results.metric, "trials": [_trial(t) for t in results.trials],
         "unfinished": [dataclasses.asdict(c) for c in results.unfinished],
         "workers": [dataclasses.asdict(w) for w in workers]}
        for results, workers in sweeps
    ]}
    return json.dumps(_plain(document), indent=2, allow_nan=False) + "\n"


def results_csv(sweeps: Sequence[SweepResults]) -> str:
    """Every trial of the sweeps as one CSV table: :data:`CSV_COLUMNS`, then the parameters.

    ``devices`` joins a trial's devices with ``;``; a parameter a trial does not have is empty.
    """
    params = sorted({name for results in sweeps for t in results.trials for name in t.params})
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*CSV_COLUMNS, *(f"param:{name}" for name in params)])
    for results in sweeps:
        for trial in results.trials:
            fields = _plain({**_trial(trial), "sweep": results.name,
                             "devices": ";".join(trial.devices)})
            row = [fields[name] for name in CSV_COLUMNS]
            row += [_plain(trial.params.get(name)) for name in params]
            writer.writerow(["" if value is None else value for value in row])
    return out.getvalue()
