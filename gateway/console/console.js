// Sluice operator console: a single page with no framework and no build step, compiled into
// the gateway and served at /console/. It reads only the public HTTP API (the REST routes and
// /metrics), so it shows nothing the same credentials could not get with curl.
//
// What shapes the code:
// - The gateway sends a strict Content-Security-Policy (script, style and connections from
//   'self' only, images also from data: and blob:): no inline script or style attribute, no
//   eval, no external resource. Every element is built with h() below, never from HTML text,
//   so no gateway data (topic names, record values) can inject markup.
// - An idle gateway must not notice the console: only the page shown polls, it stops when the
//   operator leaves it, nothing polls while the tab is hidden, and every request of a page is
//   aborted when the page changes.
// - Credentials travel only in the Authorization header. Browsers cannot set headers on
//   EventSource, WebSocket or <img src>, so streams and images are read with fetch().
"use strict";

const AUTH_KEY = "sluice.auth"; // sessionStorage: "Basic …" or "Bearer …"
const WINDOW_MS = 10 * 60 * 1000; // history kept for sparklines and p99
const POLL_MS = 5000;
const CAMERA_POLL_MS = 2000;
const TAIL_LINES = 200;
const RECORDS_PER_PARTITION = 20;
const FETCH_CONCURRENCY = 6; // a browser's connections per host over HTTP/1.1
const DASH = "\u2013";

// ---- DOM and formatting helpers ------------------------------------------------------------

const $ = (sel, root = document) => root.querySelector(sel);

// h("td", {class: "num", data: {topic: "t"}, text: "3"}, child, …): an element, safely.
function h(tag, props, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k === "data") Object.assign(e.dataset, v);
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat(Infinity)) {
    if (c !== null && c !== undefined && c !== false) e.append(c instanceof Node ? c : String(c));
  }
  return e;
}

const enc = encodeURIComponent;
const intFormat = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
const isNum = (n) => typeof n === "number" && Number.isFinite(n);

function fmtInt(n) {
  return isNum(n) ? intFormat.format(n) : DASH;
}

function fmtBytes(n) {
  if (!isNum(n)) return DASH;
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let v = Math.abs(n);
  let i = 0;
  for (; v >= 1024 && i < units.length - 1; i++) v /= 1024;
  const digits = i === 0 ? 0 : v < 10 ? 2 : v < 100 ? 1 : 0;
  return (n < 0 ? "-" : "") + v.toFixed(digits) + " " + units[i];
}

function fmtRate(n) {
  if (!isNum(n)) return DASH;
  return (n === 0 ? "0" : n < 10 ? n.toFixed(1) : intFormat.format(n)) + "/s";
}

const fmtByteRate = (n) => (isNum(n) ? fmtBytes(n) + "/s" : DASH);

function fmtMs(seconds) {
  if (!isNum(seconds)) return DASH;
  const ms = seconds * 1000;
  return ms.toFixed(ms < 10 ? 2 : ms < 100 ? 1 : 0) + " ms";
}

function fmtDuration(ms) {
  if (!isNum(ms)) return DASH;
  for (const [unit, size] of [["d", 86400000], ["h", 3600000], ["min", 60000], ["s", 1000]]) {
    if (ms >= size) return +(ms / size).toFixed(1) + " " + unit;
  }
  return ms + " ms";
}

