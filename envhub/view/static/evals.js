// envhub view: the Eval results tab: every `envhub eval --out` folder's summary table.
// Its columns are those of all its rows (a row may lack one, or hold NaN where another has a
// number); failures by reason are shown as "reason: count".
"use strict";

function summaryText(value) {
  if (value == null) return NONE;
  if (typeof value === "object" && !Array.isArray(value)) {
    const entries = Object.entries(value);
    return entries.length ? entries.map(([k, v]) => `${k}: ${shortNumber(v)}`).join(", ") : NONE;
  }
  return shortNumber(value);
}

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
    const keys = [...new Set(rows.flatMap((row) => Object.keys(row)))];
    const table = el("table", {}, el("thead", {}, el("tr", {}, ...keys.map((k) => el("th", { text: k })))));
    const body = el("tbody");
    for (const row of rows) {
      body.append(el("tr", {}, ...keys.map((k) => {
        const td = el("td", { text: summaryText(row[k]) });
        if (NONFINITE.has(row[k])) td.className = "nonfinite";
        return td;
      })));
    }
    table.append(body);
    box.append(el("h2", { text: run.name }), table);
  }
  if (!box.children.length) box.append(el("p", { text: "No envhub eval results among these runs." }));
}
