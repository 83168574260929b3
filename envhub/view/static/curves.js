// envhub view: the Curves tab. Each run's metrics rows are kept; a poll asks only for the rows
// after the last step the page has (?after=STEP&file=...), and the server sends every row
// again (full) when the file is another one (a resumed run rewrote it). A value that is no
// number (NaN or infinity: "NaN"/"inf" or null in metrics.jsonl) breaks its line and gets a
// red mark at its step, so a diverged loss is seen, not bridged over.
"use strict";

function lastStep(rows) {
  let last = null;
  for (const row of rows) if (typeof row.step === "number" && (last === null || row.step > last)) last = row.step;
  return last;
}

// every run's new metrics rows; one that fails keeps its last curves and is named in the
// error thrown. Redraws only when a run's rows changed.
async function loadMetrics() {
  const failed = [];
  let changed = false;
  await Promise.all(state.runs.map(async (run) => {
    const kept = state.metrics[run.id];
    const after = kept ? lastStep(kept.rows) : null;
    const params = { run: run.id };
    if (kept && after !== null && kept.file) Object.assign(params, { after, file: kept.file });
    let answer;
    try { answer = await api("metrics", params); }
    catch (error) { failed.push(`${run.name}: ${error.message}`); return; }
    if (answer.full || !kept) {
      state.metrics[run.id] = { rows: answer.rows, keys: answer.keys, file: answer.file };
      changed = true;
    } else if (answer.rows.length) {
      kept.rows.push(...answer.rows);
      kept.keys = [...new Set([...kept.keys, ...answer.keys])].sort();
      changed = true;
    }
  }));
  if (changed) drawCharts();
  if (failed.length) throw new Error(failed.join("; "));
}

function smooth(values, alpha) {
  let last = null;
  return values.map((v) => (last = last === null ? v : alpha * last + (1 - alpha) * v));
}

function drawCharts() {
  const box = document.getElementById("charts");
  const x = document.getElementById("x-axis").value;
  const alpha = Number(document.getElementById("smoothing").value);
  // words separated by "|", any of which a name contains (case aside): never a regular
  // expression, since the filter also comes from a link, and a pattern can backtrack for ever
  const words = document.getElementById("metric-filter").value.toLowerCase().split("|")
    .map((word) => word.trim()).filter(Boolean);
  const keys = new Set();
  for (const id of state.shown) for (const key of state.metrics[id]?.keys || []) keys.add(key);
  const chosen = [...keys]
    .filter((key) => !words.length || words.some((word) => key.toLowerCase().includes(word)))
    .sort();
  box.replaceChildren();
  for (const key of chosen) box.append(chart(key, x, alpha));
  if (!chosen.length) box.append(el("p", { text: "No metric matches the filter (yet)." }));
}

function label(value, span) {
  // enough digits to tell the axis ends apart when the range is small next to the values
  const digits = Math.min(8, Math.max(3, Math.ceil(Math.log10(Math.abs(value) / (span || 1) + 1)) + 2));
  return Number(value.toPrecision(digits)).toString();
}

// one run's values of `key` against `x`: its points (smoothed, split into segments where a
// value is no number) and those gaps
function seriesOf(id, key, x, alpha) {
  const rows = (state.metrics[id]?.rows || []).filter((r) => typeof r[x] === "number" && key in r);
  const points = rows.filter((r) => typeof r[key] === "number");
  if (!rows.length) return null;
  const ys = smooth(points.map((r) => r[key]), alpha);
  const segments = [[]];
  const gaps = [];
  let next = 0;
  for (const row of rows) {
    if (typeof row[key] === "number") { segments[segments.length - 1].push([row[x], ys[next++]]); continue; }
    gaps.push([row[x], row[key] == null ? "null (NaN or inf)" : String(row[key])]);
    if (segments[segments.length - 1].length) segments.push([]);
  }
  return { id, points: points.length, segments: segments.filter((s) => s.length), gaps };
}

function chart(key, x, alpha) {
  const width = 340, height = 170, left = 46, bottom = 20;
  const series = [];
  for (const id of state.shown) { const s = seriesOf(id, key, x, alpha); if (s) series.push(s); }
  const xsOf = (s) => [...s.segments.flat().map((p) => p[0]), ...s.gaps.map((g) => g[0])];
  const ysOf = (s) => s.segments.flat().map((p) => p[1]);
  const xs = series.flatMap(xsOf), ys = series.flatMap(ysOf);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = ys.length ? [Math.min(...ys), Math.max(...ys)] : [0, 1];
  if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 0.5; y0 -= pad; y1 += pad; }
  const px = (v) => left + ((v - x0) / ((x1 - x0) || 1)) * (width - left - 6);
  const py = (v) => 6 + (1 - (v - y0) / (y1 - y0)) * (height - bottom - 12);
  const plot = svg("svg", { class: "chart", viewBox: `0 0 ${width} ${height}`, "data-key": key });
  plot.append(svg("line", { class: "grid", x1: left, y1: py((y0 + y1) / 2), x2: width, y2: py((y0 + y1) / 2) }));
  plot.append(svg("line", { class: "axis", x1: left, y1: height - bottom, x2: width, y2: height - bottom }));
  plot.append(svg("line", { class: "axis", x1: left, y1: 0, x2: left, y2: height - bottom }));
  const text = (content, attrs) => { const t = svg("text", attrs); t.textContent = content; plot.append(t); };
  for (const value of [y1, (y0 + y1) / 2, y0]) text(label(value, y1 - y0), { x: 2, y: py(value) + 4 });
  text(label(x0, x1 - x0), { x: left, y: height - 4 });
  text(`${x === "step" ? "step" : "s"} ${label(x1, x1 - x0)}`, { x: width - 4, y: height - 4, "text-anchor": "end" });
  for (const s of series) {
    const colour = COLOURS[s.id % COLOURS.length];
    const name = state.runs[s.id].name;
    const d = s.segments.map((seg) => seg.map(([v, y], i) => `${i ? "L" : "M"}${px(v).toFixed(1)},${py(y).toFixed(1)}`).join(" ")).join(" ");
    const line = svg("path", {
      class: "series", d, stroke: colour, "data-points": s.points, "data-run": s.id,
    });
    const title = svg("title");
    const last = s.segments.length ? s.segments[s.segments.length - 1].slice(-1)[0][1] : NONE;
    title.textContent = `${name}: ${s.points} points, last ${last}` + (s.gaps.length ? `, ${s.gaps.length} not a number` : "");
    line.append(title);
    plot.append(line);
    for (const [v, what] of s.gaps) {  // a value that is no number: a red mark at its step
      const mark = svg("line", { class: "nonfinite", x1: px(v), y1: 4, x2: px(v), y2: height - bottom, "data-run": s.id });
      const tip = svg("title");
      tip.textContent = `${name} \u00b7 ${x} ${v}: ${key} ${what}`;
      mark.append(tip);
      plot.append(mark);
    }
    if (s.points > 300) continue;  // hover dots only where they stay readable
    for (const seg of s.segments) {
      for (const [v, y] of seg) {
        const only = seg.length === 1;  // a lone point has no line: always drawn
        const dot = svg("circle", { class: only ? "dot single" : "dot", cx: px(v), cy: py(y), r: only ? 2.5 : 2, fill: colour });
        const tip = svg("title");
        tip.textContent = `${name} \u00b7 ${x} ${v}: ${key} ${Number(y.toPrecision(6))}`;
        dot.append(tip);
        plot.append(dot);
      }
    }
  }
  return el("div", { class: "chart-box" }, el("h3", { text: key }), plot);
}
