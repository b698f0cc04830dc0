// The devices page: shard tasks per device over time (a Gantt chart coloured by job), memory in
// use, swap volume and p2p bytes per device, p2p transfers between the lanes, and the fused arrays.
// Filled in by the executor's records.
import { getJSON, subscribe } from "../api.js";
import { el, clear, errorBox, setCrumbs, throttle } from "../dom.js";
import * as f from "../format.js";
import { draw, message } from "../plots.js";

const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
  "#7f7f7f", "#bcbd22", "#17becf"];

function gantt(timeline) {
  const byJob = new Map();
  for (const lane of timeline.devices) {
    for (const t of lane.tasks) {
      if (!byJob.has(t.job)) byJob.set(t.job, { base: [], x: [], y: [], text: [] });
      const s = byJob.get(t.job);
      s.base.push(t.start_s);
      s.x.push(Math.max(t.end_s - t.start_s, 1e-6));
      s.y.push(lane.device);
      s.text.push(`${t.job} · shard ${t.shard} · ${t.kind}` + (t.bytes ? ` · ${f.bytes(t.bytes)} moved` : "")
        + (t.p2p_bytes ? ` · ${f.bytes(t.p2p_bytes)} p2p out` : ""));
    }
  }
  return [...byJob.entries()].map(([job, s], i) => ({
    type: "bar", orientation: "h", name: job, base: s.base, x: s.x, y: s.y, text: s.text,
    hovertemplate: "%{text}<br>%{base:.3f}s + %{x:.3f}s<extra></extra>", textposition: "none",
    marker: { color: PALETTE[i % PALETTE.length] },
  }));
}

// Device-to-device (p2p) transfers of pipelined steps, drawn between the device lanes: the
// records of one pipelined step (kind "pipeline", one per device, same start) in pack order,
// each pack's device joined to the next pack's, where boundary activations go forward and
// their gradients come back.
function transfers(timeline) {
  const steps = new Map();
  for (const lane of timeline.devices) {
    for (const t of lane.tasks) {
      if (t.kind !== "pipeline") continue;
      const key = `${t.job}@${t.start_s}`;
      if (!steps.has(key)) steps.set(key, []);
      steps.get(key).push({ ...t, device: lane.device });
    }
  }
  const x = [];
  const y = [];
  const text = [];
  for (const packs of steps.values()) {
    packs.sort((a, b) => a.shard - b.shard);
    for (let i = 0; i + 1 < packs.length; i++) {
      const [a, b] = [packs[i], packs[i + 1]];
      if (a.device === b.device) continue;
      const mid = (a.start_s + a.end_s) / 2;
      const label = `${a.job} · p2p ${a.device} ⇄ ${b.device} · ${f.bytes(a.p2p_bytes)} out of ${a.device}, `
        + `${f.bytes(b.p2p_bytes)} out of ${b.device}`;
      x.push(mid, mid, null);
      y.push(a.device, b.device, null);
      text.push(label, label, null);
    }
  }
  if (!x.length) return [];
  return [{
    type: "scatter", mode: "lines+markers", name: "p2p transfers", x, y, text,
    hovertemplate: "%{text}<extra></extra>", line: { color: "#333", width: 2, dash: "dot" },
    marker: { symbol: "diamond", size: 8, color: "#333" },
  }];
}