function fmtTime(ms) {
  if (!isNum(ms)) return DASH;
  const d = new Date(ms);
  const pad = (x, n = 2) => String(x).padStart(n, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
    `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}.${pad(d.getMilliseconds(), 3)}`;
}

// A policy value in words: the policy's -1 means "no limit", -2 "follow the whole-log value".
function fmtPolicy(key, v) {
  if (typeof v === "boolean") return v ? "on" : "off";
  if (v === -1 && /_(ms|bytes)$/.test(key)) return "unlimited";
  if (v === -2 && key.startsWith("local_retention")) return "as " + key.replace("local_", "").replace(/_/g, " ");
  if (key.endsWith("_ms")) return fmtDuration(v);
  if (key.endsWith("_bytes")) return fmtBytes(v);
  return String(v);
}

function b64bytes(s) {
  const bin = atob(s);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

const strictUtf8 = new TextDecoder("utf-8", { fatal: true });

// The bytes as text when they are UTF-8 without control characters (tab and newlines aside);
// null otherwise, so that binary values are shown as hex instead of mojibake.
function asText(bytes) {
  let text;
  try {
    text = strictUtf8.decode(bytes);
  } catch {
    return null;
  }
  return /[\u0000-\u0008\u000b\u000c\u000e-\u001f\u007f]/.test(text) ? null : text;
}

function hexDump(bytes) {
  const lines = [];
  for (let i = 0; i < bytes.length; i += 16) {
    const row = Array.from(bytes.subarray(i, i + 16));
    const hex = row.map((b) => b.toString(16).padStart(2, "0")).join(" ");
    const ascii = row.map((b) => (b >= 0x20 && b < 0x7f ? String.fromCharCode(b) : ".")).join("");
    lines.push(`${i.toString(16).padStart(8, "0")}  ${hex.padEnd(47)}  ${ascii}`);
  }
  return lines.join("\n");
}

// The image type of a value: its content-type header, else its magic bytes.
function imageType(bytes, contentType) {
  if (contentType && /^image\/[\w.+-]+$/i.test(contentType)) return contentType.toLowerCase();
  const starts = (...sig) => sig.every((b, i) => bytes[i] === b);
  if (starts(0xff, 0xd8, 0xff)) return "image/jpeg";
  if (starts(0x89, 0x50, 0x4e, 0x47)) return "image/png";
  if (starts(0x47, 0x49, 0x46, 0x38)) return "image/gif";
  if (starts(0x52, 0x49, 0x46, 0x46) && bytes[8] === 0x57 && bytes[9] === 0x45) return "image/webp";
  return null;
}

// Runs fn over items with at most `limit` in flight, results in order.
async function mapLimit(items, limit, fn) {
  const out = new Array(items.length);
  let next = 0;
  const worker = async () => {
    while (next < items.length) {
      const i = next++;
      out[i] = await fn(items[i], i);
    }
  };
  await Promise.all(Array.from({ length: Math.min(limit, items.length) }, worker));
  return out;
}

// ---- status line and notices ----------------------------------------------------------------

function setStatus(error) {
  if (!error) $("#status-time").textContent = "updated " + new Date().toLocaleTimeString();
  $("#status-error").textContent = error || "";
}

function notice(section, kind, text) {
  const box = $(".page-notice", section);
  box.className = "page-notice " + kind;
  box.textContent = text;
  box.hidden = !text;
}

// ---- API access and sign-in -----------------------------------------------------------------

class HttpError extends Error {
  constructor(status, path, problem) {
    const why = (problem && (problem.detail || problem.title)) || "HTTP " + status;
    super(`${path}: ${why}`);
    this.status = status;
    this.path = path;
    this.problem = problem;
  }
}

async function httpError(response, path) {
  let problem = null;
  try {
    problem = await response.json(); // problem+json (RFC 9457) on every error route
  } catch {
    // an empty or non-JSON body: the status says enough
  }
  return new HttpError(response.status, path, problem);
}

const isAbort = (e) => e && e.name === "AbortError";

let loginWait = null; // the sign-in in progress, shared by every request that met a 401
let loginDone = null;

// Every request goes through here: it adds the stored credentials, and on a 401 asks for new
// ones (once, however many requests were refused together) and tries again. (The gateway
// leaves `WWW-Authenticate: Basic` out of a 401 to fetch(), so no browser dialog comes first.)
async function api(path, opts = {}) {
  for (;;) {
    const auth = sessionStorage.getItem(AUTH_KEY);
    const headers = new Headers(opts.headers);
    if (auth) headers.set("Authorization", auth);
    const r = await fetch(path, { ...opts, headers, cache: "no-store" });
    if (r.status !== 401) return r;
    r.body?.cancel().catch(() => {});
    const now = sessionStorage.getItem(AUTH_KEY);
    if (now && now !== auth) continue; // someone signed in meanwhile: use that
    if (now) sessionStorage.removeItem(AUTH_KEY); // refused: expired token, changed password
    await signIn(Boolean(auth));
    if (opts.signal?.aborted) throw new DOMException("request aborted", "AbortError");
  }
}

async function getJson(path, signal) {
  const r = await api(path, { signal });
  if (!r.ok) throw await httpError(r, path);
  return r.json();
}

function signIn(refused) {
  if (!loginWait) {
    loginWait = new Promise((resolve) => { loginDone = resolve; });
    document.body.classList.add("locked");
    $("#login-overlay").hidden = false;
    $("#login-error").textContent = refused ? "Your credentials were refused; sign in again." : "";
    $("#login-user").focus();
  }
  return loginWait;
}

function utf8Base64(text) {
  let bin = "";
  for (const b of new TextEncoder().encode(text)) bin += String.fromCharCode(b);
  return btoa(bin);
}

async function submitLogin(event) {
  event.preventDefault();
  const user = $("#login-user").value;
  const password = $("#login-password").value;
  const token = $("#login-token").value.trim();
  const error = $("#login-error");
  if (!token && !user) {
    error.textContent = "Enter a user name and password, or an API token.";
    return;
  }
  const header = token ? "Bearer " + token : "Basic " + utf8Base64(user + ":" + password);
  $("#login-submit").disabled = true;
  error.textContent = "";
  try {
    // Checked on a route every principal may read, so a refusal means bad credentials.
    const r = await fetch("/topics", { headers: { Authorization: header }, cache: "no-store" });
    r.body?.cancel().catch(() => {});
    if (r.status === 401) {
      error.textContent = "Sign-in refused: wrong user name, password or token.";
      return;
    }
    sessionStorage.setItem(AUTH_KEY, header);
    $("#login-password").value = "";
    $("#login-token").value = "";
    $("#login-overlay").hidden = true;
    document.body.classList.remove("locked");
    $("#sign-out").hidden = false;
    const done = loginDone;
    loginWait = loginDone = null;
    if (done) done();
  } catch (e) {
    error.textContent = "Cannot reach the gateway: " + e.message;
  } finally {
    $("#login-submit").disabled = false;
  }
}

// ---- polling ----------------------------------------------------------------------------------

// Runs fn now and then `ms` after each run ends (never two at once), until the page is left.
// Nothing runs while the tab is hidden; showing it again runs fn at once. fn may return a
// number of milliseconds to wait for the next run instead of `ms`.
function poll(ctx, fn, ms) {
  let timer = 0;
  let running = false;
  async function tick() {
    timer = 0;
    if (ctx.signal.aborted || document.hidden || running) return;
    running = true;
    let wait = ms;
    try {
      wait = (await fn()) || ms;
      ctx.ok();
    } catch (e) {
      ctx.fail(e);
    } finally {
      running = false;
    }
    if (!ctx.signal.aborted && !document.hidden) timer = setTimeout(tick, wait);
  }
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && !timer && !running) tick();
  }, { signal: ctx.signal });
  ctx.onLeave(() => clearTimeout(timer));
  tick();
}

// ---- metrics ----------------------------------------------------------------------------------

// Prometheus text format: `name{label="value",…} value`; comments (# HELP, # TYPE) skipped.
// Returns Map name -> [{labels, value}].
function parseMetrics(text) {
  const out = new Map();
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = /^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    for (const l of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) {
      labels[l[1]] = l[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    }
    const value = m[3] === "+Inf" ? Infinity : m[3] === "-Inf" ? -Infinity : Number(m[3]);
    if (!out.has(m[1])) out.set(m[1], []);
    out.get(m[1]).push({ labels, value });
  }
  return out;
}

const labelsMatch = (labels, where) => Object.entries(where || {}).every(([k, v]) => labels[k] === v);

// The sum of a metric's series whose labels match `where`; null when there is none, so that a
// metric this gateway does not export shows as a dash rather than as 0.
function total(metrics, name, where) {
  let sum = null;
  for (const s of metrics.get(name) || []) {
    if (labelsMatch(s.labels, where) && isNum(s.value)) sum = (sum ?? 0) + s.value;
  }
  return sum;
}

function totalOf(metrics, names) {
  const parts = names.map((n) => total(metrics, n)).filter((v) => v !== null);
  return parts.length ? parts.reduce((a, b) => a + b, 0) : null;
}

async function fetchMetrics(signal) {
  const r = await api("/metrics", { signal });
  if (!r.ok) throw await httpError(r, "/metrics");
  return parseMetrics(await r.text());
}

// Counter rates from the deltas between scrapes, with each series' history over the window.
// Kept across page visits, so coming back to a page shows what was measured before.
class Rates {
  constructor() {
    this.last = new Map();
    this.hist = new Map();
  }

  // Records counter `key` at time t; its rate per second since the previous sample, or null
  // (first sample, metric absent, or the counter went down: the gateway restarted).
  update(key, t, value) {
    const prev = this.last.get(key);
    if (value === null) {
      this.last.delete(key);
      return null;
    }
    this.last.set(key, { t, value });
    if (!prev || value < prev.value || t <= prev.t) return null;
    const rate = ((value - prev.value) * 1000) / (t - prev.t);
    this.push(key, t, rate);
    return rate;
  }

  push(key, t, v) {
    let a = this.hist.get(key);
    if (!a) this.hist.set(key, (a = []));
    a.push([t, v]);
    while (a.length && a[0][0] < t - WINDOW_MS) a.shift();
  }

  history(key) {
    return this.hist.get(key) || [];
  }
}

const SVG_NS = "http://www.w3.org/2000/svg";

