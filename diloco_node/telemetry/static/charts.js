// A small chart drawer for <canvas>: lines or grouped bars over rounds, with a legend, grid, tick
// labels and axis titles. No library: the dashboard has to work offline and stay small.
//
// drawChart(canvas, {kind: "line" | "bar", series: [{label, color, points: [[x, y], ...]}],
//                    xLabel, yLabel, format: (y) => string, yMin, yMax})
// Non-finite points are dropped. After drawing, canvas.dataset.points holds the number of points of
// the longest series, so a test (or a curious human) can see what was drawn.

const MARGIN = { left: 64, right: 14, top: 26, bottom: 38 };
const INK = "#1d2430", MUTED = "#6b7380", GRID = "#e9ecf0";
const FONT = "11px system-ui, sans-serif";

function niceStep(span, targetTicks) {
  const raw = span / targetTicks;
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  const norm = raw / magnitude;
  return (norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 5 ? 5 : 10) * magnitude;
}

function ticks(lo, hi, step) {
  const out = [];
  for (let v = Math.ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) out.push(v);
  return out;
}

// Value domain [lo, hi] rounded out to whole ticks; a flat series gets some room around it.
function yDomain(values, spec) {
  let lo = Math.min(...values), hi = Math.max(...values);
  if (spec.yMin !== undefined) lo = Math.min(lo, spec.yMin);
  if (spec.yMax !== undefined) hi = Math.max(hi, spec.yMax);
  if (hi - lo < 1e-12) { const pad = Math.abs(hi) * 0.1 || 1; lo -= lo === spec.yMin ? 0 : pad; hi += pad; }
  const step = niceStep(hi - lo, 4);
  return { lo: Math.floor(lo / step + 1e-9) * step, hi: Math.ceil(hi / step - 1e-9) * step, step };
}

function xDomain(xs, kind) {
  let lo = Math.min(...xs), hi = Math.max(...xs);
  if (kind === "bar" || lo === hi) { lo -= 0.5; hi += 0.5; }
  const step = Math.max(1, Math.round(niceStep(hi - lo, 6)));
  return { lo, hi, step };
}

function resize(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 400, height = canvas.clientHeight || 200;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return { ctx, width, height };
}

// The plot's left edge: wide enough for the widest tick label ("2.00 Mbit/s") right of the rotated
// axis title, which sits in the first TITLE_ROOM pixels.
const TITLE_ROOM = 22;
function leftEdge(ctx, y, spec) {
  ctx.font = FONT;
  const widest = Math.max(0, ...ticks(y.lo, y.hi, y.step).map((v) => ctx.measureText(spec.format(v)).width));
  return Math.max(MARGIN.left, Math.ceil(TITLE_ROOM + widest + 8));
}

function drawAxes(ctx, box, x, y, spec) {
  ctx.font = FONT;
  ctx.lineWidth = 1;
  ctx.fillStyle = MUTED;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const v of ticks(y.lo, y.hi, y.step)) {
    const py = Math.round(box.y(v)) + 0.5;
    ctx.strokeStyle = GRID;
    ctx.beginPath(); ctx.moveTo(box.left, py); ctx.lineTo(box.right, py); ctx.stroke();
    ctx.fillText(spec.format(v), box.left - 6, py);
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (const v of ticks(Math.ceil(x.lo), x.hi, x.step)) ctx.fillText(String(v), box.x(v), box.bottom + 5);
  ctx.strokeStyle = MUTED;
  ctx.beginPath(); ctx.moveTo(box.left, box.top); ctx.lineTo(box.left, box.bottom + 0.5);
  ctx.lineTo(box.right, box.bottom + 0.5); ctx.stroke();
  ctx.fillStyle = INK;
  ctx.fillText(spec.xLabel, (box.left + box.right) / 2, box.bottom + 20);
  ctx.save();
  ctx.translate(12, (box.top + box.bottom) / 2);
  ctx.rotate(-Math.PI / 2);
  ctx.textBaseline = "middle";
  ctx.fillText(spec.yLabel, 0, 0);
  ctx.restore();
}

function drawLegend(ctx, series, left) {
  ctx.font = FONT;
  ctx.textAlign = "left";
  ctx.textBaseline = "middle";
  let at = left;
  for (const s of series) {
    ctx.fillStyle = s.color;
    ctx.fillRect(at, 8, 10, 10);
    ctx.fillStyle = INK;
    ctx.fillText(s.label, at + 14, 13);
    at += 14 + ctx.measureText(s.label).width + 16;
  }
}

