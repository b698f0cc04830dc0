// plotly.js, loaded on first use from the dashboard server (/vendor/plotly.min.js: the copy in
// the installed plotly Python package; no network needed).
import { el, clear } from "./dom.js";

let loading = null;

export function ensurePlotly() {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  if (!loading) {
    loading = new Promise((resolve, reject) => {
      const script = document.createElement("script");
      script.src = "/vendor/plotly.min.js";
      script.onload = () => resolve(window.Plotly);
      script.onerror = () => {
        loading = null;
        reject(new Error("cannot load plotly.js from the dashboard server"));
      };
      document.head.appendChild(script);
    });
  }
  return loading;
}

const BASE_LAYOUT = {
  margin: { l: 56, r: 16, t: 24, b: 44 },
  autosize: true,
  font: { size: 12 },
};

const COMPACT = new Intl.NumberFormat("en-US", { notation: "compact", maximumSignificantDigits: 3 });

// A tick label for a log axis: the whole value ("20k", "500", "0.05"), never a bare digit.
function logLabel(v) {
  if (v >= 1000) return COMPACT.format(v);
  if (v >= 1e-3) return String(Number(v.toPrecision(3)));
  return v.toExponential(0);
}

// Ticks of a log axis over [lo, hi]: powers of ten over wide ranges, 1-2-5 steps over a few
// decades, every digit within one; null where fewer than two would show (plotly's own then).
export function logTicks(lo, hi) {
  if (!(lo > 0) || !(hi >= lo)) return null;
  const decades = Math.log10(hi / lo);
  const steps = decades > 4 ? [1] : decades > 1.2 ? [1, 2, 5] : [1, 2, 3, 4, 5, 6, 7, 8, 9];
  const every = Math.max(1, Math.ceil(decades / 8));  // at most about 8 powers of ten
  const tickvals = [];
  for (let k = Math.floor(Math.log10(lo)); k <= Math.ceil(Math.log10(hi)); k++) {
    if (steps.length === 1 && k % every !== 0) continue;
    for (const m of steps) {
      const v = m * 10 ** k;
      if (v >= lo * 0.999 && v <= hi * 1.001) tickvals.push(Number(v.toPrecision(6)));
    }
  }
  if (tickvals.length < 2) return null;
  return { tickvals, ticktext: tickvals.map(logLabel) };
}

function axisKey(ref) {  // "x" -> "xaxis", "y2" -> "yaxis2"
  return `${ref[0]}axis${ref.slice(1)}`;
}

// Numbers each axis shows, from scatter and bar traces (a bar with a base, as in a Gantt chart,
// spans base .. base + length). An axis that also carries a trace of another kind, or values
// that are not numbers (dates, categories), maps to null: plotly's business.
function axisValues(data) {
  const values = new Map();
  const add = (key, list) => {
    if (values.get(key) === null) return;
    if (!Array.isArray(list)) return;
    const present = list.filter((v) => v !== null && v !== undefined);  // gaps draw nothing
    const numbers = present.filter((v) => typeof v === "number" && Number.isFinite(v));
    if (numbers.length !== present.length) {
      values.set(key, null);
      return;
    }
    values.set(key, [...(values.get(key) || []), ...numbers]);
  };
  for (const trace of data) {
    const x = axisKey(trace.xaxis || "x");
    const y = axisKey(trace.yaxis || "y");
    if (!["scatter", "scattergl", "bar", undefined].includes(trace.type)) {
      values.set(x, null);
      values.set(y, null);
      continue;
    }
    const horizontal = trace.type === "bar" && trace.orientation === "h";
    if (trace.type === "bar" && Array.isArray(trace.base)) {
      const [along, lengths] = horizontal ? [x, trace.x] : [y, trace.y];
      const ends = Array.isArray(lengths)
        ? trace.base.map((b, i) => (typeof b === "number" && typeof lengths[i] === "number"
          ? b + lengths[i] : null)) : [];
      add(along, trace.base);
      add(along, ends);
      add(horizontal ? y : x, horizontal ? trace.y : trace.x);
      continue;
    }
    add(x, trace.x);
    add(y, trace.y);
    if (trace.type === "bar") add(horizontal ? x : y, [0]);
  }
  return values;
}

// Axes plotly would draw badly: log axes get whole-value ticks; an axis whose values are all
// equal (one point, a constant) gets a range around that value instead of plotly's v-1..v+1.
function fixAxes(data, layout) {
  for (const [key, values] of axisValues(data)) {
    if (!values || !values.length) continue;
    const axis = { ...(layout[key] || {}) };
    const lo = Math.min(...values);
    const hi = Math.max(...values);
    if (axis.type === "log") {
      const ticks = axis.tickvals ? null : logTicks(lo, hi);
      if (ticks) Object.assign(axis, ticks);
      if (lo === hi && lo > 0 && !axis.range) axis.range = [Math.log10(lo) - 0.3, Math.log10(lo) + 0.3];
    } else if (lo === hi && !axis.range && axis.type !== "category") {
      const pad = lo === 0 ? 1 : Math.abs(lo) * 0.1;
      axis.range = lo === 0 ? [0, 1] : [lo - pad, lo + pad];
    }
    layout[key] = axis;
  }
}

// The chart's title as a heading above it: it wraps instead of being cut off, and never
// overlaps the legend.
function setTitle(div, title) {
  const text = typeof title === "string" ? title : title && title.text;
  let heading = div.previousElementSibling;
  if (!heading || !heading.classList.contains("plot-title")) {
    if (!text) return;
    heading = el("h3", { class: "plot-title" });
    div.before(heading);
  }
  heading.textContent = text ? String(text).replace(/<[^>]*>/g, "") : "";
  heading.hidden = !text;
}

export async function draw(div, data, layout = {}, config = {}) {
  const Plotly = await ensurePlotly();
  const { title, ...rest } = layout;
  const merged = { ...BASE_LAYOUT, ...rest, margin: { ...BASE_LAYOUT.margin, ...(layout.margin || {}) } };
  fixAxes(data, merged);
  setTitle(div, title);
  await Plotly.react(div, data, merged, { responsive: true, displaylogo: false, ...config });
}

export function message(div, text, isError = false) {
  if (window.Plotly) window.Plotly.purge(div);
  setTitle(div, null);
  clear(div, el("div", { class: isError ? "error" : "message", text }));
}