// A tiny inline chart of [t, value] points: time on x (the span measured so far, at least a
// minute, at most the window), 0..max on y.
function sparkline(points, width = 110, height = 26) {
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("aria-hidden", "true");
  if (points.length < 2) return svg;
  const end = points[points.length - 1][0];
  const span = Math.min(WINDOW_MS, Math.max(60000, end - points[0][0]));
  const max = Math.max(...points.map((p) => p[1])) || 1;
  const x = (t) => (width * (1 - (end - t) / span)).toFixed(1);
  const y = (v) => (height - 1 - (Math.max(v, 0) / max) * (height - 3)).toFixed(1);
  const line = points.filter((p) => p[0] >= end - span).map((p) => `${x(p[0])},${y(p[1])}`);
  const area = document.createElementNS(SVG_NS, "polygon");
  area.setAttribute("class", "spark-area");
  area.setAttribute("points", `${line[0].split(",")[0]},${height} ${line.join(" ")} ${width},${height}`);
  const poly = document.createElementNS(SVG_NS, "polyline");
  poly.setAttribute("class", "spark-line");
  poly.setAttribute("points", line.join(" "));
  svg.append(area, poly);
  return svg;
}

// The q-quantile of a cumulative histogram [[le, count]] (sorted, +Inf last), interpolated
// within the bucket as Prometheus' histogram_quantile does; null without observations.
function histogramQuantile(q, buckets) {
  const count = buckets.length ? buckets[buckets.length - 1][1] : 0;
  if (!(count > 0)) return null;
  const rank = q * count;
  let lower = 0;
  let below = 0;
  for (const [le, n] of buckets) {
    if (n >= rank) {
      if (le === Infinity) return lower; // above the top bound: the bound is all we know
      return lower + (le - lower) * ((rank - below) / (n - below || 1));
    }
    lower = le;
    below = n;
  }
  return lower;
}

// ---- overview -------------------------------------------------------------------------------

const rates = new Rates();

// Per protocol, the counters summed into each column (docs/metrics.txt); none: no such flow.
const PROTOCOLS = [
  {
    id: "kafka", label: "Kafka",
    "ingest-records": ["sluice_kafka_produced_records_total"],
    "ingest-bytes": ["sluice_kafka_produced_bytes_total"],
    "delivery-records": ["sluice_kafka_fetched_records_total"],
    "delivery-bytes": ["sluice_kafka_fetched_bytes_total"],
    connections: (m) => fmtInt(total(m, "sluice_kafka_connections_open")),
  },
  {
    id: "mqtt", label: "MQTT",
    "ingest-records": ["sluice_mqtt_publishes_received_total"],
    "ingest-bytes": ["sluice_mqtt_received_bytes_total"],
    "delivery-records": ["sluice_mqtt_deliveries_total"],
    "delivery-bytes": ["sluice_mqtt_sent_bytes_total"],
    connections: (m) => fmtInt(total(m, "sluice_mqtt_connections_open")),
  },
  {
    id: "rest", label: "REST / HTTP",
    "ingest-records": ["sluice_rest_records_produced_total"],
    "ingest-bytes": ["sluice_rest_produced_bytes_total"],
    "delivery-records": ["sluice_rest_records_streamed_total", "sluice_rest_messages_delivered_total"],
    "delivery-bytes": ["sluice_rest_delivered_bytes_total"],
    connections: (m) => {
      const http = total(m, "sluice_listener_connections_open", { protocol: "http" }) ??
        total(m, "sluice_listener_connections_open", { listener: "http" });
      const ws = total(m, "sluice_rest_websocket_streams");
      const sse = total(m, "sluice_rest_sse_streams");
      return `${fmtInt(http)} HTTP · ${fmtInt(ws)} WS · ${fmtInt(sse)} SSE`;
    },
  },
  {
    id: "rtsp", label: "RTSP cameras",
    "ingest-records": ["sluice_camera_frames_total"],
    "ingest-bytes": ["sluice_camera_bytes_total"],
    "delivery-records": [],
    "delivery-bytes": [],
    connections: (m) => {
      const cams = (m.get("sluice_camera_up") || []).length;
      return cams ? `${fmtInt(total(m, "sluice_camera_up"))} of ${cams} playing` : DASH;
    },
  },
];
const RATE_COLUMNS = ["ingest-records", "ingest-bytes", "delivery-records", "delivery-bytes"];

function overview(ctx) {
  const rows = PROTOCOLS.map((p) => {
    const cells = Object.fromEntries(RATE_COLUMNS.map((c) => [c, h("td", { class: "rate num " + c })]));
    const conns = h("td", { class: "num connections", text: DASH });
    const tr = h("tr", { class: "protocol", data: { protocol: p.id } },
      h("th", { scope: "row", text: p.label }), conns, RATE_COLUMNS.map((c) => cells[c]));
    return { p, tr, cells, conns };
  });
  $("#protocols tbody").replaceChildren(...rows.map((r) => r.tr));
  const canary = new CanaryView($("#canary"));
  let first = true;

  poll(ctx, async () => {
    const m = await fetchMetrics(ctx.signal);
    const now = Date.now();
    let measured = false;
    for (const { p, cells, conns } of rows) {
      conns.textContent = p.connections(m);
      for (const c of RATE_COLUMNS) {
        const key = `${p.id}:${c}`;
        const value = p[c].length ? totalOf(m, p[c]) : null;
        const rate = rates.update(key, now, value);
        if (rate !== null) measured = true;
        const text = c.endsWith("bytes") ? fmtByteRate(rate) : fmtRate(rate);
        const spark = value === null ? "" : sparkline(rates.history(key));
        cells[c].replaceChildren(spark, h("span", { class: "value", text }));
      }
    }
    const lagBytes = total(m, "sluice_offload_lag_bytes");
    const lagSegments = total(m, "sluice_offload_lag_segments");
    // local_bytes is exported with offload on (the log less what only the object store
    // holds); without offload the whole log is local.
    const disk = total(m, "sluice_partition_local_bytes") ?? total(m, "sluice_partition_log_bytes");
    $("#disk-use").textContent = fmtBytes(disk);
    $("#offload-lag").textContent = lagBytes === null && lagSegments === null
      ? "offload off" : `${fmtBytes(lagBytes)} in ${fmtInt(lagSegments)} segments`;
    $("#topic-count").textContent = fmtInt(total(m, "sluice_topics"));
    const cpu = rates.update("process:cpu", now, total(m, "process_cpu_seconds_total"));
    $("#process-cpu").textContent = isNum(cpu) ? (cpu * 100).toFixed(1) + " %" : DASH;
    $("#process-memory").textContent = fmtBytes(total(m, "process_resident_memory_bytes"));
    const fds = total(m, "process_open_fds");
    const maxFds = total(m, "process_max_fds");
    $("#process-fds").textContent = fds === null ? DASH : `${fmtInt(fds)} of ${fmtInt(maxFds)}`;
    canary.update(m, now);
    // The first visit has no rate yet: measure again soon instead of in 5 s.
    const soon = first && !measured;
    first = false;
    return soon ? 1000 : POLL_MS;
  }, POLL_MS);
}

const CANARY_METRICS = [
  "sluice_canary_last_latency_seconds", "sluice_canary_latency_seconds_bucket",
  "sluice_canary_failures_total", "sluice_canary_consecutive_failures",
];
const CANARY_ORDER = ["kafka", "websocket", "mqtt"];
const canaryBuckets = new Map(); // path -> [[t, Map(le -> cumulative count)]] over the window

