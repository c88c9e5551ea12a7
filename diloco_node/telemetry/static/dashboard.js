// The bandwidth dashboard: polls the node's JSON API every 2 s and redraws the header, the charts
// and the swarm table. Every value may be missing or null (a node that has not finished a round
// has no loss yet), and every string from the API is untrusted (a peer picks its own label), so
// text only ever goes in through textContent / setAttribute, never innerHTML.

import { drawChart, drawTimeline } from "./charts.js";

const POLL_MS = 2000;
const SENT = "#2563eb", RECEIVED = "#e07b24", THIRD = "#2e9e5b";
const WIRE_SENT = "#93b4f5", WIRE_RECEIVED = "#f2bf8f";  // lighter twins: the same traffic, headers and control included

const finite = (v) => typeof v === "number" && Number.isFinite(v);
const show = (v, fallback = "–") => (v === null || v === undefined || v === "" ? fallback : String(v));

function scaled(v) {  // decimal units, as network people count: 1 kB = 1000 B
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
  return [v, units[i]];
}
function bytes(v) {
  if (!finite(v)) return "–";
  const [n, unit] = scaled(v);
  return `${unit === "B" ? Math.round(n) : n.toFixed(Math.abs(n) < 10 ? 2 : 1)} ${unit}`;
}
function bytesAxis(v) {  // tick labels: no trailing zeros, so 1.5 MB sits next to 2 MB
  const [n, unit] = scaled(v);
  return `${+n.toFixed(2)} ${unit}`;
}
const rate = (v) => `${bytesAxis(v)}/s`;
const mbit = (bps) => (finite(bps) ? `${(bps / 1e6).toFixed(2)} Mbit/s` : "–");
const percent = (f) => (finite(f) ? `${(f * 100).toFixed(1)}%` : "–");
const fixed = (v, digits) => (finite(v) ? v.toFixed(digits) : "–");
const shortId = (id) => (typeof id === "string" && id.length > 14 ? `${id.slice(0, 6)}…${id.slice(-6)}` : show(id));

function duration(seconds) {
  if (!finite(seconds)) return "–";
  if (seconds < 60) return `${Math.round(seconds)}s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)}m ${Math.round(seconds % 60)}s`;
  return `${Math.floor(seconds / 3600)}h ${Math.floor((seconds % 3600) / 60)}m`;
}

function ago(unixSeconds) {  // never negative: two machines' clocks may disagree a little
  return finite(unixSeconds) ? `${Math.max(0, Math.round(Date.now() / 1000 - unixSeconds))}s ago` : "–";
}

function setText(id, value) { document.getElementById(id).textContent = value; }

// --- header and cards -----------------------------------------------------------------------

function renderStatus(s) {
  setText("run-id", show(s.run_id));
  setText("peer-id", shortId(s.peer_id));
  document.getElementById("peer-id").title = show(s.peer_id, "");
  setText("label", show(s.label));
  setText("round", show(s.outer_step));
  setText("peers", show(s.peers));
  // The link's cost (wire bytes) leads when the node can measure it; payload bytes are what codecs save.
  const measured = finite(s.wire_bytes_sent) && finite(s.wire_bytes_received);
  setText("total-sent", bytes(measured ? s.wire_bytes_sent : s.bytes_sent));
  setText("total-received", bytes(measured ? s.wire_bytes_received : s.bytes_received));
  setText("total-sent-sub", measured ? `on the wire · payload ${bytes(s.bytes_sent)}` : "payload");
  setText("total-received-sub", measured ? `on the wire · payload ${bytes(s.bytes_received)}` : "payload");
  setText("compression", show(s.compression));
  setText("bytes-per-param", finite(s.bytes_per_param) ? `${s.bytes_per_param.toFixed(3)} B/param` : "");
  setText("loss", `${fixed(s.loss, 3)} / ${fixed(s.eval_loss, 3)}`);
  setText("utilization", percent(s.utilization));
  // A model given as a file path would overflow its card: its name, the whole path on hover.
  const model = show(s.model);
  setText("model", model.startsWith("hf:") ? model : model.replace(/\/+$/, "").split("/").pop());
  document.getElementById("model").title = model;
  setText("parameters", finite(s.parameters) ? `${(s.parameters / 1e6).toFixed(2)} M parameters` : "");
  setText("uptime", duration(s.uptime_seconds));
  // A cut-off node pauses training: say so above everything else, with how long it has been.
  const isolated = document.getElementById("isolated");
  isolated.hidden = s.isolated !== true;
  if (s.isolated === true) {
    const since = finite(s.isolated_since) ? new Date(s.isolated_since * 1000).toLocaleTimeString() : "–";
    isolated.textContent = `isolated from the swarm since ${since} (${ago(s.isolated_since)}) — `
      + "training is paused while the node retries its peers";
  }
  // A joiner's state download is minutes of nothing else on a slow link: how far, how fast, how long.
  const download = document.getElementById("state-download");
  const d = s.state_download;
  download.hidden = !(d && finite(d.bytes));
  if (!download.hidden) {
    const of = finite(d.total_bytes) ? ` of ${bytes(d.total_bytes)}` : "";
    const left = finite(d.seconds_left) ? `, ${duration(d.seconds_left)} left` : "";
    download.textContent = `downloading the run's state: ${bytes(d.bytes)}${of} at ${bits(d.bytes_per_second)}${left}`;
  }
  document.title = `diloco-node · ${show(s.run_id)} · round ${show(s.outer_step)}`;
  if (finite(s.fragments) && s.fragments >= 1) fragmentCount = s.fragments;
  renderLink(s);
  noteStreams(s);
}

