// envhub view: what every part of the page shares (loaded first; curves.js, episodes.js,
// evals.js and viewer.js use these names).
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
const ROLES = new Set(["system", "user", "assistant", "tool"]);  // the roles with a style
const NONFINITE = new Set(["NaN", "inf", "-inf"]);  // how the API sends what JSON cannot hold
const NONE = "\u2014";  // a value the run does not have (null)
const state = {
  runs: [], shown: new Set([0]), metrics: {}, sort: "step", desc: false, offset: 0,
  limit: 50, total: 0, version: null, selected: [], listing: 0, opening: 0, polling: false,
  tab: "curves",
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

// a number as short text: whole numbers as they are, others to `digits` decimals (tiny ones
// with three significant digits, so a latency of 1e-5 s is not shown as 0); NaN and infinity
// (sent as text) and null ("\u2014") are shown, never blank
function numberText(value, digits = 3) {
  if (value == null) return NONE;
  if (typeof value !== "number") return asText(value);
  if (Number.isInteger(value)) return String(value);
  if (Math.abs(value) < 10 ** -digits) return String(Number(value.toPrecision(3)));
  return value.toFixed(digits);
}

// a number without trailing zeros (rewards, summary cells): 0.5, 1, 0.333
function shortNumber(value) {
  if (typeof value !== "number") return value == null ? NONE : asText(value);
  if (Number.isInteger(value)) return String(value);
  return String(Number(Math.abs(value) < 1e-3 ? value.toPrecision(3) : value.toFixed(3)));
}
