// The chat page: conversations kept in this browser (localStorage), replies streamed from
// /v1/chat/completions, and under each reply what the cache did for it.
"use strict";

const STORE = "mcs.conversations";
const CURRENT = "mcs.current";
const $ = (id) => document.getElementById(id);

let conversations = JSON.parse(localStorage.getItem(STORE) || "[]");
let current = localStorage.getItem(CURRENT);
let running = null; // the AbortController of the reply being streamed
let pending = []; // data URLs of the images attached to the next message

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(conversations));
  } catch (e) { // images fill the browser's storage quickly: the page still works without it
    $("error").textContent = "This conversation is too large to keep in the browser: " + e.message;
  }
  localStorage.setItem(CURRENT, current || "");
}

function attach(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.onload = () => { pending.push(reader.result); drawAttachments(); };
    reader.readAsDataURL(file);
  }
}

function drawAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  pending.forEach((url, i) => {
    const remove = el("button", { type: "button", class: "small", title: "Remove",
      onclick: () => { pending.splice(i, 1); drawAttachments(); } }, "✕");
    box.append(el("span", { class: "attachment" }, el("img", { class: "thumb", src: url, alt: "attached image" }), remove));
  });
}

// A user turn as the API takes it: its text, or its images then its text.
function apiContent(m) {
  if (!m.images || !m.images.length) return m.content;
  const parts = m.images.map((url) => ({ type: "image_url", image_url: { url } }));
  return m.content ? [...parts, { type: "text", text: m.content }] : parts;
}

function conversation() {
  let c = conversations.find((x) => x.id === current);
  if (!c) {
    c = { id: String(Date.now()) + Math.random().toString(16).slice(2, 6), title: "New chat", messages: [] };
    conversations.unshift(c);
    current = c.id;
  }
  return c;
}

function drawList() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of conversations) {
    const open = el("button", { type: "button", class: "title", onclick: () => { current = c.id; save(); draw(); } }, c.title);
    const rename = el("button", { type: "button", title: "Rename", class: "small", onclick: () => {
      const name = prompt("Name this chat", c.title);
      if (name && name.trim()) { c.title = name.trim(); save(); drawList(); }
    } }, "✎");
    const remove = el("button", { type: "button", title: "Delete", class: "small", onclick: () => {
      conversations = conversations.filter((x) => x !== c);
      if (current === c.id) current = conversations.length ? conversations[0].id : null;
      save(); draw();
    } }, "✕");
    list.append(el("li", c.id === current ? { class: "current" } : {}, open, rename, remove));
  }
}

function stats(m) {
  if (!m.stats) return null;
  const s = m.stats;
  const parts = [`prompt ${s.prompt} tokens`, `cached ${s.cached}`];
  if (s.ttft !== null) parts.push(`first token ${s.ttft.toFixed(2)} s`);
  if (s.rate) parts.push(`${s.rate.toFixed(1)} tokens/s`);
  return el("div", { class: "stats", "data-cached": String(s.cached) }, parts.join(" · "));
}

function drawMessage(c, m, index) {
  const body = el("div", { class: "body" });
  if (m.reasoning) {
    body.append(el("details", { class: "reasoning" }, el("summary", {}, "Reasoning"),
      el("div", {}, renderMarkdown(m.reasoning))));
  }
  for (const url of m.images || []) body.append(el("img", { class: "thumb", src: url, alt: "image" }));
  body.append(m.role === "user" ? el("p", { class: "plain" }, m.content) : renderMarkdown(m.content || ""));
  for (const call of m.tool_calls || []) {
    body.append(el("div", { class: "tool-call" }, el("strong", {}, "Tool call: " + call.name),
      el("pre", {}, call.arguments)));
  }
  const tools = el("div", { class: "tools" });
  if (m.role === "user") {
    tools.append(el("button", { type: "button", class: "small", onclick: () => edit(c, index) }, "Edit"));
  } else if (index === c.messages.length - 1) {
    tools.append(el("button", { type: "button", class: "small", onclick: () => regenerate(c) }, "Regenerate"));
  }
  if (m.error) body.append(el("p", { class: "error" }, m.error));
  return el("article", { class: "message " + m.role }, body, stats(m), tools);
}

function draw() {
  drawList();
  const c = conversations.find((x) => x.id === current);
  const box = $("messages");
  box.replaceChildren();
  if (!c) return;
  $("system").value = c.system || "";
  c.messages.forEach((m, i) => box.append(drawMessage(c, m, i)));
  box.scrollTop = box.scrollHeight;
}

function edit(c, index) {
  if (running) return;
  $("input").value = c.messages[index].content;
  pending = [...(c.messages[index].images || [])];
  drawAttachments();
  c.messages = c.messages.slice(0, index); // resending replaces this turn and what followed
  save(); draw();
  $("input").focus();
}

