// The trial page: its numbers, parameters, learning curves and intermediate values, live.
import { getJSON, subscribe } from "../api.js";
import { el, clear, errorBox, setCrumbs, throttle } from "../dom.js";
import * as f from "../format.js";
import { draw, message } from "../plots.js";

// Curves drawn together: every "*loss" metric in one chart, each other metric alone.
function groups(curves) {
  const losses = curves.filter((c) => c.name.endsWith("loss"));
  const others = curves.filter((c) => !c.name.endsWith("loss"));
  const out = [];
  if (losses.length) out.push({ title: "loss (nats/token)", curves: losses });
  for (const c of others) out.push({ title: c.name, curves: [c], log: c.name === "eval_perplexity" });
  return out;
}

function summary(d) {
  const t = d.trial;
  const rows = [
    ["state", el("span", { class: `badge ${t.state}`, text: t.state })],
    ["objective", f.num(t.objective, 6)],
    ["progress", t.total_steps ? `${f.int(t.step)} / ${f.int(t.total_steps)} steps` : f.DASH],
    ["tokens/s", f.int(t.tokens_per_s)],
    ["train loss", f.num(t.train_loss)],
    ["eval loss", f.num(t.eval_loss)],
    [t.devices && t.devices.length > 1 ? "devices" : "device", f.devices(t)],
    ["started", f.when(t.started_at)],
    [t.state === "RUNNING" ? "running for" : "took", f.duration(t.duration_s)],
  ];
  if (t.state === "RUNNING") rows.push(["ETA", t.eta_s === null ? f.DASH : f.duration(t.eta_s)]);
  const checkpoint = d.checkpoint_missing ? `${d.checkpoint_path} (missing: deleted or moved)` : d.checkpoint_path;
  rows.push(["checkpoint", checkpoint ? el("span", { class: "mono", text: checkpoint }) : f.DASH]);
  return el("dl", { class: "kv", id: "trial-summary" },
    rows.map(([k, v]) => [el("dt", { text: k }), el("dd", { "data-field": k }, v)]));
}

export async function trialPage(main, name, number) {
  const sweepHref = `/sweeps/${encodeURIComponent(name)}`;
  const url = `/api/sweeps/${encodeURIComponent(name)}/trials/${number}`;
  setCrumbs({ text: "sweeps", href: "/" }, { text: name, href: sweepHref }, { text: `trial ${number}` });
  let detail = await getJSON(url);

  const title = el("h1");
  const failure = el("div");
  const info = el("div", { class: "card" });
  const params = el("div", { class: "card" });
  const charts = el("div", { class: "grid", id: "curves" });
  const liveError = el("div");
  clear(main, title, liveError, failure,
    el("div", { class: "grid" }, info, params),
    el("h2", { style: { margin: "16px 0 8px" }, text: "Learning curves" }), charts);

  const chartDivs = new Map();
  function chartDiv(key) {
    if (!chartDivs.has(key)) {
      const div = el("div", { class: "plot small", "data-chart": key });
      charts.appendChild(el("div", { class: "card" }, div));
      chartDivs.set(key, div);
    }
    return chartDivs.get(key);
  }

  function render(d) {
    detail = d;
    const t = d.trial;
    clear(title, `Trial ${t.number}`, el("span", { class: `badge ${t.state}`, text: t.state }));
    const retry = t.retried_by === null || t.retried_by === undefined ? null
      : el("span", {}, " · runs again as ", el("a", { id: "retry-link",
        href: `${sweepHref}/trials/${t.retried_by}`, text: `trial ${t.retried_by}` }));
    clear(failure, d.failure_reason
      ? el("div", { class: "error", id: "failure" }, `failed: ${d.failure_reason}`, retry) : null);
    clear(info, el("h2", { text: "Trial" }), summary(d));
    clear(params, el("h2", { text: "Parameters" }),
      Object.keys(t.params).length === 0 ? el("span", { class: "muted", text: "none" })
        : el("dl", { class: "kv" }, Object.entries(t.params).map(([k, v]) => [
          el("dt", { text: k, title: d.distributions[k] || "" }), el("dd", { class: "mono", text: f.param(v) })])));
    const all = groups(d.curves);
    if (d.intermediate_values.length) {
      all.push({ title: "intermediate values (reported to Optuna)", curves: [{
        name: "intermediate", steps: d.intermediate_values.map((p) => p.step),
        values: d.intermediate_values.map((p) => p.value), num_points: d.intermediate_values.length }] });
    }
    if (all.length === 0) {
      clear(charts, el("div", { class: "card message", text: "no metrics recorded yet" }));
      chartDivs.clear();
      return;
    }
    if (charts.querySelector(".message")) clear(charts);
    for (const g of all) {
      const div = chartDiv(g.title);
      const thinned = g.curves.some((c) => c.num_points > c.steps.length);
      draw(div, g.curves.map((c) => ({
        type: "scatter", mode: c.steps.length > 60 ? "lines" : "lines+markers", name: c.name,
        x: c.steps, y: c.values,
      })), {
        title: { text: g.title + (thinned ? " (thinned)" : ""), font: { size: 13 } },
        xaxis: { title: { text: "step" } },
        yaxis: { type: g.log ? "log" : "linear" },
        showlegend: g.curves.length > 1,
        legend: { orientation: "h", x: 1, xanchor: "right", y: 1.02, yanchor: "bottom" },
      }).catch((err) => message(div, String(err.message || err), true));
    }
  }

  render(detail);
  const refresh = throttle(async () => {
    try {
      render(await getJSON(url));
      clear(liveError);
    } catch (err) {
      clear(liveError, errorBox(err));
    }
  }, 1000);
  subscribe(`/api/sweeps/${encodeURIComponent(name)}/events`, {
    trials: (data) => { if (data.trials.some((t) => t.number === number)) refresh(); },
    error: (data) => clear(liveError, errorBox(data)),
  });
}