// The end-to-end canary: per path, the last latency with its trend, the p99 of the window
// from the histogram's deltas, failures, and whether it is failing now.
class CanaryView {
  constructor(box) {
    this.box = box;
  }

  update(m, now) {
    const paths = new Set();
    for (const name of CANARY_METRICS) {
      for (const s of m.get(name) || []) if (s.labels.path) paths.add(s.labels.path);
    }
    if (!paths.size) {
      this.box.replaceChildren(h("p", { class: "canary-off muted", text: "canary off" }));
      return;
    }
    const rank = (p) => (CANARY_ORDER.includes(p) ? CANARY_ORDER.indexOf(p) : 99);
    const ordered = [...paths].sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
    const rows = ordered.map((path) => {
      // The gauge reads 0 until the first probe of the path comes back: no latency yet.
      const probes = total(m, "sluice_canary_latency_seconds_count", { path });
      const latency = probes === 0 ? null : total(m, "sluice_canary_last_latency_seconds", { path });
      const key = "canary:" + path;
      if (latency !== null) rates.push(key, now, latency);
      const p99 = this.p99(m, path, now);
      const failing = total(m, "sluice_canary_consecutive_failures", { path });
      const state = failing === null ? DASH : failing === 0 ? "ok" : `failing ${fmtInt(failing)}`;
      const stateClass = failing === null ? "badge" : failing === 0 ? "badge ok" : "badge bad";
      return h("tr", { class: "canary-path", data: { path } },
        h("th", { scope: "row", text: path }),
        h("td", {}, h("span", { class: "canary-state " + stateClass, data: { path }, text: state })),
        h("td", { class: "num" }, latency === null ? "" : sparkline(rates.history(key)),
          h("span", { class: "canary-latency value", data: { path }, text: fmtMs(latency) })),
        h("td", { class: "num canary-p99", data: { path }, text: fmtMs(p99) }),
        h("td", { class: "num canary-failures", data: { path },
          text: fmtInt(total(m, "sluice_canary_failures_total", { path })) }));
    });
    const head = h("tr", {}, ["path", "state", "last latency", "p99 (10 min)", "failures"]
      .map((t, i) => h("th", { class: i > 1 ? "num" : null, text: t })));
    this.box.replaceChildren(h("table", { class: "canary" }, h("thead", {}, head), h("tbody", {}, rows)));
  }

  // p99 of the observations between the oldest kept scrape and this one.
  p99(m, path, now) {
    const counts = new Map();
    for (const s of m.get("sluice_canary_latency_seconds_bucket") || []) {
      if (s.labels.path !== path) continue;
      const le = s.labels.le === "+Inf" ? Infinity : Number(s.labels.le);
      counts.set(le, (counts.get(le) || 0) + s.value);
    }
    if (!counts.size) return null;
    let hist = canaryBuckets.get(path);
    if (!hist) canaryBuckets.set(path, (hist = []));
    hist.push([now, counts]);
    while (hist.length && hist[0][0] < now - WINDOW_MS) hist.shift();
    const base = hist[0][1];
    const reset = [...counts].some(([le, n]) => n < (base.get(le) || 0));
    const delta = [...counts].sort((a, b) => a[0] - b[0])
      .map(([le, n]) => [le, reset || hist.length < 2 ? n : n - (base.get(le) || 0)]);
    // One scrape only: nothing measured over the window yet.
    return hist.length < 2 && !reset ? null : histogramQuantile(0.99, delta);
  }
}

// ---- topics -----------------------------------------------------------------------------------

const isInternal = (name) => name.startsWith("__");

function sortTopics(names) {
  return [...names].sort((a, b) => isInternal(a) - isInternal(b) || a.localeCompare(b));
}

// Per topic, the sums of the partition counters (records and bytes appended).
function topicCounters(m) {
  const out = new Map();
  for (const [metric, field] of [["sluice_partition_records_appended_total", "records"],
    ["sluice_partition_bytes_appended_total", "bytes"]]) {
    for (const s of m.get(metric) || []) {
      const t = out.get(s.labels.topic) || out.set(s.labels.topic, {}).get(s.labels.topic);
      t[field] = (t[field] || 0) + s.value;
    }
  }
  return out;
}

function topics(ctx) {
  const tbody = $("#topics tbody");
  tbody.replaceChildren(h("tr", { class: "loading" }, h("td", { colspan: 9, class: "muted", text: "loading…" })));
  let first = true;
  poll(ctx, async () => {
    const [list, m] = await Promise.all([
      getJson("/topics", ctx.signal),
      // Rates are a bonus: a gateway whose /metrics this user may not read still lists topics.
      fetchMetrics(ctx.signal).catch((e) => { if (isAbort(e)) throw e; return new Map(); }),
    ]);
    const names = sortTopics(list.topics);
    const descs = await mapLimit(names, FETCH_CONCURRENCY, (name) =>
      getJson(`/topics/${enc(name)}`, ctx.signal).catch((e) => { if (isAbort(e)) throw e; return e; }));
    const counters = topicCounters(m);
    const now = Date.now();
    const rows = names.map((name, i) => {
      const d = descs[i];
      const c = counters.get(name) || {};
      const recRate = rates.update("topic-records:" + name, now, c.records ?? null);
      const byteRate = rates.update("topic-bytes:" + name, now, c.bytes ?? null);
      const link = h("td", { class: "name" }, h("a", { href: "#/topics/" + enc(name), text: name }));
      const tr = h("tr", { class: "topic" + (isInternal(name) ? " internal" : ""), data: { topic: name } }, link);
      if (d instanceof Error) {
        tr.append(h("td", { colspan: 8, class: "muted", text: d.status === 403 ? "forbidden" : d.message }));
        return tr;
      }
      const parts = d.partitions || [];
      const sum = (f) => parts.reduce((a, p) => a + (f(p) || 0), 0);
      const policy = d.policy || {};
      const retention = [fmtPolicy("retention_ms", policy.retention_ms)];
      if (isNum(policy.retention_bytes) && policy.retention_bytes >= 0) retention.push(fmtBytes(policy.retention_bytes));
      tr.append(
        h("td", { class: "num", text: fmtInt(parts.length) }),
        h("td", { class: "num", text: fmtInt(sum((p) => p.high_watermark - p.log_start)) }),
        h("td", { class: "num", text: fmtBytes(sum((p) => p.local_bytes ?? p.bytes)) }),
        h("td", { class: "num records-rate", text: fmtRate(recRate) }),
        h("td", { class: "num bytes-rate", text: fmtByteRate(byteRate) }),
        h("td", { text: retention.join(", ") }),
        h("td", { text: policy.cleanup_policy ?? DASH }),
        h("td", { text: policy.remote_storage_enable ? "on" : "off" }),
      );
      return tr;
    });
    if (!rows.length) rows.push(h("tr", {}, h("td", { colspan: 9, class: "muted", text: "no topics" })));
    tbody.replaceChildren(...rows);
    // As on the overview: a first visit measures its rates a second later.
    const soon = first && m.size > 0 && !names.some((n) => rates.history("topic-records:" + n).length);
    first = false;
    return soon ? 1000 : POLL_MS;
  }, POLL_MS);
}