function regenerate(c) {
  if (running || !c.messages.length) return;
  if (c.messages[c.messages.length - 1].role === "assistant") c.messages.pop();
  save(); draw();
  reply(c);
}

async function send(text) {
  const c = conversation();
  c.system = $("system").value;
  if (!c.messages.length) c.title = text.slice(0, 40) || "Image";
  const m = { role: "user", content: text };
  if (pending.length) m.images = pending;
  pending = [];
  drawAttachments();
  c.messages.push(m);
  save(); draw();
  await reply(c);
}

async function reply(c) {
  const messages = [];
  if (c.system && c.system.trim()) messages.push({ role: "system", content: c.system });
  for (const m of c.messages) {
    // A reply that failed or was empty is not the model's turn to send back.
    if (m.role === "assistant" && (m.error || !m.content)) continue;
    messages.push({ role: m.role, content: m.role === "user" ? apiContent(m) : m.content });
  }
  const m = { role: "assistant", content: "", reasoning: "", tool_calls: [] };
  c.messages.push(m);
  running = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  $("error").textContent = "";
  const sent = performance.now();
  let first = null, last = null, usage = null, ended = false;
  const calls = {};
  const view = () => {
    if (current !== c.id) return; // another chat is shown: this one is drawn when opened
    const box = $("messages");
    const articles = box.querySelectorAll("article");
    const node = drawMessage(c, m, c.messages.length - 1);
    if (articles.length === c.messages.length) articles[articles.length - 1].replaceWith(node);
    else box.append(node);
    box.scrollTop = box.scrollHeight;
  };
  view();
  try {
    const res = await Api.request("/v1/chat/completions", {
      method: "POST",
      signal: running.signal,
      body: JSON.stringify({
        model: $("model").value || undefined,
        messages,
        stream: true,
        stream_options: { include_usage: true },
        temperature: Number($("temperature").value),
        max_tokens: Number($("max-tokens").value),
      }),
    });
    if (!res.ok) {
      let message = `The server answered ${res.status}.`;
      try { message = (await res.json()).error.message; } catch (e) { /* keep */ }
      throw new Error(message);
    }
    await readEvents(res, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        if (choice.finish_reason) ended = true;
        const d = choice.delta || {};
        if (d.content || d.reasoning_content || d.tool_calls) {
          last = performance.now();
          if (first === null) first = last;
        }
        if (d.content) m.content += d.content;
        if (d.reasoning_content) m.reasoning += d.reasoning_content;
        for (const t of d.tool_calls || []) {
          const call = calls[t.index] || (calls[t.index] = { name: "", arguments: "" });
          if (t.function && t.function.name) call.name += t.function.name;
          if (t.function && t.function.arguments) call.arguments += t.function.arguments;
          m.tool_calls = Object.values(calls);
        }
      }
      view();
    });
    if (!ended) m.error = "The reply was cut off: the stream ended without a finish.";
  } catch (e) {
    if (e.name !== "AbortError") m.error = e.message;
  } finally {
    if (usage) {
      const n = usage.completion_tokens;
      m.stats = {
        prompt: usage.prompt_tokens,
        cached: (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0,
        ttft: first === null ? null : (first - sent) / 1000,
        rate: first !== null && last > first && n > 1 ? (n - 1) / ((last - first) / 1000) : null,
      };
    }
    running = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    save(); draw();
  }
}

async function loadModels() {
  try {
    const res = await Api.request("/v1/models");
    const body = await res.json();
    const select = $("model");
    select.replaceChildren(...(body.data || []).map((m) => el("option", { value: m.id }, m.id)));
  } catch (e) {
    $("error").textContent = "Could not list the models: " + e.message;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("input").value.trim();
    if ((!text && !pending.length) || running) return;
    $("input").value = "";
    send(text);
  });
  $("attach").addEventListener("click", () => $("image-file").click());
  $("image-file").addEventListener("change", (ev) => { attach(ev.target.files); ev.target.value = ""; });
  $("input").addEventListener("paste", (ev) => attach([...ev.clipboardData.files]));
  $("composer").addEventListener("dragover", (ev) => ev.preventDefault());
  $("composer").addEventListener("drop", (ev) => { ev.preventDefault(); attach([...ev.dataTransfer.files]); });
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => running && running.abort());
  $("new-chat").addEventListener("click", () => { current = null; conversation(); save(); draw(); });
  $("system").addEventListener("change", () => {
    const c = conversations.find((x) => x.id === current);
    if (c) { c.system = $("system").value; save(); }
  });
  loadModels();
  draw();
});
