// The sweep page: state counts, best so far, the trial table (sorted, filtered, paged; rows
// update live), the workers training the sweep, and Optuna's analysis plots.
import { ApiError, getJSON, subscribe } from "../api.js";
import { el, clear, errorBox, setCrumbs, throttle } from "../dom.js";
import * as f from "../format.js";
import { draw, message } from "../plots.js";

const PLOTS = [
  ["history", "Optimization history"],
  ["parallel_coordinate", "Parallel coordinate"],
  ["importances", "Importance"],
  ["intermediate_values", "Intermediate values"],
  ["timeline", "Timeline"],
];
const PAGE_SIZES = [25, 50, 100, 250];

function readView() {
  const q = new URLSearchParams(window.location.search);
  return {
    sort: q.get("sort") || "number",
    order: q.get("order") === "asc" ? "asc" : (q.get("order") || "desc"),
    state: q.getAll("state"),
    offset: Math.max(0, Number(q.get("offset")) || 0),
    limit: PAGE_SIZES.includes(Number(q.get("limit"))) ? Number(q.get("limit")) : 50,
    plot: q.get("plot") || "history",
  };
}

function writeView(view) {
  const q = new URLSearchParams();
  if (view.sort !== "number") q.set("sort", view.sort);
  if (view.order !== "desc") q.set("order", view.order);
  view.state.forEach((s) => q.append("state", s));
  if (view.offset) q.set("offset", view.offset);
  if (view.limit !== 50) q.set("limit", view.limit);
  if (view.plot !== "history") q.set("plot", view.plot);
  const search = q.toString();
  history.replaceState(history.state, "", window.location.pathname + (search ? `?${search}` : ""));
}

function timeCell(t) {
  if (t.state === "RUNNING") return t.eta_s === null ? f.DASH : `≈${f.duration(t.eta_s)} left`;
  return f.duration(t.duration_s);
}

function progressCell(t) {
  const fraction = t.total_steps > 0 ? Math.min(t.step / t.total_steps, 1) : 0;
  return el("span", { class: "progress" },
    el("span", { class: `bar ${t.state}` },
      el("span", { style: { width: `${(fraction * 100).toFixed(1)}%` } })),
    el("span", { class: "steps", text: t.total_steps > 0 ? `${f.int(t.step)}/${f.int(t.total_steps)}` : f.DASH }));
}

function devicesCell(t) {
  return f.devices(t);
}

// The state, and for an interrupted trial a link to the trial that runs it again.
function stateCell(t, sweepHref) {
  const badge = el("span", { class: `badge ${t.state}`, text: t.state });
  if (t.retried_by === null || t.retried_by === undefined) return badge;
  return el("span", {}, badge, " ", el("a", { class: "retry", "data-retry": t.retried_by,
    href: `${sweepHref}/trials/${t.retried_by}`, title: `runs again as trial ${t.retried_by}`,
    text: `→ #${t.retried_by}` }));
}

// The table's columns: header, sort key, cell class, cell content.
function columns(paramNames) {
  const short = f.shortNames(paramNames);
  return [
    { title: "#", sort: "number", cls: "num", cell: (t) => String(t.number) },
    { title: "state", sort: "state", cell: stateCell },
    ...paramNames.map((p) => ({ title: short[p], tip: p, sort: `param:${p}`, cls: "num", key: `param:${p}`,
      cell: (t) => f.param(t.params[p]) })),
    { title: "progress", sort: "progress", key: "step", cell: progressCell },
    { title: "tokens/s", sort: "tokens_per_s", cls: "num hide-narrow", cell: (t) => f.int(t.tokens_per_s) },
    { title: "train loss", sort: "train_loss", cls: "num", cell: (t) => f.num(t.train_loss) },
    { title: "eval loss", sort: "eval_loss", cls: "num", cell: (t) => f.num(t.eval_loss) },
    { title: "objective", sort: "objective", cls: "num", cell: (t) => f.num(t.objective) },
    { title: "device", sort: "device", cls: "hide-narrow", cell: devicesCell },
    { title: "ETA / time", cls: "num hide-narrow", key: "time", cell: timeCell },
  ];
}