// ---- one topic --------------------------------------------------------------------------------

function topic(ctx, name) {
  $("#topic-name").textContent = name;
  $("#topic-partitions").replaceChildren();
  $("#topic-policy").replaceChildren();
  $("#records").replaceChildren(h("p", { class: "muted loading", text: "loading…" }));
  $("#tail").replaceChildren();
  const load = async () => {
    try {
      const d = await getJson(`/topics/${enc(name)}`, ctx.signal);
      renderTopicHeader(d);
      await loadRecords(ctx, name, d);
      ctx.ok();
    } catch (e) {
      ctx.fail(e);
    }
  };
  $("#records-refresh").addEventListener("click", load, { signal: ctx.signal });
  liveTail(ctx, name);
  load();
}

function renderTopicHeader(d) {
  const cols = ["partition", "log start", "high watermark", "records", "local size", "offloaded"];
  const head = h("tr", {}, cols.map((c, i) => h("th", { class: i ? "num" : null, text: c })));
  const rows = (d.partitions || []).map((p) => h("tr", { class: "partition", data: { partition: p.partition } },
    h("td", { text: p.partition }),
    h("td", { class: "num", text: fmtInt(p.log_start) }),
    h("td", { class: "num", text: fmtInt(p.high_watermark) }),
    h("td", { class: "num", text: fmtInt(p.high_watermark - p.log_start) }),
    h("td", { class: "num", text: fmtBytes(p.local_bytes ?? p.bytes) }),
    h("td", { class: "num", text: p.remote_segments ? `${fmtInt(p.remote_start)}–${fmtInt(p.remote_end)}, ` +
      fmtBytes(p.remote_bytes) : DASH })));
  $("#topic-partitions").replaceChildren(h("thead", {}, head), h("tbody", {}, rows));
  const policy = Object.entries(d.policy || {}).map(([k, v]) =>
    h("tr", { data: { key: k } }, h("th", { scope: "row", text: k.replace(/_/g, " ") }), h("td", { text: fmtPolicy(k, v) })));
  if (isNum(d.created_at_ms)) policy.unshift(h("tr", {}, h("th", { text: "created" }), h("td", { text: fmtTime(d.created_at_ms) })));
  $("#topic-policy").replaceChildren(h("tbody", {}, policy));
}

// The newest records of every partition (up to 20 each), newest first across partitions.
async function loadRecords(ctx, name, d) {
  const results = await mapLimit(d.partitions || [], FETCH_CONCURRENCY, async (p) => {
    const start = Math.max(p.log_start, p.high_watermark - RECORDS_PER_PARTITION);
    if (p.high_watermark <= start) return [];
    const path = `/topics/${enc(name)}/partitions/${p.partition}/records?offset=${start}&max_records=${RECORDS_PER_PARTITION}`;
    const r = await api(path, { signal: ctx.signal });
    if (r.status === 422) {
      r.body?.cancel().catch(() => {});
      return h("p", { class: "partition-note", data: { partition: p.partition },
        text: `Partition ${p.partition}: its batches are compressed (written by a Kafka producer) and cannot be shown here.` });
    }
    if (!r.ok) {
      const e = await httpError(r, path);
      if (e.status === 403) throw e;
      return h("p", { class: "partition-note", text: `Partition ${p.partition}: ${e.message}` });
    }
    return (await r.json()).records.map((rec) => ({ ...rec, partition: p.partition }));
  });
  const notes = results.filter((x) => x instanceof Node);
  const records = results.filter(Array.isArray).flat()
    .sort((a, b) => b.timestamp - a.timestamp || b.offset - a.offset || a.partition - b.partition);
  const box = $("#records");
  box.replaceChildren(...notes, ...records.map(renderRecord));
  if (!records.length && !notes.length) box.append(h("p", { class: "muted", text: "no records" }));
}

function headerText(bytes) {
  const text = asText(bytes);
  return text === null ? "0x" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("") : text;
}

function renderRecord(rec) {
  const headers = (rec.headers || []).map(([k, v]) => [k, v === null ? null : b64bytes(v)]);
  const ct = headers.find(([k]) => k.toLowerCase() === "content-type");
  const value = rec.value === null ? null : b64bytes(rec.value);
  const meta = h("div", { class: "record-meta" },
    h("span", { class: "record-partition", text: "partition " + rec.partition }),
    h("span", { class: "record-offset", text: "offset " + rec.offset }),
    h("span", { class: "record-time", text: fmtTime(rec.timestamp) }),
    h("span", { class: "record-key", text: "key " + (rec.key === null ? "(none)" : headerText(b64bytes(rec.key))) }),
    h("span", { class: "record-size", text: value === null ? "tombstone" : fmtBytes(value.length) }));
  const hdrs = headers.length ? h("dl", { class: "record-headers" },
    headers.map(([k, v]) => [h("dt", { text: k }), h("dd", { text: v === null ? "(null)" : headerText(v) })])) : null;
  return h("div", { class: "record", data: { partition: rec.partition, offset: rec.offset } },
    meta, hdrs, renderValue(value, ct && ct[1] ? asText(ct[1]) : null, rec.value));
}

// A value by kind: an image, pretty JSON, text, or a hex dump of its first 512 bytes.
function renderValue(bytes, contentType, base64) {
  if (bytes === null) return h("pre", { class: "record-text muted", text: "(no value)" });
  const image = imageType(bytes, contentType);
  if (image) {
    // A data: URL from the base64 the API already sent: no second request, no credentials.
    const img = h("img", { class: "record-image", src: `data:${image};base64,${base64}`, alt: `${image}, ${fmtBytes(bytes.length)}` });
    img.addEventListener("load", () => img.classList.toggle("tiny", img.naturalHeight < 48), { once: true });
    return img;
  }
  const text = asText(bytes);
  if (text !== null) {
    try {
      return h("pre", { class: "record-json", text: JSON.stringify(JSON.parse(text), null, 2) });
    } catch {
      const clipped = text.length > 8192 ? text.slice(0, 8192) + `\n… ${fmtInt(text.length - 8192)} more characters` : text;
      return h("pre", { class: "record-text", text: clipped });
    }
  }
  const more = bytes.length > 512 ? `\n… ${fmtInt(bytes.length - 512)} more bytes` : "";
  return h("pre", { class: "record-hex", text: hexDump(bytes.subarray(0, 512)) + more });
}

// ---- live tail (Server-Sent Events over fetch) -----------------------------------------------

// Reads an SSE body and calls onEvent({event, data, id}) per event. EventSource would be
// simpler but cannot send the Authorization header.
async function readSse(body, onEvent) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  let ev = { event: "message", data: [], id: null };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let nl;
    while ((nl = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, nl).replace(/\r$/, "");
      buf = buf.slice(nl + 1);
      if (line === "") {
        if (ev.data.length) onEvent({ event: ev.event, data: ev.data.join("\n"), id: ev.id });
        ev = { event: "message", data: [], id: null };
      } else if (line[0] !== ":") { // ":…" is a keep-alive comment
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const val = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "data") ev.data.push(val);
        else if (field === "event") ev.event = val;
        else if (field === "id") ev.id = val;
      }
    }
  }
}

