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
  margin: { l: 56, r: 16, t: 36, b: 44 },
  autosize: true,
  font: { size: 12 },
};

export async function draw(div, data, layout = {}, config = {}) {
  const Plotly = await ensurePlotly();
  const merged = { ...BASE_LAYOUT, ...layout, margin: { ...BASE_LAYOUT.margin, ...(layout.margin || {}) } };
  await Plotly.react(div, data, merged, { responsive: true, displaylogo: false, ...config });
}

export function message(div, text, isError = false) {
  if (window.Plotly) window.Plotly.purge(div);
  clear(div, el("div", { class: isError ? "error" : "message", text }));
}
