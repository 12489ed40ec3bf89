// The stepline dashboard: a fold of the event log, read live from /v1/events (EventSource),
// or, served by `stepline replay LOG --serve`, from a recorded log with a step scrubber.
// Live, it starts from the state now (`after=view`: the events of what it draws, not all
// that memory keeps), then folds every event that follows.
// Plain JS, no build step, nothing fetched from elsewhere. See docs/dashboard.md.
"use strict";

const KEY_COOKIE = "stepline_api_key";
const STRIP = 150; // steps drawn (the server's VIEW_STEPS: what `after=view` sends)
const ENDED = 25; // ended requests listed (its VIEW_ENDED)
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
    slots: 0, // steps seen: each step's slot in the strip
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
  for (let i = S.steps.length - 1; i >= 0; i -= 1) if (S.steps[i].step === n) return S.steps[i];
  return undefined;
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
        chunks: 0, out: 0, looked: false, // looked: its first step looked its prompt up
        scheduledAt: null, firstTokenAt: null, state: "waiting",
      });
      break;
    case "chunk-prefilled": {
      const r = S.requests.get(e.request_id);
      if (!r) break;
      if (!r.looked) noteLookup(r, e);
      r.chunks += 1;
      r.prefilled = e.end;
      r.state = r.prefilled >= r.prompt ? "decoding" : "prefilling";
      break;
    }
    case "image-encoded": { // an image's encoder work: maybe the request's first step
      const r = S.requests.get(e.request_id);
      if (r && !r.looked) noteLookup(r, e);
      break;
    }
    case "step": {
      S.lastStep = Math.max(S.lastStep, e.step);
      const s = { step: e.step, slot: S.slots++, ts: e.ts, prefill: 0, decode: 0, encode: 0,
        members: [], budget: e.max_step_tokens, seconds: null, predicted: null, warming: false };
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

// A request's first step (its first chunk, or its first image's encoding) says what the
// prefix cache gave it (the server's PrefixTally counts the same, for a page's start).
function noteLookup(r, e) {
  r.looked = true;
  r.cached = e.num_cached_tokens || 0;
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
// Events only fold into S and mark the parts they change; a frame draws those parts at most
// every FRAME_MS (in an animation frame: none while the page is hidden), and each part
// changes only the elements whose text or shape changed, so a busy engine's hundreds of
// events a second cost the page a few small DOM updates a frame, not a page rebuilt.

const FRAME_MS = 200; // the page draws at most this often
const PARTS = { // which parts of the page each kind of event changes
  admitted: ["requests", "models"],
  "chunk-prefilled": ["requests", "models", "cache"],
  "image-encoded": ["requests", "cache"],
  step: ["steps", "requests", "models"],
  "step-finished": ["steps"],
  decoding: ["requests"],
  terminal: ["requests", "models"],
  "model-loaded": ["models"],
  "model-unloaded": ["models"],
  "model-load-failed": ["models"],
};
const ALL = ["models", "steps", "requests", "cache"];

const ms = (s) => (s === null || s === undefined ? "–" : `${(s * 1000).toFixed(1)} ms`);
const secs = (s) => (s === null || s === undefined ? "–" : s < 1 ? ms(s) : `${s.toFixed(2)} s`);
const gb = (b) => `${(b / 2 ** 30).toFixed(2)} GB`;

function escapeHtml(text) {
  return String(text).replace(/[&<>"]/g,
    (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
}

// An element's text and attributes, written only when they change (a write of the same
// value still makes the browser lay the page out again).
function setText(el, text) {
  if (el.textContent !== text) el.textContent = text;
}
function setAttr(el, name, value) {
  if (el.getAttribute(name) !== value) el.setAttribute(name, value);
}
const written = new WeakMap(); // element -> the HTML setHtml last wrote into it
function setHtml(el, html) {
  if (written.get(el) !== html) {
    el.innerHTML = html;
    written.set(el, html);
  }
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

// -- the step strip: a bar a step, drawn once (when its time is known) at its own slot; the
// strip moves left and rescales by the transforms of the groups that hold the bars.

const SVG = "http://www.w3.org/2000/svg";
const W = 900, H = 160, SLOT = W / STRIP;
const KINDS = [["decode", "#10b981"], ["prefill", "#3b82f6"], ["encode", "#a855f7"]];
const strip = { of: null, target: undefined, drawn: new Map() }; // step -> its elements

function svgEl(name, attrs) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}

function resetStrip(target) {
  strip.of = S;
  strip.target = target;
  strip.drawn.clear();
  strip.line = svgEl("line", { x1: 0, x2: W, y1: 0, y2: 0, class: "target", stroke: "#f59e0b",
    "stroke-dasharray": "4 3", visibility: target ? "visible" : "hidden" });
  strip.bars = svgEl("g", {}); // in seconds, up from the bottom: scaled to the tallest
  strip.marks = svgEl("g", {});
  strip.hits = svgEl("g", {});
  strip.shift = svgEl("g", {});
  strip.shift.append(strip.bars, strip.marks, strip.hits);
  $("steps").replaceChildren(strip.line, strip.shift);
}

function stepTitle(s, stall) {
  return stall || `step ${s.step}: ${ms(s.seconds)}, ${s.prefill} prefill + ${s.decode}` +
    ` decode tokens of ${s.budget}`;
}

function newStep(s) {
  const x = s.slot * SLOT;
  const els = { seconds: undefined, stall: null, mark: null, bars: svgEl("g", {}),
    title: svgEl("title", {}),
    hit: svgEl("rect", { "data-step": s.step, x, y: 0, width: SLOT, height: H,
      fill: "transparent" }) };
  els.hit.append(els.title);
  strip.bars.append(els.bars);
  strip.hits.append(els.hit);
  return els;
}

function fillStep(s, els, target) {
  els.seconds = s.seconds;
  const x = s.slot * SLOT;
  const total = s.prefill + s.decode + s.encode || 1;
  const rects = [];
  let y = 0;
  for (const [kind, color] of KINDS) {
    const part = (s[kind] / total) * (s.seconds || 0);
    if (part > 0) rects.push(svgEl("rect", { x, y, width: SLOT - 1, height: part, fill: color }));
    y += part;
  }
  els.bars.replaceChildren(...rects);
  els.stall = stallOf(s, target);
  if (els.stall && !els.mark) {
    els.mark = svgEl("rect", { class: "stalled", x, y: 0, width: SLOT - 1, height: 6,
      fill: "#dc2626" });
    strip.marks.append(els.mark);
  }
  setText(els.title, stepTitle(s, els.stall));
}

function drawSteps() {
  const target = targetSeconds();
  if (strip.of !== S || strip.target !== target) resetStrip(target);
  const shown = new Set(S.steps);
  for (const [s, els] of strip.drawn) {
    if (shown.has(s)) continue;
    els.bars.remove();
    els.hit.remove();
    if (els.mark) els.mark.remove();
    strip.drawn.delete(s);
  }
  let stalls = 0, tallest = 0;
  for (const s of S.steps) {
    let els = strip.drawn.get(s);
    if (!els) strip.drawn.set(s, (els = newStep(s)));
    if (els.seconds !== s.seconds) fillStep(s, els, target);
    if (els.stall) stalls += 1;
    tallest = Math.max(tallest, s.seconds || 0);
  }
  const top = Math.max(target ? target * 2 : 0, tallest, 1e-3);
  const first = S.steps.length ? S.steps[0].slot : 0;
  setAttr(strip.shift, "transform", `translate(${-first * SLOT},0)`);
  setAttr(strip.bars, "transform", `translate(0,${H}) scale(1,${-H / top})`);
  if (target) {
    const y = String(H - (target / top) * H);
    setAttr(strip.line, "y1", y);
    setAttr(strip.line, "y2", y);
  }
  setText($("step-note"), S.steps.length
    ? `steps ${S.steps[0].step}–${S.steps[S.steps.length - 1].step}; ${stalls} over target` +
      (target ? ` (${ms(target)})` : " (no step-time target)")
    : "no steps yet");
}

// -- the requests: a row a request, made when it is first shown, its changing cells written
// when their text changes.

// When the page first showed each request, and its first token (wall-clock seconds, as the
// events' `ts`), beside the event times: how far behind the engine the page runs (the browser
// test measures it). Kept for the last SHOWN requests.
const SHOWN = 200;
const shown = new Map(); // id -> {admitted, shown, firstToken, firstTokenShown}
window.steplineShown = shown;

function stampShown(r) {
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
  return s;
}

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

function newRow(r) {
  const row = document.createElement("tr");
  row.dataset.request = r.id;
  row.onclick = () => showTimeline(r.id);
  return row;
}

// `body`'s rows are those of `list`, in its order: `rows` (request -> its row) keeps them,
// `make` makes a new one, `update` (if any) brings one up to date.
function syncRows(body, list, rows, make, update) {
  const wanted = new Set(list);
  for (const [r, it] of rows) {
    if (!wanted.has(r)) {
      it.row.remove();
      rows.delete(r);
    }
  }
  let prev = null;
  for (const r of list) {
    let it = rows.get(r);
    if (!it) rows.set(r, (it = make(r)));
    else if (update) update(r, it);
    const at = prev ? prev.nextSibling : body.firstChild;
    if (it.row !== at) body.insertBefore(it.row, at);
    prev = it.row;
  }
}

function runningRow(r) {
  const row = newRow(r);
  idCell(row, r.id);
  cell(row, r.door).title = r.doorPath;
  cell(row, r.client ? r.client.slice(0, 8) : "anonymous");
  const it = { row, state: cell(row, "") };
  const prompt = cell(row, "");
  prompt.innerHTML = '<span class="bar"><span class="cached"></span><span></span></span>';
  [it.cachedBar, it.doneBar] = prompt.firstChild.children;
  it.progress = document.createTextNode("");
  prompt.append(it.progress);
  it.out = cell(row, "");
  it.rate = cell(row, "");
  it.waited = cell(row, "");
  updateRunning(r, it);
  row.dataset.shownAt = stampShown(r).shown;
  return it;
}

function updateRunning(r, it) {
  const now = S.now;
  setText(it.state, r.state);
  const done = r.prompt ? r.prefilled / r.prompt : 1;
  const cached = r.prompt ? r.cached / r.prompt : 0;
  setAttr(it.cachedBar, "style", `width:${cached * 100}%`);
  setAttr(it.doneBar, "style", `width:${(done - cached) * 100}%`);
  const progress = `${r.prefilled}/${r.prompt} (${r.chunks} chunks, ${r.cached} cached)`;
  if (it.progress.data !== progress) it.progress.data = progress;
  setText(it.out, String(r.out));
  const span = r.firstTokenAt !== null ? (r.lastTokenAt || now) - r.firstTokenAt : 0;
  setText(it.rate, span > 0 ? `${((r.out - 1) / span).toFixed(1)} tok/s` : "–");
  setText(it.waited, secs((r.scheduledAt !== null ? r.scheduledAt : now) - r.admittedAt));
  stampShown(r);
}

function endedRow(r) {
  const row = newRow(r);
  idCell(row, r.id);
  cell(row, r.door || "–").title = r.doorPath || "";
  cell(row, r.end);
  cell(row, String(r.prompt));
  cell(row, String(r.out));
  cell(row, r.admittedAt !== null && r.firstTokenAt !== null
    ? secs(r.firstTokenAt - r.admittedAt) : "–");
  cell(row, r.admittedAt !== null ? secs(r.endedAt - r.admittedAt) : "–");
  if (r.admittedAt !== null) row.dataset.shownAt = stampShown(r).shown;
  return { row };
}

const tables = { running: new Map(), ended: new Map() }; // request -> its row

function drawRequests() {
  syncRows($("requests").tBodies[0], [...S.requests.values()], tables.running, runningRow,
    updateRunning);
  syncRows($("finished").tBodies[0], S.ended, tables.ended, endedRow);
}

// -- models, the cache

let health = null; // /health's body, asked every few seconds (live only)

function drawModels() {
  const names = header ? (Object.keys(header.models || {}).length ? Object.keys(header.models)
    : [header.model]) : [];
  const parts = [];
  for (const name of names) {
    const known = S.models.get(name);
    const state = (health && health.models && health.models[name] && health.models[name].state)
      || (known ? known.state : live ? "loaded" : "");
    parts.push(`<div>${escapeHtml(`${name}: ${state}` +
      (known && known.bytes ? `, ${gb(known.bytes)}` : ""))}</div>`);
  }
  if (health && health.memory_gb) {
    const m = health.memory_gb;
    parts.push(`<div>memory <span class="meter"><span style="width:${Math.min(100,
      (100 * m.used) / (m.budget || 1))}%"></span></span> ${m.used} of ${m.budget} GB</div>`);
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
    parts.push('<div id="kv" title="running requests\' prompt + max_tokens, of the KV budget ' +
      `(--max-kv-gb)">KV <span class="meter"><span style="width:${Math.min(100,
        (100 * reserved) / kv)}%"></span></span> ${reserved} of ${kv} tokens reserved</div>`);
  }
  setHtml($("models"), parts.join(""));
  setHtml($("counts"), `<div id="queue">queued <b>${waiting}</b></div>` +
    `<div id="running">running <b>${running}</b></div>` + `<div>step <b>${S.lastStep}</b></div>`);
}

function drawCache() {
  const c = S.cache;
  const rate = c.lookups ? ((100 * c.hits) / c.lookups).toFixed(0) : "–";
  const tokens = c.promptTokens ? ((100 * c.cachedTokens) / c.promptTokens).toFixed(0) : "–";
  setHtml($("cache"), `hit rate <b id="hit-rate">${rate}%</b> of ${c.lookups} requests; ` +
    `${tokens}% of prompt tokens came from the cache`);
  const items = c.misses.map((m) => {
    const why = m.why && MISS_WHY[m.why] ? MISS_WHY[m.why](m.shared) : "no cached prefix of them";
    const text = `${m.id}: ${m.cached} of ${m.prompt} prompt tokens cached; ${why}`;
    return `<li>${escapeHtml(text)}</li>`;
  });
  setHtml($("misses"), items.join(""));
}

// -- when to draw

const dirty = new Set(ALL); // the parts changed since the last frame
let frameAsked = false;
let drewAt = -Infinity;

function changed(parts) {
  for (const p of parts) dirty.add(p);
  if (frameAsked || dirty.size === 0) return;
  frameAsked = true;
  const wait = Math.max(0, drewAt + FRAME_MS - performance.now());
  setTimeout(() => requestAnimationFrame(draw), wait);
}

function draw() {
  frameAsked = false;
  drewAt = performance.now();
  if (dirty.has("models")) drawModels();
  if (dirty.has("steps")) drawSteps();
  if (dirty.has("requests")) drawRequests();
  if (dirty.has("cache")) drawCache();
  dirty.clear();
}
changed(ALL);

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
let caughtUp = false; // the view's catch-up has been read (or the page resumed from a place)
let viewEvents = 0; // events read before it
window.steplineCaughtUp = null; // the `caught-up` frame's body, and how many events came first
let runKey = null;
let recorded = []; // replay: every event, to fold again up to the scrubbed step

function onRun(body) {
  const next = runKey !== null && body.run !== runKey;
  if (next) {
    // A new run (the server restarted): what was in flight in the old one ended with it.
    for (const r of S.requests.values()) {
      r.end = "interrupted (the run ended)";
      r.endedAt = S.now;
      S.ended.unshift(r);
    }
    S.requests.clear();
    S.ended = S.ended.slice(0, ENDED);
    S.steps = [];
    S.lastStep = 0;
  }
  runKey = body.run;
  header = body.header;
  $("run").textContent = `run ${body.run}` + (body.live ? "" : " (recorded)");
  changed(ALL);
  if (next && live) {
    // A resume past the end of the run it had read gets the next run from its first event
    // (and the one after, if there was one): start from the state now instead.
    source.close();
    lastId = null;
    caughtUp = false;
    viewEvents = 0;
    connect();
  }
}

function onEvent(msg) {
  lastId = msg.lastEventId || lastId;
  if (!caughtUp) viewEvents += 1;
  const e = JSON.parse(msg.data);
  if (!live) {
    recorded.push(e);
    scrubberGrows(e);
    return;
  }
  apply(e);
  if (caughtUp) changed(PARTS[e.type] || []); // (the view is drawn once it is all read)
}

// The view's catch-up sends only the first and last of a request's tokens before its last
// steps: its `tokens_out` says how many there were. It sends the lives of only the requests
// it shows: `prefix_cache` counts the prefix lookups of every request the run has had (those
// it shows among them), which the page's counters go on from.
function onCaughtUp(m) {
  lastId = m.lastEventId || lastId;
  const body = JSON.parse(m.data);
  window.steplineCaughtUp = { ...body, received: viewEvents };
  const ended = new Map(S.ended.map((r) => [r.id, r]));
  for (const [id, n] of Object.entries(body.tokens_out || {})) {
    const r = S.requests.get(id) || ended.get(id);
    if (r) r.out = n;
  }
  const p = body.prefix_cache;
  if (p) Object.assign(S.cache, { lookups: p.lookups, hits: p.hits,
    promptTokens: p.prompt_tokens, cachedTokens: p.cached_tokens });
  caughtUp = true;
  setStatus("live", "live");
  changed(ALL);
}

// The first connection of a live page asks for the view (the state now); after that the page
// goes on from the last event it read (EventSource itself sends its id as Last-Event-ID).
function connect() {
  let url = "/v1/events";
  if (lastId) url = `/v1/events?after=${encodeURIComponent(lastId)}`;
  else if (live) url = "/v1/events?after=view";
  caughtUp = caughtUp || !!lastId || !live;
  const src = (source = new EventSource(url));
  // what a source closed for another still had to hand on is not the page's (a new run)
  const ours = (f) => (m) => { if (src === source) f(m); };
  source.onopen = ours(() => {
    if (!live) setStatus("recorded log", "live");
    else setStatus(caughtUp ? "live" : "catching up…", caughtUp ? "live" : "");
  });
  source.addEventListener("caught-up", ours(onCaughtUp));
  source.onmessage = ours(onEvent);
  source.addEventListener("run", ours((m) => onRun(JSON.parse(m.data))));
  source.addEventListener("missed", ours((m) => {
    const b = JSON.parse(m.data);
    $("notes").textContent = `missed ${b.missed === null ? "some" : b.missed} events after ` +
      `${b.after}: ${b.reason}`;
  }));
  source.addEventListener("error", ours((m) => {
    if (m.data) $("notes").textContent = `the stream ended: ${JSON.parse(m.data).message}`;
  }));
  source.onerror = ours(() => {
    if (!caughtUp) {
      // Dropped in the middle of the view: read it again, from the state then.
      source.close();
      S = emptyState();
      lastId = null;
      viewEvents = 0;
      setStatus("reconnecting…", "down");
      changed(ALL);
      setTimeout(start, 2000);
    } else if (source.readyState === EventSource.CLOSED) {
      // Refused (a 401, or the server is gone): ask again, soon.
      setStatus("reconnecting…", "down");
      source.close();
      setTimeout(start, 2000);
    } else {
      setStatus("reconnecting…", "down"); // EventSource retries with Last-Event-ID
    }
  });
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
    changed(["models"]);
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
    changed(PARTS[e.type] || []);
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
  changed(ALL);
};

takeKeyFromUrl();
start();
