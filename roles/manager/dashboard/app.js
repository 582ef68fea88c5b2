// Laminar dashboard: plain JS, no build step, no external assets (the cluster may be offline).
// Data: GET /v1/status every second (bearer token) and the /v1/events SSE stream (?token=,
// because EventSource cannot set headers). Stable ids / data-* attributes are for tests.
"use strict";

const KINDS = ["repack", "publish", "pull", "failure", "membership", "policy", "drain", "resume"];
const POLL_MS = 1000;
const WINDOW_S = 300; // charts show the last five minutes
const MAX_EVENTS = 200;
const COLORS = ["#58a6ff", "#3fb950", "#d29922", "#f778ba", "#a371f7", "#39c5cf", "#ff7b72", "#e3b341"];

const state = {
  token: null,
  prev: null,          // previous status (for token deltas)
  rates: {},           // rollout -> tokens/s
  throughput: [],      // [t, tokens/s]
  versions: {},        // rollout -> [[t, version], ...]
  publishes: [],       // [t, version]
  colors: {},
  lastSeq: 0,
  source: null,
  timer: null,
  now: 0,              // manager clock of the newest status
};

const $ = (sel) => document.querySelector(sel);

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

function svgEl(tag, attrs = {}) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

function colorOf(id) {
  if (!(id in state.colors)) state.colors[id] = COLORS[Object.keys(state.colors).length % COLORS.length];
  return state.colors[id];
}

// -- token -----------------------------------------------------------------------------------

function initToken() {
  const url = new URL(window.location.href);
  const fromUrl = url.searchParams.get("token");
  if (fromUrl) {
    sessionStorage.setItem("laminar-token", fromUrl);
    url.searchParams.delete("token"); // keep it out of the address bar and history
    window.history.replaceState(null, "", url.pathname + url.search + url.hash);
  }
  state.token = sessionStorage.getItem("laminar-token");
  $("#token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const t = $("#token-input").value.trim();
    if (!t) return;
    sessionStorage.setItem("laminar-token", t);
    state.token = t;
    $("#token-form").hidden = true;
    start();
  });
}

function askToken(message) {
  stop();
  $("#token-form").hidden = false;
  $("#token-error").textContent = message || "";
}

async function api(path, options = {}) {
  const headers = Object.assign({ Authorization: `Bearer ${state.token}` }, options.headers || {});
  const resp = await fetch(path, Object.assign({}, options, { headers }));
  if (resp.status === 401) {
    askToken("the token was refused");
    throw new Error("unauthorized");
  }
  const body = await resp.json();
  if (!resp.ok) throw new Error(`${resp.status} ${body.error || ""}`);
  return body;
}

// -- status poll ---------------------------------------------------------------------------

async function poll() {
  try {
    const status = await api("/v1/status");
    $("#poll-state").dataset.state = "ok";
    $("#poll-state").textContent = "status: ok";
    onStatus(status);
  } catch (err) {
    $("#poll-state").dataset.state = "error";
    $("#poll-state").textContent = `status: ${err.message}`;
  }
}

