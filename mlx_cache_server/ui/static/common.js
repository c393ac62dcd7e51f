// Shared by the chat and cache pages: the API key, authenticated requests, an SSE reader,
// and a markdown renderer that builds DOM nodes (never HTML from text), so nothing a
// model writes can become markup or script.
"use strict";

const Api = {
  keySlot: "mcs.key", // sessionStorage: gone with the tab, never in a URL

  key() { return sessionStorage.getItem(this.keySlot) || ""; },
  setKey(k) { sessionStorage.setItem(this.keySlot, k); },

  headers(extra) {
    const h = Object.assign({ "Content-Type": "application/json" }, extra || {});
    if (this.key()) h.Authorization = "Bearer " + this.key();
    return h;
  },

  // fetch() that asks for a key (and tries again) on a 401.
  async request(path, options) {
    for (;;) {
      const opts = Object.assign({}, options || {});
      opts.headers = this.headers(opts.headers);
      const res = await fetch(path, opts);
      if (res.status !== 401) return res;
      let message = "This server needs an API key.";
      try { message = (await res.json()).error.message || message; } catch (e) { /* keep */ }
      await askForKey(message);
    }
  },
};

// A dialog for the key: resolves when one was entered, fails when the dialog was closed
// without one (Escape). Requests that need a key meanwhile share the one dialog.
let asking = null;
function askForKey(message) {
  if (asking) return asking;
  asking = new Promise((resolve, reject) => {
    const dialog = document.getElementById("key-dialog");
    document.getElementById("key-message").textContent = message;
    const input = document.getElementById("key-input");
    input.value = "";
    let entered = false;
    document.getElementById("key-form").onsubmit = (ev) => {
      ev.preventDefault();
      entered = true;
      Api.setKey(input.value.trim());
      dialog.close();
    };
    dialog.onclose = () => {
      asking = null;
      if (entered) resolve();
      else reject(new Error("This server needs an API key; none was entered."));
    };
    dialog.showModal();
    input.focus();
  });
  return asking;
}

// The events of a text/event-stream body: calls onData(parsed JSON) for each `data:` line
// but [DONE]; resolves when the body ends.
async function readEvents(res, onData) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data && data !== "[DONE]") onData(JSON.parse(data));
      }
    }
  }
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) {
    if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

// Markdown, the common part: fenced code, headings, lists, quotes, paragraphs, and inline
// code, bold and italics. Everything else stays text.
function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+-]*)/);
    if (fence) {
      const code = [];
      i++;
      while (i < lines.length && !/^\s*```/.test(lines[i])) code.push(lines[i++]);
      i++; // the closing fence (or the end of a reply still streaming)
      const block = el("code", fence[1] ? { class: "lang-" + fence[1] } : {}, code.join("\n"));
      out.append(el("pre", {}, block));
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)/);
    if (heading) {
      out.append(inline(el("h" + Math.min(6, heading[1].length + 2)), heading[2]));
      i++;
      continue;
    }
    if (/^\s*([-*+]|\d+[.)])\s+/.test(line)) {
      const ordered = /^\s*\d/.test(line);
      const list = el(ordered ? "ol" : "ul");
      while (i < lines.length && /^\s*([-*+]|\d+[.)])\s+/.test(lines[i])) {
        list.append(inline(el("li"), lines[i].replace(/^\s*([-*+]|\d+[.)])\s+/, "")));
        i++;
      }
      out.append(list);
      continue;
    }
    if (/^>\s?/.test(line)) {
      const quote = [];
      while (i < lines.length && /^>\s?/.test(lines[i])) quote.push(lines[i++].replace(/^>\s?/, ""));
      out.append(inline(el("blockquote"), quote.join("\n")));
      continue;
    }
    if (!line.trim()) { i++; continue; }
    const para = [];
    while (i < lines.length && lines[i].trim() && !/^\s*(```|#{1,6}\s|[-*+]\s|\d+[.)]\s|>)/.test(lines[i])) {
      para.push(lines[i++]);
    }
    if (!para.length) para.push(lines[i++]);
    out.append(inline(el("p"), para.join("\n")));
  }
  return out;
}

function inline(node, text) {
  const pattern = /(`[^`]+`|\*\*[^*]+\*\*|\*[^*\s][^*]*\*)/g;
  let last = 0;
  for (const m of text.matchAll(pattern)) {
    node.append(text.slice(last, m.index));
    const t = m[0];
    if (t.startsWith("`")) node.append(el("code", {}, t.slice(1, -1)));
    else if (t.startsWith("**")) node.append(el("strong", {}, t.slice(2, -2)));
    else node.append(el("em", {}, t.slice(1, -1)));
    last = m.index + t.length;
  }
  node.append(text.slice(last));
  return node;
}

function formatBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}
