// The chat page of `petals-chain api`: talks to the gateway's own OpenAI endpoint. Each turn sends
// the whole conversation; the swarm's prefix caches hold what earlier turns computed, and the answer's
// footer says how much of the prompt they reused, which chain served it and how fast it came.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];  // the conversation as OpenAI messages
let controller = null;  // the answer being streamed (its AbortController), or null

function apiKey() {
  return $("api-key").value.trim();
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey()) h["Authorization"] = "Bearer " + apiKey();
  return h;
}

function status(text) {
  $("status").textContent = text || "";
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && (body.error.message || body.error)) || JSON.stringify(body);
  } catch (e) {
    return response.status + " " + response.statusText;
  }
}

async function loadModels() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (response.status === 401) {
    $("key-label").hidden = false;
    status("This gateway needs an API key: type one of its --api-key values above.");
    return;
  }
  if (!response.ok) {
    status("Cannot list the models: " + (await errorText(response)));
    return;
  }
  const ids = (await response.json()).data.map((m) => m.id);
  const bases = ids.filter((id) => !id.includes(":"));
  const model = $("model");
  const previous = model.value;
  model.replaceChildren(...bases.map((id) => new Option(id, id)));
  if (bases.includes(previous)) model.value = previous;
  model.dataset.ids = JSON.stringify(ids);
  fillAdapters();
  status("");
}

function fillAdapters() {
  const ids = JSON.parse($("model").dataset.ids || "[]");
  const base = $("model").value;
  const adapters = ids.filter((id) => id.startsWith(base + ":")).map((id) => id.slice(base.length + 1));
  $("adapter").replaceChildren(new Option("none", ""), ...adapters.map((a) => new Option(a, a)));
  $("adapter").disabled = adapters.length === 0;
}

function addMessage(role, text) {
  $("empty").hidden = true;
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  div.append(body);
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function setBusy(busy) {
  const button = $("send");
  button.textContent = busy ? "Stop" : "Send";
  button.classList.toggle("stop", busy);
  button.type = busy ? "button" : "submit";
}

function footer(div, info) {
  const meta = document.createElement("div");
  meta.className = "meta";
  const parts = [];
  if (info.chain) parts.push("chain <b>" + escapeHtml(info.chain) + "</b>");
  if (info.tokens !== null) parts.push(info.tokens + " tokens");
  if (info.rate !== null) parts.push("<b>" + info.rate.toFixed(1) + " tokens/s</b>");
  if (info.ttft !== null) parts.push("first token after " + info.ttft.toFixed(2) + " s");
  if (info.cached !== null && info.prompt !== null) {
    parts.push("prompt " + info.prompt + " tokens, " + info.cached + " reused from the servers' prefix caches");
  }
  if (info.note) parts.push(info.note);
  meta.innerHTML = parts.join(" · ");
  meta.dataset.chain = info.chain || "";
  meta.dataset.tokens = info.tokens === null ? "" : String(info.tokens);
  meta.dataset.cached = info.cached === null ? "" : String(info.cached);
  meta.dataset.rate = info.rate === null ? "" : info.rate.toFixed(3);
  div.append(meta);
}

function escapeHtml(text) {
  const span = document.createElement("span");
  span.textContent = text;
  return span.innerHTML;
}

async function send(text) {
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant", "");
  div.dataset.state = "streaming";
  const out = div.querySelector(".text");
  const model = $("model").value + ($("adapter").value ? ":" + $("adapter").value : "");
  const body = {
    model, messages: history, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  };
  const info = { chain: "", tokens: null, rate: null, ttft: null, cached: null, prompt: null, note: "" };
  const started = performance.now();
  let first = null, answer = "", served = null;
  controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 2);
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
        for (const choice of chunk.choices || []) {
          const delta = (choice.delta && choice.delta.content) || "";
          if (delta) {
            if (first === null) first = performance.now();
            answer += delta;
            out.textContent = answer;
            div.scrollIntoView({ block: "end" });
          }
          if (choice.petals_chain) served = choice.petals_chain;
          if (choice.finish_reason === "length") info.note = "stopped at max tokens";
        }
        if (chunk.usage) {
          info.tokens = chunk.usage.completion_tokens;
          info.prompt = chunk.usage.prompt_tokens;
          info.cached = (chunk.usage.prompt_tokens_details || {}).cached_tokens ?? null;
        }
      }
    }
    div.dataset.state = "done";
  } catch (e) {
    if (e.name === "AbortError") {
      div.dataset.state = "stopped";
      info.note = "stopped";
    } else {
      div.dataset.state = "error";
      out.textContent = answer ? answer + "\n\n" + e.message : e.message;
      if (!answer) history.pop();  // the turn failed as a whole: it is not part of the conversation
    }
  } finally {
    controller = null;
    setBusy(false);
  }
  if (served) {
    // the gateway's own timing of the tokens (a busy browser may read several chunks at once)
    info.chain = served.chain;
    info.rate = served.tokens_per_s;
    info.ttft = served.time_to_first_token_s;
  } else if (first !== null) {  // stopped: no finishing chunk, so no token count; the browser's wait
    info.ttft = (first - started) / 1000;
  }
  if (answer && div.dataset.state !== "error") history.push({ role: "assistant", content: answer });
  if (div.dataset.state !== "error" || answer) footer(div, info);
  $("input").focus();
}

function stop() {
  if (controller) controller.abort();
}

document.addEventListener("DOMContentLoaded", () => {
  if (document.body.dataset.keyRequired === "true") $("key-label").hidden = false;
  $("api-key").value = localStorage.getItem("petals-chain-api-key") || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem("petals-chain-api-key", apiKey());
    loadModels();
  });
  $("model").addEventListener("change", fillAdapters);
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    if (controller) return;
    const text = $("input").value.trim();
    if (!text || !$("model").value) return;
    $("input").value = "";
    send(text);
  });
  $("send").addEventListener("click", () => {
    if (controller) stop();
  });
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("new-chat").addEventListener("click", () => {
    stop();
    history.length = 0;
    $("messages").querySelectorAll(".msg").forEach((m) => m.remove());
    $("empty").hidden = false;
    $("input").focus();
  });
  if (document.body.dataset.keyRequired === "true" && !apiKey()) {
    status("This gateway needs an API key: type one of its --api-key values above.");
    $("api-key").focus();
    return;
  }
  loadModels();
  $("input").focus();
});
