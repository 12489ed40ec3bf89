// The stepline dashboard: a fold of the event log, read live from /v1/events (EventSource),
// or, served by `stepline replay LOG --serve`, from a recorded log with a step scrubber.
// Plain JS, no build step, nothing fetched from elsewhere. See docs/dashboard.md.
"use strict";

const KEY_COOKIE = "stepline_api_key";
const STRIP = 150; // steps drawn
const ENDED = 25; // ended requests listed
const MISSES = 10; // prefix-cache misses listed
// A door's short name, by the HTTP path its requests' `admitted` events record (`door`).
const DOORS = { "/v1/chat/completions": "chat", "/v1/completions": "completions",
  "/v1/messages": "messages", "/v1/responses": "responses", "/v1/embeddings": "embeddings",
  "/api/chat": "ollama chat", "/api/generate": "ollama generate" };

const $ = (id) => document.getElementById(id);

// -- the fold: what the events say -----------------------------------------------------------

function emptyState() {
  return {
    requests: new Map(), // id -> request, until it ends
    ended: [], // the last ENDED, newest first
    steps: [], // the last STRIP steps: {step, ts, tokens by kind, members, seconds, predicted}
    models: new Map(), // a server of several: name -> its last load or unload
    cache: { lookups: 0, hits: 0, promptTokens: 0, cachedTokens: 0, misses: [] },
    now: 0, // the last event's time (replay: the scrubbed step's)
    lastStep: 0,
  };
}

let S = emptyState();
let header = null; // the run's header (its config: the step-time target)
let live = true;

// The door an `admitted` event records: its HTTP path's short name (the path itself for one
// not listed); none: the Python API. The engine's own next-turn prefills say so.
function doorOf(e) {
  if (e.origin === "next-turn") return "next turn (engine)";
  if (e.door) return DOORS[e.door] || e.door;
  return "python";
}

function stepOf(n) {
  return S.steps.find((s) => s.step === n);
}

function apply(e) {
  S.now = Math.max(S.now, e.ts);
  switch (e.type) {
    case "admitted":
      S.requests.set(e.request_id, {
        id: e.request_id, model: e.model, client: e.client, admittedAt: e.ts, door: doorOf(e),
        doorPath: e.door || "the Python API",
        origin: e.origin || "client", // "next-turn": the engine's own prefill of a next turn
        prompt: e.num_prompt_tokens, maxTokens: e.params.max_tokens, prefilled: 0, cached: 0,
        chunks: 0, out: 0,
        scheduledAt: null, firstTokenAt: null, state: "waiting",
      });
      break;
    case "chunk-prefilled": {
      const r = S.requests.get(e.request_id);
      if (!r) break;
      if (r.chunks === 0) {
        r.cached = e.num_cached_tokens || 0;
        noteLookup(r, e);
      }
      r.chunks += 1;
      r.prefilled = e.end;
      r.state = r.prefilled >= r.prompt ? "decoding" : "prefilling";
      break;
    }
    case "step": {
      S.lastStep = Math.max(S.lastStep, e.step);
      const s = { step: e.step, ts: e.ts, prefill: 0, decode: 0, encode: 0, members: [],
        budget: e.max_step_tokens, seconds: null, predicted: null, warming: false };
      e.request_ids.forEach((rid, i) => {
        s[e.kinds[i]] += e.num_tokens[i];
        s.members.push([rid, e.num_tokens[i], e.kinds[i]]);
        const r = S.requests.get(rid);
        if (r && r.scheduledAt === null) r.scheduledAt = e.ts;
      });
      S.steps.push(s);
      if (S.steps.length > STRIP) S.steps.shift();
      break;
    }
    case "step-finished": {
      const s = stepOf(e.step);
      if (s) Object.assign(s, { seconds: e.seconds, predicted: e.predicted_seconds,
        warming: e.warming_up });
      break;
    }
    case "decoding": {
      for (const rid of e.request_ids) {
        const r = S.requests.get(rid);
        if (!r) continue;
        r.out += 1;
        if (r.firstTokenAt === null) r.firstTokenAt = e.ts;
        r.lastTokenAt = e.ts;
        r.state = "decoding";
      }
      break;
    }
    case "terminal": {
      const r = S.requests.get(e.request_id) || { id: e.request_id, admittedAt: null,
        prompt: 0, out: 0, firstTokenAt: null };
      S.requests.delete(e.request_id);
      r.end = e.reason + (e.code ? ` (${e.code})` : "");
      r.endedAt = e.ts;
      S.ended.unshift(r);
      if (S.ended.length > ENDED) S.ended.pop();
      break;
    }
    case "model-loaded":
      S.models.set(e.model, { state: "loaded", bytes: e.weights_bytes + e.kv_bytes +
        e.prefix_cache_bytes, at: e.ts });
      break;
    case "model-unloaded":
      S.models.set(e.model, { state: `unloaded (${e.reason})`, bytes: 0, at: e.ts });
      break;
    case "model-load-failed":
      S.models.set(e.model, { state: "failed", bytes: 0, message: e.message, at: e.ts });
      break;
  }
}

