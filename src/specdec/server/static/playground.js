// The specdec playground: a chat that colours each token by who produced it (the stream's
// `speculative` extension, docs/server.md), and a dashboard of the server's /metrics and costs.
// It talks only to the server that served it; the API key stays in this tab's sessionStorage
// and goes out as a bearer token.
"use strict";

const KEY_STORAGE = "specdec.apiKey";
const POLL_MS = 2000;
const RATE_WINDOW_MS = 10000; // rates over the last 10 s: the token counters move as requests finish
const HISTORY_POINTS = 150; // five minutes of dashboard points, one per poll

const $ = (id) => document.getElementById(id);
const state = { model: null, conversation: [], running: null, poller: null, samples: [], series: null };

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text; // never innerHTML: model text is untrusted
  return node;
}

// -- the server's API --------------------------------------------------------------------------
function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (apiKey()) headers.Authorization = `Bearer ${apiKey()}`;
  const response = await fetch(path, { ...options, headers });
  if (!response.ok) throw await apiError(response);
  return response;
}

async function apiError(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    message = (await response.json()).error.message || message;
  } catch (_) {
    // not an OpenAI error body: the status line says enough
  }
  return new Error(response.status === 401 ? `${message} Enter the key above.` : message);
}

// Server-sent events of a fetch response, as parsed `data:` payloads, until `[DONE]`.
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const lines = buffer.slice(0, end).split("\n");
      buffer = buffer.slice(end + 2);
      const data = lines.filter((line) => line.startsWith("data: ")).map((line) => line.slice(6)).join("\n");
      if (!data) continue; // a keep-alive comment
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function loadModel() {
  const status = $("server-status");
  try {
    state.model = (await (await api("/v1/models")).json()).data[0].id;
    status.textContent = `model: ${state.model}`;
    status.classList.remove("error");
  } catch (error) {
    state.model = null;
    status.textContent = error.message;
    status.classList.add("error");
  }
}

// -- chat --------------------------------------------------------------------------------------
function settings() {
  const number = (id) => ($(id).value === "" ? null : Number($(id).value));
  return {
    method: $("method").value,
    k: number("k"),
    temperature: number("temperature") ?? 0,
    maxTokens: number("max-tokens"),
    compare: $("compare").checked,
  };
}

function requestBody(run, messages) {
  const body = {
    model: state.model || "",
    messages,
    stream: true,
    // The extension: every chunk names its tokens' sources and the rounds that ended in it.
    stream_options: { include_usage: true, speculative: { rejected: true } },
    temperature: run.temperature,
  };
  if (run.maxTokens !== null) body.max_tokens = run.maxTokens;
  const speculative = {};
  if (run.method) speculative.method = run.method;
  if (run.k !== null) speculative.num_speculative_tokens = run.k;
  if (Object.keys(speculative).length) body.speculative_decoding = speculative;
  return body;
}

function answerView(parent, title) {
  const view = element("div", "message answer");
  view.dataset.state = "running";
  view.append(element("h3", "", title));
  view.text = view.appendChild(element("div", "text"));
  view.stats = view.appendChild(element("p", "stats", "waiting…"));
  view.strip = view.appendChild(element("div", "rounds"));
  parent.append(view);
  return view;
}

function sourceClass(sources) {
  // A piece whose character took several tokens shows the last one's source.
  return `src-${sources.length ? sources[sources.length - 1] : "target"}`;
}

function showRound(view, round) {
  if (round.rejected) {
    const rejected = element("span", "rejected", round.rejected);
    rejected.title = `${round.method} proposed this; the target rejected it`;
    view.text.append(rejected);
  }
  const mark = element("i", `src-${round.method}`);
  mark.style.height = `${4 + 3 * Math.min(round.accepted, 8)}px`;
  mark.title = round.method === "none"
    ? "no proposal"
    : `${round.method}: ${round.accepted}/${round.proposed} accepted`;
  view.strip.append(mark);
}

function countRounds(rounds) {
  const counts = {};
  for (const round of rounds) counts[round.method] = (counts[round.method] || 0) + 1;
  return Object.entries(counts).sort((a, b) => b[1] - a[1]).map(([method, n]) => `${method} ${n}`).join(", ");
}

