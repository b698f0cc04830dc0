"""The dashboard's API on a real sweep database: reads, live events, safety, schema fuzzing.

The database comes from an actual small sweep (session-scoped, a few seconds); tests that write
(live progress, task tables) work on a copy of it.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import optuna
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from optuna.trial import TrialState

from sweepmaster.config import load_sweep_config
from sweepmaster.dashboard import DashboardError, create_app, serve, start_in_background
from sweepmaster.dashboard.live import SweepWatcher
from sweepmaster.dashboard.server import TOKEN_ENV, is_loopback
from sweepmaster.dashboard.static import resolve_static, web_dir
from sweepmaster.errors import StorageError
from sweepmaster.store import (
    ProgressRecorder,
    create_store_engine,
    get_or_create_sweep,
    get_sweep,
    trial_progress,
    upgrade_to_head,
)
from sweepmaster.sweep import run_sweep
from tests.kit.sweeps import tiny_sweep, write_sweep

try:
    import schemathesis
except ImportError:  # the schema test is skipped
    schemathesis = None

NAME = "tiny"
BASE = "http://127.0.0.1"
METRICS = {"train_loss", "lr", "tokens_per_s", "eval_loss", "eval_perplexity"}
_SWEEPS: dict[str, Path] = {}


def run_dashboard_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SQLite file of a finished tiny sweep: 2 COMPLETE and 2 FAIL trials (run once)."""
    if "db" not in _SWEEPS:
        root = tmp_path_factory.mktemp("dashboard-sweep")
        raw = tiny_sweep(root, parameters={"train.lr": {"values": [1e-2, 1e30]},
                                           "train.batch_size": {"values": [2, 4]}})
        run_sweep(load_sweep_config(write_sweep(root, raw)))
        _SWEEPS["db"] = root / "sweep.db"
    return _SWEEPS["db"]


def copy_db(source: Path, target: Path) -> str:
    """A consistent copy of a SQLite database (WAL included); returns its URL."""
    with sqlite3.connect(source) as src, sqlite3.connect(target) as dst:
        src.backup(dst)
    return f"sqlite:///{target}"


@pytest.fixture(scope="session")
def sweep_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_dashboard_sweep(tmp_path_factory)


@pytest.fixture(scope="session")
def sweep_url(sweep_db: Path) -> str:
    return f"sqlite:///{sweep_db}"


@pytest.fixture
def copy_url(sweep_db: Path, tmp_path: Path) -> str:
    return copy_db(sweep_db, tmp_path / "copy.db")


@pytest.fixture(scope="module")
def client(sweep_url: str) -> Iterator[TestClient]:
    with TestClient(create_app(sweep_url), base_url=BASE) as c:
        yield c


@pytest.fixture(scope="session")
def study(sweep_url: str) -> optuna.Study:
    return optuna.load_study(study_name=NAME, storage=sweep_url)