function noteLookup(r, e) {
  const c = S.cache;
  c.lookups += 1;
  c.promptTokens += r.prompt;
  if (e.num_cached_tokens > 0) {
    c.hits += 1;
    c.cachedTokens += e.num_cached_tokens;
  }
  // a hit short of all but its last prompt token says why (`prefix_miss`); older logs: a
  // request with no hit at all is listed without one
  if (e.prefix_miss || (e.prefix_miss === undefined && !(e.num_cached_tokens > 0))) {
    c.misses.unshift({
      id: r.id, prompt: r.prompt, cached: e.num_cached_tokens || 0, ts: e.ts,
      why: e.prefix_miss, shared: e.prefix_shared || 0,
    });
    if (c.misses.length > MISSES) c.misses.pop();
  }
}

const MISS_WHY = {
  cold: () => "nothing cached starts as its prompt does",
  diverged: (n) => `its prompt first differs from everything cached at token ${n}`,
  "no-snapshot": (n) => `an entry shares its first ${n} tokens, but this model's cache serves ` +
    "an entry only where it was taken",
  evicted: (n) => `an entry that shared its first ${n} tokens was evicted`,
};

// -- drawing ---------------------------------------------------------------------------------

const ms = (s) => (s === null || s === undefined ? "–" : `${(s * 1000).toFixed(1)} ms`);
const secs = (s) => (s === null || s === undefined ? "–" : s < 1 ? ms(s) : `${s.toFixed(2)} s`);
const gb = (b) => `${(b / 2 ** 30).toFixed(2)} GB`;

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

// A request's id, short (its door's prefix and 8 digits), the whole id in its title.
function idCell(row, id) {
  const td = cell(row, id.length > 32 ? `${id.slice(0, id.length - 24)}…` : id, "id");
  td.title = id;
  return td;
}

function targetSeconds() {
  const cfg = (header && header.config) || {};
  const t = cfg.max_step_ms;
  return t ? t / 1000 : null;
}

// A step over its target stalls every stream in it; its cause is its biggest prompt work.
function stallOf(s, target) {
  if (s.seconds === null || target === null || s.warming || s.seconds <= target) return null;
  const work = s.members.filter((m) => m[2] !== "decode").sort((a, b) => b[1] - a[1])[0];
  const cause = work ? `${work[0]} ${work[2]} ${work[1]} tokens` : `${s.decode} decode rows`;
  return `step ${s.step} took ${ms(s.seconds)} (target ${ms(target)}): ${cause}`;
}

