// The sweeps page: every sweep in the database with its trial counts, live.
import { getJSON, subscribe } from "../api.js";
import { el, clear, errorBox, setCrumbs } from "../dom.js";
import * as f from "../format.js";

function countsCell(counts) {
  return el("div", { class: "chips" },
    f.STATES.filter((s) => counts[s] > 0).map((s) =>
      el("span", { class: "chip", title: s }, el("span", { class: `dot ${s}` }), `${f.int(counts[s])}`)));
}

function render(tbody, sweeps) {
  clear(tbody, sweeps.map((s) => {
    const href = `/sweeps/${encodeURIComponent(s.name)}`;
    return el("tr", { "data-sweep": s.name, onclick: () => { window.location.href = href; } },
      el("td", {}, el("a", { href, text: s.name })),
      el("td", {}, el("span", { class: `badge ${s.status}`, text: s.status })),
      el("td", { class: "hide-narrow", text: `${s.direction || f.DASH} ${s.metric || ""}` }),
      el("td", { class: "num", text: f.int(s.counts.total) }),
      el("td", {}, countsCell(s.counts)),
      el("td", { class: "num" }, s.best_number === null ? f.DASH
        : `${f.num(s.best_value)} (#${s.best_number})`),
      el("td", { class: "hide-narrow", text: f.when(s.created_at) }));
  }));
}

export async function sweepsPage(main) {
  setCrumbs({ text: "sweeps" });
  const list = await getJSON("/api/sweeps");
  const tbody = el("tbody");
  const empty = el("p", { class: "message", text: "No sweeps in this database yet. "
    + "Start one with: sweepmaster launch sweep.yaml" });
  const table = el("div", { class: "card" },
    el("div", { class: "table-wrap" }, el("table", {},
      el("thead", {}, el("tr", {},
        el("th", { text: "sweep" }), el("th", { text: "status" }),
        el("th", { class: "hide-narrow", text: "objective" }), el("th", { class: "num", text: "trials" }),
        el("th", { text: "states" }), el("th", { class: "num", text: "best" }),
        el("th", { class: "hide-narrow", text: "created" }))),
      tbody)));
  const show = (sweeps) => {
    empty.hidden = sweeps.length > 0;
    table.hidden = sweeps.length === 0;
    render(tbody, sweeps);
  };
  clear(main, el("h1", { text: "Sweeps" }), empty, table);
  show(list.sweeps);
  subscribe("/api/events", {
    sweeps: (data) => show(data.sweeps),
    error: (data) => { main.prepend(errorBox(data)); },
  });
}