function statsLine(result) {
  const spec = result.usage ? result.usage.speculative || {} : {};
  const elapsed = (performance.now() - result.firstAt) / 1000;
  const rate = spec.tokens_per_second ?? (result.firstAt && elapsed > 0 ? result.tokens / elapsed : null);
  const parts = [rate == null ? "– tok/s" : `${rate.toFixed(1)} tok/s`];
  if (result.firstAt) parts.push(`TTFT ${Math.round(result.firstAt - result.sentAt)} ms`);
  if (spec.acceptance_rate != null) {
    parts.push(`acceptance ${(100 * spec.acceptance_rate).toFixed(0)}%`);
    parts.push(`${spec.mean_acceptance_length.toFixed(2)} tokens/round`);
  } else if (result.usage) {
    parts.push("nothing proposed");
  }
  if (result.rounds.length) parts.push(`${result.rounds.length} rounds: ${countRounds(result.rounds)}`);
  return parts.join(" · ");
}

async function streamAnswer(run, messages, view, signal) {
  const result = { text: "", tokens: 0, rounds: [], usage: null, sentAt: performance.now(), firstAt: null };
  const response = await api("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(requestBody(run, messages)),
    signal,
  });
  for await (const chunk of events(response)) {
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) result.usage = chunk.usage;
    const extension = chunk.speculative;
    if (extension) {
      // A round's rejected proposal stood where this chunk's token (the target's own) now is.
      for (const round of extension.rounds) showRound(view, round);
      result.rounds.push(...extension.rounds);
      result.tokens += extension.sources.length;
    }
    const content = chunk.choices.length ? chunk.choices[0].delta.content : null;
    if (content) {
      result.firstAt = result.firstAt ?? performance.now();
      result.text += content;
      const piece = element("span", extension ? sourceClass(extension.sources) : "", content);
      if (extension) piece.title = extension.sources.join(", ") || "(its token follows)";
      view.text.append(piece);
    }
    view.stats.textContent = statsLine(result);
  }
  const method = result.usage && result.usage.speculative ? result.usage.speculative.method : run.method;
  view.querySelector("h3").textContent = method;
  view.stats.textContent = statsLine(result);
  view.dataset.state = "done";
  return result;
}

function compareLine(turn, off, chosen, temperature) {
  const same = off.text === chosen.text;
  let note = "identical text";
  if (!same) note = temperature > 0 ? "texts differ (sampled: only greedy output is identical)" : "texts differ";
  const rate = (result) => result.usage?.speculative?.tokens_per_second ?? null;
  const speedup = rate(off) && rate(chosen) ? ` · ${(rate(chosen) / rate(off)).toFixed(2)}× the speed of off` : "";
  const line = element("p", `comparison ${same ? "same" : "different"}`, note + speedup);
  turn.append(line);
}

async function send(prompt) {
  const run = settings();
  if (!state.model) await loadModel();
  $("messages").append(element("div", "message user", prompt));
  const turn = element("div", run.compare ? "turn pair" : "turn");
  $("messages").append(turn);
  const messages = [...state.conversation, { role: "user", content: prompt }];
  const runs = run.compare ? [{ ...run, method: "off" }, run] : [run];
  const controller = new AbortController();
  state.running = controller;
  $("send").textContent = "Stop";
  const results = [];
  try {
    // One after the other: run together they would share the machine and each look slower.
    for (const each of runs) {
      const view = answerView(turn, each.method || "server's method");
      view.scrollIntoView({ block: "end" });
      try {
        results.push(await streamAnswer(each, messages, view, controller.signal));
      } catch (error) {
        view.dataset.state = "error";
        view.stats.textContent = error.name === "AbortError" ? "stopped" : error.message;
        view.stats.classList.add("error");
        return;
      }
    }
    if (run.compare) compareLine(turn, results[0], results[1], run.temperature);
    state.conversation = [...messages, { role: "assistant", content: results[results.length - 1].text }];
  } finally {
    state.running = null;
    $("send").textContent = "Send";
  }
}

