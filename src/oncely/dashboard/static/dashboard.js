"use strict";
// Reads /api/snapshot every few seconds and draws it. Keys and scopes come from clients, so
// every value is set as text (textContent), never as markup.
// name, label, colour, dash (completions often equal first claims: dashed, both stay visible)
const SERIES = [["started", "first claims", "--started", ""], ["finished", "completions", "--finished", "6 4"],
                ["retried", "retried", "--retried", ""]];
const ACTIVITY = [["replayed", "replays", "--replayed", ""], ["duplicate", "duplicates", "--duplicate", "6 4"]];
const WATCHED = [["in_progress", "in progress"], ["mismatch", "mismatches"], ["refused", "refusals"]];
const STATUSES = [["in_progress", "in progress"], ["completed", "completed"], ["failed", "failed"],
                  ["released", "released"]];
const NS = "http://www.w3.org/2000/svg";

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function card(value, label) {
  const box = el("div", undefined, "card");
  box.append(el("div", value, "value"), el("div", label, "label"));
  return box;
}

function span(ms) {
  const s = Math.floor(ms / 1000);
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m " + (s % 60) + "s";
  return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
}

function rows(table, items, cells) {
  const body = table.tBodies[0];
  body.replaceChildren(...items.map((item) => {
    const tr = document.createElement("tr");
    tr.append(...cells(item).map((value) => el("td", value)));
    return tr;
  }));
}

function svg(tag, attrs) {
  const node = document.createElementNS(NS, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  return node;
}

function chart(id, lines, series) {
  const box = document.getElementById(id);
  const width = 900, height = 240, left = 40, bottom = 20, top = 10;
  const count = series[lines[0][0]].length;
  const peak = Math.max(1, ...lines.map(([name]) => Math.max(...series[name])));
  const x = (i) => left + (i * (width - left - 10)) / Math.max(1, count - 1);
  const y = (v) => top + (height - top - bottom) * (1 - v / peak);
  const parts = [svg("line", {x1: left, y1: y(0), x2: width - 10, y2: y(0), class: "axis"}),
                 svg("line", {x1: left, y1: top, x2: left, y2: y(0), class: "axis"})];
  const label = svg("text", {x: 4, y: top + 10});
  label.textContent = String(peak);
  parts.push(label);
  const style = getComputedStyle(document.documentElement);
  for (const [name, , color, dash] of lines) {
    const points = series[name].map((v, i) => x(i).toFixed(1) + "," + y(v).toFixed(1)).join(" ");
    parts.push(svg("polyline", {points, fill: "none", "stroke-width": 2, "stroke-dasharray": dash,
                                stroke: style.getPropertyValue(color).trim(), "data-series": name}));
  }
  const first = new Date(series.first_minute_ms), last = new Date(series.first_minute_ms + (count - 1) * series.minute_ms);
  for (const [when, at, anchor] of [[first, left, "start"], [last, width - 10, "end"]]) {
    const t = svg("text", {x: at, y: height - 4, "text-anchor": anchor});
    t.textContent = when.toISOString().slice(11, 16) + " UTC";
    parts.push(t);
  }
  box.replaceChildren(...parts);
  box.dataset.points = String(series[lines[0][0]].reduce((a, b) => a + b, 0));
}

function activity(data) {
  const error = document.getElementById("activity-error");
  error.hidden = !data.error;
  if (data.error) {
    error.textContent = "activity unavailable: " + data.error;
    return;
  }
  const totals = data.totals;
  document.getElementById("activity-cards").replaceChildren(
    ...ACTIVITY.map(([key, label]) => card(totals[key] || 0, label)),
    ...WATCHED.map(([key, label]) => card(totals[key] || 0, label)));
  chart("activity-chart", ACTIVITY, data);
  document.getElementById("recent-count").textContent = String(data.recent.length);
  rows(document.getElementById("recent"), data.recent,
       (e) => [e.scope, new Date(e.at_ms).toISOString().replace("T", " ").slice(0, 19) + " UTC",
               e.kind, e.surface, e.reason]);
}

function legend(id, lines) {
  document.getElementById(id).replaceChildren(...lines.map(([, label, color]) => {
    const item = el("span", label);
    item.style.setProperty("--swatch", "var(" + color + ")");
    return item;
  }));
}

function draw(data) {
  document.getElementById("statuses").replaceChildren(
    card(data.records, "live records"), ...STATUSES.map(([key, label]) => card(data.by_status[key] || 0, label)),
    card(data.stuck_count, "stuck leases"));
  chart("chart", SERIES, data.series);
  if (data.activity) activity(data.activity);
  document.getElementById("stuck-count").textContent = String(data.stuck_count);
  rows(document.getElementById("stuck"), data.stuck,
       (lease) => [lease.key, lease.token, lease.attempt, span(lease.lapsed_ms) + " ago"]);
  document.getElementById("scope-count").textContent = String(data.scopes);
  rows(document.getElementById("scopes"), data.by_scope,
       (s) => [s.scope, s.total, s.in_progress || 0, s.completed || 0, s.failed || 0, s.released || 0]);
  const outbox = data.outbox;
  document.getElementById("outbox-section").hidden = !outbox;
  if (outbox) {
    document.getElementById("outbox").replaceChildren(
      ...Object.entries(outbox).map(([name, value]) => card(value === null ? "—" : value, name.replaceAll("_", " "))));
  }
  document.getElementById("partial").hidden = !data.partial;
  document.getElementById("updated").textContent = "updated " + new Date(data.now_ms).toISOString().replace("T", " ").slice(0, 19) + " UTC";
  document.body.dataset.loaded = "true";
}

async function refresh() {
  const error = document.getElementById("error");
  try {
    const response = await fetch("/api/snapshot", {credentials: "same-origin"});
    if (!response.ok) throw new Error("the dashboard answered " + response.status);
    draw(await response.json());
    error.hidden = true;
  } catch (exc) {
    error.textContent = String(exc.message || exc);
    error.hidden = false;
  }
}

function start() {
  legend("legend", SERIES);
  legend("activity-legend", ACTIVITY);
  refresh();
  setInterval(refresh, 3000);
}

document.addEventListener("DOMContentLoaded", start);
