// envhub view: curves, the episode table and transcripts over envhub.view's JSON API.
// Every text from a run goes into the page with textContent (never innerHTML): env output is
// data, not markup. A message's role is text too: only the known roles become CSS classes.
// The page runs under the server's Content-Security-Policy (default-src 'self'): no inline
// script or style attribute; colours are set through element.style.
// A request that fails shows its error where its answer would have gone, never the previous
// answer as if it were this one.
"use strict";

const QUERY = new URLSearchParams(location.search);
const TOKEN = QUERY.get("token");
const POLL_MS = Number(QUERY.get("poll")) || 3000;  // how often the page looks for new data
const COLOURS = ["#2b6cb0", "#d9480f", "#2f9e44", "#862e9c", "#c2255c", "#1098ad", "#5c940d"];
const COLUMNS = [
  ["step", "step"], ["kind", "kind"], ["env_id", "env"], ["seed", "seed"],
  ["success", "success"], ["return", "return"], ["advantage", "advantage"],
  ["turns", "turns"], ["tokens", "tokens"], ["failure", "failure"],
];
const ROLES = new Set(["system", "user", "assistant", "tool"]);  // the roles with a style
const state = {
  runs: [], shown: new Set([0]), metrics: {}, sort: "step", desc: false, offset: 0,
  limit: 50, total: 0, selected: [], listing: 0, opening: 0, polling: false,
};

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "text") node.textContent = value;
    else if (name === "class") node.className = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  return node;
}

async function api(path, params = {}) {
  const query = new URLSearchParams(Object.entries(params).filter(([, v]) => v !== "" && v != null));
  if (TOKEN) query.set("token", TOKEN);
  const response = await fetch(`api/${path}?${query}`);
  let body;
  try { body = await response.json(); } catch { body = {}; }  // an error page that is not JSON
  if (!response.ok) throw new Error(body.error || `${response.status} ${response.statusText}`);
  return body;
}

// a value from a run as text: strings as they are, anything else as JSON
function asText(value) {
  if (value == null) return "";
  if (typeof value === "string") return value;
  try { return JSON.stringify(value); } catch { return String(value); }
}

// ---------------------------------------------------------------- runs and tabs
async function loadRuns() {
  state.runs = await api("runs");
  const box = document.getElementById("runs");
  const select = document.getElementById("episode-run");
  box.replaceChildren();
  select.replaceChildren();
  state.runs.forEach((run, i) => {
    const check = el("input", { type: "checkbox", "data-run": i });
    check.checked = state.shown.has(i);
    check.addEventListener("change", () => {
      if (check.checked) state.shown.add(i); else state.shown.delete(i);
      drawCharts();
    });
    const swatch = el("span", { text: "\u25A0 " });
    swatch.style.color = COLOURS[i % COLOURS.length];  // CSSOM: allowed by the CSP
    box.append(el("label", { title: run.path }, check, swatch, run.name));
    select.append(el("option", { value: i, text: run.name }));
  });
}

function showTab(name) {
  for (const button of document.querySelectorAll("nav button")) {
    button.classList.toggle("active", button.dataset.tab === name);
  }
  for (const section of document.querySelectorAll("section.tab")) {
    section.classList.toggle("hidden", section.id !== name);
  }
  if (name === "episodes") loadEpisodes();
  if (name === "eval") loadEval();
}

// ---------------------------------------------------------------- curves
// every run's metrics; one that fails keeps its last curves and is named in the error thrown
async function loadMetrics() {
  const failed = [];
  await Promise.all(state.runs.map(async (run) => {
    try { state.metrics[run.id] = await api("metrics", { run: run.id }); }
    catch (error) { failed.push(`${run.name}: ${error.message}`); }
  }));
  drawCharts();
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
  let pattern;
  try { pattern = new RegExp(document.getElementById("metric-filter").value || "."); }
  catch { pattern = /./; }
  const keys = new Set();
  for (const id of state.shown) for (const key of state.metrics[id]?.keys || []) keys.add(key);
  const chosen = [...keys].filter((key) => pattern.test(key)).sort();
  box.replaceChildren();
  for (const key of chosen) box.append(chart(key, x, alpha));
  if (!chosen.length) box.append(el("p", { text: "No metric matches the filter (yet)." }));
}

