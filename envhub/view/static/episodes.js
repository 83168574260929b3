// envhub view: the Episodes tab: the table (filters and sorting run in the server), and the
// transcripts of the episodes opened from it.
"use strict";

const COLUMNS = [
  ["step", "step"], ["kind", "kind"], ["env_id", "env"], ["agent", "agent"], ["sample", "sample"],
  ["seed", "seed"], ["success", "success"], ["return", "return"], ["advantage", "advantage"],
  ["turns", "turns"], ["tokens", "tokens"], ["failure", "failure"],
];
const OPTIONAL = new Set(["agent", "sample"]);  // shown for runs that have them (envhub eval)
const TOKEN_PAGE = 4000;  // tokens drawn at once; a long episode shows "more" for the rest

function filters() {
  const out = {};
  for (const input of document.querySelectorAll("#filters [name]")) out[input.name] = input.value.trim();
  return out;
}

// a select's options: "any" and `values`, keeping the value chosen (or asked for by a link)
function fillSelect(select, values) {
  const chosen = select.value || select.dataset.wanted || "";
  select.replaceChildren(el("option", { value: "", text: "any" }),
    ...values.map((v) => el("option", { value: String(v), text: String(v) })));
  if (chosen && !values.map(String).includes(chosen)) select.append(el("option", { value: chosen, text: chosen }));
  select.value = chosen;
  delete select.dataset.wanted;
}

// what the run holds to choose from: its agents (a select, shown when there are any) and env ids
function showChoices(choices) {
  const agents = choices?.agent || [];
  const select = document.querySelector("#filters select[name='agent']");
  fillSelect(select, agents);
  select.closest("label").classList.toggle("hidden", !agents.length && !select.value);
  const list = document.getElementById("env-ids");
  list.replaceChildren(...(choices?.env_id || []).map((id) => el("option", { value: id })));
}