function drawSteps() {
  const svg = $("steps");
  const target = targetSeconds();
  const W = 900, H = 160, w = W / STRIP;
  const top = Math.max(target ? target * 2 : 0, ...S.steps.map((s) => s.seconds || 0), 1e-3);
  const parts = [];
  if (target) {
    const y = H - (target / top) * H;
    parts.push(`<line x1="0" x2="${W}" y1="${y}" y2="${y}" class="target" stroke="#f59e0b"
      stroke-dasharray="4 3"/>`);
  }
  let stalls = 0;
  S.steps.forEach((s, i) => {
    const x = i * w;
    const h = ((s.seconds || 0) / top) * H;
    const total = s.prefill + s.decode + s.encode || 1;
    let y = H;
    for (const [kind, color] of [["decode", "#10b981"], ["prefill", "#3b82f6"],
      ["encode", "#a855f7"]]) {
      const part = (s[kind] / total) * h;
      if (part > 0) parts.push(`<rect x="${x}" y="${y - part}" width="${w - 1}" height="${part}"
        fill="${color}"/>`);
      y -= part;
    }
    const stall = stallOf(s, target);
    if (stall) stalls += 1;
    const title = stall || `step ${s.step}: ${ms(s.seconds)}, ${s.prefill} prefill + ${s.decode}` +
      ` decode tokens of ${s.budget}`;
    if (stall) parts.push(`<rect class="stalled" x="${x}" y="0" width="${w - 1}" height="6"
      fill="#dc2626"/>`);
    parts.push(`<rect data-step="${s.step}" x="${x}" y="0" width="${w}" height="${H}"
      fill="transparent"><title>${escapeHtml(title)}</title></rect>`);
  });
  svg.innerHTML = parts.join("");
  $("step-note").textContent = S.steps.length
    ? `steps ${S.steps[0].step}–${S.steps[S.steps.length - 1].step}; ${stalls} over target` +
      (target ? ` (${ms(target)})` : " (no step-time target)")
    : "no steps yet";
}

function escapeHtml(text) {
  return text.replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
}

// When the page first showed each request, and its first token (wall-clock seconds, as the
// events' `ts`), beside the event times: how far behind the engine the page runs (the browser
// test measures it). Kept for the last SHOWN requests.
const SHOWN = 200;
const shown = new Map(); // id -> {admitted, shown, firstToken, firstTokenShown}
window.steplineShown = shown;

function stampShown(r, row) {
  const at = (performance.timeOrigin + performance.now()) / 1000;
  let s = shown.get(r.id);
  if (!s) {
    s = { admitted: r.admittedAt, shown: at, firstToken: null, firstTokenShown: null };
    shown.set(r.id, s);
    if (shown.size > SHOWN) shown.delete(shown.keys().next().value);
  }
  if (s.firstTokenShown === null && r.firstTokenAt !== null && r.out > 0) {
    s.firstToken = r.firstTokenAt;
    s.firstTokenShown = at;
  }
  row.dataset.shownAt = s.shown;
}

function drawRequests() {
  const body = $("requests").tBodies[0];
  body.replaceChildren();
  const now = S.now;
  for (const r of S.requests.values()) {
    const row = body.insertRow();
    row.dataset.request = r.id;
    row.onclick = () => showTimeline(r.id);
    idCell(row, r.id);
    cell(row, r.door).title = r.doorPath;
    cell(row, r.client ? r.client.slice(0, 8) : "anonymous");
    cell(row, r.state);
    const prompt = cell(row, "");
    const done = r.prompt ? r.prefilled / r.prompt : 1;
    const cached = r.prompt ? r.cached / r.prompt : 0;
    prompt.innerHTML = `<span class="bar"><span class="cached" style="width:${cached * 100}%">` +
      `</span><span style="width:${(done - cached) * 100}%"></span></span>`;
    prompt.append(`${r.prefilled}/${r.prompt} (${r.chunks} chunks, ${r.cached} cached)`);
    cell(row, String(r.out));
    const span = r.firstTokenAt !== null ? (r.lastTokenAt || now) - r.firstTokenAt : 0;
    cell(row, span > 0 ? `${((r.out - 1) / span).toFixed(1)} tok/s` : "–");
    cell(row, secs((r.scheduledAt !== null ? r.scheduledAt : now) - r.admittedAt));
    stampShown(r, row);
  }
  const ended = $("finished").tBodies[0];
  ended.replaceChildren();
  for (const r of S.ended) {
    const row = ended.insertRow();
    row.dataset.request = r.id;
    row.onclick = () => showTimeline(r.id);
    idCell(row, r.id);
    cell(row, r.door || "–").title = r.doorPath || "";
    cell(row, r.end);
    cell(row, String(r.prompt));
    cell(row, String(r.out));
    cell(row, r.admittedAt !== null && r.firstTokenAt !== null ? secs(r.firstTokenAt - r.admittedAt) : "–");
    cell(row, r.admittedAt !== null ? secs(r.endedAt - r.admittedAt) : "–");
    if (r.admittedAt !== null) stampShown(r, row);
  }
}

let health = null; // /health's body, asked every few seconds (live only)