function onStatus(s) {
  state.now = s.now;
  $("#cluster-name").textContent = `${s.cluster} · ${s.manager}`;
  $("#trainer-version").textContent = s.trainer ? s.trainer.version : (s.staleness.trainer_version ?? "–");
  $("#buffer").textContent = s.data
    ? `${s.data.trajectories - s.data.consumed} ready · ${s.data.queued} queued · ${s.data.leased} leased`
    : "–";
  $("#max-lag").textContent = s.staleness.max_lag ?? "–";
  $("#chain").textContent = s.chain.order.length ? `${s.chain.order.join(" → ")} (e${s.chain.epoch})` : "–";
  const p = s.repack_policy;
  $("#policy").textContent = `policy: ${p.enabled ? "enabled" : "disabled"}, every ${p.period_s} s, ` +
    `C_max ${p.c_max}, B ${p.batch_limit}, on publish ${p.on_publish ? "yes" : "no"}`;
  $("#policy").dataset.enabled = String(p.enabled);
  $("#policy").dataset.periodS = String(p.period_s);

  // throughput from generated_tokens deltas
  if (state.prev && s.now > state.prev.now) {
    const dt = s.now - state.prev.now;
    const before = Object.fromEntries(state.prev.rollouts.map((r) => [r.id, r.generated_tokens]));
    let total = 0;
    for (const r of s.rollouts) {
      const a = before[r.id];
      if (a == null || r.generated_tokens == null || r.generated_tokens < a) continue;
      state.rates[r.id] = (r.generated_tokens - a) / dt;
      total += state.rates[r.id];
    }
    state.throughput.push([s.now, total]);
    $("#throughput").textContent = total.toFixed(1);
    $("#throughput").dataset.value = String(total);
  }
  state.prev = s;

  for (const r of s.rollouts) {
    if (r.version != null && r.member_state === "alive") noteVersion(r.id, r.version, s.now);
  }
  renderRollouts(s.rollouts);
  renderThroughput();
  renderTimeline();
}

function noteVersion(id, version, t) {
  const series = (state.versions[id] = state.versions[id] || []);
  const last = series[series.length - 1];
  if (!last || last[1] !== version) series.push([t, version]);
  else if (t > last[0]) series.push([t, version]);
  if (series.length > 2000) series.splice(0, series.length - 2000);
}

function renderRollouts(rollouts) {
  const body = $("#rollouts tbody");
  const seen = new Set();
  for (const r of rollouts) {
    seen.add(r.id);
    let row = body.querySelector(`tr[data-rollout="${CSS.escape(r.id)}"]`);
    if (!row) {
      row = el("tr", { "data-rollout": r.id });
      for (const f of ["id", "version", "kv", "running", "waiting", "in_flight", "rate", "state", "actions"]) {
        row.append(el("td", { "data-field": f }));
      }
      const drain = el("button", { "data-action": "drain", text: "drain" });
      const resume = el("button", { "data-action": "resume", text: "resume" });
      drain.onclick = () => act(r.id, "drain");
      resume.onclick = () => act(r.id, "resume");
      row.querySelector('[data-field="actions"]').append(drain, " ", resume);
      body.append(row);
    }
    const cell = (f) => row.querySelector(`[data-field="${f}"]`);
    cell("id").textContent = r.id;
    cell("id").style.color = colorOf(r.id);
    cell("version").textContent = r.version ?? "–";
    const kv = r.kv_cache_usage;
    cell("kv").dataset.value = kv == null ? "" : String(kv);
    cell("kv").replaceChildren(
      el("span", { class: "kv" }, el("i", { style: `width:${Math.round((kv || 0) * 100)}%` })),
      el("span", { text: kv == null ? "–" : `${(kv * 100).toFixed(1)}%` }),
    );
    cell("running").textContent = r.running ?? "–";
    cell("waiting").textContent = r.waiting ?? "–";
    cell("in_flight").textContent = r.in_flight ?? "–";
    cell("rate").textContent = r.id in state.rates ? state.rates[r.id].toFixed(0) : "–";
    cell("state").textContent = r.state;
    cell("state").className = `state-${r.state}`;
    row.dataset.state = r.state;
    row.dataset.version = r.version == null ? "" : String(r.version);
  }
  for (const row of [...body.querySelectorAll("tr[data-rollout]")]) {
    if (!seen.has(row.dataset.rollout)) row.remove();
  }
}

async function act(id, action) {
  try {
    await api(`/v1/rollouts/${encodeURIComponent(id)}/${action}`, { method: "POST" });
  } catch (err) {
    window.alert(`${action} ${id}: ${err.message}`);
  }
  poll();
}

// -- charts ----------------------------------------------------------------------------------