function liveTail(ctx, name) {
  const button = $("#tail-toggle");
  const out = $("#tail");
  let stream = null; // the AbortController of the running stream
  let pending = []; // lines not drawn yet: drawn once per frame, so a fast topic costs little
  const setState = (state) => {
    out.dataset.state = state;
    const on = state === "connecting" || state === "open";
    button.textContent = on ? "Stop live tail" : "Start live tail";
    button.setAttribute("aria-pressed", String(on));
  };
  const stop = (state) => {
    stream?.abort();
    stream = null;
    setState(state);
  };
  const flush = () => {
    if (ctx.signal.aborted) return; // left the page before this frame
    const lines = pending;
    pending = [];
    out.prepend(...lines.reverse());
    while (out.childElementCount > TAIL_LINES) out.lastElementChild.remove();
  };
  const add = (line) => {
    if (!pending.length) requestAnimationFrame(flush);
    pending.push(line);
    if (pending.length > TAIL_LINES) pending.shift();
  };
  const onEvent = ({ event, data, id }) => {
    const time = h("span", { class: "tail-time", text: new Date().toLocaleTimeString() });
    const where = h("span", { class: "tail-id", text: id || "" });
    if (event === "record") {
      add(h("div", { class: "tail-line" }, time, where, h("span", { class: "tail-data", text: data.slice(0, 1000) })));
    } else if (event === "record-base64") {
      // Only the head is decoded, for the magic bytes: frames can be megabytes each.
      const size = Math.floor((data.length * 3) / 4) - (data.match(/=*$/)[0].length);
      const head = b64bytes(data.slice(0, 24));
      const annexB = head[0] === 0 && head[1] === 0 && (head[2] === 1 || (head[2] === 0 && head[3] === 1));
      const kind = imageType(head, null) || (annexB ? "video frame" : "binary");
      const text = `[${kind}, ${fmtBytes(size)}]`;
      add(h("div", { class: "tail-line binary" }, time, where, h("span", { class: "tail-data", text })));
    } else if (event === "end") {
      add(h("div", { class: "tail-line note" }, time, h("span", { class: "tail-data", text: "stream ended: " + data })));
    }
  };
  const start = async () => {
    const mine = (stream = new AbortController());
    setState("connecting");
    const path = `/topics/${enc(name)}/events?start=latest`;
    try {
      const r = await api(path, { signal: mine.signal, headers: { Accept: "text/event-stream" } });
      if (!r.ok) throw await httpError(r, path);
      setState("open");
      await readSse(r.body, onEvent);
      if (stream === mine) stop("ended");
    } catch (e) {
      if (isAbort(e)) return;
      if (stream === mine) stop("failed");
      add(h("div", { class: "tail-line note" }, h("span", { class: "tail-data", text: "live tail failed: " + e.message })));
      ctx.fail(e);
    }
  };
  setState("stopped");
  button.addEventListener("click", () => (stream ? stop("stopped") : start()), { signal: ctx.signal });
  ctx.onLeave(() => stop("stopped"));
}

// ---- groups, subscriptions, relays: tables with expandable rows ------------------------------

// Rows with data-key toggle the detail rows of the same key; the choice survives refreshes.
function expandable(ctx, tbody, rowClass) {
  const open = new Set();
  tbody.addEventListener("click", (ev) => {
    const tr = ev.target.closest("tr." + rowClass);
    if (!tr || ev.target.closest("a")) return;
    const key = tr.dataset.key;
    if (open.has(key)) open.delete(key);
    else open.add(key);
    apply();
  }, { signal: ctx.signal });
  const apply = () => {
    for (const tr of tbody.querySelectorAll("tr[data-key]")) {
      const isOpen = open.has(tr.dataset.key);
      if (tr.classList.contains(rowClass)) tr.setAttribute("aria-expanded", String(isOpen));
      else tr.hidden = !isOpen;
    }
  };
  return apply;
}

const emptyRow = (cols, text) => h("tr", { class: "empty" }, h("td", { colspan: cols, class: "muted", text }));

function groups(ctx) {
  const tbody = $("#groups tbody");
  const apply = expandable(ctx, tbody, "group");
  poll(ctx, async () => {
    const { groups } = await getJson("/groups", ctx.signal);
    groups.sort((a, b) => a.group.localeCompare(b.group));
    const rows = [];
    for (const g of groups) {
      const key = "g:" + g.group;
      rows.push(h("tr", { class: "group expander", data: { group: g.group, key } },
        h("td", { class: "name", text: g.group }),
        h("td", { class: "muted", text: `${g.partitions.length} partition${g.partitions.length === 1 ? "" : "s"}` }),
        h("td", {}),
        h("td", { class: "num lag", data: { lag: g.lag }, text: fmtInt(g.lag) })));
      for (const p of g.partitions) {
        rows.push(h("tr", { class: "group-partition", data: { group: g.group, key, topic: p.topic, partition: p.partition } },
          h("td", {}),
          h("td", {}, h("a", { href: "#/topics/" + enc(p.topic), text: p.topic }), ` / ${p.partition}`),
          h("td", { class: "num committed", text: fmtInt(p.committed) }),
          h("td", { class: "num lag", data: { lag: p.lag }, text: fmtInt(p.lag) })));
      }
    }
    tbody.replaceChildren(...(rows.length ? rows : [emptyRow(4, "no consumer group has committed offsets")]));
    apply();
  }, POLL_MS);
}

function subscriptions(ctx) {
  const tbody = $("#subscriptions tbody");
  const apply = expandable(ctx, tbody, "subscription");
  poll(ctx, async () => {
    const names = sortTopics((await getJson("/topics", ctx.signal)).topics);
    let refused = 0;
    const lists = await mapLimit(names, FETCH_CONCURRENCY, (t) =>
      getJson(`/topics/${enc(t)}/subscriptions`, ctx.signal).then((r) => r.subscriptions, (e) => {
        if (isAbort(e) || e.status !== 403) throw e;
        refused++;
        return [];
      }));
    const rows = [];
    lists.forEach((subs, i) => {
      for (const s of subs) {
        const key = "s:" + JSON.stringify([names[i], s.name]);
        const unacked = s.partitions.reduce((a, p) => a + p.unacked_dispatched, 0);
        rows.push(h("tr", { class: "subscription expander", data: { topic: names[i], subscription: s.name, key } },
          h("td", {}, h("a", { href: "#/topics/" + enc(names[i]), text: names[i] })),
          h("td", { class: "name", text: s.name }),
          h("td", { text: s.type }),
          h("td", { class: "num consumers", text: fmtInt(s.consumers) }),
          h("td", {}), h("td", {}),
          h("td", { class: "num backlog", text: fmtInt(s.backlog) }),
          h("td", { class: "num unacked", text: fmtInt(unacked) })));
        for (const p of s.partitions) {
          const data = { key, topic: names[i], subscription: s.name, partition: p.partition };
          rows.push(h("tr", { class: "subscription-partition", data },
            h("td", {}), h("td", {}),
            h("td", { text: "partition " + p.partition }),
            h("td", {}),
            h("td", { class: "num mark-delete", text: fmtInt(p.mark_delete) }),
            h("td", { class: "num acked-ranges", text: fmtInt(p.acked_ranges) }),
            h("td", { class: "num backlog", text: fmtInt(p.backlog) }),
            h("td", { class: "num unacked", text: fmtInt(p.unacked_dispatched) })));
        }
      }
    });
    if (!rows.length) rows.push(emptyRow(8, "no named subscriptions"));
    if (refused) rows.push(emptyRow(8, `${refused} topic${refused === 1 ? "" : "s"} not shown: forbidden`));
    tbody.replaceChildren(...rows);
    apply();
  }, POLL_MS);
}

