"""Dashboard at scale: a sweep of 10,000 trials and 1,000,000 metric rows.

Builds the database with bulk inserts (Optuna's tables through SQL too: creating 10,000 trials
through Optuna's API would take minutes), then serves it with a real uvicorn on a free port and
times, over HTTP, the sweep page's first API response (a fresh server, cold caches) and warm
repeats of the other requests. For comparison it also times what Optuna's own API needs to load
every trial (``study.get_trials``), which is what a dashboard built on it would pay.

Run:
    python bench/dashboard.py                       # SQLite file in /tmp, reused if present
    python bench/dashboard.py --storage postgresql+psycopg://postgres@127.0.0.1:5432/test
    python bench/dashboard.py --trials 1000 --metrics 100000 --rebuild
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import optuna
from optuna.distributions import (
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
    distribution_to_json,
)
from optuna.storages._rdb import models as optuna_models
from optuna.trial import TrialState
from sqlalchemy import func, insert, select

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import report  # noqa: E402

from sweepmaster.dashboard import start_in_background  # noqa: E402
from sweepmaster.store import create_store_engine, get_or_create_sweep, upgrade_to_head  # noqa: E402
from sweepmaster.store.models import Metric, TrialProgress  # noqa: E402

NAME = "bench"
METRICS = ("train_loss", "lr", "tokens_per_s", "eval_loss", "eval_perplexity")
DISTRIBUTIONS = {
    "train.lr": FloatDistribution(1e-5, 1e-2, log=True),
    "train.weight_decay": FloatDistribution(0.0, 0.1),
    "train.batch_size": CategoricalDistribution([8, 16, 32, 64]),
    "model.config.n_layer": IntDistribution(2, 12),
}
CONFIG = json.dumps(
    {"name": NAME, "study": {"direction": "minimize", "metric": "eval_loss"}}, indent=2
)
CHUNK = 50_000


def _state(i: int, num_trials: int, rng: random.Random) -> TrialState:
    if i >= num_trials - 8:
        return TrialState.RUNNING
    r = rng.random()
    return TrialState.FAIL if r < 0.05 else TrialState.PRUNED if r < 0.15 else TrialState.COMPLETE


def build(url: str, num_trials: int, num_metrics: int, seed: int = 0) -> None:
    """Create the bench sweep: Optuna's tables, progress rows and metrics, by bulk inserts."""
    rng = random.Random(seed)
    storage = optuna.storages.RDBStorage(url)
    study = optuna.create_study(study_name=NAME, storage=storage, direction="minimize")
    study_id = study._study_id
    storage.engine.dispose()
    upgrade_to_head(url)
    engine = create_store_engine(url)
    sweep = get_or_create_sweep(engine, NAME, NAME, CONFIG)
    t0 = datetime(2025, 1, 1)
    per_trial = max(num_metrics // (num_trials * len(METRICS)), 1)
    tables = {m: m.__table__ for m in (optuna_models.TrialModel, optuna_models.TrialParamModel,
                                       optuna_models.TrialValueModel,
                                       optuna_models.TrialIntermediateValueModel)}
    with engine.begin() as conn:
        first_id = (conn.execute(select(func.max(optuna_models.TrialModel.trial_id))).scalar()
                    or 0) + 1
        trials, params, values, inter, progress = [], [], [], [], []
        for i in range(num_trials):
            state = _state(i, num_trials, rng)
            start = t0 + timedelta(seconds=60 * i)
            done = state != TrialState.RUNNING
            trials.append({"trial_id": first_id + i, "number": i, "study_id": study_id,
                           "state": state, "datetime_start": start,
                           "datetime_complete": start + timedelta(seconds=55) if done else None})
            sample = {
                "train.lr": 10 ** rng.uniform(-5, -2), "train.weight_decay": rng.uniform(0, .1),
                "train.batch_size": rng.randrange(4), "model.config.n_layer": rng.randint(2, 12),
            }
            for name, dist in DISTRIBUTIONS.items():
                params.append({"trial_id": first_id + i, "param_name": name,
                               "param_value": float(sample[name]),
                               "distribution_json": distribution_to_json(dist)})
            loss = 3 + 2 * abs(math.log10(sample["train.lr"]) + 3.2) + rng.gauss(0, 0.1)
            if state == TrialState.COMPLETE:
                values.append({"trial_id": first_id + i, "objective": 0, "value": loss,
                               "value_type": "FINITE"})
            for k in range(1, 6):
                inter.append({"trial_id": first_id + i, "step": 100 * k,
                              "intermediate_value": loss + 1 / k,
                              "intermediate_value_type": "FINITE"})
            steps = per_trial if done else per_trial // 2
            progress.append({
                "sweep_id": sweep.id, "trial_number": i, "optuna_trial_id": first_id + i,
                "state": state.name if state.name != "WAITING" else "RUNNING", "step": steps,
                "total_steps": per_trial, "tokens_per_s": 5e4 + rng.random() * 1e3,
                "train_loss": loss + 0.1, "eval_loss": loss,
                "objective": loss if state == TrialState.COMPLETE else None,
                "device": f"cuda:{i % 4}",
                "failure_reason": "FloatingPointError: loss is nan" if state.name == "FAIL"
                else None,
                "checkpoint_path": None,
                "started_at": start.replace(tzinfo=timezone.utc),
                "updated_at": (start + timedelta(seconds=55)).replace(tzinfo=timezone.utc),
            })
        for table, rows in ((tables[optuna_models.TrialModel], trials),
                            (tables[optuna_models.TrialParamModel], params),
                            (tables[optuna_models.TrialValueModel], values),
                            (tables[optuna_models.TrialIntermediateValueModel], inter),
                            (TrialProgress.__table__, progress)):
            for lo in range(0, len(rows), CHUNK):
                conn.execute(insert(table), rows[lo:lo + CHUNK])
        ids = dict(conn.execute(select(TrialProgress.trial_number, TrialProgress.id)
                                .where(TrialProgress.sweep_id == sweep.id)).all())
    metric_table = Metric.__table__
    batch: list[dict[str, object]] = []
    written = 0
    with engine.begin() as conn:
        for i in range(num_trials):
            for step in range(1, per_trial + 1):
                for name in METRICS:
                    batch.append({"trial_progress_id": ids[i], "step": step, "name": name,
                                  "value": 1.0 / step})
            if len(batch) >= CHUNK:
                conn.execute(insert(metric_table), batch)
                written += len(batch)
                batch = []
        if batch:
            conn.execute(insert(metric_table), batch)
            written += len(batch)
    engine.dispose()
    print(f"built {num_trials} trials, {written} metric rows", file=sys.stderr)


def _timed_get(client: httpx.Client, path: str, repeat: int) -> tuple[float, float, int]:
    """First and median-of-``repeat`` seconds of a GET, and the response size."""
    times, size = [], 0
    for _ in range(repeat + 1):
        start = time.perf_counter()
        response = client.get(path)
        times.append(time.perf_counter() - start)
        assert response.status_code == 200, (path, response.status_code, response.text[:200])
        size = len(response.content)
    return times[0], statistics.median(times[1:]), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", default="sqlite:////tmp/sweepmaster-bench-dashboard.db")
    parser.add_argument("--trials", type=int, default=10_000)
    parser.add_argument("--metrics", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rebuild", action="store_true", help="Delete and rebuild the SQLite "
                        "file (a PostgreSQL database must be empty).")
    parser.add_argument("--no-plots", action="store_true", help="Skip timing Optuna's plots.")
    args = parser.parse_args()

    url = args.storage
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        if args.rebuild:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)
        built = path.exists()
    else:
        built = False
    build_s = 0.0
    if not built:
        build_s, _ = time.perf_counter(), None
        build(url, args.trials, args.metrics)
        build_s = time.perf_counter() - build_s

    rows = []
    # The sweep page's first API response: a fresh server, nothing cached, over HTTP.
    handle = start_in_background(url, port=0)
    try:
        with httpx.Client(base_url=handle.url, timeout=120) as client:
            requests = [
                # exactly what the sweep page asks first: newest trials first
                ("sweep page (first page, by number)",
                 f"/api/sweeps/{NAME}?sort=number&order=desc&limit=50"),
                ("sweep page by objective",
                 f"/api/sweeps/{NAME}?limit=50&sort=objective"),
                ("trials: RUNNING only", f"/api/sweeps/{NAME}/trials?state=RUNNING"),
                ("trials: by param, last page",
                 f"/api/sweeps/{NAME}/trials?sort=param:train.lr&offset={args.trials - 50}"),
                ("trials: by eval_loss desc",
                 f"/api/sweeps/{NAME}/trials?sort=eval_loss&order=desc"),
                ("one trial (curves)", f"/api/sweeps/{NAME}/trials/{args.trials // 2}"),
                ("sweeps list", "/api/sweeps"),
                ("timeline (no table)", f"/api/sweeps/{NAME}/timeline"),
            ]
            if not args.no_plots:
                requests += [(f"plot {kind}", f"/api/sweeps/{NAME}/plots/{kind}")
                             for kind in ("history", "parallel_coordinate", "importances",
                                          "intermediate_values", "timeline")]
            for label, path in requests:
                repeat = 1 if label.startswith("plot") else args.repeat
                first_s, warm_s, size = _timed_get(client, path, repeat)
                rows.append({"request": label, "first_s": first_s, "warm_median_s": warm_s,
                             "bytes": size})
        # One live-update poll (what each open page costs the database every second).
        from sweepmaster.dashboard.live import SweepWatcher

        watcher = SweepWatcher(handle.app.state.dashboard.reader, NAME)
        watcher.poll()
        polls = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            watcher.poll()
            polls.append(time.perf_counter() - start)
        rows.append({"request": "live poll (SSE, per second per page)", "first_s": polls[0],
                     "warm_median_s": statistics.median(polls), "bytes": 0})
    finally:
        handle.stop()

    # Optuna's API loading every trial: what a dashboard on study.get_trials would pay.
    start = time.perf_counter()
    trials = optuna.load_study(study_name=NAME, storage=url).get_trials(deepcopy=False)
    optuna_s = time.perf_counter() - start
    rows.append({"request": f"optuna get_trials ({len(trials)} trials), for comparison",
                 "first_s": optuna_s, "warm_median_s": float("nan"), "bytes": 0})
    backend = url.split(":", 1)[0].split("+", 1)[0]
    name = "dashboard" if backend == "sqlite" else f"dashboard-{backend}"
    report(name, rows, storage=backend, trials=args.trials,
           metric_rows=args.metrics, build_s=build_s,
           sweep_page_first_response_s=rows[0]["first_s"])


if __name__ == "__main__":
    main()