// --- the link against the caps (live) ------------------------------------------------------------
// The egress and ingress rates the node measures on its wire (the last 5 s, DHT and headers
// included), against --upload-limit and --download-limit, one point per poll.

const LINK_SAMPLES = 150;  // 5 minutes of polls
const linkSamples = [];
const started = Date.now();

const bits = (bytesPerSecond) => (finite(bytesPerSecond) ? mbit(8 * bytesPerSecond) : "–");
const capText = (cap, now) => {
  if (!finite(cap) || cap <= 0) return "no cap";
  return finite(now) ? `${percent(now / cap)} of the ${bits(cap)} cap` : `cap ${bits(cap)}`;
};

function renderLink(s) {
  setText("egress", bits(s.egress_bytes_per_second));
  setText("ingress", bits(s.ingress_bytes_per_second));
  setText("egress-cap", capText(s.upload_limit_bytes_per_second, s.egress_bytes_per_second));
  setText("ingress-cap", capText(s.download_limit_bytes_per_second, s.ingress_bytes_per_second));
  linkSamples.push({ at: (Date.now() - started) / 1000, egress: s.egress_bytes_per_second,
                     ingress: s.ingress_bytes_per_second, up: s.upload_limit_bytes_per_second,
                     down: s.download_limit_bytes_per_second });
  if (linkSamples.length > LINK_SAMPLES) linkSamples.shift();
  drawLink();
}

function drawLink() {
  const canvas = document.querySelector("canvas[data-live='link']");
  if (!canvas) return;
  const line = (label, color, value) => ({ label, color, points: linkSamples.map((x) => [x.at, value(x)]) });
  const capped = (value) => (x) => (finite(value(x)) && value(x) > 0 ? 8 * value(x) : null);
  drawChart(canvas, {
    kind: "line", xLabel: "seconds", yLabel: "bit/s", format: (v) => mbit(v), yMin: 0,
    series: [line("egress", SENT, (x) => (finite(x.egress) ? 8 * x.egress : null)),
             line("ingress", RECEIVED, (x) => (finite(x.ingress) ? 8 * x.ingress : null)),
             line("upload cap", WIRE_SENT, capped((x) => x.up)),
             line("download cap", WIRE_RECEIVED, capped((x) => x.down))],
  });
}

// --- our streams per peer (live) -------------------------------------------------------------------
// What our run's streams (payloads, butterfly parts, state) sent to and received from each peer over
// the last 5 s (/api/status `peer_streams`: the busiest peers, the rest as "other"), and their total:
// the swarm table shows them beside our caps and each peer's own (docs/architecture.md §14).

const OTHER = "other";  // the peers beyond the busiest, summed (swarm/peer_traffic.py)
let streams = { known: false, rows: new Map(), egress: null, ingress: null, up: null, down: null };

function noteStreams(s) {
  const rows = new Map();
  for (const row of Array.isArray(s.peer_streams) ? s.peer_streams : []) {
    if (row && typeof row.peer_id === "string") rows.set(row.peer_id, row);
  }
  streams = { known: Array.isArray(s.peer_streams), rows, egress: s.stream_egress_bytes_per_second,
              ingress: s.stream_ingress_bytes_per_second, up: s.upload_limit_bytes_per_second,
              down: s.download_limit_bytes_per_second };
}

// --- charts -----------------------------------------------------------------------------------
// Each chart point `r` is one entry of /api/history: a round event, whose fields (r.bytes_sent, ...)
// the round record declares (telemetry/record.py); the header's `s.*` are /api/status keys
// (meter.STATUS_FIELDS) and the swarm table's `p.*` are swarm_table.py's row keys
// (tests/unit/test_record.py holds every name read here to those declarations).