function relays(ctx) {
  const tbody = $("#relays tbody");
  const apply = expandable(ctx, tbody, "relay");
  poll(ctx, async () => {
    const r = await api("/relays", { signal: ctx.signal });
    if (r.status === 404) {
      r.body?.cancel().catch(() => {});
      tbody.replaceChildren(emptyRow(6, "no relay information (this gateway does not report relays)"));
      $("#upstream").replaceChildren();
      return;
    }
    if (!r.ok) throw await httpError(r, "/relays");
    const data = await r.json();
    const rows = [];
    for (const relay of data.relays || []) {
      const key = "r:" + JSON.stringify([relay.client_id, relay.peer]); // one per connection
      rows.push(h("tr", { class: "relay expander", data: { client: relay.client_id, key } },
        h("td", { class: "name", text: relay.client_id }),
        h("td", { text: relay.peer ?? DASH }),
        h("td", { class: "num muted", text: `${(relay.partitions || []).length} followed` }),
        h("td", {}), h("td", {}),
        h("td", { class: "num lag", data: { lag: relay.lag }, text: fmtInt(relay.lag) })));
      for (const p of relay.partitions || []) {
        rows.push(h("tr", { class: "relay-partition", data: { key } },
          h("td", {}),
          h("td", {}, h("a", { href: "#/topics/" + enc(p.topic), text: p.topic })),
          h("td", { class: "num", text: p.partition }),
          h("td", { class: "num", text: fmtInt(p.position) }),
          h("td", { class: "num", text: fmtInt(p.high_watermark) }),
          h("td", { class: "num lag", text: fmtInt(p.lag) })));
      }
    }
    tbody.replaceChildren(...(rows.length ? rows : [emptyRow(6, "no relay is connected to this node")]));
    apply();
    renderUpstream(data.upstream);
  }, POLL_MS);
}

function renderUpstream(up) {
  const box = $("#upstream");
  if (!up) {
    box.replaceChildren(h("p", { class: "muted", text: "This node is not a relay." }));
    return;
  }
  const lag = (up.lag || []).map((l) => h("tr", {},
    h("td", { text: l.topic }), h("td", { class: "num", text: l.partition }), h("td", { class: "num lag", text: fmtInt(l.lag) })));
  box.replaceChildren(
    h("dl", { class: "upstream" },
      h("dt", { text: "upstream" }), h("dd", { text: up.upstream ?? DASH }),
      h("dt", { text: "link" }),
      h("dd", {}, h("span", { class: up.connected ? "badge ok" : "badge bad", text: up.connected ? "connected" : "down" })),
      h("dt", { text: "links down" }), h("dd", { text: fmtInt(up.links_down) })),
    h("table", { class: "upstream-lag" },
      h("thead", {}, h("tr", {}, h("th", { text: "topic" }), h("th", { class: "num", text: "partition" }),
        h("th", { class: "num", text: "lag" }))),
      h("tbody", {}, lag.length ? lag : emptyRow(3, "no followed partition"))));
}

// ---- cameras ----------------------------------------------------------------------------------

const STATE_CLASS = { playing: "ok", connecting: "warn", backoff: "warn", unauthorized: "bad", stopped: "bad" };

function cameras(ctx) {
  const box = $("#cameras");
  const cards = new Map(); // name -> {root, fields, still, url, shown}
  const forget = (card) => { if (card.url) URL.revokeObjectURL(card.url); };
  ctx.onLeave(() => cards.forEach(forget));
  box.replaceChildren(h("p", { class: "muted loading", text: "loading…" }));
  poll(ctx, async () => {
    const r = await api("/cameras", { signal: ctx.signal });
    const list = r.status === 404 ? [] : r.ok ? (await r.json()).cameras : null;
    if (list === null) throw await httpError(r, "/cameras");
    if (!list.length) {
      cards.forEach(forget);
      cards.clear();
      box.replaceChildren(h("p", { class: "no-cameras muted", text: "no cameras" }));
      return;
    }
    const seen = new Set(list.map((c) => c.name));
    for (const [name, card] of cards) if (!seen.has(name)) { forget(card); cards.delete(name); }
    for (const cam of list) {
      if (!cards.has(cam.name)) cards.set(cam.name, cameraCard(cam.name));
      updateCamera(cards.get(cam.name), cam);
    }
    box.replaceChildren(...list.map((c) => cards.get(c.name).root));
    await mapLimit(list, 4, (cam) => refreshStill(ctx, cards.get(cam.name), cam));
  }, CAMERA_POLL_MS);
}

function cameraCard(name) {
  const fields = {};
  const field = (k, label) => [h("dt", { text: label }), (fields[k] = h("dd", { class: "camera-" + k }))];
  const still = h("div", { class: "camera-still" });
  const state = h("span", { class: "camera-state badge" });
  const root = h("div", { class: "camera card", data: { camera: name } },
    h("h3", {}, name, " ", state), still,
    h("dl", {}, field("codec", "codec"), field("resolution", "resolution"), field("fps", "fps"),
      field("bitrate", "bitrate"), field("frames", "frames"), field("dropped", "dropped / lost"),
      field("reconnects", "reconnects"), field("topic", "topic"), field("error", "last error")));
  return { root, fields, state, still, url: null, shown: null };
}

function updateCamera(card, cam) {
  card.state.textContent = cam.state;
  card.state.className = "camera-state badge " + (STATE_CLASS[cam.state] || "");
  const f = card.fields;
  f.codec.textContent = cam.codec ?? DASH;
  f.resolution.textContent = cam.width ? `${cam.width}×${cam.height}` : DASH;
  f.fps.textContent = isNum(cam.fps) ? cam.fps.toFixed(1) : DASH;
  f.bitrate.textContent = isNum(cam.bitrate_bps) ? (cam.bitrate_bps / 1e6).toFixed(2) + " Mbit/s" : DASH;
  f.frames.textContent = `${fmtInt(cam.frames)} (${fmtInt(cam.keyframes)} key), ${fmtBytes(cam.bytes)}`;
  f.dropped.textContent = `${fmtInt(cam.frames_dropped)} / ${fmtInt(cam.frames_lost)}`;
  f.reconnects.textContent = fmtInt(cam.reconnects);
  f.topic.replaceChildren(h("a", { href: "#/topics/" + enc(cam.topic), text: cam.topic }));
  f.error.textContent = cam.last_error || DASH;
}

