// Laminar dashboard: plain JS, no build step, no external assets (the cluster may be offline).
// Data: GET /v1/status every second and GET /v1/learning every two (bearer token; the learning
// curves incrementally, ?since= the newest version held), and the /v1/events SSE stream (?token=,
// because EventSource cannot set headers). Stable ids / data-* attributes are for tests.
"use strict";

const KINDS = ["repack", "publish", "pull", "failure", "membership", "policy", "drain", "resume"];
const POLL_MS = 1000;
const WINDOW_S = 300; // charts show the last five minutes
const MAX_EVENTS = 200;
const LEARN_POLL_MS = 2000;
const MAX_LEARN_POINTS = 5000; // versions kept here: a long run's oldest drop off the curves
const LEARN_LIMIT = 2000;      // the API's most per answer
const LAG_SAMPLES = 6;         // samples of each rollout's lag per bin of the timeline
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
  learn: {
    since: 0,          // newest version held: the next poll asks for what came after it
    versions: new Map(), // version -> VersionPoint
    evals: new Map(),    // "version@time" -> EvalPoint
    trainer: null,
    busy: false,
    timer: null,
    x: "version",      // the learning charts' x axis: "version" or "time"
  },
  repacks: 0,          // repack events since the page opened
  empty: { n: 0, id: null, at: 0, errors: 0, lastError: "" }, // of those, the ones that moved nothing
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

// The viewBox follows the SVG's size on the page, so one unit is one pixel: text and dots keep
// their shape however wide the window is.
function fit(svg) {
  const box = svg.getBoundingClientRect();
  const W = Math.max(200, Math.round(box.width) || 600);
  const H = Math.max(60, Math.round(box.height) || 160);
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  return { W, H };
}

function ticks(lo, hi, n) {
  const span = hi - lo;
  if (!(span > 0)) return [lo];
  const raw = span / n, mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((x) => x >= raw) || raw;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) {
    out.push(Math.abs(v) < step * 1e-6 ? 0 : Number(v.toPrecision(12)));
  }
  return out;
}

function fmt(v) {
  const a = Math.abs(v);
  if (a >= 1e6) return `${(v / 1e6).toFixed(1)}M`;
  if (a >= 1e4) return `${(v / 1e3).toFixed(0)}k`;
  if (a >= 1e3) return `${(v / 1e3).toFixed(1)}k`;
  if (Number.isInteger(v) || a >= 10) return String(Math.round(v));
  return v.toFixed(a >= 1 ? 1 : 2);
}

function trailingMean(pts, w) {
  const out = [];
  let sum = 0;
  pts.forEach(([x, y], i) => {
    sum += y;
    if (i >= w) sum -= pts[i - w][1];
    out.push([x, sum / Math.min(i + 1, w)]);
  });
  return out;
}