function series(rounds, label, color, value) {
  return { label, color, points: rounds.map((r) => [r.round, value(r)]) };
}

const perSecond = (amount, r) => (finite(amount) && finite(r.round_seconds) && r.round_seconds > 0
  ? amount / r.round_seconds : null);

// Payload series ("sent", "received") and, for nodes that measure it, the same traffic on the wire
// with headers and control messages ("wire out", "wire in"; see docs/operations.md, wire bytes).
function wireSeries(rounds, value) {
  if (!rounds.some((r) => finite(r.wire_sent))) return [];
  return [series(rounds, "wire out", WIRE_SENT, (r) => value(r, r.wire_sent)),
          series(rounds, "wire in", WIRE_RECEIVED, (r) => value(r, r.wire_received))];
}

const CHARTS = {
  bytes: (rounds) => ({
    kind: "bar", xLabel: "round", yLabel: "bytes", format: bytesAxis, yMin: 0,
    series: [series(rounds, "sent", SENT, (r) => r.bytes_sent),
             series(rounds, "received", RECEIVED, (r) => r.bytes_received),
             ...wireSeries(rounds, (r, amount) => amount)],
  }),
  rate: (rounds) => ({
    kind: "line", xLabel: "round", yLabel: "bytes / s", format: rate, yMin: 0,
    series: [series(rounds, "send", SENT, (r) => perSecond(r.bytes_sent, r)),
             series(rounds, "receive", RECEIVED, (r) => perSecond(r.bytes_received, r)),
             ...wireSeries(rounds, (r, amount) => perSecond(amount, r))],
  }),
  compression: (rounds) => ({
    kind: "line", xLabel: "round", yLabel: "raw / payload (×)", format: (v) => `${+v.toFixed(2)}×`, yMin: 0,
    series: [series(rounds, "compression ratio", THIRD, (r) => r.compression_ratio)],
  }),
  loss: (rounds) => ({
    kind: "line", xLabel: "round", yLabel: "loss (nats)", format: (v) => v.toFixed(2),
    series: [series(rounds, "train loss", SENT, (r) => r.loss),
             series(rounds, "eval loss", RECEIVED, (r) => r.eval_loss)],
  }),
  utilization: (rounds) => ({
    kind: "line", xLabel: "round", yLabel: "compute (%)", format: (v) => `${+v.toFixed(1)}%`, yMin: 0, yMax: 100,
    series: [series(rounds, "utilization", THIRD, (r) => (finite(r.utilization) ? r.utilization * 100 : null))],
  }),
  "round-time": (rounds) => ({
    kind: "line", xLabel: "round", yLabel: "seconds", format: (v) => `${+v.toFixed(2)}s`, yMin: 0,
    series: [series(rounds, "round", SENT, (r) => r.round_seconds),
             series(rounds, "compute", THIRD, (r) => r.compute_seconds),
             series(rounds, "waiting", RECEIVED, (r) => r.wait_seconds)],
  }),
};

let lastRounds = [];

// Throughput per node over time: /api/peers gives each peer's last round only, so the page keeps
// what it has seen (peer id → round → tokens / s) while it is open, at most THROUGHPUT_ROUNDS
// rounds per peer. Under --round-seconds the nodes' speeds differ (docs/architecture.md §13).
const THROUGHPUT_ROUNDS = 200;
const PALETTE = [SENT, RECEIVED, THIRD, "#9333ea", "#dc2626", "#0891b2", "#ca8a04", "#4b5563"];
const throughput = new Map();

function noteThroughput(p) {
  if (!finite(p.rounds) || !finite(p.last_round_tokens_per_second) || p.last_round_tokens_per_second <= 0) return;
  const id = show(p.peer_id, "");
  if (!throughput.has(id)) throughput.set(id, { label: show(p.label, shortId(id)), points: new Map() });
  const seen = throughput.get(id);
  seen.points.set(p.rounds, p.last_round_tokens_per_second);
  if (seen.points.size > THROUGHPUT_ROUNDS) seen.points.delete(seen.points.keys().next().value);
}

function amount(v) {  // a count of tokens: 12.3 k, 4.1 M
  if (!finite(v)) return "–";
  return v >= 1e6 ? `${(v / 1e6).toFixed(1)} M` : v >= 1e3 ? `${(v / 1e3).toFixed(1)} k` : v.toFixed(0);
}