function drawModels() {
  const box = $("models");
  box.replaceChildren();
  const names = header ? (Object.keys(header.models || {}).length ? Object.keys(header.models)
    : [header.model]) : [];
  for (const name of names) {
    const div = document.createElement("div");
    const known = S.models.get(name);
    const state = (health && health.models && health.models[name] && health.models[name].state)
      || (known ? known.state : live ? "loaded" : "");
    div.textContent = `${name}: ${state}` + (known && known.bytes ? `, ${gb(known.bytes)}` : "");
    box.append(div);
  }
  if (health && health.memory_gb) {
    const m = health.memory_gb;
    const div = document.createElement("div");
    div.innerHTML = `memory <span class="meter"><span style="width:${Math.min(100,
      (100 * m.used) / (m.budget || 1))}%"></span></span> ${m.used} of ${m.budget} GB`;
    box.append(div);
  }
  let waiting = 0, running = 0, reserved = 0;
  for (const r of S.requests.values()) {
    if (r.state === "waiting") waiting += 1;
    else {
      running += 1;
      reserved += r.prompt + r.maxTokens; // what admission reserves of the KV budget
    }
  }
  const kv = header && header.config && header.config.max_kv_tokens;
  if (kv) {
    const div = document.createElement("div");
    div.id = "kv";
    div.title = "running requests' prompt + max_tokens, of the KV budget (--max-kv-gb)";
    div.innerHTML = `KV <span class="meter"><span style="width:${Math.min(100,
      (100 * reserved) / kv)}%"></span></span> ${reserved} of ${kv} tokens reserved`;
    box.append(div);
  }
  $("counts").innerHTML = `<div id="queue">queued <b>${waiting}</b></div>` +
    `<div id="running">running <b>${running}</b></div>` + `<div>step <b>${S.lastStep}</b></div>`;
}

function drawCache() {
  const c = S.cache;
  const rate = c.lookups ? ((100 * c.hits) / c.lookups).toFixed(0) : "–";
  const tokens = c.promptTokens ? ((100 * c.cachedTokens) / c.promptTokens).toFixed(0) : "–";
  $("cache").innerHTML = `hit rate <b id="hit-rate">${rate}%</b> of ${c.lookups} requests; ` +
    `${tokens}% of prompt tokens came from the cache`;
  const list = $("misses");
  list.replaceChildren();
  for (const m of c.misses) {
    const li = document.createElement("li");
    const why = m.why && MISS_WHY[m.why] ? MISS_WHY[m.why](m.shared) : "no cached prefix of them";
    li.textContent = `${m.id}: ${m.cached} of ${m.prompt} prompt tokens cached; ${why}`;
    list.append(li);
  }
}

let dirty = true;
function draw() {
  if (!dirty) return;
  dirty = false;
  drawModels();
  drawSteps();
  drawRequests();
  drawCache();
}
setInterval(draw, 200);

// -- the key ---------------------------------------------------------------------------------

function takeKeyFromUrl() {
  const url = new URL(location.href);
  const key = url.searchParams.get("key");
  if (key) {
    setKey(key);
    url.searchParams.delete("key");
    history.replaceState(null, "", url); // out of the address bar and the history
  }
}

function setKey(key) {
  document.cookie = `${KEY_COOKIE}=${encodeURIComponent(key)}; path=/v1/events; SameSite=Strict`;
}

$("key-form").onsubmit = (ev) => {
  ev.preventDefault();
  setKey($("key-input").value);
  $("key-needed").hidden = true;
  start();
};

function setStatus(text, cls) {
  const s = $("status");
  s.textContent = text;
  s.className = `status ${cls || ""}`;
}

// -- reading the events ----------------------------------------------------------------------

let source = null;
let lastId = null;
let runKey = null;
let recorded = []; // replay: every event, to fold again up to the scrubbed step

function onRun(body) {
  if (runKey !== null && body.run !== runKey) {
    // A new run (the server restarted): what was in flight in the old one ended with it.
    for (const r of S.requests.values()) {
      r.end = "interrupted (the run ended)";
      r.endedAt = S.now;
      S.ended.unshift(r);
    }
    S.requests.clear();
    S.ended = S.ended.slice(0, ENDED);
    S.steps = [];
  }
  runKey = body.run;
  header = body.header;
  $("run").textContent = `run ${body.run}` + (body.live ? "" : " (recorded)");
  dirty = true;
}