// Fetches the newest keyframe when it changed since the last one shown.
async function refreshStill(ctx, card, cam) {
  if (!cam.last_keyframe) {
    // Nothing stored yet: the snapshot would be a 404 every 2 s for a camera that is down.
    if (card.shown !== "none") card.still.replaceChildren(h("p", { class: "muted", text: "no keyframe yet" }));
    card.shown = "none";
    return;
  }
  const at = `${cam.last_keyframe.partition}:${cam.last_keyframe.offset}`;
  if (at === card.shown) return;
  const path = `/cameras/${enc(cam.name)}/snapshot`;
  const r = await api(path, { signal: ctx.signal });
  if (r.status === 404) {
    r.body?.cancel().catch(() => {});
    card.still.replaceChildren(h("p", { class: "muted", text: "no keyframe yet" }));
    return;
  }
  if (!r.ok) throw await httpError(r, path);
  const type = (r.headers.get("content-type") || "").split(";")[0].trim();
  const blob = await r.blob();
  if (type === "image/jpeg") {
    // A blob: URL, as <img src="/cameras/…"> could not carry the Authorization header.
    const old = card.url;
    card.url = URL.createObjectURL(blob);
    let img = $("img", card.still);
    if (!img) card.still.replaceChildren((img = h("img", { class: "camera-image", alt: cam.name })));
    img.src = card.url;
    if (old) URL.revokeObjectURL(old);
  } else if (type === "video/h264" || type === "video/h265") {
    const bytes = new Uint8Array(await blob.arrayBuffer());
    let canvas = $("canvas", card.still);
    if (!canvas) canvas = h("canvas", { class: "camera-image" });
    if (await decodeKeyframe(bytes, type, canvas)) {
      if (!canvas.isConnected) card.still.replaceChildren(canvas);
    } else {
      const codec = type === "video/h264" ? "H.264" : "H.265";
      card.still.replaceChildren(h("p", { class: "muted", text: `${codec} keyframe, ${fmtInt(bytes.length)} bytes` }));
    }
  } else {
    card.still.replaceChildren(h("p", { class: "muted", text: `${type || "unknown type"}, ${fmtInt(blob.size)} bytes` }));
  }
  card.shown = at;
}

// The RFC 6381 codec string WebCodecs needs, from the keyframe's own SPS (as the gateway's
// /cameras/{name}/view page does).
function codecString(bytes, type) {
  if (type === "video/h264") {
    for (let i = 0; i + 6 < bytes.length; i++) {
      if (bytes[i] === 0 && bytes[i + 1] === 0 && bytes[i + 2] === 1 && (bytes[i + 3] & 0x1f) === 7) {
        const hex = (b) => b.toString(16).padStart(2, "0");
        return "avc1." + hex(bytes[i + 4]) + hex(bytes[i + 5]) + hex(bytes[i + 6]);
      }
    }
    return "avc1.640028";
  }
  return "hev1.1.6.L120.B0";
}

// Decodes one Annex B keyframe into the canvas with WebCodecs; false when this browser cannot.
async function decodeKeyframe(bytes, type, canvas) {
  if (!("VideoDecoder" in window)) return false;
  const config = { codec: codecString(bytes, type), optimizeForLatency: true };
  try {
    if (!(await VideoDecoder.isConfigSupported(config)).supported) return false;
  } catch {
    return false;
  }
  let decoder = null;
  const decoded = new Promise((resolve) => {
    decoder = new VideoDecoder({
      output: (frame) => {
        canvas.width = frame.displayWidth;
        canvas.height = frame.displayHeight;
        canvas.getContext("2d").drawImage(frame, 0, 0);
        frame.close();
        resolve(true);
      },
      error: () => resolve(false),
    });
    decoder.configure(config);
    decoder.decode(new EncodedVideoChunk({ type: "key", timestamp: 0, data: bytes }));
    decoder.flush().catch(() => resolve(false));
  });
  // A broken frame may produce neither output nor error: never let that stall the refresh.
  const timeout = new Promise((resolve) => setTimeout(resolve, 3000, false));
  const ok = await Promise.race([decoded, timeout]);
  if (decoder.state !== "closed") decoder.close();
  return ok;
}

// ---- routing ----------------------------------------------------------------------------------

const PAGES = { overview, topics, topic, groups, subscriptions, cameras, relays };
let leavePage = null;

// #/overview, #/topics, #/topics/NAME, #/groups, … Each page gets a context whose signal
// aborts its requests and timers when another page is shown.
function route() {
  if (leavePage) leavePage();
  const parts = location.hash.replace(/^#\/?/, "").split("/");
  let name = parts[0] || "overview";
  let arg = null;
  if (name === "topics" && parts.length > 1 && parts[1]) {
    name = "topic";
    arg = decodeURIComponent(parts.slice(1).join("/"));
  }
  if (!Object.prototype.hasOwnProperty.call(PAGES, name)) name = "overview";
  const section = $("#page-" + name);
  const controller = new AbortController();
  const cleanups = [];
  leavePage = () => {
    controller.abort();
    for (const fn of cleanups) fn();
  };
  const ctx = {
    signal: controller.signal,
    onLeave: (fn) => cleanups.push(fn),
    ok: () => {
      notice(section, "", "");
      setStatus(null);
    },
    fail: (e) => {
      if (isAbort(e) || controller.signal.aborted) return;
      for (const placeholder of section.querySelectorAll(".loading")) placeholder.remove();
      if (e instanceof HttpError && e.status === 403) {
        notice(section, "forbidden", `Forbidden: your credentials do not allow this (${e.path}).`);
        setStatus("forbidden: " + e.path);
      } else if (e instanceof HttpError && e.status === 404 && !e.problem) {
        // No problem+json: the route itself is missing, as the REST API is on a relay.
        notice(section, "error", `This node does not serve ${e.path.split("?")[0]}: a relay has no REST API; ` +
          "open the console of its upstream.");
        setStatus(e.message);
      } else if (e instanceof HttpError) {
        notice(section, "error", e.message);
        setStatus(e.message);
      } else {
        setStatus(e.message || String(e));
      }
    },
  };
  notice(section, "", "");
  for (const s of document.querySelectorAll(".page")) s.hidden = s !== section;
  const navName = name === "topic" ? "topics" : name;
  for (const a of document.querySelectorAll("#nav a")) {
    a.classList.toggle("active", a.dataset.page === navName);
    if (a.dataset.page === navName) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  document.title = `Sluice · ${arg ?? name}`;
  PAGES[name](ctx, arg);
}

function start() {
  $("#login").addEventListener("submit", submitLogin);
  $("#sign-out").hidden = !sessionStorage.getItem(AUTH_KEY);
  $("#sign-out").addEventListener("click", () => {
    sessionStorage.removeItem(AUTH_KEY);
    location.reload();
  });
  window.addEventListener("hashchange", route);
  if (!location.hash) history.replaceState(null, "", "#/overview");
  // Ask for credentials before showing any page when the gateway needs them (listing topics
  // needs only a signed-in principal), so no page flashes with half its data refused.
  api("/topics")
    .then((r) => r.body?.cancel())
    .catch(() => {})
    .finally(route);
}

start();