function renderThroughput() {
  const canvas = document.querySelector('canvas[data-chart="throughput"]');
  if (!canvas) return;
  const nodes = [...throughput.entries()].sort(([a], [b]) => (a < b ? -1 : 1));
  drawChart(canvas, {
    kind: "line", xLabel: "round", yLabel: "tokens / s", format: amount, yMin: 0,
    series: nodes.map(([, seen], i) => ({ label: seen.label, color: PALETTE[i % PALETTE.length],
                                          points: [...seen.points.entries()].sort((a, b) => a[0] - b[0]) })),
  });
}

// The fragment timeline (docs/architecture.md §15): one row per fragment, a mark for each round of the
// last TIMELINE_CYCLES cycles from its exchange (the round's wait) to its fragment's outer step, in
// seconds before the latest step. With P fragments they move one at a time, in turn.
const TIMELINE_CYCLES = 4, TIMELINE_LEAST = 8;
let fragmentCount = 1;  // P, from /api/status

function renderTimeline(rounds) {
  const canvas = document.querySelector("canvas[data-timeline='fragments']");
  if (!canvas) return;
  const moved = rounds.filter((r) => finite(r.moved_at) && finite(r.fragment))
    .slice(-Math.max(TIMELINE_LEAST, TIMELINE_CYCLES * fragmentCount));
  const latest = moved.length ? moved[moved.length - 1].moved_at : 0;
  drawTimeline(canvas, {
    rows: fragmentCount, xLabel: "seconds before the latest step", yLabel: "fragment",
    rowLabel: (row) => String(row),
    marks: moved.map((r) => ({ row: r.fragment, to: r.moved_at - latest,
                               from: r.moved_at - latest - (finite(r.wait_seconds) ? r.wait_seconds : 0),
                               color: PALETTE[r.fragment % PALETTE.length] })),
  });
}

function renderCharts(rounds) {
  lastRounds = rounds;
  for (const canvas of document.querySelectorAll("canvas[data-chart]")) {
    const spec = CHARTS[canvas.dataset.chart];
    if (spec) drawChart(canvas, spec(rounds));
  }
  renderTimeline(rounds);
}

// --- swarm table ------------------------------------------------------------------------------

function cell(row, text, { numeric = false, column, value, title } = {}) {
  const td = row.insertCell();
  td.textContent = text;
  if (numeric) td.className = "num";
  if (column) td.dataset.col = column;
  if (finite(value)) td.dataset.value = String(value);
  if (title) td.title = title;
  return td;
}

const capOf = (cap) => (finite(cap) && cap > 0 ? bits(cap) : "none");
function againstCap(rate, cap) {  // "1.20 / 2.00 Mbit/s", or "0.40 Mbit/s · no cap"
  const mbits = (v) => (finite(v) ? (8 * v / 1e6).toFixed(2) : "–");
  return finite(cap) && cap > 0 ? `${mbits(rate)} / ${mbits(cap)} Mbit/s` : `${bits(rate)} · no cap`;
}

// A live cell: our streams' rate to (or from) the peer against our cap, and the peer's cap on the
// other end below it; on our own row, the total of our streams against our cap.
function liveCell(row, column, rate, ours, theirs, title) {
  const td = cell(row, againstCap(rate, ours), { numeric: true, column, value: rate, title });
  const sub = document.createElement("span");
  sub.className = "sub";
  sub.textContent = theirs;
  td.append(sub);
}

function streamCells(row, p) {
  if (p.is_self) {
    liveCell(row, "live_egress", streams.egress, streams.up, "all peers",
             "our streams' egress over the last 5 s / our upload cap");
    liveCell(row, "live_ingress", streams.ingress, streams.down, "all peers",
             "our streams' ingress over the last 5 s / our download cap");
    return;
  }
  // a peer not listed moved nothing in the window, unless the list names only the busiest ("other")
  const live = streams.rows.get(show(p.peer_id, ""));
  const none = streams.known && !streams.rows.has(OTHER) ? 0 : null;
  liveCell(row, "live_egress", live ? live.stream_egress_bytes_per_second : none, streams.up,
           `its ↓ cap ${capOf(p.download_limit_bytes_per_second)}`,
           "our streams to it over the last 5 s / our upload cap; below, its download cap");
  liveCell(row, "live_ingress", live ? live.stream_ingress_bytes_per_second : none, streams.down,
           `its ↑ cap ${capOf(p.upload_limit_bytes_per_second)}`,
           "our streams from it over the last 5 s / our download cap; below, its upload cap");
}

