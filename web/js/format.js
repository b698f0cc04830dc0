// Formatting of numbers, durations, sizes and times; Optuna's state names and colours.

export const STATES = ["RUNNING", "WAITING", "COMPLETE", "PRUNED", "FAIL"];

// Optuna's plot_timeline colours, as CSS variables of style.css.
export const STATE_COLORS = {
  COMPLETE: "#1f6fd1",
  PRUNED: "#f08c00",
  FAIL: "#d62828",
  RUNNING: "#2b9348",
  WAITING: "#868e96",
};

export const DASH = "–";

export function num(value, digits = 4) {
  if (value === null || value === undefined || Number.isNaN(value)) return DASH;
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value) && Math.abs(value) < 1e15) return value.toLocaleString("en-US");
  const abs = Math.abs(value);
  if (abs !== 0 && (abs >= 1e6 || abs < 1e-3)) return value.toExponential(2);
  return Number(value.toPrecision(digits)).toString();
}

// Every device a trial ran on (a spilled or fused trial may have used several).
export function devices(trial) {
  return (trial.devices && trial.devices.length ? trial.devices.join(", ") : trial.device) || DASH;
}

export function int(value) {
  if (value === null || value === undefined) return DASH;
  return Math.round(value).toLocaleString("en-US");
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined) return DASH;
  const s = Math.max(0, Math.round(seconds));
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const r = s % 60;
  if (h > 0) return `${h}h ${String(m).padStart(2, "0")}m`;
  if (m > 0) return `${m}m ${String(r).padStart(2, "0")}s`;
  return `${r}s`;
}

export function bytes(value) {
  if (value === null || value === undefined) return DASH;
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = value;
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${i === 0 ? v : v.toFixed(1)} ${units[i]}`;
}

export function when(iso) {
  if (!iso) return DASH;
  const d = new Date(iso);
  return Number.isNaN(d.getTime()) ? iso : d.toLocaleString();
}

export function param(value) {
  if (typeof value === "number") return num(value);
  if (value === null || value === undefined) return DASH;
  return String(value);
}

// Column titles for dotted parameter names: the last part where that is unambiguous.
export function shortNames(names) {
  const last = names.map((n) => n.split(".").pop());
  const out = {};
  names.forEach((n, i) => {
    out[n] = last.filter((x) => x === last[i]).length === 1 ? last[i] : n;
  });
  return out;
}