function label(value, span) {
  // enough digits to tell the axis ends apart when the range is small next to the values
  const digits = Math.min(8, Math.max(3, Math.ceil(Math.log10(Math.abs(value) / (span || 1) + 1)) + 2));
  return Number(value.toPrecision(digits)).toString();
}

function chart(key, x, alpha) {
  const width = 340, height = 170, left = 46, bottom = 20;
  const series = [];
  for (const id of state.shown) {
    const rows = (state.metrics[id]?.rows || []).filter((r) => r[key] != null && r[x] != null);
    if (rows.length) series.push({ id, xs: rows.map((r) => r[x]), ys: smooth(rows.map((r) => r[key]), alpha) });
  }
  const all = (f) => series.flatMap(f);
  const [x0, x1] = [Math.min(...all((s) => s.xs)), Math.max(...all((s) => s.xs))];
  let [y0, y1] = [Math.min(...all((s) => s.ys)), Math.max(...all((s) => s.ys))];
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
    const points = s.xs.map((v, i) => `${px(v).toFixed(1)},${py(s.ys[i]).toFixed(1)}`).join(" ");
    const line = svg("polyline", {
      class: "series", points, stroke: colour, "data-points": s.xs.length, "data-run": s.id,
    });
    const title = svg("title");
    title.textContent = `${state.runs[s.id].name}: ${s.xs.length} points, last ${s.ys[s.ys.length - 1]}`;
    line.append(title);
    plot.append(line);
    if (s.xs.length > 300) continue;  // hover dots only where they stay readable
    s.xs.forEach((v, i) => {
      const only = s.xs.length === 1;  // a lone point has no line: always drawn
      const dot = svg("circle", { class: only ? "dot single" : "dot", cx: px(v), cy: py(s.ys[i]), r: only ? 2.5 : 2, fill: colour });
      const tip = svg("title");
      tip.textContent = `${state.runs[s.id].name} \u00b7 ${x} ${v}: ${key} ${Number(s.ys[i].toPrecision(6))}`;
      dot.append(tip);
      plot.append(dot);
    });
  }
  return el("div", { class: "chart-box" }, el("h3", { text: key }), plot);
}

// ---------------------------------------------------------------- episodes
function filters() {
  const out = {};
  for (const input of document.querySelectorAll("#filters [name]")) out[input.name] = input.value.trim();
  return out;
}

async function loadEpisodes() {
  const run = document.getElementById("episode-run").value || 0;
  const listing = ++state.listing;  // answers come back in any order: only the last one counts
  let page;
  try {
    page = await api("episodes", {
      run, ...filters(), sort: state.sort, desc: state.desc, offset: state.offset, limit: state.limit,
    });
  } catch (error) {
    if (listing !== state.listing) return;
    document.getElementById("problems").textContent = error.message;
    document.querySelector("#episode-table tbody").replaceChildren();
    document.getElementById("page-info").textContent = "";
    return;
  }
  if (listing !== state.listing) return;
  state.total = page.total;
  document.getElementById("problems").textContent = (page.problems || []).join("; ");
  const head = document.querySelector("#episode-table thead");
  head.replaceChildren(el("tr", {}, ...COLUMNS.map(([name, label]) => {
    const th = el("th", { text: label, "data-sort": name });
    if (state.sort === name) th.className = state.desc ? "sorted desc" : "sorted";
    th.addEventListener("click", () => {
      state.desc = state.sort === name ? !state.desc : false;
      state.sort = name;
      state.offset = 0;
      loadEpisodes();
    });
    return th;
  })));
  const body = document.querySelector("#episode-table tbody");
  body.replaceChildren(...page.rows.map((row) => {
    const tr = el("tr", { "data-key": row.key });
    for (const [name] of COLUMNS) {
      let value = row[name];
      if (typeof value === "number" && !Number.isInteger(value)) value = value.toFixed(3);
      if (name === "success") value = row.success ? "\u2713" : "\u2717";
      const td = el("td", { text: value == null ? "" : String(value) });
      if (name === "success") td.className = row.success ? "ok" : "fail";
      tr.append(td);
    }
    tr.addEventListener("click", (event) => openEpisode(run, row.key, event.shiftKey));
    return tr;
  }));
  const last = Math.min(state.offset + state.limit, state.total);
  document.getElementById("page-info").textContent =
    `${state.total ? state.offset + 1 : 0}-${last} of ${state.total} episodes (shift-click a second row to compare)`;
}