def _strict_json(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in JSON")

    return json.loads(text, parse_constant=refuse)


# -- reads ---------------------------------------------------------------------------------------
def test_sweeps_list(client: TestClient, study: optuna.Study) -> None:
    response = client.get("/api/sweeps")
    assert response.status_code == 200
    [sweep] = response.json()["sweeps"]
    assert sweep["name"] == NAME and sweep["status"] == "incomplete"  # two cells failed
    assert sweep["direction"] == "minimize" and sweep["metric"] == "eval_loss"
    assert sweep["counts"] == {"RUNNING": 0, "WAITING": 0, "COMPLETE": 2, "PRUNED": 0,
                               "FAIL": 2, "total": 4}
    assert sweep["best_number"] == study.best_trial.number
    assert sweep["best_value"] == pytest.approx(study.best_value)


def test_sweep_detail_matches_optuna_and_progress(client: TestClient, study: optuna.Study,
                                                  sweep_url: str) -> None:
    response = client.get(f"/api/sweeps/{NAME}")
    assert response.status_code == 200
    body = _strict_json(response.text)
    assert body["config"]["name"] == NAME and "parameters" in body["config_text"]
    assert body["param_names"] == ["train.batch_size", "train.lr"]
    assert body["best"]["number"] == study.best_trial.number
    assert body["best"]["params"] == study.best_trial.params
    page = body["page"]
    assert (page["total"], page["offset"], page["limit"], page["sort"]) == (4, 0, 50, "number")
    engine = create_store_engine(sweep_url)
    progress = {p.trial_number: p for p in trial_progress(engine, get_sweep(engine, NAME).id)}
    rows = {row["number"]: row for row in page["trials"]}
    assert [row["number"] for row in page["trials"]] == [0, 1, 2, 3]
    for trial in study.get_trials():
        row, p = rows[trial.number], progress[trial.number]
        assert row["state"] == trial.state.name
        assert row["params"] == trial.params
        assert row["device"] == p.device
        assert row["duration_s"] > 0 and row["eta_s"] is None
        if trial.state == TrialState.COMPLETE:
            assert row["objective"] == pytest.approx(trial.value)
            assert (row["step"], row["total_steps"]) == (6, 6)
            assert row["eval_loss"] == pytest.approx(p.eval_loss)
            assert row["train_loss"] == pytest.approx(p.train_loss)
            assert row["tokens_per_s"] == pytest.approx(p.tokens_per_s)
        else:
            assert row["objective"] is None
            assert "FloatingPointError" in row["failure_reason"]


def test_trial_table_sorts_filters_and_pages(client: TestClient, study: optuna.Study) -> None:
    url = f"/api/sweeps/{NAME}/trials"
    failed = client.get(url, params={"state": "FAIL"}).json()
    assert failed["total"] == 2 and {t["state"] for t in failed["trials"]} == {"FAIL"}
    both = client.get(url, params=[("state", "FAIL"), ("state", "COMPLETE")]).json()
    assert both["total"] == 4
    by_objective = client.get(url, params={"sort": "objective"}).json()["trials"]
    assert by_objective[0]["number"] == study.best_trial.number
    assert [t["objective"] is None for t in by_objective] == [False, False, True, True]
    descending = client.get(url, params={"sort": "objective", "order": "desc"}).json()["trials"]
    assert descending[0]["objective"] > descending[1]["objective"]
    assert descending[2]["objective"] is None  # missing values last in either order
    page = client.get(url, params={"sort": "number", "order": "desc", "offset": 1,
                                   "limit": 2}).json()
    assert page["total"] == 4 and [t["number"] for t in page["trials"]] == [2, 1]
    by_param = client.get(url, params={"sort": "param:train.batch_size"}).json()["trials"]
    assert [t["params"]["train.batch_size"] for t in by_param] == [2, 2, 4, 4]
    assert client.get(url, params={"state": "RUNNING"}).json() == {
        "total": 0, "offset": 0, "limit": 50, "sort": "number", "order": "asc",
        "states": ["RUNNING"], "trials": []}


def test_trial_detail(client: TestClient, study: optuna.Study) -> None:
    best = study.best_trial
    body = _strict_json(client.get(f"/api/sweeps/{NAME}/trials/{best.number}").text)
    assert body["trial"]["number"] == best.number and body["trial"]["params"] == best.params
    assert set(body["distributions"]) == set(best.params)
    curves = {c["name"]: c for c in body["curves"]}
    assert set(curves) == METRICS
    assert curves["train_loss"]["steps"] == [1, 2, 3, 4, 5, 6]
    assert curves["eval_loss"]["steps"] == [0, 3, 6]
    assert curves["eval_loss"]["values"][-1] == pytest.approx(best.value)
    assert [(v["step"], v["value"]) for v in body["intermediate_values"]] == [
        (step, pytest.approx(value)) for step, value in sorted(best.intermediate_values.items())]
    assert body["checkpoint_path"] and Path(body["checkpoint_path"]).is_dir()
    assert body["failure_reason"] is None
    assert "checkpoint_path" not in body["user_attrs"]  # save: best records it in its row only

    thinned = client.get(f"/api/sweeps/{NAME}/trials/{best.number}",
                         params={"max_points": 2}).json()
    train = next(c for c in thinned["curves"] if c["name"] == "train_loss")
    assert train["steps"] == [1, 6] and train["num_points"] == 6

    failed = next(t for t in study.get_trials() if t.state == TrialState.FAIL)
    body = client.get(f"/api/sweeps/{NAME}/trials/{failed.number}").json()
    assert "FloatingPointError" in body["failure_reason"]
    assert body["trial"]["state"] == "FAIL" and body["checkpoint_path"] is None


@pytest.mark.parametrize("kind", ["history", "parallel_coordinate", "importances",
                                  "intermediate_values", "timeline"])
def test_optuna_plots(client: TestClient, kind: str) -> None:
    response = client.get(f"/api/sweeps/{NAME}/plots/{kind}")
    assert response.status_code == 200, response.text
    body = _strict_json(response.text)
    assert body["kind"] == kind and body["num_trials"] == 4
    assert body["figure"]["data"] and "layout" in body["figure"]


def test_plot_that_cannot_be_drawn_is_a_clear_json_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'one.db'}"
    study = optuna.create_study(study_name="one", storage=url)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    upgrade_to_head(url)
    get_or_create_sweep(create_store_engine(url), "one", "one", "study: {metric: eval_loss}")
    with TestClient(create_app(url), base_url=BASE) as c:
        response = c.get("/api/sweeps/one/plots/importances")
        assert response.status_code == 409
        assert response.json() == {
            "detail": "parameter importances need at least 2 COMPLETE trials; there are 1"}
        assert c.get("/api/sweeps/one/plots/history").status_code == 200
        assert c.get("/api/sweeps/one/plots/intermediate_values").status_code == 409
        # asked first, the same answers without an error status (the page asks this way)
        check = c.get("/api/sweeps/one/plots/importances/availability")
        assert check.status_code == 200 and check.json() == {
            "kind": "importances", "available": False,
            "reason": "parameter importances need at least 2 COMPLETE trials; there are 1"}
        assert c.get("/api/sweeps/one/plots/history/availability").json() == {
            "kind": "history", "available": True, "reason": None}
        assert c.get("/api/sweeps/nope/plots/history/availability").status_code == 404