function renderThroughput() {
  const svg = $("#throughput-chart");
  const W = 600, H = 120, now = state.now;
  const pts = state.throughput.filter(([t]) => t >= now - WINDOW_S);
  state.throughput = pts;
  svg.replaceChildren();
  if (pts.length < 2) return;
  const t0 = pts[0][0], ymax = Math.max(1, ...pts.map((p) => p[1])) * 1.1;
  const x = (t) => ((t - t0) / Math.max(1e-9, now - t0)) * (W - 40) + 35;
  const y = (v) => H - 12 - (v / ymax) * (H - 24);
  svg.append(svgEl("polyline", {
    points: pts.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" "),
    fill: "none", stroke: "#3fb950", "stroke-width": "1.5", "vector-effect": "non-scaling-stroke",
  }));
  const label = svgEl("text", { x: "2", y: "12", fill: "#7b8794", "font-size": "10" });
  label.textContent = `${Math.round(ymax / 1.1)}`;
  svg.append(label);
}

function renderTimeline() {
  const svg = $("#timeline");
  const W = 600, H = 180, now = state.now;
  const tmin = now - WINDOW_S;
  svg.replaceChildren();
  const ids = Object.keys(state.versions).sort();
  let vmin = Infinity, vmax = -Infinity, tfirst = now;
  for (const id of ids) {
    for (const [t, v] of state.versions[id]) {
      vmin = Math.min(vmin, v); vmax = Math.max(vmax, v);
      if (t >= tmin) tfirst = Math.min(tfirst, t);
    }
  }
  for (const [t, v] of state.publishes) {
    if (t >= tmin) { vmin = Math.min(vmin, v); vmax = Math.max(vmax, v); tfirst = Math.min(tfirst, t); }
  }
  if (!isFinite(vmin)) return;
  const t0 = Math.max(tmin, tfirst - 1);
  const span = Math.max(1, vmax - vmin);
  const x = (t) => ((Math.max(t, t0) - t0) / Math.max(1e-9, now - t0)) * (W - 45) + 40;
  const y = (v) => H - 14 - ((v - vmin) / span) * (H - 30);
  for (let v = vmin; v <= vmax; v += Math.max(1, Math.ceil(span / 6))) {
    const tick = svgEl("text", { x: "2", y: (y(v) + 3).toFixed(1), fill: "#7b8794", "font-size": "10" });
    tick.textContent = `v${v}`;
    svg.append(tick);
  }
  for (const [t, v] of state.publishes) {
    if (t < t0) continue;
    svg.append(svgEl("line", {
      x1: x(t), x2: x(t), y1: 4, y2: H - 10, stroke: "#7b8794", "stroke-dasharray": "3 3",
      "data-publish": String(v), "vector-effect": "non-scaling-stroke",
    }));
  }
  ids.forEach((id, i) => {
    const series = state.versions[id];
    const off = (i - (ids.length - 1) / 2) * 2; // separate overlapping lines a little
    const pts = [];
    let prev = null;
    for (const [t, v] of series) {
      if (prev !== null) pts.push(`${x(t).toFixed(1)},${(y(prev) + off).toFixed(1)}`);
      pts.push(`${x(t).toFixed(1)},${(y(v) + off).toFixed(1)}`);
      prev = v;
    }
    if (prev !== null) pts.push(`${x(now).toFixed(1)},${(y(prev) + off).toFixed(1)}`);
    svg.append(svgEl("polyline", {
      points: pts.join(" "), fill: "none", stroke: colorOf(id), "stroke-width": "2",
      "data-rollout": id, "vector-effect": "non-scaling-stroke",
    }));
  });
  $("#timeline-legend").replaceChildren(...ids.map((id) => {
    const last = state.versions[id][state.versions[id].length - 1];
    return el("span", { style: `color:${colorOf(id)}`, "data-rollout": id, text: `${id}: v${last[1]}` });
  }));
}

// -- events ----------------------------------------------------------------------------------