// ---------------------------------------------------------------- transcripts
async function openEpisode(run, key, compare) {
  state.selected = compare ? [...state.selected.slice(-1), { run, key }] : [{ run, key }];
  for (const tr of document.querySelectorAll("#episode-table tbody tr")) {
    tr.classList.toggle("selected", state.selected.some((s) => s.key === tr.dataset.key));
  }
  const opening = ++state.opening;  // a slower, earlier click must not overwrite this one
  const box = document.getElementById("transcripts");
  const panels = await Promise.all(state.selected.map(async (s) => {
    try { return transcript(s.run, await api("episode", s)); }
    catch (error) {
      return el("div", { class: "transcript error", "data-run": String(s.run) },
        el("h2", { text: `${s.key}: cannot be shown` }), el("p", { class: "fail", text: error.message }));
    }
  }));
  if (opening === state.opening) box.replaceChildren(...panels);
}

async function sameSeed(run, episode, box) {
  if (episode.seed == null) return;
  let page;
  try {
    page = await api("episodes", { run, env_id: episode.env_id, seed: episode.seed, kind: episode.kind, limit: 500 });
  } catch (error) {
    box.append(el("span", { class: "fail", text: `other steps: ${error.message}` }));
    return;
  }
  const others = page.rows.filter((r) => r.key !== episode.key);
  if (!others.length) return;
  const select = el("select", { class: "compare" }, el("option", { value: "", text: `same seed at another step (${others.length})` }));
  for (const row of others) select.append(el("option", { value: row.key, text: `step ${row.step} #${row.index}: return ${Number(row.return).toFixed(2)}` }));
  select.addEventListener("change", async () => {
    if (!select.value) return;
    state.selected = [{ run, key: episode.key }];  // this one on the left, the other beside it
    openEpisode(run, select.value, true);
  });
  box.append(select);
}

function transcript(run, episode) {
  const box = el("div", { class: "transcript", "data-key": episode.key, "data-run": String(run) });
  const score = episode.return == null ? "-" : Number(episode.return).toFixed(3);
  box.append(el("h2", { text: `${episode.env_id} seed ${episode.seed} \u00b7 ${episode.kind} step ${episode.step} #${episode.index} \u00b7 return ${score} \u00b7 ${episode.success ? "success" : "no success"}` }));
  if (episode.failure) box.append(el("p", { class: "fail", text: `failed: ${episode.failure}` }));
  box.append(el("code", { class: "replay", text: episode.replay }));
  const slot = el("div", { class: "compare-slot" });  // filled once the other steps are known
  box.append(slot);
  sameSeed(run, episode, slot);
  const messages = Array.isArray(episode.messages) ? episode.messages : [{ content: episode.messages }];
  for (const message of messages) box.append(messageBox(message));
  if (episode.tokens.length) {
    const tokens = el("div", { class: "tokens" });
    const starts = new Set((episode.row_starts || []).slice(1));
    for (const [i, token] of episode.tokens.entries()) {
      if (starts.has(i)) tokens.append(el("div", { class: "row-break", text: "next training sample (this turn's prompt as the template rendered it)" }));
      const span = el("span", { class: token.policy ? "tok policy" : "tok context", text: token.text });
      let title = `token ${JSON.stringify(token.text)} id ${token.id}`;
      if (token.policy) {
        const p = Math.exp(token.logprob ?? 0);
        span.style.background = `rgba(47, 158, 68, ${(0.15 + 0.75 * p).toFixed(3)})`;
        title += ` logprob ${token.logprob?.toFixed(4)} advantage ${token.advantage == null ? "-" : token.advantage.toFixed(4)}`;
      }
      span.title = title;
      tokens.append(span);
    }
    box.append(el("h2", { text: "tokens (green: policy, shaded by probability; grey: prompt, env and template)" }), tokens);
  }
  return box;
}

