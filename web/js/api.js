// API access: JSON requests and live event streams, carrying the token when there is one.
//
// A page opened as /...?token=T keeps T in sessionStorage and removes it from the address bar;
// requests send it as "Authorization: Bearer T", event streams as ?token=T (EventSource cannot
// set headers). The server also sets a cookie on that first request, so scripts and styles load.

const TOKEN_KEY = "sweepmaster-token";

function initToken() {
  const url = new URL(window.location.href);
  const fromUrl = url.searchParams.get("token");
  if (fromUrl) {
    sessionStorage.setItem(TOKEN_KEY, fromUrl);
    url.searchParams.delete("token");
    history.replaceState(history.state, "", url.pathname + url.search + url.hash);
  }
  return sessionStorage.getItem(TOKEN_KEY);
}

const token = initToken();

export class ApiError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
    this.detail = detail;
  }
}

export function apiUrl(path, params = {}) {
  const url = new URL(path, window.location.origin);
  for (const [key, value] of Object.entries(params)) {
    if (Array.isArray(value)) value.forEach((v) => url.searchParams.append(key, v));
    else if (value !== undefined && value !== null && value !== "") url.searchParams.set(key, value);
  }
  return url;
}

export async function getJSON(path, params = {}) {
  const headers = { Accept: "application/json" };
  if (token) headers.Authorization = `Bearer ${token}`;
  let response;
  try {
    response = await fetch(apiUrl(path, params), { headers, credentials: "same-origin" });
  } catch (err) {
    throw new ApiError(0, `cannot reach the dashboard server (${err.message})`);
  }
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  if (!response.ok) {
    throw new ApiError(response.status, (body && body.detail) || response.statusText);
  }
  return body;
}

// Open a Server-Sent Events stream; handlers maps event names to functions of the parsed data.
// Returns a function that closes the stream. The header's "live" badge shows its state.
export function subscribe(path, handlers) {
  const url = apiUrl(path);
  if (token) url.searchParams.set("token", token);
  const source = new EventSource(url);
  const badge = document.getElementById("live");
  const show = (on, title) => {
    if (!badge) return;
    badge.classList.toggle("off", !on);
    badge.title = title;
  };
  source.onopen = () => show(true, "live updates: connected");
  source.onerror = () => show(false, "live updates: reconnecting…");
  for (const [name, handler] of Object.entries(handlers)) {
    source.addEventListener(name, (event) => {
      let data;
      try {
        data = JSON.parse(event.data);
      } catch (err) {
        console.error("bad event data", name, err);
        return;
      }
      handler(data);
    });
  }
  window.addEventListener("pagehide", () => source.close());
  return () => source.close();
}