function describe(ev) {
  const d = ev.data || {};
  switch (ev.kind) {
    case "repack": return `#${d.id} ${d.reason}: ${(d.moves || []).length} moves, ${d.moved} moved, ${d.overhead_s}s`;
    case "publish": return `version ${d.version}`;
    case "pull": return `${d.rollout}: v${d.previous} → v${d.version}`;
    case "failure": return `${d.what || ""} ${d.member || ""} ${d.reason || d.error || ""}`;
    case "membership": return `${d.member} (${d.member_role}) ${d.event}`;
    case "policy": return `by ${d.by}: ${JSON.stringify(d.changed || {})}`;
    case "drain": case "resume": return `${d.rollout} ${d.reason || ""}`;
    default: return JSON.stringify(d);
  }
}

function onEvent(ev) {
  if (ev.seq <= state.lastSeq) return;
  state.lastSeq = ev.seq;
  const list = $("#events");
  const time = new Date(ev.at * 1000).toLocaleTimeString();
  list.prepend(el("li", { "data-seq": String(ev.seq), "data-kind": ev.kind },
    el("span", { class: "dim", text: `${time} ` }),
    el("span", { class: "kind", text: ev.kind }),
    el("span", { text: describe(ev) })));
  while (list.children.length > MAX_EVENTS) list.lastElementChild.remove();
  const d = ev.data || {};
  if (ev.kind === "pull" && d.rollout) {
    const series = (state.versions[d.rollout] = state.versions[d.rollout] || []);
    series.push([ev.at, d.version]);
    series.sort((a, b) => a[0] - b[0]);
  } else if (ev.kind === "publish" && d.version != null) {
    state.publishes.push([ev.at, d.version]);
  } else if (ev.kind === "repack") {
    addRepack(ev);
  }
}

function addRepack(ev) {
  const d = ev.data || {};
  const body = $("#repacks tbody");
  const row = el("tr", { "data-repack": String(d.id ?? ev.seq), "data-seq": String(ev.seq) });
  const cells = [
    d.id, new Date(ev.at * 1000).toLocaleTimeString(), d.reason,
    (d.moves || []).map((m) => `${m.source}→${m.destination}`).join(", ") || "–",
    d.moved, (d.released || []).join(", ") || "–",
    d.overhead_s != null ? `${(d.overhead_s * 1000).toFixed(0)} ms` : "–", (d.modes || []).join(","),
  ];
  const names = ["id", "time", "reason", "moves", "moved", "released", "overhead", "mode"];
  cells.forEach((c, i) => row.append(el("td", { "data-field": names[i], text: String(c ?? "–") })));
  body.prepend(row);
  while (body.children.length > 50) body.lastElementChild.remove();
}

function connectEvents() {
  if (state.source) state.source.close();
  // EventSource resends Last-Event-ID itself when it reconnects; since= covers a fresh start.
  const url = `/v1/events?since=${state.lastSeq}&token=${encodeURIComponent(state.token)}`;
  const source = new EventSource(url);
  state.source = source;
  const handle = (msg) => {
    try { onEvent(JSON.parse(msg.data)); } catch (err) { console.error(err); }
  };
  for (const kind of KINDS) source.addEventListener(kind, handle);
  source.onmessage = handle;
  source.onopen = () => {
    $("#sse-state").dataset.state = "open";
    $("#sse-state").textContent = "events: live";
  };
  source.onerror = () => {
    $("#sse-state").dataset.state = "error";
    $("#sse-state").textContent = "events: reconnecting";
  };
}

// -- lifecycle -------------------------------------------------------------------------------

function stop() {
  if (state.timer) clearInterval(state.timer);
  state.timer = null;
  if (state.source) state.source.close();
  state.source = null;
}

function start() {
  stop();
  poll();
  state.timer = setInterval(poll, POLL_MS);
  connectEvents();
}

initToken();
if (state.token) start();
else askToken("");