function cell(name, row) {
  const value = row[name];
  if (name === "success") return el("td", { text: value ? "\u2713" : "\u2717", class: value ? "ok" : "fail" });
  if (typeof value === "string" && NONFINITE.has(value) && !["kind", "env_id", "agent", "failure"].includes(name)) {
    return el("td", { text: value, class: "nonfinite" });
  }
  if (typeof value === "string") return el("td", { text: value, title: value, class: "text" });
  if (value == null) return el("td", { text: name === "failure" ? "" : NONE });
  return el("td", { text: numberText(value) });
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
  state.version = page.version;
  showChoices(page.choices);
  document.getElementById("problems").textContent = (page.problems || []).join("; ");
  const columns = COLUMNS.filter(([name]) => !OPTIONAL.has(name)
    || (name === "agent" ? (page.choices?.agent || []).length : page.rows.some((r) => r[name] != null)));
  const head = document.querySelector("#episode-table thead");
  head.replaceChildren(el("tr", {}, ...columns.map(([name, label]) => {
    const th = el("th", { text: label, "data-sort": name });
    if (state.sort === name) th.className = state.desc ? "sorted desc" : "sorted";
    th.addEventListener("click", () => {
      state.desc = state.sort === name ? !state.desc : false;
      state.sort = name;
      state.offset = 0;
      saveState();
      loadEpisodes();
    });
    return th;
  })));
  const body = document.querySelector("#episode-table tbody");
  body.replaceChildren(...page.rows.map((row) => {
    const tr = el("tr", { "data-key": row.key }, ...columns.map(([name]) => cell(name, row)));
    tr.classList.toggle("selected", state.selected.some((s) => s.key === row.key && String(s.run) === String(run)));
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
  saveState();
  await showSelected();
}

async function showSelected() {
  for (const tr of document.querySelectorAll("#episode-table tbody tr")) {
    tr.classList.toggle("selected", state.selected.some((s) => s.key === tr.dataset.key));
  }
  const opening = ++state.opening;  // a slower, earlier click must not overwrite this one
  const box = document.getElementById("transcripts");
  const panels = await Promise.all(state.selected.map(async (s) => {
    try { return transcript(s.run, await api("episode", s)); }
    catch (error) {
      return el("div", { class: "transcript error", "data-run": String(s.run), "data-key": s.key },
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
  for (const row of others) {
    const who = row.agent ? ` ${row.agent}` : "";
    select.append(el("option", { value: row.key, text: `step ${row.step} #${row.index}${who}: return ${numberText(row.return, 2)}` }));
  }
  select.addEventListener("change", async () => {
    if (!select.value) return;
    state.selected = [{ run, key: episode.key }];  // this one on the left, the other beside it
    openEpisode(run, select.value, true);
  });
  box.append(select);
}

function transcript(run, episode) {
  const box = el("div", { class: "transcript", "data-key": episode.key, "data-run": String(run) });
  const who = [episode.agent && `agent ${episode.agent}`, episode.sample != null && `sample ${episode.sample}`].filter(Boolean);
  const parts = [`${episode.env_id} seed ${episode.seed ?? NONE}`, `${episode.kind} step ${episode.step} #${episode.index}`,
    ...who, `return ${typeof episode.return === "number" ? episode.return.toFixed(3) : numberText(episode.return)}`,
    episode.success ? "success" : "no success"];
  box.append(el("h2", { text: parts.join(" \u00b7 ") }));
  if (episode.failure) box.append(el("p", { class: "fail", text: `failed: ${episode.failure}` }));
  if (Array.isArray(episode.turn_rewards) && episode.turn_rewards.length) {
    box.append(el("p", { class: "rewards", text: `rewards per turn: ${episode.turn_rewards.map(shortNumber).join(", ")}` }));
  }
  box.append(el("code", { class: "replay", text: episode.replay }));
  const slot = el("div", { class: "compare-slot" });  // filled once the other steps are known
  box.append(slot);
  sameSeed(run, episode, slot);
  const messages = Array.isArray(episode.messages) ? episode.messages : [{ content: episode.messages }];
  for (const message of messages) box.append(messageBox(message));
  const info = episode.info;
  if (info != null && !(typeof info === "object" && !Array.isArray(info) && !Object.keys(info).length)) {
    box.append(el("details", { class: "info" }, el("summary", { text: "info (as the run recorded it)" }),
      el("pre", { text: JSON.stringify(info, null, 1) })));
  }
  if (episode.tokens.length) {
    box.append(el("h2", { text: "tokens (green: policy, shaded by probability; grey: prompt, env and template)" }),
      tokenView(episode));
  }
  return box;
}

// the tokens, TOKEN_PAGE at a time (a 150k-token episode would freeze the page if drawn whole);
// a token's details are set as its title when the pointer reaches it, not for every token
function tokenView(episode) {
  const tokens = el("div", { class: "tokens" });
  const starts = new Set((episode.row_starts || []).slice(1));
  let shown = 0;
  const more = el("button", { class: "more-tokens" });
  const drawNext = () => {
    const end = Math.min(episode.tokens.length, shown + TOKEN_PAGE);
    const chunk = document.createDocumentFragment();
    for (let i = shown; i < end; i++) {
      const token = episode.tokens[i];
      if (starts.has(i)) chunk.append(el("div", { class: "row-break", text: "next training sample (this turn's prompt as the template rendered it)" }));
      const span = el("span", { class: token.policy ? "tok policy" : "tok context", text: token.text, "data-i": i });
      if (token.policy) span.style.background = `rgba(47, 158, 68, ${(0.15 + 0.75 * Math.exp(token.logprob ?? 0)).toFixed(3)})`;
      chunk.append(span);
    }
    shown = end;
    more.before(chunk);
    const left = episode.tokens.length - shown;
    if (left > 0) more.textContent = `show ${Math.min(left, TOKEN_PAGE)} more of ${left} tokens left`;
    else more.remove();
  };
  tokens.append(more);
  more.addEventListener("click", drawNext);
  tokens.addEventListener("mouseover", (event) => {
    const span = event.target;
    if (!span.classList?.contains("tok") || span.title) return;
    const token = episode.tokens[Number(span.dataset.i)];
    let title = `token ${JSON.stringify(token.text)} id ${token.id}`;
    if (token.policy) title += ` logprob ${token.logprob?.toFixed(4)} advantage ${token.advantage == null ? "-" : token.advantage.toFixed(4)}`;
    span.title = title;
  });
  drawNext();
  return tokens;
}

// one chat message; whatever shape an env gave it (role, content, tool calls), shown as text
function messageBox(message) {
  const fields = message !== null && typeof message === "object" && !Array.isArray(message)
    ? message : { content: message };
  const role = asText(fields.role) || "?";
  const label = el("span", { class: "role", text: role });
  const about = [asText(fields.name), fields.tool_call_id != null ? `id ${asText(fields.tool_call_id)}` : ""];
  if (about.some(Boolean)) label.append(el("span", { class: "about", text: ` \u00b7 ${about.filter(Boolean).join(" \u00b7 ")}` }));
  const item = el("div", { class: ROLES.has(role) ? `message ${role}` : "message other" }, label);
  const content = Array.isArray(fields.content)
    ? fields.content.map((part) => (typeof part?.text === "string" ? part.text : asText(part))).join("")
    : asText(fields.content);
  item.append(document.createTextNode(content));
  const calls = fields.tool_calls;
  for (const call of Array.isArray(calls) ? calls : calls == null ? [] : [calls]) {
    const fn = call?.function;
    const text = fn && typeof fn.name === "string"
      ? `${fn.name}(${asText(fn.arguments)})` : asText(call);
    const id = call?.id != null && fn ? `  [id ${asText(call.id)}]` : "";
    item.append(el("span", { class: "tool-call", text: `\u2192 ${text}${id}` }));
  }
  return item;
}