function renderPeers(peers) {
  const body = document.querySelector("#swarm-table tbody");
  const ordered = [...peers].sort((a, b) => Number(Boolean(b.is_self)) - Number(Boolean(a.is_self)));
  body.replaceChildren();
  for (const p of ordered) {
    const row = body.insertRow();
    row.dataset.peerId = show(p.peer_id, "");
    if (p.is_self) row.className = "self";
    const id = cell(row, shortId(p.peer_id), { column: "peer_id", title: show(p.peer_id, "") });
    id.classList.add("mono");
    if (p.is_self) {
      const badge = document.createElement("span");
      badge.className = "badge";
      badge.textContent = "this node";
      id.append(badge);
    }
    cell(row, show(p.label), { column: "label" });
    cell(row, show(p.rounds), { numeric: true, column: "rounds", value: p.rounds });
    for (const way of ["sent", "received"]) {  // wire bytes when the node measured them, else payload
      const payload = p[`bytes_${way}`], wire = p[`wire_bytes_${way}`];
      cell(row, bytes(finite(wire) ? wire : payload), {
        numeric: true, column: `bytes_${way}`, value: payload,
        title: finite(wire) ? `on the wire; payload ${bytes(payload)}` : "payload (wire not measured)" });
    }
    cell(row, mbit(p.bandwidth_bps), { numeric: true, column: "bandwidth", value: p.bandwidth_bps });
    streamCells(row, p);
    // its link over its last round against its own caps (docs/architecture.md §14)
    cell(row, againstCap(p.egress_bytes_per_second, p.upload_limit_bytes_per_second),
         { numeric: true, column: "egress", value: p.egress_bytes_per_second,
           title: `upload cap: ${capOf(p.upload_limit_bytes_per_second)}` });
    cell(row, againstCap(p.ingress_bytes_per_second, p.download_limit_bytes_per_second),
         { numeric: true, column: "ingress", value: p.ingress_bytes_per_second,
           title: `download cap: ${capOf(p.download_limit_bytes_per_second)}` });
    cell(row, percent(p.utilization), { numeric: true, column: "utilization", value: p.utilization });
    // "4 × 3": four steps of three batches each (--speed-spent batch gave a fast node a larger batch)
    const k = finite(p.batches_per_step) && p.batches_per_step > 1.05 ? ` × ${+p.batches_per_step.toFixed(1)}` : "";
    cell(row, show(p.last_round_inner_steps) + k, { numeric: true, column: "steps", value: p.last_round_inner_steps });
    cell(row, amount(p.last_round_tokens),
         { numeric: true, column: "tokens", value: p.last_round_tokens });
    cell(row, amount(p.last_round_tokens_per_second),
         { numeric: true, column: "tokens_per_second", value: p.last_round_tokens_per_second });
    cell(row, percent(p.last_round_weight),
         { numeric: true, column: "weight", value: p.last_round_weight });
    cell(row, percent(p.last_round_weight_removed),
         { numeric: true, column: "removed", value: p.last_round_weight_removed });
    noteThroughput(p);
    const bounded = (p.clipped || 0) + (p.rejected || 0);
    cell(row, bounded ? `${show(p.clipped)} / ${show(p.rejected)}` : "–", {
      numeric: true, column: "bounded", value: bounded,
      title: "this node's contributions our aggregator clipped / rejected" });
    cell(row, ago(p.last_seen), { numeric: true, column: "last_seen", value: p.last_seen });
  }
  renderThroughput();
  setText("swarm-count", ordered.length ? `(${ordered.length} nodes)` : "");
  document.getElementById("swarm-empty").hidden = ordered.length > 0;
}

// --- polling ----------------------------------------------------------------------------------

async function getJson(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function setConnection(state, text) {
  const el = document.getElementById("connection");
  el.dataset.state = state;
  el.textContent = text;
}

async function refresh() {
  const [status, history, peers] = await Promise.allSettled(
    [getJson("/api/status"), getJson("/api/history"), getJson("/api/peers")]);
  if (status.status === "fulfilled") renderStatus(status.value ?? {});
  if (history.status === "fulfilled") renderCharts(Array.isArray(history.value?.rounds) ? history.value.rounds : []);
  if (peers.status === "fulfilled") renderPeers(Array.isArray(peers.value?.peers) ? peers.value.peers : []);
  const failed = [status, history, peers].filter((r) => r.status === "rejected");
  if (failed.length === 3) setConnection("lost", "node unreachable — retrying");
  else setConnection("live", `live · updated ${new Date().toLocaleTimeString()}`);
  document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
}

async function poll() {
  try { await refresh(); } catch (error) { setConnection("lost", "update failed — retrying"); console.error(error); }
  setTimeout(poll, POLL_MS);
}

window.addEventListener("resize", () => { renderCharts(lastRounds); renderThroughput(); drawLink(); });
poll();