// -- dashboard ---------------------------------------------------------------------------------
function parseMetrics(text) {
  const sums = {};
  for (const line of text.split("\n")) {
    const match = /^([^\s{#]+)(\{[^}]*\})?\s+(\S+)/.exec(line);
    if (match) sums[match[1]] = (sums[match[1]] || 0) + Number(match[3]);
  }
  const value = (name) => sums[`specdec:${name}`] || 0;
  return {
    tokens: value("generation_tokens_total"),
    drafts: value("spec_decode_num_drafts_total"),
    drafted: value("spec_decode_num_draft_tokens_total"),
    accepted: value("spec_decode_num_accepted_tokens_total"),
    running: value("num_requests_running"),
    waiting: value("num_requests_waiting"),
  };
}

function cssColor(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

// Lines over `points` x positions (the newest at the right), y from 0 to the largest value.
function drawChart(canvas, lines, { points, format, maxAtLeast = 0, xLabels = null }) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  const values = lines.flatMap((line) => line.values).filter((v) => v != null);
  const top = Math.max(maxAtLeast, ...values, 1e-9) * 1.1;
  const left = 36;
  const bottom = height - (xLabels ? 14 : 4);
  const x = (i) => left + (i / Math.max(1, points - 1)) * (width - left - 4);
  const y = (v) => bottom - (v / top) * (bottom - 4);
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = cssColor("--muted");
  ctx.strokeStyle = cssColor("--line");
  ctx.beginPath();
  ctx.moveTo(left, 4);
  ctx.lineTo(left, bottom);
  ctx.lineTo(width - 4, bottom);
  ctx.stroke();
  ctx.fillText(format(top / 1.1), 2, y(top / 1.1) + 4);
  ctx.fillText(format(0), 2, bottom);
  if (xLabels) {
    ctx.fillText(xLabels[0], left, height - 2);
    ctx.fillText(xLabels[1], width - 4 - ctx.measureText(xLabels[1]).width, height - 2);
  }
  for (const line of lines) {
    const offset = points - line.values.length;
    ctx.strokeStyle = line.color;
    ctx.fillStyle = line.color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    let drawing = false;
    line.values.forEach((v, i) => {
      if (v == null) {
        drawing = false;
        return;
      }
      if (drawing) ctx.lineTo(x(i + offset), y(v));
      else ctx.moveTo(x(i + offset), y(v));
      drawing = true;
      if (line.markers) ctx.fillRect(x(i + offset) - 2, y(v) - 2, 4, 4);
    });
    ctx.stroke();
  }
}

function emptySeries() {
  return { tps: [], acceptance: [], mal: [], busy: [], queue: [] };
}

function record(totals) {
  const now = performance.now();
  const samples = state.samples;
  const base = samples[0];
  if (base && totals.tokens < base.tokens) samples.length = 0; // the counters restarted: a new server
  samples.push({ t: now, ...totals });
  while (samples.length > 1 && now - samples[1].t >= RATE_WINDOW_MS) samples.shift();
  const first = samples[0];
  const seconds = (now - first.t) / 1000;
  const drafted = totals.drafted - first.drafted;
  const drafts = totals.drafts - first.drafts;
  const accepted = totals.accepted - first.accepted;
  const point = {
    tps: seconds > 0 ? (totals.tokens - first.tokens) / seconds : null,
    acceptance: drafted > 0 ? accepted / drafted : null,
    mal: drafts > 0 ? 1 + accepted / drafts : null,
    busy: totals.running,
    queue: totals.waiting,
  };
  for (const [name, value] of Object.entries(point)) {
    state.series[name].push(value);
    if (state.series[name].length > HISTORY_POINTS) state.series[name].shift();
  }
  return point;
}

function drawDashboard(point) {
  const show = (id, value, format) => ($(id).textContent = value == null ? "–" : format(value));
  show("now-tps", point.tps, (v) => v.toFixed(1));
  show("now-acceptance", point.acceptance, (v) => `${(100 * v).toFixed(0)}%`);
  show("now-mal", point.mal, (v) => v.toFixed(2));
  show("now-slots", point.busy, (v) => (state.slots ? `${v} / ${state.slots}` : `${v}`));
  show("now-queue", point.queue, (v) => `${v}`);
  const accent = cssColor("--accent");
  const s = state.series;
  const time = { points: HISTORY_POINTS, xLabels: [`${(HISTORY_POINTS * POLL_MS) / 60000} min ago`, "now"] };
  drawChart($("chart-tps"), [{ values: s.tps, color: accent }], { ...time, format: (v) => v.toFixed(0) });
  drawChart($("chart-acceptance"), [{ values: s.acceptance, color: accent }],
    { ...time, format: (v) => `${(100 * v).toFixed(0)}%`, maxAtLeast: 1 });
  drawChart($("chart-mal"), [{ values: s.mal, color: accent }],
    { ...time, format: (v) => v.toFixed(1), maxAtLeast: 1 });
  drawChart($("chart-slots"), [{ values: s.busy, color: accent }, { values: s.queue, color: "#d08a2f" }],
    { ...time, format: (v) => v.toFixed(0), maxAtLeast: state.slots || 1 });
}

async function loadCosts() {
  const summary = $("costs-summary");
  try {
    const costs = await (await api("/v1/specdec/costs")).json();
    state.slots = costs.slots;
    if (!costs.calibrated) {
      summary.textContent = `not calibrated yet · ${costs.slots} slots`;
      return;
    }
    summary.textContent = `${costs.summary} · ${costs.slots} slots`;
    const sizes = Object.keys(costs.v).map(Number).sort((a, b) => a - b);
    drawChart($("chart-costs"), [{ values: sizes.map((n) => costs.v[n]), color: cssColor("--accent"), markers: true }],
      { points: sizes.length, format: (v) => v.toFixed(1), maxAtLeast: 1,
        xLabels: [`n=${sizes[0]}`, `n=${sizes[sizes.length - 1]}`] });
  } catch (error) {
    summary.textContent = error.message;
    summary.classList.add("error");
  }
}

async function poll() {
  const status = $("dashboard-status");
  try {
    const point = record(parseMetrics(await (await api("/metrics")).text()));
    drawDashboard(point);
    status.textContent = `from /metrics every ${POLL_MS / 1000} s; rates over the last ${RATE_WINDOW_MS / 1000} s`;
    status.classList.remove("error");
  } catch (error) {
    status.textContent = error.message;
    status.classList.add("error");
  }
}

// -- page --------------------------------------------------------------------------------------
function showView(name) {
  const dashboard = name === "dashboard";
  $("chat-view").hidden = dashboard;
  $("dashboard-view").hidden = !dashboard;
  $("tab-chat").setAttribute("aria-selected", String(!dashboard));
  $("tab-dashboard").setAttribute("aria-selected", String(dashboard));
  clearInterval(state.poller);
  state.poller = null;
  if (dashboard) {
    state.series = state.series || emptySeries();
    loadCosts().then(poll);
    state.poller = setInterval(poll, POLL_MS); // only while the dashboard is shown
  }
}

function start() {
  $("api-key").value = apiKey();
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
    loadModel();
    if (!$("dashboard-view").hidden) showView("dashboard");
  });
  $("tab-chat").addEventListener("click", () => showView("chat"));
  $("tab-dashboard").addEventListener("click", () => showView("dashboard"));
  $("show-rejected").addEventListener("change", (event) => {
    $("messages").classList.toggle("show-rejected", event.target.checked);
  });
  $("clear").addEventListener("click", () => {
    if (state.running) state.running.abort();
    state.conversation = [];
    $("messages").replaceChildren();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    if (state.running) {
      state.running.abort();
      return;
    }
    const prompt = $("prompt").value.trim();
    if (!prompt) return;
    $("prompt").value = "";
    send(prompt);
  });
  // A phone keeps its screen for the chat: the settings start folded.
  if (window.matchMedia("(max-width: 40rem)").matches) $("settings").open = false;
  if (location.hash === "#dashboard") showView("dashboard");
  loadModel();
}

start();
