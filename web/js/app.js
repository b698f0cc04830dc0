// The front end's router: one page per address, rendered into <main id="app">.
import { ApiError, getJSON } from "./api.js";
import { el, clear, errorBox, setCrumbs } from "./dom.js";
import { sweepsPage } from "./pages/sweeps.js";
import { sweepPage } from "./pages/sweep.js";
import { trialPage } from "./pages/trial.js";
import { devicesPage } from "./pages/devices.js";

const ROUTES = [
  [/^\/$/, (main) => sweepsPage(main)],
  [/^\/sweeps\/([^/]+)\/?$/, (main, m) => sweepPage(main, decodeURIComponent(m[1]))],
  [/^\/sweeps\/([^/]+)\/trials\/(\d+)\/?$/,
    (main, m) => trialPage(main, decodeURIComponent(m[1]), Number(m[2]))],
  [/^\/sweeps\/([^/]+)\/devices\/?$/, (main, m) => devicesPage(main, decodeURIComponent(m[1]))],
];

// A page of a sweep that is not in the database says so without asking for it: the answer
// would be a 404, which the browser logs as an error though the page expects it.
async function sweepIsMissing(main, match) {
  if (!match[1]) return false;
  const name = decodeURIComponent(match[1]);
  const list = await getJSON("/api/sweeps");
  if (list.sweeps.some((s) => s.name === name)) return false;
  setCrumbs({ text: "sweeps", href: "/" }, { text: name });
  clear(main, el("p", { class: "message", id: "not-found" }, `No sweep named ${name} in this database. `,
    el("a", { href: "/", text: "All sweeps" })));
  return true;
}

async function route() {
  const main = document.getElementById("app");
  for (const [pattern, render] of ROUTES) {
    const match = window.location.pathname.match(pattern);
    if (match) {
      try {
        if (!(await sweepIsMissing(main, match))) await render(main, match);
      } catch (err) {
        // an answer the page expects (no such trial, nothing to draw yet) is shown, not logged
        if (!(err instanceof ApiError && [404, 409].includes(err.status))) console.error(err);
        clear(main, errorBox(err));
      }
      return;
    }
  }
  setCrumbs({ text: "not found" });
  clear(main, el("p", {}, "No such page. ", el("a", { href: "/", text: "All sweeps" })));
}

route();