// A line chart of series [{name, pts: [[x, y], ...], color, width, opacity, dots, titles}],
// drawn in order, on grid lines with labelled ticks. opts: xfmt, yfmt, minSpan (the least y range
// shown, so noise on a flat curve is not blown up to the chart's height), floor / ceil (bounds
// the y range never passes), zero (the y range starts at 0), empty (what to say with no points).
// The SVG's data-points is the first series' point count.
function chart(svg, series, opts = {}) {
  const { W, H } = fit(svg);
  const all = series.flatMap((s) => s.pts);
  svg.dataset.points = String(series.length ? series[0].pts.length : 0);
  if (!all.length) {
    const t = svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" });
    t.textContent = opts.empty || "no data yet";
    svg.append(t);
    return;
  }
  const L = 46, R = 12, T = 8, B = 18;
  let x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  let y0 = Math.min(...all.map((p) => p[1])), y1 = Math.max(...all.map((p) => p[1]));
  if (opts.zero) y0 = Math.min(0, y0);
  const need = opts.minSpan ?? 1e-9;
  if (y1 - y0 < need) { const mid = (y0 + y1) / 2; y0 = mid - need / 2; y1 = mid + need / 2; }
  const pad = (y1 - y0) * 0.06;
  y1 += pad;
  if (!opts.zero) y0 -= pad;
  if (opts.floor != null && y0 < opts.floor) { y1 += opts.floor - y0; y0 = opts.floor; }
  if (opts.ceil != null && y1 > opts.ceil) { y0 = Math.max(opts.floor ?? -Infinity, y0 - (y1 - opts.ceil)); y1 = opts.ceil; }
  const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const yfmt = opts.yfmt || fmt, xfmt = opts.xfmt || fmt;
  for (const v of ticks(y0, y1, 4)) {
    svg.append(svgEl("line", { x1: L, x2: W - R, y1: Y(v), y2: Y(v), class: "grid" }));
    const t = svgEl("text", { x: L - 4, y: Y(v) + 3, "text-anchor": "end" });
    t.textContent = yfmt(v);
    svg.append(t);
  }
  for (const v of ticks(x0, x1, Math.max(2, Math.floor((W - L - R) / 90)))) {
    const t = svgEl("text", { x: X(v), y: H - 4, "text-anchor": "middle" });
    t.textContent = xfmt(v);
    svg.append(t);
  }
  for (const s of series) {
    if (!s.pts.length) continue;
    const common = { "data-series": s.name, opacity: String(s.opacity ?? 1) };
    if (s.pts.length > 1) {
      svg.append(svgEl("polyline", Object.assign({
        points: s.pts.map(([x, y]) => `${X(x).toFixed(1)},${Y(y).toFixed(1)}`).join(" "),
        fill: "none", stroke: s.color, "stroke-width": String(s.width ?? 1.5),
        "stroke-linejoin": "round", "data-count": String(s.pts.length),
      }, common)));
    }
    if (s.dots || s.pts.length === 1) {
      s.pts.forEach(([x, y], i) => {
        const dot = svgEl("circle", Object.assign({
          cx: X(x).toFixed(1), cy: Y(y).toFixed(1), r: "3", fill: s.color,
          "data-x": String(x), "data-y": String(y),
        }, common));
        const title = svgEl("title");
        title.textContent = s.titles ? s.titles[i] : `${xfmt(x)}: ${yfmt(y)}`;
        dot.append(title);
        svg.append(dot);
      });
    }
  }
}

function renderThroughput() {
  const now = state.now;
  state.throughput = state.throughput.filter(([t]) => t >= now - WINDOW_S);
  const pts = state.throughput.map(([t, v]) => [(t - now) / 60, v]);
  chart($("#throughput-chart"), [{ name: "throughput", pts, color: "#3fb950" }], {
    zero: true, minSpan: 1, xfmt: (v) => (v === 0 ? "now" : `${fmt(v)} min`),
    empty: "waiting for two status polls",
  });
}

// The version a series of [t, version] (sorted by t) held at time t; null before its first point.
function versionAt(series, t) {
  let lo = 0, hi = series.length - 1, found = null;
  while (lo <= hi) {
    const mid = (lo + hi) >> 1;
    if (series[mid][0] <= t) { found = series[mid][1]; lo = mid + 1; } else hi = mid - 1;
  }
  return found;
}