// one chat message; whatever shape an env gave it (role, content, tool calls), shown as text
function messageBox(message) {
  const fields = message !== null && typeof message === "object" && !Array.isArray(message)
    ? message : { content: message };
  const role = asText(fields.role) || "?";
  const item = el("div", { class: ROLES.has(role) ? `message ${role}` : "message other" },
    el("span", { class: "role", text: role }));
  const content = Array.isArray(fields.content)
    ? fields.content.map((part) => (typeof part?.text === "string" ? part.text : asText(part))).join("")
    : asText(fields.content);
  item.append(document.createTextNode(content));
  const calls = fields.tool_calls;
  for (const call of Array.isArray(calls) ? calls : calls == null ? [] : [calls]) {
    const fn = call?.function;
    const text = fn && typeof fn.name === "string"
      ? `${fn.name}(${asText(fn.arguments)})` : asText(call);
    item.append(el("span", { class: "tool-call", text: `\u2192 ${text}` }));
  }
  return item;
}

// ---------------------------------------------------------------- eval results
async function loadEval() {
  const box = document.getElementById("eval-tables");
  box.replaceChildren();
  for (const run of state.runs) {
    let rows;
    try { rows = await api("summary", { run: run.id }); }
    catch (error) {
      box.append(el("h2", { text: run.name }), el("p", { class: "fail", text: error.message }));
      continue;
    }
    if (!rows.length) continue;
    const keys = Object.keys(rows[0]).filter((k) => typeof rows[0][k] !== "object");
    const table = el("table", {}, el("thead", {}, el("tr", {}, ...keys.map((k) => el("th", { text: k })))));
    const body = el("tbody");
    for (const row of rows) {
      body.append(el("tr", {}, ...keys.map((k) => el("td", { text: typeof row[k] === "number" ? String(Number(row[k].toFixed(3))) : asText(row[k]) }))));
    }
    table.append(body);
    box.append(el("h2", { text: run.name }), table);
  }
  if (!box.children.length) box.append(el("p", { text: "No envhub eval results among these runs." }));
}

// ---------------------------------------------------------------- wiring
document.querySelectorAll("nav button").forEach((b) => b.addEventListener("click", () => showTab(b.dataset.tab)));
for (const id of ["metric-filter", "x-axis", "smoothing"]) document.getElementById(id).addEventListener("input", drawCharts);
document.querySelectorAll("#filters [name], #episode-run").forEach((input) =>
  input.addEventListener("change", () => { state.offset = 0; loadEpisodes(); }));
document.getElementById("prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - state.limit); loadEpisodes(); });
document.getElementById("next").addEventListener("click", () => {
  if (state.offset + state.limit < state.total) { state.offset += state.limit; loadEpisodes(); }
});

// one poll at a time: on a slow server a poll that is still waiting makes the next one skip
async function poll() {
  if (state.polling) return;
  state.polling = true;
  try {
    await loadMetrics();
    if (!document.getElementById("episodes").classList.contains("hidden") && state.offset === 0) {
      const before = state.total;
      const run = document.getElementById("episode-run").value || 0;
      const page = await api("episodes", { run, ...filters(), limit: 1 });
      if (page.total !== before) loadEpisodes();
    }
    document.getElementById("live").textContent = `live \u00b7 ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    document.getElementById("live").textContent = `offline: ${error.message}`;
  } finally {
    state.polling = false;
  }
}

(async () => {
  try {
    await loadRuns();
    await loadMetrics();
  } catch (error) {
    document.getElementById("live").textContent = `offline: ${error.message}`;
  }
  document.body.dataset.ready = "1";
  setInterval(poll, POLL_MS);
})();
