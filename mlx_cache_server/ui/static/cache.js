// The cache page: /v1/cache/events (admin) as it changes, at most once a second.
"use strict";

Api.keySlot = "mcs.adminKey"; // the cache page needs the admin key, the chat page any key
const $ = (id) => document.getElementById(id);
let feed = null; // the AbortController of the open event stream

function ago(seconds) {
  if (seconds < 1) return "now";
  if (seconds < 90) return Math.round(seconds) + " s ago";
  if (seconds < 5400) return Math.round(seconds / 60) + " min ago";
  return Math.round(seconds / 3600) + " h ago";
}

function ms(v) { return v === null || v === undefined ? "–" : (v / 1000).toFixed(2) + " s"; }
function pct(v) { return v === null || v === undefined ? "–" : Math.round(v * 100) + "%"; }

function card(title, value, detail) {
  return el("div", { class: "card" }, el("div", { class: "muted" }, title), el("div", { class: "value" }, value),
    detail ? el("div", { class: "muted" }, detail) : null);
}

function drawTotals(v) {
  const box = $("totals");
  box.replaceChildren();
  if (!v.enabled) {
    box.append(card("Cache", v.loaded === false ? "model not loaded" : "off"));
    return;
  }
  const budget = v.ram.max_bytes ? "of " + formatBytes(v.ram.max_bytes) : "no byte limit";
  box.append(card("RAM", formatBytes(v.ram.bytes), budget + " · " +
    v.ram.sequences + " of " + v.ram.max_sequences + " sequences"));
  box.append(card("Disk", v.disk ? formatBytes(v.disk.bytes) : "off",
    v.disk ? "of " + formatBytes(v.disk.max_bytes) + " · " + v.disk.files + " files" : "--cache-dir"));
  const h = v.hit_rate;
  box.append(card("Prompt tokens from the cache", pct(h.share),
    `${h.cached_tokens} of ${h.prompt_tokens} in ${h.requests} requests, last ${Math.round(h.seconds / 60)} min`));
  box.append(card("Layout", v.mode || "–"));
}

function branch(b, now) {
  const line = el("div", { class: "branch-line" },
    el("span", { class: "text" }, b.text),
    el("span", { class: "muted" },
      ` ${b.tokens} tokens (to ${b.depth}) · ${formatBytes(b.bytes)} · ${b.sequences} seq · ` +
      `${b.hits} hits · ${ago(now - b.last_used)} · ${b.tier}`));
  const node = el("li", { class: "branch", "data-depth": String(b.depth) }, line);
  if (b.children.length || b.hidden) {
    const list = el("ul");
    for (const c of b.children) list.append(branch(c, now));
    if (b.hidden) list.append(el("li", { class: "muted" }, `… ${b.hidden} smaller nodes`));
    node.append(list);
  }
  return node;
}

function drawTree(v) {
  const box = $("tree");
  box.replaceChildren();
  for (const ns of v.namespaces || []) {
    const title = ns.namespace ? `${ns.model} · tenant ${ns.namespace}` : ns.model;
    const list = el("ul", { class: "tree" });
    for (const b of ns.branches) list.append(branch(b, v.now));
    if (ns.hidden) list.append(el("li", { class: "muted" }, `(${ns.hidden} smaller nodes not shown in all)`));
    box.append(el("section", { class: "namespace" }, el("h3", {}, title), list));
  }
  if (!box.children.length) box.append(el("p", { class: "muted" }, "Nothing cached yet."));
}

function drawRequests(v) {
  const body = $("requests").querySelector("tbody");
  body.replaceChildren(...(v.requests || []).map((r) => el("tr", {},
    el("td", {}, ago(v.now - r.ended)), el("td", {}, r.route), el("td", {}, r.prompt_tokens),
    el("td", {}, r.cached_tokens), el("td", {}, pct(r.cached_share)), el("td", {}, ms(r.queued_ms)),
    el("td", {}, ms(r.prefill_ms)), el("td", {}, ms(r.decode_ms)), el("td", {}, r.finish_reason))));
}

async function follow() {
  if (feed) feed.abort();
  feed = new AbortController();
  const model = $("model").value;
  const query = model ? "?model=" + encodeURIComponent(model) : "";
  try {
    const res = await Api.request("/v1/cache/events" + query, { signal: feed.signal });
    if (!res.ok) {
      let message = `The server answered ${res.status}.`;
      try { message = (await res.json()).error.message; } catch (e) { /* keep */ }
      $("error").textContent = message;
      $("live").textContent = "stopped";
      return;
    }
    $("error").textContent = "";
    $("live").textContent = "live";
    await readEvents(res, (v) => { drawModels(v); drawTotals(v); drawTree(v); drawRequests(v); });
    $("live").textContent = "reconnecting…"; // the server ended the feed (a restart, say)
    setTimeout(follow, 2000);
  } catch (e) {
    if (e.name !== "AbortError") {
      $("live").textContent = "disconnected: reconnecting…";
      $("error").textContent = e.message;
      if (!/API key/.test(e.message)) setTimeout(follow, 5000);
    }
  }
}

// The picker, from the feed: the admin key need not be a key /v1/models takes.
function drawModels(v) {
  const select = $("model");
  if (select.options.length === (v.models || []).length) return;
  select.replaceChildren(...(v.models || []).map((id) => el("option", { value: id }, id)));
  select.value = v.model;
}

document.addEventListener("DOMContentLoaded", () => {
  $("model").addEventListener("change", follow);
  follow();
});
