// envhub view: the page's wiring (loaded last): the runs in the header, the tabs, the state
// kept in the URL, and the poll that keeps the page live. Where things are: common.js (shared
// helpers and state), curves.js, episodes.js (table and transcripts), evals.js.
//
// The URL's hash holds what is on screen (tab, the episode run, filters, sort, page, the open
// episodes, the curve controls), rewritten as it changes (history.replaceState: no entry per
// click), so a reload comes back to it and a link shows a colleague the same episode:
// #tab=episodes&kind=train&sort=return&desc=1&open=0|train:80:13
"use strict";

const TABS = new Set(["curves", "episodes", "eval"]);
let restoring = false;  // while the page is set from the URL, it does not write the URL back

function saveState() {
  if (restoring) return;
  const params = new URLSearchParams();
  params.set("tab", state.tab);
  const run = document.getElementById("episode-run").value;
  if (run && run !== "0") params.set("run", run);
  for (const [name, value] of Object.entries(filters())) if (value) params.set(name, value);
  if (state.sort !== "step") params.set("sort", state.sort);
  if (state.desc) params.set("desc", "1");
  if (state.offset) params.set("offset", String(state.offset));
  if (state.selected.length) params.set("open", state.selected.map((s) => `${s.run}|${s.key}`).join(","));
  const metric = document.getElementById("metric-filter");
  if (metric.value !== metric.defaultValue) params.set("metrics", metric.value);
  const x = document.getElementById("x-axis").value;
  if (x !== "step") params.set("x", x);
  const smoothing = document.getElementById("smoothing").value;
  if (Number(smoothing)) params.set("smooth", smoothing);
  const shown = [...state.shown].sort((a, b) => a - b).join(",");
  if (shown !== "0") params.set("runs", shown);
  history.replaceState(null, "", `${location.pathname}${location.search}#${params}`);
}

// the page as the URL's hash describes it (values that name nothing here are left out)
function restoreState() {
  const params = new URLSearchParams(location.hash.slice(1));
  restoring = true;
  try {
    state.tab = TABS.has(params.get("tab")) ? params.get("tab") : "curves";
    const runs = document.getElementById("episode-run");
    if ([...runs.options].some((o) => o.value === params.get("run"))) runs.value = params.get("run");
    else runs.value = "0";
    for (const input of document.querySelectorAll("#filters [name]")) {
      const value = params.get(input.name) ?? "";
      if (input.tagName !== "SELECT") input.value = value;
      else if ([...input.options].some((o) => o.value === value)) input.value = value;
      else if (input.name === "agent") { input.dataset.wanted = value; fillSelect(input, []); }
    }
    const sort = params.get("sort");
    state.sort = COLUMNS.some(([name]) => name === sort) ? sort : "step";
    state.desc = params.get("desc") === "1";
    state.offset = Math.max(0, Math.floor(Number(params.get("offset")) || 0));
    state.selected = (params.get("open") || "").split(",").filter((s) => s.includes("|"))
      .map((s) => { const [run, key] = s.split("|"); return { run, key }; });
    const metric = document.getElementById("metric-filter");
    metric.value = params.has("metrics") ? params.get("metrics") : metric.defaultValue;
    const x = document.getElementById("x-axis");
    x.value = params.get("x") === "time_s" ? "time_s" : "step";
    document.getElementById("smoothing").value = params.get("smooth") || "0";
    const ids = (params.get("runs") || "0").split(",").map(Number).filter((i) => state.runs.some((r) => r.id === i));
    state.shown = new Set(ids.length ? ids : [0]);
    for (const check of document.querySelectorAll("#runs input[data-run]")) check.checked = state.shown.has(Number(check.dataset.run));
  } finally {
    restoring = false;
  }
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
      saveState();
      drawCharts();
    });
    const swatch = el("span", { text: "\u25A0 " });
    swatch.style.color = COLOURS[i % COLOURS.length];  // CSSOM: allowed by the CSP
    box.append(el("label", { title: run.path }, check, swatch, run.name));
    select.append(el("option", { value: i, text: run.name }));
  });
}

function showTab(name) {
  state.tab = name;
  for (const button of document.querySelectorAll("nav button")) {
    button.classList.toggle("active", button.dataset.tab === name);
  }
  for (const section of document.querySelectorAll("section.tab")) {
    section.classList.toggle("hidden", section.id !== name);
  }
  saveState();
  if (name === "episodes") loadEpisodes();
  if (name === "eval") loadEval();
}

// ---------------------------------------------------------------- wiring
document.querySelectorAll("nav button").forEach((b) => b.addEventListener("click", () => showTab(b.dataset.tab)));
for (const id of ["metric-filter", "x-axis", "smoothing"]) {
  document.getElementById(id).addEventListener("input", () => { saveState(); drawCharts(); });
}
document.querySelectorAll("#filters [name], #episode-run").forEach((input) =>
  input.addEventListener("change", () => { state.offset = 0; saveState(); loadEpisodes(); }));
document.getElementById("prev").addEventListener("click", () => {
  state.offset = Math.max(0, state.offset - state.limit);
  saveState();
  loadEpisodes();
});
document.getElementById("next").addEventListener("click", () => {
  if (state.offset + state.limit < state.total) { state.offset += state.limit; saveState(); loadEpisodes(); }
});
window.addEventListener("hashchange", () => {  // a link pasted into this tab
  restoreState();
  drawCharts();
  showTab(state.tab);
  showSelected();
});

// one poll at a time: on a slow server a poll that is still waiting makes the next one skip.
// The table reloads when the store's version changes (a part added, replaced or pruned), not
// only its total: a keep_last run adds one part and prunes one, and the total stays.
async function poll() {
  if (state.polling) return;
  state.polling = true;
  try {
    await loadMetrics();
    if (state.tab === "episodes") {
      const run = document.getElementById("episode-run").value || 0;
      const page = await api("episodes", { run, ...filters(), limit: 1 });
      if (page.version !== state.version || page.total !== state.total) loadEpisodes();
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
    restoreState();
    await loadMetrics();
    showTab(state.tab);
    if (state.selected.length) showSelected();
  } catch (error) {
    document.getElementById("live").textContent = `offline: ${error.message}`;
  }
  document.body.dataset.ready = "1";
  setInterval(poll, POLL_MS);
})();