function drawLines(ctx, box, series) {
  for (const s of series) {
    ctx.strokeStyle = ctx.fillStyle = s.color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    s.points.forEach(([px, py], i) => (i ? ctx.lineTo(box.x(px), box.y(py)) : ctx.moveTo(box.x(px), box.y(py))));
    ctx.stroke();
    if (s.points.length <= 40) {  // dots while they can be told apart; a single point is only a dot
      for (const [px, py] of s.points) { ctx.beginPath(); ctx.arc(box.x(px), box.y(py), 3, 0, 2 * Math.PI); ctx.fill(); }
    }
  }
}

function drawBars(ctx, box, series, x) {
  const slot = (box.right - box.left) / (x.hi - x.lo);  // pixels per round
  const group = Math.min(slot * 0.8, 24 * series.length);  // few rounds: slim bars, not slabs
  const width = Math.max(1, group / series.length);
  series.forEach((s, i) => {
    ctx.fillStyle = s.color;
    for (const [px, py] of s.points) {
      const left = box.x(px) - group / 2 + i * width;
      const top = box.y(Math.max(py, 0)), base = box.y(Math.max(0, box.yLo));
      ctx.fillRect(left, Math.min(top, base), Math.max(1, width - (width > 3 ? 1 : 0)), Math.abs(base - top));
    }
  });
}

export function drawChart(canvas, spec) {
  const { ctx, width, height } = resize(canvas);
  const series = spec.series.map((s) => ({
    ...s, points: s.points.filter(([px, py]) => Number.isFinite(px) && Number.isFinite(py)),
  }));
  const count = Math.max(0, ...series.map((s) => s.points.length));
  canvas.dataset.points = String(count);
  ctx.clearRect(0, 0, width, height);
  drawLegend(ctx, series, MARGIN.left);
  const all = series.flatMap((s) => s.points);
  if (all.length === 0) {
    ctx.fillStyle = MUTED;
    ctx.textAlign = "center";
    ctx.fillText("waiting for the first round…", width / 2, height / 2);
    return;
  }
  const x = xDomain(all.map((p) => p[0]), spec.kind);
  const y = yDomain(all.map((p) => p[1]), spec);
  const box = {
    left: leftEdge(ctx, y, spec), right: width - MARGIN.right, top: MARGIN.top, bottom: height - MARGIN.bottom,
    yLo: y.lo,
  };
  box.x = (v) => box.left + ((v - x.lo) / (x.hi - x.lo)) * (box.right - box.left);
  box.y = (v) => box.bottom - ((v - y.lo) / (y.hi - y.lo)) * (box.bottom - box.top);
  drawAxes(ctx, box, x, y, spec);
  if (spec.kind === "bar") drawBars(ctx, box, series, x);
  else drawLines(ctx, box, series);
}

// drawTimeline(canvas, {rows, marks: [{row, from, to, color}], xLabel, yLabel, rowLabel: (row) => string})
// One row per fragment (row 0 on top) over time: each mark a bar from `from` to `to` (a round's
// exchange) ending in a dot (its outer step). canvas.dataset.points holds the number of marks drawn.
export function drawTimeline(canvas, spec) {
  const { ctx, width, height } = resize(canvas);
  const marks = spec.marks.filter((m) => [m.row, m.from, m.to].every(Number.isFinite));
  canvas.dataset.points = String(marks.length);
  ctx.clearRect(0, 0, width, height);
  if (marks.length === 0) {
    ctx.font = FONT;
    ctx.fillStyle = MUTED;
    ctx.textAlign = "center";
    ctx.fillText("waiting for the first round…", width / 2, height / 2);
    return;
  }
  const rows = Math.max(1, spec.rows || 0, ...marks.map((m) => m.row + 1));
  const x = xDomain(marks.flatMap((m) => [m.from, m.to]), "line");
  const y = { lo: -0.5, hi: rows - 0.5, step: 1 };
  const axes = { format: spec.rowLabel, xLabel: spec.xLabel, yLabel: spec.yLabel };
  const box = { left: leftEdge(ctx, y, axes), right: width - MARGIN.right, top: MARGIN.top,
                bottom: height - MARGIN.bottom };
  box.x = (v) => box.left + ((v - x.lo) / (x.hi - x.lo)) * (box.right - box.left);
  box.y = (v) => box.top + ((v - y.lo) / (y.hi - y.lo)) * (box.bottom - box.top);
  drawAxes(ctx, box, x, y, axes);
  const thick = Math.max(3, Math.min(12, ((box.bottom - box.top) / rows) * 0.5));
  for (const m of marks) {
    const left = box.x(m.from), right = box.x(m.to), middle = box.y(m.row);
    ctx.fillStyle = m.color;
    ctx.globalAlpha = 0.45;
    ctx.fillRect(left, middle - thick / 2, Math.max(2, right - left), thick);
    ctx.globalAlpha = 1;
    ctx.beginPath(); ctx.arc(right, middle, Math.max(3, thick / 2), 0, 2 * Math.PI); ctx.fill();
  }
}
