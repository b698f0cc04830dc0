// Building DOM nodes without innerHTML: every text from the API is inserted as text.

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on") && typeof value === "function") {
      node.addEventListener(key.slice(2), value);
    } else if (key === "style" && typeof value === "object") Object.assign(node.style, value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  append(node, children);
  return node;
}

export function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function clear(node, ...children) {
  node.replaceChildren();
  return append(node, children);
}

export function setCrumbs(...parts) {
  const nav = document.getElementById("crumbs");
  clear(nav);
  parts.forEach((part, i) => {
    if (i > 0) nav.appendChild(el("span", { class: "sep", text: "/" }));
    nav.appendChild(part.href ? el("a", { href: part.href, text: part.text })
      : el("span", { text: part.text }));
  });
  document.title = ["sweepmaster", ...parts.map((p) => p.text)].join(" · ");
}

export function errorBox(err) {
  const detail = err && err.detail ? err.detail : String(err && err.message ? err.message : err);
  return el("div", { class: "error", role: "alert", text: detail });
}

export function throttle(fn, wait_ms) {
  let timer = null;
  let last = 0;
  return (...args) => {
    const run = () => {
      last = Date.now();
      timer = null;
      fn(...args);
    };
    if (timer) return;
    const due = last + wait_ms - Date.now();
    timer = setTimeout(run, Math.max(due, 0));
  };
}