def test_empty_and_fresh_databases(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    with pytest.raises(StorageError, match="no database at"):
        create_app(url)  # the dashboard only reads: it creates no database
    assert not (tmp_path / "fresh.db").exists()
    sqlite3.connect(tmp_path / "fresh.db").close()  # an empty database, without tables
    with TestClient(create_app(url), base_url=BASE) as c:
        assert c.get("/api/sweeps").json() == {"sweeps": []}
        assert c.get("/api/sweeps/x").status_code == 404
    assert not sa.inspect(create_store_engine(url)).get_table_names()  # nothing was created


def test_timeline_shows_the_executor_tasks_and_fusion_groups(copy_url: str) -> None:
    with TestClient(create_app(copy_url), base_url=BASE) as c:
        timeline = c.get(f"/api/sweeps/{NAME}/timeline").json()
        [lane] = timeline["devices"]  # the fixture's trials fit the host CPU: one shard each
        assert lane["device"] == "cpu" and "backward" in {t["kind"] for t in lane["tasks"]}
        assert {t["kind"] for t in lane["tasks"]} <= {"eval", "backward"}  # a task per step
        assert {t["shard"] for t in lane["tasks"]} == {0} and lane["swap_bytes"] == 0
        num_trials = len(optuna.load_study(study_name=NAME, storage=copy_url).trials)
        assert sorted({t["trial_number"] for t in lane["tasks"]}) == list(range(num_trials))
        assert c.get(f"/api/sweeps/{NAME}/fusion").json()["groups"] == []

        engine = create_store_engine(copy_url)
        sweep_id = get_sweep(engine, NAME).id
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM sm_task_events"))
            t0 = 1_700_000_000.0
            events = [("cuda:0", "trial-0", 0, 0, "promote", t0, t0 + 1, 4096, 1000, 0),
                      ("cuda:0", "trial-0", 0, 0, "forward", t0 + 1, t0 + 2, 0, 3000, 0),
                      ("cuda:1", "array-1", None, 1, "pipeline", t0 + 0.5, t0 + 3, 8192, 500,
                       2048)]
            columns = ("device", "job", "trial_number", "shard", "kind", "start_s", "end_s",
                       "bytes", "memory_bytes", "p2p_bytes")
            conn.execute(sa.text(
                f"INSERT INTO sm_task_events (sweep_id, {', '.join(columns)}) "
                f"VALUES (:sweep_id, {', '.join(':' + c for c in columns)})"),
                [{"sweep_id": sweep_id, **dict(zip(columns, e, strict=True))} for e in events])
            conn.execute(sa.text("INSERT INTO sm_fusion_groups (sweep_id, job, architecture_key, "
                                 "trial_number) VALUES (:s, 'array-1', 'abc', :n)"),
                         [{"s": sweep_id, "n": 2}, {"s": sweep_id, "n": 3}])

        timeline = c.get(f"/api/sweeps/{NAME}/timeline").json()
        assert timeline["available"] and timeline["t0"] == t0 and not timeline["truncated"]
        lanes = {lane["device"]: lane for lane in timeline["devices"]}
        assert [t["kind"] for t in lanes["cuda:0"]["tasks"]] == ["promote", "forward"]
        assert lanes["cuda:0"]["swap_bytes"] == 4096 and lanes["cuda:0"]["busy_s"] == 2.0
        assert [(p["t_s"], p["bytes"]) for p in lanes["cuda:0"]["memory"]] == [(1.0, 1000),
                                                                                (2.0, 3000)]
        assert lanes["cuda:1"]["tasks"][0] == {"job": "array-1", "trial_number": None,
                                               "shard": 1, "kind": "pipeline", "start_s": 0.5,
                                               "end_s": 3.0, "bytes": 8192, "p2p_bytes": 2048}
        assert (lanes["cuda:0"]["p2p_bytes"], lanes["cuda:1"]["p2p_bytes"]) == (0, 2048)
        limited = c.get(f"/api/sweeps/{NAME}/timeline", params={"limit": 1}).json()
        assert limited["truncated"] and limited["devices"][0]["tasks"][0]["kind"] == "forward"
        assert c.get(f"/api/sweeps/{NAME}/fusion").json()["groups"] == [
            {"job": "array-1", "architecture_key": "abc", "trial_numbers": [2, 3],
             "members": [{"trial_number": n, "joined_step": 0, "left_step": None}
                         for n in (2, 3)]}]


def test_workers_of_the_sweep_with_their_heartbeats(copy_url: str) -> None:
    from datetime import datetime, timedelta, timezone

    from sweepmaster.store.workers import register_worker, this_host

    with TestClient(create_app(copy_url), base_url=BASE) as c:
        [launcher] = c.get(f"/api/sweeps/{NAME}/workers").json()["workers"]
        assert launcher["status"] == "stopped" and launcher["host"] == this_host()
        assert launcher["num_running"] == 0 and launcher["num_finished"] == 2  # 2 COMPLETE

        engine = create_store_engine(copy_url)
        sweep_id = get_sweep(engine, NAME).id
        gone = register_worker(engine, sweep_id, "cuda:0,cuda:1", host="node-b", pid=4242)
        alive = register_worker(engine, sweep_id, "cpu", host="node-c", pid=7)
        stale = datetime.now(timezone.utc) - timedelta(minutes=5)
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE sm_workers SET heartbeat_at = :t WHERE id = :i"),
                         {"t": stale.replace(tzinfo=None), "i": gone})
        body = c.get(f"/api/sweeps/{NAME}/workers").json()
        assert body["available"] and body["sweep"] == NAME
        workers = {w["id"]: w for w in body["workers"]}
        assert [w["id"] for w in body["workers"]] == [launcher["id"], gone, alive]
        assert workers[gone]["status"] == "lost" and workers[gone]["heartbeat_age_s"] > 250
        assert workers[gone]["devices"] == "cuda:0,cuda:1" and workers[gone]["pid"] == 4242
        assert workers[alive]["status"] == "running" and workers[alive]["heartbeat_age_s"] < 60
        assert c.get("/api/sweeps/nope/workers").status_code == 404