export async function devicesPage(main, name) {
  const base = `/api/sweeps/${encodeURIComponent(name)}`;
  setCrumbs({ text: "sweeps", href: "/" }, { text: name, href: `/sweeps/${encodeURIComponent(name)}` },
    { text: "devices" });
  const note = el("div");
  const ganttDiv = el("div", { class: "plot", id: "gantt" });
  const memoryDiv = el("div", { class: "plot small", id: "memory" });
  const swapDiv = el("div", { class: "plot small", id: "swap" });
  const fusion = el("div", { id: "fusion" });
  clear(main, el("h1", { text: "Devices" }), note,
    el("div", { class: "card" }, el("h2", { text: "Shard tasks per device (colour: job)" }), ganttDiv),
    el("div", { class: "grid" },
      el("div", { class: "card" }, el("h2", { text: "Memory in use" }), memoryDiv),
      el("div", { class: "card" }, el("h2", { text: "Swap volume, p2p bytes and busy time" }), swapDiv)),
    el("div", { class: "card", style: { marginTop: "14px" } }, el("h2", { text: "Fused arrays" }), fusion));

  async function load() {
    let timeline;
    let groups;
    try {
      [timeline, groups] = await Promise.all([getJSON(`${base}/timeline`), getJSON(`${base}/fusion`)]);
      clear(note);
    } catch (err) {
      clear(note, errorBox(err));
      return;
    }
    if (timeline.message) clear(note, el("p", { class: "muted", id: "timeline-message", text: timeline.message }));
    if (timeline.truncated) note.appendChild(el("p", { class: "muted", text: "showing the latest tasks only" }));
    if (!timeline.devices.length) {
      message(ganttDiv, "no shard tasks to show");
      message(memoryDiv, "no memory samples");
      message(swapDiv, "no swap recorded");
    } else {
      const height = Math.max(260, 70 * timeline.devices.length + 140);
      ganttDiv.style.minHeight = `${height}px`;
      await draw(ganttDiv, [...gantt(timeline), ...transfers(timeline)], {
        barmode: "overlay", xaxis: { title: { text: "seconds since first task" } },
        yaxis: { type: "category", automargin: true }, showlegend: true,
        legend: { orientation: "h", x: 0, y: 1.02, yanchor: "bottom" }, height,
      });
      const mem = timeline.devices.filter((d) => d.memory.length);
      if (mem.length) {
        await draw(memoryDiv, mem.map((d) => ({ type: "scatter", mode: "lines", line: { shape: "hv" }, name: d.device,
          x: d.memory.map((p) => p.t_s), y: d.memory.map((p) => p.bytes / 2 ** 30) })),
        { xaxis: { title: { text: "seconds" } }, yaxis: { title: { text: "GiB" } }, legend: { orientation: "h", y: -0.3 } });
      } else {
        message(memoryDiv, "the executor records no memory samples");
      }
      await draw(swapDiv, [
        { type: "bar", name: "swap GiB", offsetgroup: 1, x: timeline.devices.map((d) => d.device),
          y: timeline.devices.map((d) => d.swap_bytes / 2 ** 30) },
        ...(timeline.devices.some((d) => d.p2p_bytes) ? [
          { type: "bar", name: "p2p out GiB", offsetgroup: 3, x: timeline.devices.map((d) => d.device),
            y: timeline.devices.map((d) => d.p2p_bytes / 2 ** 30) }] : []),
        { type: "bar", name: "busy s", offsetgroup: 2, yaxis: "y2", x: timeline.devices.map((d) => d.device),
          y: timeline.devices.map((d) => d.busy_s) },
      ], { barmode: "group", margin: { r: 64 }, yaxis: { title: { text: "GiB moved" } },
        yaxis2: { title: { text: "busy s" }, overlaying: "y", side: "right", rangemode: "tozero" },
        legend: { orientation: "h", y: -0.3 } });
    }
    if (!groups.groups.length) {
      clear(fusion, el("p", { class: "muted", text: groups.available ? "no fused arrays in this sweep"
        : "no fused arrays recorded (the executor writes them to sm_fusion_groups)" }));
    } else {
      // One row per member: the array steps it was in. A member joining at a step > 0 refilled
      // the slot of one that left (pruned, finished or failed).
      const trialLink = (n) =>
        el("a", { href: `/sweeps/${encodeURIComponent(name)}/trials/${n}`, text: `#${n}` });
      const span = (m) => `${m.joined_step} → ${m.left_step === null ? "training" : m.left_step}`;
      const rows = groups.groups.flatMap((g) => g.members.map((m, i) => el("tr", {},
        el("td", { text: i ? "" : g.job }),
        el("td", { class: "mono", text: i ? "" : g.architecture_key }),
        el("td", {}, trialLink(m.trial_number)),
        el("td", { text: m.joined_step ? "joined" : "founder" }),
        el("td", { class: "mono", text: span(m) }))));
      const head = el("tr", {}, el("th", { text: "job" }), el("th", { text: "architecture key" }),
        el("th", { text: "trial" }), el("th", { text: "member" }),
        el("th", { text: "array steps (joined → left)" }));
      clear(fusion, el("div", { class: "table-wrap" },
        el("table", {}, el("thead", {}, head), el("tbody", {}, rows))));
    }
  }

  await load();
  const reload = throttle(load, 3000);
  subscribe(`${base}/events`, { sweep: reload, trials: reload });
}