// One lane per rollout: how many versions it is behind the newest published one, averaged over
// bins a few seconds wide. Drawn as the version itself, a rollout's line would step at every
// publish (several a second in a fast run): the lag stays near 0 while a rollout keeps up and
// rises where it falls behind, which is what a glance should tell.
function renderTimeline() {
  const svg = $("#timeline");
  const ids = Object.keys(state.versions).sort();
  svg.style.height = `${Math.max(90, 30 * ids.length + 26)}px`;
  const { W, H } = fit(svg);
  const now = state.now, t0 = now - WINDOW_S;
  state.publishes.sort((a, b) => a[0] - b[0]);
  const before = state.publishes.filter(([t]) => t < t0).length;
  if (before > 1) state.publishes.splice(0, before - 1); // the newest before the window stays
  const pubs = [];
  let newest = -Infinity;
  for (const [t, v] of state.publishes) { newest = Math.max(newest, v); pubs.push([t, newest]); }
  if (!ids.length) { $("#timeline-legend").replaceChildren(); return; }
  const L = 150, R = 12, T = 6, B = 16;
  const bins = Math.max(10, Math.min(150, Math.floor((W - L - R) / 5)));
  const binS = WINDOW_S / bins;
  const lagAt = (series, t) => {
    const v = versionAt(series, t);
    if (v == null) return null;
    return Math.max(v, versionAt(pubs, t) ?? v) - v;
  };
  const lags = {};
  let top = 2;
  for (const id of ids) {
    lags[id] = [];
    for (let b = 0; b < bins; b++) {
      let sum = 0, n = 0;
      for (let k = 0; k < LAG_SAMPLES; k++) {
        const lag = lagAt(state.versions[id], t0 + (b + (k + 0.5) / LAG_SAMPLES) * binS);
        if (lag != null && t0 + b * binS <= now) { sum += lag; n++; }
      }
      lags[id].push(n ? sum / n : null);
      if (n) top = Math.max(top, Math.ceil(sum / n));
    }
  }
  const X = (t) => L + ((t - t0) / WINDOW_S) * (W - L - R);
  for (let m = 0; m <= WINDOW_S / 60; m++) {
    const x = X(now - m * 60);
    svg.append(svgEl("line", { x1: x, x2: x, y1: T, y2: H - B, class: "grid" }));
    const t = svgEl("text", { x, y: H - 4, "text-anchor": "middle" });
    t.textContent = m === 0 ? "now" : `-${m} min`;
    svg.append(t);
  }
  const laneH = (H - T - B) / ids.length;
  const legend = [];
  ids.forEach((id, i) => {
    const base = T + (i + 1) * laneH - 4, scale = (laneH - 10) / top;
    svg.append(svgEl("line", { x1: L, x2: W - R, y1: base, y2: base, class: "grid" }));
    const pts = [];
    lags[id].forEach((lag, b) => {
      if (lag != null) pts.push(`${X(t0 + (b + 0.5) * binS).toFixed(1)},${(base - lag * scale).toFixed(1)}`);
    });
    svg.append(svgEl("polyline", {
      points: pts.join(" "), fill: "none", stroke: colorOf(id), "stroke-width": "2",
      "stroke-linejoin": "round", "data-rollout": id,
    }));
    const series = state.versions[id];
    const version = series[series.length - 1][1];
    const lag = lagAt(series, now) ?? 0;
    const label = svgEl("text", { x: 4, y: base - laneH / 2 + 8, "data-rollout": id, "data-lag": String(lag) });
    label.style.fill = colorOf(id);
    label.textContent = `${id}  v${version} · lag ${lag}`;
    svg.append(label);
    legend.push(el("span", { style: `color:${colorOf(id)}`, "data-rollout": id, text: `${id}: v${version}` }));
  });
  const scale = svgEl("text", { x: W - R, y: T + 8, "text-anchor": "end" });
  scale.textContent = `lane: lag 0–${top}`;
  svg.append(scale);
  const shown = state.publishes.filter(([t]) => t >= t0);
  const every = shown.length > 1 ? (shown[shown.length - 1][0] - shown[0][0]) / (shown.length - 1) : null;
  legend.push(el("span", {
    "data-publishes": String(shown.length),
    text: isFinite(newest)
      ? `newest published: v${newest}${every != null ? `, one publish every ${every.toFixed(1)} s` : ""}`
      : "no publish seen yet",
  }));
  $("#timeline-legend").replaceChildren(...legend);
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

const clock = (at) => new Date(at * 1000).toLocaleTimeString();

function movedNothing(d) {
  return !d.moved;
}

// Routine events come in runs: publishes and pulls (several a second in a fast run), repacks
// that moved nothing, and the migration errors of those (a source that had already moved on to
// a newer version). A run shares one line of the list that counts them, so the list keeps room
// for what an operator must see.
function routine(ev, run) {
  const d = ev.data || {};
  if (ev.kind === "publish" || ev.kind === "pull") return true;
  if (ev.kind === "repack") return movedNothing(d);
  return ev.kind === "failure" && d.what === "migration" && run != null && run.empty > 0 &&
    (run.lastKind === "repack" || run.lastKind === "failure");
}

function describeRun(r) {
  const span = r.last > r.first ? `${clock(r.first)}–${clock(r.last)}` : clock(r.first);
  const parts = [];
  if (r.publishes || r.pulls) {
    const range = !isFinite(r.vmax) ? "" : r.vmin === r.vmax ? `v${r.vmax}: ` : `v${r.vmin} → v${r.vmax}: `;
    parts.push(`${range}${r.publishes} ${r.publishes === 1 ? "publish" : "publishes"}, ` +
      `${r.pulls} ${r.pulls === 1 ? "pull" : "pulls"}`);
  }
  if (r.empty) {
    const ids = r.ids.length > 1 ? `#${r.ids[0]}–#${r.ids[r.ids.length - 1]}` : `#${r.ids[0]}`;
    let text = `${r.empty} ${r.empty === 1 ? "repack" : "repacks"} moved nothing (${ids})`;
    if (r.errors) text += `, ${r.errors} migration ${r.errors === 1 ? "error" : "errors"} (last: ${r.lastError})`;
    parts.push(text);
  }
  const kind = r.publishes ? "publish" : r.pulls ? "pull" : "repack";
  return [span, kind, parts.join("; ")];
}

function onEvent(ev) {
  if (ev.seq <= state.lastSeq) return;
  state.lastSeq = ev.seq;
  const list = $("#events");
  const d0 = ev.data || {};
  let li = list.firstElementChild;
  const open = li && li._run ? li._run : null;
  if (routine(ev, open)) {
    if (!open) {
      li = el("li", { class: "run", "data-run": "routine" });
      li._run = { n: 0, first: ev.at, last: ev.at, publishes: 0, pulls: 0, vmin: Infinity,
                  vmax: -Infinity, empty: 0, ids: [], errors: 0, lastError: "", lastKind: "" };
      list.prepend(li);
    }
    const r = li._run;
    r.n += 1; r.last = ev.at; r.lastKind = ev.kind;
    if (ev.kind === "repack") { r.empty += 1; r.ids.push(d0.id ?? ev.seq); }
    else if (ev.kind === "failure") { r.errors += 1; r.lastError = d0.error || d0.reason || ""; }
    else {
      if (ev.kind === "publish") r.publishes += 1; else r.pulls += 1;
      if (d0.version != null) { r.vmin = Math.min(r.vmin, d0.version); r.vmax = Math.max(r.vmax, d0.version); }
    }
    const [span, kind, text] = describeRun(r);
    Object.assign(li.dataset, { seq: String(ev.seq), kind, count: String(r.n),
      emptyRepacks: String(r.empty), publishes: String(r.publishes), pulls: String(r.pulls) });
    li.replaceChildren(el("span", { class: "dim", text: `${span} ` }),
      el("span", { class: "kind", text: kind }), el("span", { text }));
  } else {
    list.prepend(el("li", { "data-seq": String(ev.seq), "data-kind": ev.kind },
      el("span", { class: "dim", text: `${clock(ev.at)} ` }),
      el("span", { class: "kind", text: ev.kind }),
      el("span", { text: describe(ev) })));
  }
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

// Only repacks that moved something get a row; the ones that moved nothing are counted above the
// table (a busy cluster plans many moves whose trajectories finish or whose source moves on to
// a newer version before the migration starts).
function addRepack(ev) {
  const d = ev.data || {};
  const body = $("#repacks tbody");
  state.repacks += 1;
  if (movedNothing(d)) {
    const e = state.empty;
    e.n += 1; e.id = d.id ?? ev.seq; e.at = ev.at;
    if ((d.errors || []).length) { e.errors += 1; e.lastError = d.errors[d.errors.length - 1]; }
  } else {
    addRepackRow(body, ev, d);
    while (body.children.length > 50) body.lastElementChild.remove();
  }
  const e = state.empty, summary = $("#repack-summary");
  let text = `${state.repacks} ${state.repacks === 1 ? "repack" : "repacks"} since this page opened`;
  if (e.n) {
    text += `; ${e.n} moved nothing and ${e.n === 1 ? "is" : "are"} not listed (the latest #${e.id} at ${clock(e.at)}`;
    text += e.errors ? `; ${e.errors} with a migration error, the last: ${e.lastError})` : ")";
  }
  summary.textContent = text;
  summary.dataset.repacks = String(state.repacks);
  summary.dataset.empty = String(e.n);
}

function addRepackRow(body, ev, d) {
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

// -- learning --------------------------------------------------------------------------------

async function pollLearning() {
  const L = state.learn;
  if (L.busy) return; // an answer still on its way: the next tick asks again
  L.busy = true;
  try {
    onLearning(await api(`/v1/learning?since=${L.since}&limit=${LEARN_LIMIT}`));
  } catch (err) {
    $("#learning-note").textContent = `learning: ${err.message}`;
  } finally {
    L.busy = false;
  }
}

function onLearning(b) {
  const L = state.learn;
  // a trainer numbering below what is held here (a restart that kept no checkpoint): next time,
  // ask for everything it kept; its versions replace the ones of the same number
  if (b.version != null && b.version < L.since) L.since = 0;
  for (const v of b.versions) L.versions.set(v.version, v);
  for (const e of b.evals) L.evals.set(`${e.version}@${e.time}`, e);
  if (b.versions.length) L.since = Math.max(L.since, b.versions[b.versions.length - 1].version);
  if (L.versions.size > MAX_LEARN_POINTS) {
    const drop = [...L.versions.keys()].sort((x, y) => x - y).slice(0, L.versions.size - MAX_LEARN_POINTS);
    for (const k of drop) L.versions.delete(k);
  }
  L.trainer = b.trainer;
  const errors = Object.values(b.errors || {});
  $("#learning-note").textContent = b.trainer
    ? `(${b.trainer}, v${b.version ?? "–"}${errors.length ? `: ${errors.join("; ")}` : ""})`
    : "(no trainer in the cluster)";
  renderLearning();
}

function renderLearning() {
  const L = state.learn;
  const vs = [...L.versions.values()].sort((a, b) => a.version - b.version);
  const evs = [...L.evals.values()].sort((a, b) => a.time - b.time || a.version - b.version);
  const times = [...vs.map((v) => v.time), ...evs.map((e) => e.time)];
  const t0 = times.length ? Math.min(...times) : 0;
  const byTime = L.x === "time";
  const X = (p) => (byTime ? (p.time - t0) / 60 : p.version);
  const xfmt = byTime ? (v) => `${fmt(v)} min` : (v) => `v${Math.round(v)}`;
  const w = Math.min(50, Math.max(3, Math.ceil(vs.length / 40))); // the curves' smoothing
  const none = L.trainer ? "no trained version yet" : "no trainer in the cluster";

  const rewards = vs.filter((v) => v.reward != null).map((v) => [X(v), v.reward]);
  const rewardMean = trailingMean(rewards, w);
  chart($("#reward-chart"), [
    { name: "reward", pts: rewards, color: "#58a6ff", width: 1, opacity: 0.35 },
    { name: "reward-mean", pts: rewardMean, color: "#58a6ff", width: 2.5 },
  ], { xfmt, yfmt: (v) => v.toFixed(2), minSpan: 0.1, empty: none });
  $("#reward-caption").textContent = rewards.length
    ? `(the policy's mean per version, faint; line: mean of ${w} versions)` : "";
  $("#reward-now").textContent = rewardMean.length ? rewardMean[rewardMean.length - 1][1].toFixed(3) : "–";

  const acc = evs.map((e) => [X(e), e.accuracy]);
  const titles = evs.map((e) => {
    const buckets = Object.entries(e.buckets || {}).map(([k, a]) => `${k}: ${a.toFixed(2)}`).join(", ");
    return `v${e.version}: ${e.accuracy.toFixed(3)}${e.n ? ` of ${e.n}` : ""}${buckets ? ` (${buckets})` : ""}`;
  });
  chart($("#accuracy-chart"), [
    { name: "accuracy", pts: acc, color: "#3fb950", width: 2.5, dots: true, titles },
  ], { xfmt, yfmt: (v) => v.toFixed(2), minSpan: 0.1, floor: 0, ceil: 1,
       empty: L.trainer ? "no evaluation yet (the trainer's eval section schedules them)" : none });
  if (acc.length) {
    const first = acc[0][1], last = acc[acc.length - 1][1], gain = (last - first) * 100;
    const n = evs[evs.length - 1].n;
    $("#accuracy-caption").textContent = acc.length > 1
      ? `(${first.toFixed(3)} → ${last.toFixed(3)}: ${gain >= 0 ? "+" : ""}${gain.toFixed(1)} points over ${acc.length} evaluations${n ? ` of ${n} problems` : ""})`
      : `(${last.toFixed(3)}${n ? ` on ${n} problems` : ""})`;
    $("#accuracy-now").textContent = acc.length > 1
      ? `${last.toFixed(3)} (${gain >= 0 ? "+" : ""}${gain.toFixed(1)} pts)` : last.toFixed(3);
  } else {
    $("#accuracy-caption").textContent = "";
    $("#accuracy-now").textContent = "–";
  }

  const rates = vs.filter((v) => v.tokens_per_s != null).map((v) => [X(v), v.tokens_per_s]);
  chart($("#trained-chart"), [
    { name: "tokens-per-s", pts: rates, color: "#d29922", width: 1, opacity: 0.35 },
    { name: "tokens-per-s-mean", pts: trailingMean(rates, w), color: "#d29922", width: 2.5 },
  ], { xfmt, zero: true, minSpan: 1, empty: none });
  $("#trained-caption").textContent = rates.length ? `(per version, faint; line: mean of ${w})` : "";

  chart($("#staleness-chart"), [
    { name: "staleness-mean", pts: vs.map((v) => [X(v), v.staleness_mean]), color: "#a371f7", width: 2 },
    { name: "staleness-max", pts: vs.map((v) => [X(v), v.staleness_max]), color: "#a371f7", width: 1,
      opacity: 0.45, dots: vs.length <= 300 },
  ], { xfmt, zero: true, minSpan: 2, empty: none });
}

function initLearning() {
  for (const button of document.querySelectorAll(".axis-switch button")) {
    button.addEventListener("click", () => {
      state.learn.x = button.dataset.x;
      for (const b of document.querySelectorAll(".axis-switch button")) b.classList.toggle("on", b === button);
      renderLearning();
    });
  }
}

// -- lifecycle -------------------------------------------------------------------------------

function stop() {
  if (state.timer) clearInterval(state.timer);
  state.timer = null;
  if (state.learn.timer) clearInterval(state.learn.timer);
  state.learn.timer = null;
  if (state.source) state.source.close();
  state.source = null;
}

function start() {
  stop();
  poll();
  state.timer = setInterval(poll, POLL_MS);
  pollLearning();
  state.learn.timer = setInterval(pollLearning, LEARN_POLL_MS);
  connectEvents();
}

initToken();
initLearning();
if (state.token) start();
else askToken("");