# -- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "status"), [
    ("/api/sweeps/nope", 404),
    (f"/api/sweeps/{NAME}/trials/99", 404),
    ("/api/sweeps/nope/trials/0", 404),
    ("/api/sweeps/nope/events", 404),
    ("/api/nothing-here", 404),
    (f"/api/sweeps/{NAME}/trials?limit=0", 422),
    (f"/api/sweeps/{NAME}/trials?sort=bogus", 422),
    (f"/api/sweeps/{NAME}/trials?sort=param:nope", 422),
    (f"/api/sweeps/{NAME}/trials?state=DONE", 422),
    (f"/api/sweeps/{NAME}/trials/minus-one", 422),
    (f"/api/sweeps/{NAME}/plots/pie", 422),
])
def test_errors_are_json_with_a_message(client: TestClient, path: str, status: int) -> None:
    response = client.get(path)
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["detail"] and isinstance(body["detail"], str) and body["detail"]


def test_writes_are_not_allowed(client: TestClient) -> None:
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        response = client.request(method, f"/api/sweeps/{NAME}")
        assert response.status_code == 405 and "detail" in response.json()


def test_unexpected_errors_are_json_without_traceback(sweep_url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    app = create_app(sweep_url)
    with TestClient(app, base_url=BASE, raise_server_exceptions=False) as c:
        def boom() -> None:
            raise RuntimeError("secret internals at /home/user")

        monkeypatch.setattr(app.state.dashboard.reader, "sweeps", boom)
        response = c.get("/api/sweeps")
        assert response.status_code == 500
        assert response.json() == {"detail": "internal error (RuntimeError); see the "
                                              "dashboard's log"}

        def locked(*args: object) -> None:
            raise sa.exc.OperationalError("SELECT", {}, Exception("database is locked"))

        monkeypatch.setattr(app.state.dashboard.reader, "overview", locked)
        response = c.get(f"/api/sweeps/{NAME}")
        assert response.status_code == 503
        assert response.json() == {"detail": "cannot read the database: database is locked"}


def test_the_dashboard_engine_cannot_write(sweep_url: str) -> None:
    app = create_app(sweep_url)
    engine = app.state.dashboard.reader.engine
    with pytest.raises(sa.exc.OperationalError, match="readonly"):
        with engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM sm_metrics")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM sm_metrics").scalar() > 0


