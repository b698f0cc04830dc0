"""End to end in headless Chromium: the sweep page shows the trials and follows a running one.

Uses Debian's Chromium (``/usr/bin/chromium``) driven by Playwright for Python; never a
downloaded browser. Skipped when either is missing.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest

from sweepmaster.dashboard import start_in_background
from sweepmaster.store import ProgressRecorder, create_store_engine, get_sweep
from tests.dashboard.test_dashboard_api import (
    NAME,
    add_two_device_trial_and_a_retry,
    copy_db,
    run_dashboard_sweep,
)

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-quic"]
# Set SMTEST_SCREENSHOT_DIR (e.g. docs/screenshots) to keep the page's screenshot.
SCREENSHOT_DIR = os.environ.get("SMTEST_SCREENSHOT_DIR")

pytestmark = pytest.mark.browser



def _watch(page: Any, problems: list[str]) -> None:
    """Add ``page``'s script errors and console errors to ``problems`` as they come."""
    page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
    page.on("console", lambda msg: problems.append(f"console: {msg.text}")
            if msg.type == "error" else None)

@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.is_file():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def live_sweep(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> str:
    """A copy of the finished tiny sweep, to which the test adds a running trial."""
    return copy_db(run_dashboard_sweep(tmp_path_factory), tmp_path / "live.db")


def test_sweep_page_shows_trials_and_follows_a_running_trial(
    browser: Any, live_sweep: str, tmp_path: Path
) -> None:
    engine = create_store_engine(live_sweep)
    recorder = ProgressRecorder(engine, get_sweep(engine, NAME).id, min_interval_s=0)
    study = optuna.load_study(study_name=NAME, storage=live_sweep)
    trial = study.ask({"train.lr": optuna.distributions.CategoricalDistribution([1e-2, 1e30]),
                       "train.batch_size": optuna.distributions.CategoricalDistribution([2, 4])})
    recorder.trial_started(trial.number, trial._trial_id, total_steps=100, device="cpu")
    recorder.step(trial.number, step=10, total_steps=100, train_loss=5.5, tokens_per_s=2e3,
                  lr=1e-2)

    problems: list[str] = []
    with start_in_background(live_sweep, port=0, poll_interval_s=0.3) as handle:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        _watch(page, problems)
        page.goto(f"{handle.url}sweeps/{NAME}")

        rows = page.locator("#trial-rows tr[data-number]")
        rows.first.wait_for()
        assert rows.count() == 5
        running = page.locator(f'#trial-rows tr[data-number="{trial.number}"]')
        assert running.get_attribute("data-state") == "RUNNING"
        assert running.locator('td[data-col="step"]').inner_text().strip() == "10/100"
        assert page.locator('b[data-count="RUNNING"]').inner_text() == "1"
        failed = page.locator('#trial-rows tr[data-state="FAIL"]')
        assert failed.count() == 2
        workers = page.locator("#worker-rows tr[data-worker]")  # the launch that ran it
        workers.first.wait_for()
        assert workers.count() == 1 and workers.first.get_attribute("data-status") == "stopped"

        # a live update: progress written by the sweep shows up without a reload
        recorder.step(trial.number, step=55, total_steps=100, train_loss=4.25, tokens_per_s=2e3,
                      lr=1e-2)
        page.wait_for_function(
            f"""() => {{
                const cell = document.querySelector(
                    '#trial-rows tr[data-number="{trial.number}"] td[data-col="step"]');
                return cell && cell.textContent.trim() === "55/100";
            }}""",
            timeout=15_000,
        )
        assert running.locator('td[data-col="train_loss"]').inner_text() == "4.25"
        page.locator("#analysis-plot .main-svg").first.wait_for(timeout=30_000)
        page.screenshot(path=str(tmp_path / "sweep.png"), full_page=True)
        assert (tmp_path / "sweep.png").stat().st_size > 10_000
        if SCREENSHOT_DIR:
            Path(SCREENSHOT_DIR).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(tmp_path / "sweep.png", Path(SCREENSHOT_DIR) / "sweep.png")

        # the trial finishes: its state, the counts and the best trial follow
        recorder.finished(trial.number, "COMPLETE", objective=1.0)
        study.tell(trial, 1.0)
        page.wait_for_function(
            f"""() => document.querySelector(
                '#trial-rows tr[data-number="{trial.number}"]')?.dataset.state === "COMPLETE"
                && document.querySelector('b[data-count="RUNNING"]')?.textContent === "0"
                && document.querySelector('#best-value')?.textContent === "1" """,
            timeout=15_000,
        )

        # the trial page draws its learning curves
        page.goto(f"{handle.url}sweeps/{NAME}/trials/{study.best_trial.number}")
        page.locator('[data-chart="loss (nats/token)"] .main-svg').first.wait_for(timeout=30_000)
        assert "checkpoint" in page.locator("#trial-summary").inner_text()

        # the devices page draws the executor's tasks: one bar per trial on the host CPU
        page.goto(f"{handle.url}sweeps/{NAME}/devices")
        page.locator("#gantt .main-svg").first.wait_for(timeout=30_000)
        trained = len(study.trials) - 1  # the test itself made the last trial, without a device
        assert page.locator("#gantt .legendtext").count() == trained

        # readable in a narrow window: only the table scrolls sideways, never the page
        narrow = browser.new_page(viewport={"width": 390, "height": 800})
        narrow.goto(f"{handle.url}sweeps/{NAME}")
        narrow.locator("#trial-rows tr[data-number]").first.wait_for()
        assert narrow.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        narrow.close()
        page.close()
    assert not problems, problems


def test_pages_work_with_a_token(browser: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    url = f"sqlite:///{run_dashboard_sweep(tmp_path_factory)}"
    problems: list[str] = []
    with start_in_background(url, port=0, token="t0k/en?&") as handle:
        page = browser.new_page()
        page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
        page.goto(f"{handle.url}sweeps/{NAME}")
        assert "a valid token is required" in page.content()
        page.goto(handle.login_url.replace("/?", f"/sweeps/{NAME}?"))
        page.locator("#trial-rows tr[data-number]").first.wait_for()
        assert "token" not in page.url  # kept in the tab's session, not in the address bar
        page.locator("#live:not(.off)").wait_for()  # the event stream authenticated
        page.locator("#analysis-plot .main-svg").first.wait_for(timeout=30_000)  # plotly.js too
        page.close()
    assert not problems, problems


def test_devices_page_lists_the_fused_arrays_of_a_fused_sweep(browser: Any,
                                                             tmp_path: Path) -> None:
    from sweepmaster.config import load_sweep_config
    from sweepmaster.sweep import run_sweep
    from tests.kit.sweeps import tiny_sweep, write_sweep

    raw = tiny_sweep(tmp_path, resources={"fusion": 2},
                     parameters={"train.batch_size": {"value": 4}})
    config = load_sweep_config(write_sweep(tmp_path, raw))
    assert run_sweep(config).num_finished == 2
    problems: list[str] = []
    with start_in_background(config.storage, port=0) as handle:
        page = browser.new_page()
        page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
        page.goto(f"{handle.url}sweeps/{NAME}/devices")
        page.locator("#fusion table").wait_for(timeout=30_000)
        rows = page.locator("#fusion tbody tr")
        assert rows.count() == 2  # one per member
        cells = rows.first.locator("td")
        assert cells.nth(0).inner_text() == "trials-0+1"
        assert [row.locator("td").nth(2).inner_text() for row in rows.all()] == ["#0", "#1"]
        assert [row.locator("td").nth(4).inner_text() for row in rows.all()] == ["0 → 6"] * 2
        page.locator("#gantt .main-svg").first.wait_for(timeout=30_000)
        assert page.locator("#gantt .legendtext").count() == 1  # one job: the array
        page.close()
    assert not problems, problems


def test_api_docs_page_shows_the_operations_offline(
        browser: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    url = f"sqlite:///{run_dashboard_sweep(tmp_path_factory)}"
    problems: list[str] = []
    outside: list[str] = []
    with start_in_background(url, port=0) as handle:
        context = browser.new_context()

        def offline(route: Any) -> None:  # no network: only the dashboard answers
            if route.request.url.startswith(handle.url):
                route.continue_()
            else:
                outside.append(route.request.url)
                route.abort()

        context.route("**/*", offline)
        page = context.new_page()
        _watch(page, problems)
        page.goto(f"{handle.url}docs")
        operations = page.locator(".opblock-summary-path")
        operations.first.wait_for(timeout=30_000)
        paths = {operations.nth(i).inner_text().strip() for i in range(operations.count())}
        assert "/api/sweeps" in paths and "/api/sweeps/{name}/trials" in paths, paths
        assert "sweepmaster dashboard" in page.locator(".info .title").inner_text()
        context.close()
    assert not outside, outside
    assert not problems, problems


def _label_value(label: str) -> float:
    """A tick label as a number: "20K" -> 20000."""
    scale = {"K": 1e3, "k": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}
    label = label.replace("\u2212", "-").replace(",", "")
    if label[-1:] in scale:
        return float(label[:-1]) * scale[label[-1]]
    return float(label)


def test_trial_charts_devices_and_retry_links(browser: Any, tmp_path: Path,
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    url = copy_db(run_dashboard_sweep(tmp_path_factory), tmp_path / "links.db")
    spilled, interrupted, retry = add_two_device_trial_and_a_retry(url)
    problems: list[str] = []
    with start_in_background(url, port=0) as handle:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
        page.goto(f"{handle.url}sweeps/{NAME}?limit=250")
        row = page.locator(f'#trial-rows tr[data-number="{spilled}"]')
        row.wait_for()
        assert row.locator('td[data-col="device"]').inner_text() == "cpu, cpu:0, cpu:1"
        link = page.locator(f'#trial-rows tr[data-number="{interrupted}"] a.retry')
        assert link.inner_text() == f"→ #{retry}"
        link.click()
        page.wait_for_url(f"**/sweeps/{NAME}/trials/{retry}")

        page.goto(f"{handle.url}sweeps/{NAME}/trials/{interrupted}")
        page.locator("#retry-link").wait_for()
        assert "runs again on relaunch" in page.locator("#failure").inner_text()
        assert page.locator("#retry-link").get_attribute("href") == \
            f"/sweeps/{NAME}/trials/{retry}"

        # its pipelined step's p2p transfers are drawn between the two device lanes
        page.goto(f"{handle.url}sweeps/{NAME}/devices")
        page.locator("#gantt .main-svg").first.wait_for(timeout=30_000)
        assert "p2p transfers" in page.locator("#gantt .legendtext").all_text_contents()
        drawn = page.evaluate("""() => document.querySelector('#gantt').data
            .filter((t) => t.name === 'p2p transfers').map((t) => [t.x, t.y, t.text[0]])""")
        [(x, y, text)] = drawn  # one step: one line from pack 0's lane to pack 1's
        assert x[0] == x[1] and x[2] is None and y == ["cpu:0", "cpu:1", None]
        assert text == "trial-x · p2p cpu:0 ⇄ cpu:1 · 3.0 MiB out of cpu:0, 1.0 MiB out of cpu:1"
        # the time axis shows every task, not a constant range around that one step's line
        low, high = page.evaluate(
            "document.querySelector('#gantt')._fullLayout.xaxis.range")
        spans = page.evaluate("""() => document.querySelector('#gantt').data
            .filter((t) => t.base).flatMap((t) => t.base.map((b, i) => [b, b + t.x[i]]))""")
        assert len(spans) > 3
        assert low <= min(s for s, _ in spans) and high >= max(e for _, e in spans), \
            (low, high, spans)

        page.goto(f"{handle.url}sweeps/{NAME}/trials/{spilled}")
        assert "cpu, cpu:0, cpu:1" in page.locator("#trial-summary").inner_text()
        for chart in ("loss (nats/token)", "eval_perplexity", "lr"):
            page.locator(f'[data-chart="{chart}"] .main-svg').first.wait_for(timeout=30_000)
        # a chart's title is a heading above it: whole, and clear of the legend
        title = page.locator(".plot-title", has_text="loss (nats/token)").bounding_box()
        legend = page.locator('[data-chart="loss (nats/token)"] .legend').bounding_box()
        assert title is not None and legend is not None
        assert title["y"] + title["height"] <= legend["y"]
        # the log axis of perplexity: every label a whole value, rising up the axis
        labels = page.locator('[data-chart="eval_perplexity"] .ytick text').all_text_contents()
        values = [_label_value(label) for label in labels]
        assert len(values) >= 2 and values == sorted(set(values)), labels
        # a constant learning rate: a range around it, not plotly's value - 1 .. value + 1
        low, high = page.evaluate(
            """document.querySelector('[data-chart="lr"]')._fullLayout.yaxis.range""")
        assert 0 < low < 1e-2 < high < 2e-2
        # a chart of one point: a range around it on both axes, not -1 .. 1
        ranges = page.evaluate("""async () => {
            const { draw } = await import("/static/js/plots.js");
            const div = document.createElement("div");
            document.body.append(div);
            await draw(div, [{ type: "scatter", mode: "markers", x: [3], y: [0.5] }]);
            return [div._fullLayout.xaxis.range, div._fullLayout.yaxis.range];
        }""")
        (x_low, x_high), (y_low, y_high) = ranges
        assert 2 < x_low < 3 < x_high < 4 and 0.4 < y_low < 0.5 < y_high < 0.6, ranges
        page.close()
    assert not problems, problems


def test_a_plot_the_trials_cannot_draw_yet_is_a_message_without_console_errors(
        browser: Any, tmp_path: Path) -> None:
    from sweepmaster.store import get_or_create_sweep, upgrade_to_head

    url = f"sqlite:///{tmp_path / 'one.db'}"
    engine = create_store_engine(url)
    upgrade_to_head(engine)
    study = optuna.create_study(study_name="one", storage=url)
    sweep = get_or_create_sweep(engine, "one", "one", "name: one\n")
    recorder = ProgressRecorder(engine, sweep.id, min_interval_s=0)
    trial = study.ask({"lr": optuna.distributions.FloatDistribution(1e-4, 1e-2)})
    recorder.trial_started(trial.number, trial._trial_id, total_steps=4, device="cpu")
    recorder.finished(trial.number, "COMPLETE", objective=3.0)
    study.tell(trial, 3.0)
    engine.dispose()
    problems: list[str] = []
    with start_in_background(url, port=0) as handle:
        page = browser.new_page()
        _watch(page, problems)
        page.goto(f"{handle.url}sweeps/one")
        page.locator("#analysis-plot .main-svg").first.wait_for(timeout=30_000)  # history
        for kind, reason in (("importances", "need at least 2 COMPLETE trials"),
                             ("intermediate_values", "no trial has reported")):
            page.locator(f'button[data-kind="{kind}"]').click()
            page.locator("#analysis-plot .message", has_text=reason).wait_for(timeout=30_000)
        page.close()
    assert not problems, problems  # no "Failed to load resource: ... 409" in the console


def test_pages_of_a_sweep_or_trial_that_is_not_there_say_so_without_console_errors(
        browser: Any, live_sweep: str) -> None:
    problems: list[str] = []
    with start_in_background(live_sweep, port=0) as handle:
        page = browser.new_page()
        _watch(page, problems)
        for path in ("sweeps/nosuch", "sweeps/nosuch/trials/3", "sweeps/nosuch/devices"):
            page.goto(f"{handle.url}{path}")
            page.locator("#not-found", has_text="No sweep named nosuch").wait_for(timeout=30_000)
        page.goto(f"{handle.url}sweeps/{NAME}/trials/999")  # the sweep is there, the trial not
        page.locator("main .error").wait_for(timeout=30_000)
        app_errors = [p for p in problems if "Failed to load resource" not in p]
        page.close()
    assert not app_errors, app_errors  # the page shows the 404; it does not log it
    assert len(problems) <= 1, problems  # only the browser's own line for the trial's 404