function onEvent(msg) {
  lastId = msg.lastEventId || lastId;
  const e = JSON.parse(msg.data);
  if (!live) {
    recorded.push(e);
    scrubberGrows(e);
    return;
  }
  apply(e);
  dirty = true;
}

function connect() {
  const url = lastId ? `/v1/events?after=${encodeURIComponent(lastId)}` : "/v1/events";
  source = new EventSource(url);
  source.onopen = () => setStatus(live ? "live" : "recorded log", "live");
  source.onmessage = onEvent;
  source.addEventListener("run", (m) => onRun(JSON.parse(m.data)));
  source.addEventListener("missed", (m) => {
    const b = JSON.parse(m.data);
    $("notes").textContent = `missed ${b.missed === null ? "some" : b.missed} events after ` +
      `${b.after}: ${b.reason}`;
  });
  source.addEventListener("error", (m) => {
    if (m.data) $("notes").textContent = `the stream ended: ${JSON.parse(m.data).message}`;
  });
  source.onerror = () => {
    if (source.readyState === EventSource.CLOSED) {
      // Refused (a 401, or the server is gone): ask again, soon.
      setStatus("reconnecting…", "down");
      source.close();
      setTimeout(start, 2000);
    } else {
      setStatus("reconnecting…", "down"); // EventSource retries with Last-Event-ID
    }
  };
}

async function start() {
  let about;
  try {
    const r = await fetch("/v1/events/about", { credentials: "same-origin",
      signal: AbortSignal.timeout(5000) }); // a server going down may never answer
    if (r.status === 401) {
      setStatus("API key needed", "down");
      $("key-needed").hidden = false;
      return;
    }
    if (!r.ok) throw new Error(`${r.status}`);
    about = await r.json();
  } catch (err) {
    setStatus("server down: reconnecting…", "down");
    setTimeout(start, 2000);
    return;
  }
  live = about.live;
  $("replay").hidden = live;
  header = about.header;
  if (source) source.close();
  connect();
}

let notOpen = 0; // /health answers, yet the stream has not been open this many polls

async function pollHealth() {
  if (!live) return;
  try {
    const r = await fetch("/health", { signal: AbortSignal.timeout(5000) });
    health = await r.json();
    dirty = true;
    // The server is up but the stream is not (it was opened to a server that went away and
    // never answered): open it again, from the last event read.
    notOpen = source && source.readyState !== EventSource.OPEN ? notOpen + 1 : 0;
    if (notOpen >= 2) {
      notOpen = 0;
      source.close();
      start();
    }
  } catch (err) {
    health = null;
  }
}
setInterval(pollHealth, 3000);

// -- a request's timeline --------------------------------------------------------------------

async function showTimeline(id) {
  $("timeline-panel").hidden = false;
  $("timeline-of").textContent = id;
  $("timeline").textContent = "reading…";
  const r = await fetch(`/v1/events/requests/${encodeURIComponent(id)}/timeline`,
    { credentials: "same-origin" });
  if (r.ok) {
    $("timeline").textContent = await r.text();
  } else {
    const body = await r.json().catch(() => ({}));
    $("timeline").textContent = (body.error && body.error.message) || `error ${r.status}`;
  }
}
$("timeline-close").onclick = () => { $("timeline-panel").hidden = true; };

// -- a recorded log: a step scrubber ---------------------------------------------------------

let scrubbed = null; // the step shown; null: follow the end as the log is read

function scrubberGrows(e) {
  const bar = $("scrubber");
  if (e.step > Number(bar.max)) bar.max = e.step;
  if (scrubbed === null) {
    bar.value = bar.max;
    apply(e);
    dirty = true;
    $("scrubbed").textContent = `step ${bar.value} of ${bar.max}`;
  }
}

$("scrubber").oninput = () => {
  const bar = $("scrubber");
  scrubbed = Number(bar.value);
  S = emptyState();
  for (const e of recorded) {
    if (e.step > scrubbed) break;
    apply(e);
  }
  $("scrubbed").textContent = `step ${scrubbed} of ${bar.max}`;
  dirty = true;
};

takeKeyFromUrl();
start();