# -- static files, safety -------------------------------------------------------------------------
def test_pages_static_files_and_plotly_are_served(client: TestClient) -> None:
    for path in ("/", f"/sweeps/{NAME}", f"/sweeps/{NAME}/trials/0", f"/sweeps/{NAME}/devices"):
        response = client.get(path)
        assert response.status_code == 200 and "<main id=\"app\">" in response.text
        assert "default-src 'self'" in response.headers["content-security-policy"]
    js = client.get("/static/js/app.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    plotly = client.get("/vendor/plotly.min.js")
    assert plotly.status_code == 200 and b"plotly.js v" in plotly.content[:200]
    assert "openapi" in client.get("/openapi.json").json()


def test_api_docs_are_served_from_this_server(client: TestClient) -> None:
    page = client.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "http" not in page.text  # no CDN: every asset comes from this server
    assert "<script>" not in page.text  # no inline script: the CSP allows 'self' only
    for asset, kind in (("/docs/swagger-ui-bundle.js", "text/javascript"),
                        ("/docs/swagger-ui.css", "text/css"), ("/static/js/docs.js",
                                                               "text/javascript")):
        response = client.get(asset)
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
    assert client.get("/docs/redoc.standalone.js").status_code == 404
    assert client.get("/docs/..%2f__init__.py").status_code == 404
    assert client.get("/redoc").status_code == 404


TRAVERSALS = [
    "/static/../pyproject.toml",
    "/static/%2e%2e/pyproject.toml",
    "/static/..%2fpyproject.toml",
    "/static/%2e%2e%2f%2e%2e%2fpyproject.toml",
    "/static/js/../../../pyproject.toml",
    "/static/..%5c..%5cpyproject.toml",
    "/static//etc/passwd",
    "/static/%2fetc%2fpasswd",
    "/static/.%2e/sweepmaster/__init__.py",
    "/static/__init__.py",
    "/static/index.html%00.js",
    "/vendor/../pyproject.toml",
]


def test_static_routes_refuse_path_traversal(sweep_url: str) -> None:
    handle = start_in_background(sweep_url, port=0)
    try:
        host, port = handle.url.split("//")[1].rstrip("/").split(":")
        for path in TRAVERSALS:
            conn = http.client.HTTPConnection(host, int(port), timeout=10)
            conn.request("GET", path)  # sent as is: no client-side normalization
            response = conn.getresponse()
            body = response.read().decode("utf-8", "replace")
            conn.close()
            assert response.status == 404, (path, response.status, body[:100])
            assert "detail" in json.loads(body)
            assert "[build-system]" not in body and "root:" not in body
    finally:
        handle.stop()


def test_resolve_static(tmp_path: Path) -> None:
    root = tmp_path / "web"
    (root / "js").mkdir(parents=True)
    (root / "js" / "a.js").write_text("x")
    (root / ".hidden.js").write_text("x")
    (tmp_path / "outside.js").write_text("secret")
    (root / "js" / "link.js").symlink_to(tmp_path / "outside.js")
    assert resolve_static(root, "js/a.js") == (root / "js" / "a.js").resolve()
    for bad in ("", "js", "js/../js/a.js", "../outside.js", "/etc/passwd", "js\\a.js",
                ".hidden.js", "js/link.js", "js/a.js\x00", "js/missing.js", "js/a.py"):
        assert resolve_static(root, bad) is None, bad
    assert (web_dir() / "index.html").is_file()


def test_token_is_checked_on_every_request(sweep_url: str) -> None:
    app = create_app(sweep_url, token="s3cret")
    with TestClient(app, base_url="http://dashboard.example:8080") as c:
        for path in ("/api/sweeps", f"/api/sweeps/{NAME}", "/", "/static/js/app.js",
                     "/vendor/plotly.min.js", "/openapi.json", f"/api/sweeps/{NAME}/events"):
            refused = c.get(path)
            assert refused.status_code == 401, path
            assert refused.json()["detail"].startswith("a valid token is required")
            assert refused.headers["www-authenticate"] == "Bearer"
        assert c.get("/api/sweeps", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/api/sweeps?token=wrong").status_code == 401
        assert c.get("/api/sweeps", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        first = c.get("/?token=s3cret")
        assert first.status_code == 200
        assert "sweepmaster_token=s3cret" in first.headers["set-cookie"]
        assert "HttpOnly" in first.headers["set-cookie"]
        # the cookie lets the page's scripts load without the token in their URLs
        assert c.get("/static/js/app.js").status_code == 200
        c.cookies.clear()
        assert c.get("/static/js/app.js").status_code == 401


def test_without_a_token_only_loopback_host_names_are_answered(sweep_url: str) -> None:
    with TestClient(create_app(sweep_url), base_url="http://evil.example") as c:
        response = c.get("/api/sweeps")
        assert response.status_code == 403 and "without a token" in response.json()["detail"]
    for host in ("http://localhost:8080", "http://127.0.0.1", "http://[::1]:9"):
        with TestClient(create_app(sweep_url), base_url=host) as c:
            assert c.get("/api/sweeps").status_code == 200, host


def test_public_address_without_a_token_gets_a_generated_one(
    sweep_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    tokens = set()
    for host in ("0.0.0.0", "::"):
        with start_in_background(sweep_url, host=host, port=0) as handle:
            token = handle.login_url.split("?token=", 1)[1]
            tokens.add(token)
            assert len(token) >= 40 and token.isascii()  # 32 random bytes, URL-safe
            local = f"http://127.0.0.1:{handle.url.rsplit(':', 1)[1].rstrip('/')}/api/sweeps"
            assert httpx.get(local).status_code == 401
            assert httpx.get(local, headers={"Authorization": f"Bearer {token}"}
                             ).status_code == 200
    assert len(tokens) == 2  # a new one each time
    with start_in_background(sweep_url, host="127.0.0.1", port=0) as handle:
        assert "token=" not in handle.login_url  # localhost needs none
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("[::1]")


@pytest.mark.parametrize(("token", "got"), [
    ("   ", "got a blank one"), ("", "got a blank one"), ("abc", "got one of 3 characters"),
    ("1234567", "got one of 7 characters"), ("two words!", "got one with white space"),
])
def test_blank_and_short_tokens_are_refused(
    sweep_url: str, monkeypatch: pytest.MonkeyPatch, token: str, got: str,
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    for host in ("0.0.0.0", "127.0.0.1"):
        with pytest.raises(DashboardError) as info:
            start_in_background(sweep_url, host=host, port=0, token=token)
        assert str(info.value) == ("--token: expected a token of at least 8 characters "
                                   "without spaces (leave it out off localhost for a "
                                   f"generated one), {got}")
        with pytest.raises(DashboardError, match=f"^--token: .*{got}"):
            serve(sweep_url, host=host, port=0, token=token)
    if token:  # an empty variable is an unset one
        monkeypatch.setenv(TOKEN_ENV, token)
        with pytest.raises(DashboardError, match=f"^environment variable {TOKEN_ENV}: .*{got}"):
            start_in_background(sweep_url, host="0.0.0.0", port=0)

    monkeypatch.setenv(TOKEN_ENV, "from-env")
    with start_in_background(sweep_url, host="0.0.0.0", port=0) as handle:
        port = handle.url.rsplit(":", 1)[1].rstrip("/")
        assert handle.login_url.endswith("?token=from-env")
        local = f"http://127.0.0.1:{port}/api/sweeps"
        assert httpx.get(local).status_code == 401
        assert httpx.get(local, headers={"Authorization": "Bearer from-env"}).status_code == 200


def test_tokens_are_redacted_from_the_access_log() -> None:
    from sweepmaster.dashboard.server import _RedactToken

    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s" %d',
                               ("127.0.0.1:5", "GET", "/api/x?a=1&token=s3cret&b=2", 200), None)
    assert _RedactToken().filter(record)
    assert record.getMessage() == '127.0.0.1:5 - "GET /api/x?a=1&token=***&b=2" 200'


def test_address_in_use_is_a_clear_error(sweep_url: str) -> None:
    with start_in_background(sweep_url, port=0) as handle:
        port = int(handle.url.rsplit(":", 1)[1].rstrip("/"))
        with pytest.raises(DashboardError, match=f"127.0.0.1:{port}"):
            start_in_background(sweep_url, port=port)


# -- live updates --------------------------------------------------------------------------------
class _Events:
    """Reads a Server-Sent Events stream on a thread; events are (name, data) pairs."""

    def __init__(self, url: str) -> None:
        self.events: list[tuple[str, Any]] = []
        self._client = httpx.Client(timeout=httpx.Timeout(10, read=None))
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self._thread.start()

    def _read(self, url: str) -> None:
        name, data = "message", []
        try:
            with self._client.stream("GET", url) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                for line in response.iter_lines():
                    if self._stop:
                        return
                    if line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].strip())
                    elif not line and data:
                        with self._lock:
                            self.events.append((name, json.loads("\n".join(data))))
                        name, data = "message", []
        except httpx.HTTPError:
            return

    def wait_for(self, predicate: Any, timeout_s: float = 15.0) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                for event in self.events:
                    if predicate(*event):
                        return event
            time.sleep(0.05)
        raise AssertionError(f"no such event in {timeout_s}s; got {self.events}")

    def close(self) -> None:
        self._stop = True
        self._client.close()


def _running_trial(url: str) -> tuple[optuna.trial.Trial, optuna.Study]:
    study = optuna.load_study(study_name=NAME, storage=url)
    return study.ask(), study


def test_progress_written_by_the_recorder_appears_in_the_event_stream(copy_url: str) -> None:
    engine = create_store_engine(copy_url)
    sweep_id = get_sweep(engine, NAME).id
    recorder = ProgressRecorder(engine, sweep_id, min_interval_s=0)
    with start_in_background(copy_url, port=0, poll_interval_s=0.2) as handle:
        stream = _Events(f"{handle.url}api/sweeps/{NAME}/events")
        try:
            stream.wait_for(lambda name, data: name == "sweep" and data["counts"]["total"] == 4)
            trial, study = _running_trial(copy_url)
            recorder.trial_started(trial.number, trial._trial_id, total_steps=100, device="cpu")
            stream.wait_for(lambda name, data: name == "sweep" and data["counts"]["RUNNING"] == 1)
            stream.wait_for(lambda name, data: name == "trials" and any(
                t["number"] == trial.number and t["state"] == "RUNNING" for t in data["trials"]))
            recorder.step(trial.number, step=37, total_steps=100, train_loss=4.25,
                          tokens_per_s=1234.0, lr=1e-3)
            _, data = stream.wait_for(lambda name, data: name == "trials" and any(
                t["number"] == trial.number and t["step"] == 37 for t in data["trials"]))
            row = next(t for t in data["trials"] if t["number"] == trial.number)
            assert row["train_loss"] == 4.25 and row["tokens_per_s"] == 1234.0
            assert row["total_steps"] == 100 and row["eta_s"] is not None
            recorder.finished(trial.number, "COMPLETE", objective=3.5)
            study.tell(trial, 3.5)
            stream.wait_for(lambda name, data: name == "sweep" and data["counts"]["COMPLETE"] == 3
                            and data["best_number"] == trial.number)
            stream.wait_for(lambda name, data: name == "trials" and any(
                t["number"] == trial.number and t["state"] == "COMPLETE" and t["objective"] == 3.5
                for t in data["trials"]))
        finally:
            stream.close()
    # the server stopped although a stream was open
    assert not any(t.name == "sweepmaster-dashboard" and t.is_alive()
                   for t in threading.enumerate())


def test_sweep_list_event_stream(sweep_url: str) -> None:
    with start_in_background(sweep_url, port=0, poll_interval_s=0.2) as handle:
        stream = _Events(f"{handle.url}api/events")
        try:
            _, data = stream.wait_for(lambda name, data: name == "sweeps")
            assert [s["name"] for s in data["sweeps"]] == [NAME]
        finally:
            stream.close()


def test_reading_while_a_sweep_writes_never_fails(copy_url: str) -> None:
    engine = create_store_engine(copy_url)
    recorder = ProgressRecorder(engine, get_sweep(engine, NAME).id, min_interval_s=0)
    trial, _ = _running_trial(copy_url)
    recorder.trial_started(trial.number, trial._trial_id, total_steps=10_000, device="cpu")
    stop = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        step = 0
        try:
            while not stop.is_set():
                step += 1
                recorder.step(trial.number, step, 10_000, 3.0, 100.0, 1e-3)
                recorder.evaluated(trial.number, step, 3.0, math.exp(3.0))
        except BaseException as err:  # noqa: B036
            errors.append(err)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        app = create_app(copy_url)
        watcher = SweepWatcher(app.state.dashboard.reader, NAME)
        with TestClient(app, base_url=BASE) as c:
            deadline = time.monotonic() + 3
            num_reads = 0
            while time.monotonic() < deadline:
                for path in (f"/api/sweeps/{NAME}", f"/api/sweeps/{NAME}/trials/{trial.number}",
                             f"/api/sweeps/{NAME}/trials?state=RUNNING"):
                    response = c.get(path)
                    assert response.status_code == 200, response.text
                watcher.poll()
                num_reads += 1
    finally:
        stop.set()
        writer.join()
    assert not errors and num_reads > 3
    assert recorder.flush_count > 10
    detail = TestClient(create_app(copy_url), base_url=BASE).get(
        f"/api/sweeps/{NAME}/trials/{trial.number}").json()
    assert detail["trial"]["step"] > 0


# -- schema --------------------------------------------------------------------------------------
def test_openapi_schema_documents_the_api(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    for path in ("/api/sweeps", "/api/sweeps/{name}", "/api/sweeps/{name}/trials",
                 "/api/sweeps/{name}/trials/{number}", "/api/sweeps/{name}/timeline",
                 "/api/sweeps/{name}/fusion", "/api/sweeps/{name}/workers",
                 "/api/sweeps/{name}/plots/{kind}",
                 "/api/sweeps/{name}/events", "/api/events", "/api/info"):
        assert "get" in paths[path], path
    assert not any(p.startswith("/static") or p == "/" for p in paths)
    detail = paths["/api/sweeps/{name}"]["get"]["responses"]
    assert detail["200"]["content"]["application/json"]["schema"]["$ref"].endswith("SweepDetail")
    assert detail["404"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "ErrorResponse")
    assert "text/event-stream" in paths["/api/sweeps/{name}/events"]["get"]["responses"]["200"][
        "content"]


@pytest.fixture(scope="module")
def dashboard_schema(sweep_url: str) -> Any:
    app = create_app(sweep_url, allowed_hosts=None)  # schemathesis sends Host: testserver
    return schemathesis.openapi.from_asgi("/openapi.json", app)


if schemathesis is not None:
    # The event streams never end: the tests of live events cover them.
    schema = schemathesis.pytest.from_fixture("dashboard_schema").exclude(path_regex=r"/events$")

    @schema.parametrize()
    @settings(max_examples=40, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    def test_schemathesis_conforms_and_finds_no_server_error(case: Any) -> None:
        response = case.call_and_validate()
        assert response.status_code < 500, response.text
else:

    def test_schemathesis_conforms_and_finds_no_server_error() -> None:
        pytest.skip("schemathesis is not installed (pip install schemathesis)")


# -- PostgreSQL ----------------------------------------------------------------------------------
@pytest.mark.postgres
def test_dashboard_on_postgresql(postgres_url: str, tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path, storage=postgres_url,
                     parameters={"train.lr": {"values": [1e-2, 1e30]}},
                     train={"max_steps": 3, "eval_every": 3})
    run_sweep(load_sweep_config(write_sweep(tmp_path, raw)))
    app = create_app(postgres_url)
    with TestClient(app, base_url=BASE) as c:
        [sweep] = c.get("/api/sweeps").json()["sweeps"]
        assert sweep["counts"]["COMPLETE"] == 2 and sweep["counts"]["FAIL"] == 2
        detail = c.get(f"/api/sweeps/{NAME}", params={"sort": "objective"}).json()
        assert detail["page"]["trials"][0]["state"] == "COMPLETE"
        assert detail["best"]["number"] == sweep["best_number"]
        failed = c.get(f"/api/sweeps/{NAME}/trials", params={"state": "FAIL"}).json()
        assert failed["total"] == 2
        trial = c.get(f"/api/sweeps/{NAME}/trials/{sweep['best_number']}").json()
        assert {c["name"] for c in trial["curves"]} == METRICS
        assert c.get(f"/api/sweeps/{NAME}/plots/history").status_code == 200
        timeline = c.get(f"/api/sweeps/{NAME}/timeline").json()
        [lane] = timeline["devices"]  # the trials fit the host CPU: one shard, a task per step
        assert lane["device"] == "cpu" and {t["shard"] for t in lane["tasks"]} == {0}
        steps = Counter(t["trial_number"] for t in lane["tasks"] if t["kind"] == "backward")
        complete = [row["number"] for row in detail["page"]["trials"]
                    if row["state"] == "COMPLETE"]
        assert len(steps) == 4 and [steps[n] for n in complete] == [3, 3]
        assert SweepWatcher(app.state.dashboard.reader, NAME).poll()[0][0] == "sweep"
    with pytest.raises(sa.exc.InternalError, match="read-only"):
        with app.state.dashboard.reader.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM sm_metrics")


def add_two_device_trial_and_a_retry(url: str) -> tuple[int, int, int]:
    """On a copy of the sweep: a trial whose shards ran on cpu:0 and cpu:1 (recorded by the
    executor's task recorder), then a step of it pipelined over both, and an interrupted trial
    re-queued as a retry.

    Returns:
        ``(two_device_trial, interrupted_trial, its_retry)``.
    """
    from sweepmaster.runtime.events import TaskRecord
    from sweepmaster.store import TaskEventRecorder
    from sweepmaster.study import fail_trial, requeue_interrupted

    engine = create_store_engine(url)
    study = optuna.load_study(study_name=NAME, storage=url)
    spilled = next(t for t in study.trials if t.state == TrialState.COMPLETE)
    recorder = TaskEventRecorder(engine, get_sweep(engine, NAME).id, min_interval_s=0)
    recorder.name_job("trial-x", spilled.number)
    for shard, device in enumerate(["cpu:1", "cpu:0", "cpu:1"]):
        recorder.record(TaskRecord(device=device, job="trial-x", shard=shard, kind="forward",
                                   start_s=100.0 + shard, end_s=100.5 + shard, swap_bytes=0,
                                   peak_bytes=None, step=0))
    # then a step pipelined over both devices: packs of shards 0-1 and 2 (Harmony PP)
    for shard, device, p2p in [(0, "cpu:0", 3 * 2**20), (2, "cpu:1", 2**20)]:
        recorder.record(TaskRecord(device=device, job="trial-x", shard=shard, kind="pipeline",
                                   start_s=104.0, end_s=105.0, swap_bytes=0, peak_bytes=None,
                                   step=1, p2p_bytes=p2p))
    recorder.flush()
    failed = next(t for t in study.trials if t.state == TrialState.FAIL)
    study.enqueue_trial(failed.params)  # run its cell again, and interrupt it
    interrupted = study.ask(failed.distributions)
    assert interrupted.params == failed.params
    fail_trial(study, interrupted, "interrupted (Ctrl-C); runs again on relaunch",
               interrupted=True)
    assert requeue_interrupted(study) == 1
    retry = study.trials[-1]
    engine.dispose()
    return spilled.number, interrupted.number, retry.number


def test_trials_list_every_device_and_link_a_retry(copy_url: str) -> None:
    spilled, interrupted, retry = add_two_device_trial_and_a_retry(copy_url)
    with TestClient(create_app(copy_url), base_url=BASE) as c:
        rows = {t["number"]: t for t in c.get(f"/api/sweeps/{NAME}?limit=250").json()["page"]
                ["trials"]}
        # the device it really trained on in the sweep, and the two of its shard tasks added
        assert rows[spilled]["devices"] == ["cpu", "cpu:0", "cpu:1"]
        assert rows[interrupted]["retried_by"] == retry
        assert rows[retry]["retried_by"] is None and rows[retry]["state"] == "WAITING"
        detail = c.get(f"/api/sweeps/{NAME}/trials/{interrupted}").json()
        assert detail["trial"]["retried_by"] == retry
        assert "runs again on relaunch" in detail["failure_reason"]
        assert c.get(f"/api/sweeps/{NAME}/trials/{spilled}").json()["trial"]["devices"] == [
            "cpu", "cpu:0", "cpu:1"]
