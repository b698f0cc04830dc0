// The front end's router: one page per address, rendered into <main id="app">.
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

async function route() {
  const main = document.getElementById("app");
  for (const [pattern, render] of ROUTES) {
    const match = window.location.pathname.match(pattern);
    if (match) {
      try {
        await render(main, match);
      } catch (err) {
        console.error(err);
        clear(main, errorBox(err));
      }
      return;
    }
  }
  setCrumbs({ text: "not found" });
  clear(main, el("p", {}, "No such page. ", el("a", { href: "/", text: "All sweeps" })));
}

route();