export async function sweepPage(main, name) {
  const base = `/api/sweeps/${encodeURIComponent(name)}`;
  const pageHref = `/sweeps/${encodeURIComponent(name)}`;
  setCrumbs({ text: "sweeps", href: "/" }, { text: name });
  const view = readView();
  const query = () => ({ sort: view.sort, order: view.order, state: view.state,
    offset: view.offset, limit: view.limit });

  let detail;
  try {
    detail = await getJSON(base, query());
  } catch (err) {
    if (!(err instanceof ApiError) || err.status !== 422) throw err;
    Object.assign(view, { sort: "number", order: "desc", state: [], offset: 0 });
    detail = await getJSON(base, query());
  }

  // --- skeleton ---------------------------------------------------------------------------
  const title = el("h1");
  const sub = el("div", { class: "sub" });
  const chips = el("div", { class: "chips", id: "state-chips" });
  const bestBox = el("div", { id: "best" });
  const tableHead = el("thead");
  const tableBody = el("tbody", { id: "trial-rows" });
  const pagerText = el("span", { class: "muted", id: "pager-text" });
  const prev = el("button", { type: "button", text: "‹ prev" });
  const next = el("button", { type: "button", text: "next ›" });
  const sizeSelect = el("select", { "aria-label": "rows per page" },
    PAGE_SIZES.map((n) => el("option", { value: n, text: `${n} rows`, selected: n === view.limit })));
  const tableError = el("div");
  const plotTabs = el("div", { class: "tabs", role: "tablist" });
  const plotDiv = el("div", { class: "plot", id: "analysis-plot" });
  const configPre = el("pre", { class: "config mono" });
  const workersBox = el("div", { id: "workers" });

  clear(main,
    title, sub,
    el("div", { class: "grid" },
      el("div", { class: "card" }, el("h2", { text: "Trials by state" }), chips),
      el("div", { class: "card" }, el("h2", { text: "Best so far" }), bestBox)),
    el("div", { class: "card", style: { marginTop: "14px" } },
      el("div", { class: "row" }, el("h2", { text: "Trials" }), el("span", { class: "spacer" }),
        el("a", { href: `${pageHref}/devices`, text: "Devices →" })),
      tableError,
      el("div", { class: "table-wrap" }, el("table", { id: "trials" }, tableHead, tableBody)),
      el("div", { class: "pager" }, prev, next, pagerText, el("span", { class: "spacer" }), sizeSelect)),
    el("div", { class: "card" }, el("h2", { text: "Workers" }), workersBox),
    el("div", { class: "card" }, el("h2", { text: "Analysis (Optuna)" }), plotTabs, plotDiv),
    el("div", { class: "card" }, el("details", {}, el("summary", { text: "Configuration" }), configPre)));

  // --- rendering ----------------------------------------------------------------------------
  let cols = columns(detail.param_names);
  let bestNumber = null;
  let summaryKey = "";

  function renderSummary(sweep, best) {
    clear(title, sweep.name, el("span", { class: `badge ${sweep.status}`, id: "sweep-status", text: sweep.status }));
    clear(sub, `${sweep.direction || ""} ${sweep.metric || ""}`.trim() || "—",
      ` · ${f.int(sweep.counts.total)} trials · started ${f.when(sweep.created_at)}`);
    clear(chips,
      el("button", { type: "button", class: `chip${view.state.length ? "" : " active"}`,
        onclick: () => { view.state = []; view.offset = 0; reload(); } }, `all ${f.int(sweep.counts.total)}`),
      f.STATES.map((s) => el("button", {
        type: "button", class: `chip${view.state.includes(s) ? " active" : ""}`, "data-state": s,
        title: `show ${s} trials only`,
        onclick: () => {
          view.state = view.state.includes(s) ? view.state.filter((x) => x !== s) : [...view.state, s];
          view.offset = 0;
          reload();
        },
      }, el("span", { class: `dot ${s}` }), `${s} `, el("b", { "data-count": s, text: f.int(sweep.counts[s]) }))));
    bestNumber = sweep.best_number;
    if (best) {
      clear(bestBox, el("dl", { class: "kv" },
        el("dt", { text: "trial" }), el("dd", {}, el("a", { href: `${pageHref}/trials/${best.number}`, text: `#${best.number}` })),
        el("dt", { text: sweep.metric || "objective" }), el("dd", { id: "best-value", text: f.num(best.objective, 6) }),
        Object.entries(best.params).map(([k, v]) => [el("dt", { text: k }), el("dd", { text: f.param(v) })])));
    } else {
      clear(bestBox, el("span", { class: "muted", text: "no COMPLETE trial yet" }));
    }
    summaryKey = JSON.stringify([sweep.status, sweep.counts, sweep.best_number, sweep.best_value]);
  }

  function renderHead() {
    clear(tableHead, el("tr", {}, cols.map((c) => {
      const sorted = c.sort && c.sort === view.sort;
      const arrow = sorted ? (view.order === "asc" ? " ▲" : " ▼") : "";
      return el("th", {
        class: [c.cls || "", c.sort ? "sortable" : "", sorted ? "sorted" : ""].join(" ").trim(),
        title: c.tip || (c.sort ? `sort by ${c.title}` : undefined),
        "aria-sort": sorted ? (view.order === "asc" ? "ascending" : "descending") : undefined,
        onclick: c.sort ? () => {
          if (view.sort === c.sort) view.order = view.order === "asc" ? "desc" : "asc";
          else { view.sort = c.sort; view.order = c.sort === "number" ? "desc" : "asc"; }
          view.offset = 0;
          reload();
        } : undefined,
      }, c.title + arrow);
    })));
  }

  function row(t) {
    return el("tr", {
      "data-number": t.number, "data-state": t.state, class: t.number === bestNumber ? "best" : "",
      onclick: (event) => {
        if (event.target.closest("a")) return;
        window.location.href = `${pageHref}/trials/${t.number}`;
      },
    }, cols.map((c) => el("td", { class: c.cls || "", "data-col": c.key || c.sort }, c.cell(t, pageHref))));
  }

  function renderPage(page) {
    clear(tableBody, page.trials.map(row));
    if (page.trials.length === 0) {
      tableBody.appendChild(el("tr", {}, el("td", { colspan: cols.length, class: "message",
        text: page.total === 0 && !view.state.length ? "no trials yet" : "no trials match" })));
    }
    const first = page.total === 0 ? 0 : page.offset + 1;
    pagerText.textContent = `${f.int(first)}–${f.int(page.offset + page.trials.length)} of ${f.int(page.total)}`;
    prev.disabled = page.offset === 0;
    next.disabled = page.offset + page.trials.length >= page.total;
  }

  function renderAll(d) {
    detail = d;
    if (JSON.stringify(d.param_names) !== JSON.stringify(cols.filter((c) => c.key && c.key.startsWith("param:")).map((c) => c.key.slice(6)))) {
      cols = columns(d.param_names);
    }
    renderSummary(d.sweep, d.best);
    renderHead();
    renderPage(d.page);
    configPre.textContent = d.config_text;
    writeView(view);
  }

  let reloading = false;
  let reloadAgain = false;
  async function reload() {
    if (reloading) { reloadAgain = true; return; }
    reloading = true;
    try {
      const d = await getJSON(base, query());
      clear(tableError);
      renderAll(d);
    } catch (err) {
      clear(tableError, errorBox(err));
    } finally {
      reloading = false;
      if (reloadAgain) { reloadAgain = false; reload(); }
    }
  }
  const reloadSoon = throttle(reload, 1000);

  prev.addEventListener("click", () => { view.offset = Math.max(0, view.offset - view.limit); reload(); });
  next.addEventListener("click", () => { view.offset += view.limit; reload(); });
  sizeSelect.addEventListener("change", () => { view.limit = Number(sizeSelect.value); view.offset = 0; reload(); });

  // --- workers: processes training this sweep, on any host ----------------------------------
  async function loadWorkers() {
    try {
      const data = await getJSON(`${base}/workers`);
      if (!data.workers.length) {
        clear(workersBox, el("span", { class: "muted", text: "no worker has joined this sweep yet" }));
        return;
      }
      clear(workersBox, el("div", { class: "table-wrap" }, el("table", { id: "worker-rows" },
        el("thead", {}, el("tr", {}, ["worker", "host", "pid", "devices", "state", "last heartbeat",
          "running", "finished"].map((h) => el("th", { text: h })))),
        el("tbody", {}, data.workers.map((w) => el("tr", { "data-worker": w.id, "data-status": w.status },
          el("td", { class: "num", text: String(w.id) }), el("td", { text: w.host }),
          el("td", { class: "num", text: String(w.pid) }), el("td", { text: w.devices }),
          el("td", {}, el("span", { class: `badge ${w.status}`, text: w.status })),
          el("td", { class: "num", text: `${f.duration(w.heartbeat_age_s)} ago` }),
          el("td", { class: "num", text: f.int(w.num_running) }),
          el("td", { class: "num", text: f.int(w.num_finished) })))))));
    } catch (err) {
      clear(workersBox, errorBox(err));
    }
  }
  const refreshWorkers = throttle(loadWorkers, 5000);
  loadWorkers();

  // --- analysis plots -------------------------------------------------------------------------
  let plotCounts = null;
  async function showPlot(kind) {
    view.plot = kind;
    writeView(view);
    for (const b of plotTabs.children) b.classList.toggle("active", b.dataset.kind === kind);
    message(plotDiv, "drawing…");
    plotCounts = JSON.stringify(detail.sweep.counts);
    try {
      // Asked first, so that a plot the trials cannot draw yet is a message, not a 409.
      const check = await getJSON(`${base}/plots/${kind}/availability`);
      if (view.plot !== kind) return;
      if (!check.available) {
        message(plotDiv, check.reason);
        return;
      }
      const plot = await getJSON(`${base}/plots/${kind}`);
      if (view.plot !== kind) return;
      clear(plotDiv);
      const layout = { ...(plot.figure.layout || {}), autosize: true };
      if (window.innerWidth < 700) layout.legend = { orientation: "h", y: -0.3 };
      await draw(plotDiv, plot.figure.data || [], layout);
    } catch (err) {
      if (view.plot !== kind) return;
      message(plotDiv, err.detail || String(err), !(err instanceof ApiError && err.status === 409));
    }
  }
  const refreshPlot = throttle(() => showPlot(view.plot), 10000);
  clear(plotTabs, PLOTS.map(([kind, label]) => el("button", { type: "button", "data-kind": kind,
    role: "tab", text: label, onclick: () => showPlot(kind) })));

  renderAll(detail);
  showPlot(PLOTS.some(([k]) => k === view.plot) ? view.plot : "history");

  // --- live updates ---------------------------------------------------------------------------
  subscribe(`${base}/events`, {
    sweep: (sweep) => {
      const key = JSON.stringify([sweep.status, sweep.counts, sweep.best_number, sweep.best_value]);
      refreshWorkers();
      if (key === summaryKey) return;
      reloadSoon();  // counts or best changed: rows may have moved between pages
      if (plotCounts !== JSON.stringify(sweep.counts)) refreshPlot();
    },
    trials: (data) => {
      refreshWorkers();
      for (const t of data.trials) {
        const old = tableBody.querySelector(`tr[data-number="${t.number}"]`);
        if (!old) continue;
        if (view.state.length && !view.state.includes(t.state)) { reloadSoon(); continue; }
        const fresh = row(t);
        fresh.classList.add("flash");
        old.replaceWith(fresh);
      }
    },
    error: (data) => clear(tableError, errorBox(data)),
  });
}
