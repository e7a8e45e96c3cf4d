// The dashboard's page (pipeline/dashboard.h): static HTML and script, no data. Everything
// the page shows comes from GET /v1/dashboard with the bearer token from the URL's
// fragment; model text is put into the page as text (textContent), never as markup.
// window.fw holds what the page has drawn, for the browser test (tests/pipeline/dashboard_browser_test.py).
#include "pipeline/dashboard.h"

namespace flywheel::pipeline {
namespace {

constexpr const char kPage[] = R"fwhtml(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="referrer" content="no-referrer">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>flywheel run</title>
<style>
  body { font: 14px system-ui, sans-serif; margin: 0; background: #f6f7f9; color: #1d2330; }
  header { background: #1d2330; color: #fff; padding: 10px 18px; display: flex; gap: 18px; align-items: baseline; flex-wrap: wrap; }
  header h1 { font-size: 17px; margin: 0; }
  #state { opacity: 0.85; }
  #error { color: #ffb4a8; font-weight: 600; }
  main { padding: 12px 18px; }
  #summary { display: flex; flex-wrap: wrap; gap: 8px; margin-bottom: 12px; }
  .stat { background: #fff; border: 1px solid #dde1e8; border-radius: 6px; padding: 6px 10px; min-width: 110px; }
  .stat b { display: block; font-size: 16px; }
  .stat span { font-size: 12px; color: #5b6475; }
  #charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(360px, 1fr)); gap: 12px; }
  .chart { background: #fff; border: 1px solid #dde1e8; border-radius: 6px; padding: 8px; }
  .chart h3 { font-size: 13px; margin: 0 0 4px; }
  .chart .box { position: relative; height: 200px; }
  table { border-collapse: collapse; width: 100%; background: #fff; border: 1px solid #dde1e8; }
  th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #eceff3; vertical-align: top; }
  th { background: #eef1f5; font-weight: 600; }
  td.text { font-family: ui-monospace, monospace; white-space: pre-wrap; max-width: 520px; word-break: break-word; }
  h2 { font-size: 15px; margin: 18px 0 6px; }
  .lag { color: #b25400; font-weight: 600; }
</style>
<script src="/dashboard/chart.js"></script>
</head>
<body>
<header><h1 id="title">flywheel run</h1><span id="state">connecting…</span><span id="error"></span></header>
<main>
<div id="summary"></div>
<div id="charts"></div>
<h2>Fleet</h2>
<table id="fleet"><thead><tr><th>node</th><th>region</th><th>role</th><th>serves</th><th>lag (versions)</th><th>samples/s</th><th>last error</th></tr></thead><tbody></tbody></table>
<section id="sessions-section" hidden>
<h2>Sessions</h2>
<table id="sessions"><thead><tr><th>session</th><th>mode</th><th>step</th><th>last version</th><th>calls</th><th>idle (s)</th></tr></thead><tbody></tbody></table>
<h2>Latest calls</h2>
<table id="calls"><thead><tr><th>session</th><th>call</th><th>seq</th><th>HTTP</th><th>ms</th><th>version after</th></tr></thead><tbody></tbody></table>
</section>
<section id="rollouts-section">
<h2>Latest rollouts</h2>
<table id="rollouts"><thead><tr><th>step</th><th>version</th><th>worker</th><th>reward</th><th>prompt</th><th>completion</th></tr></thead><tbody></tbody></table>
</section>
</main>
<script>
"use strict";
// `rl`: curves of an RL run (live or from its report); the training service's steps are a
// user's optim_step calls, which carry the loss-side figures only.
const CURVES = [
  {id: "reward", rl: true, title: "Reward and held-out score", series: [["mean_reward", "mean reward"], ["eval_accuracy", "held-out score"]]},
  {id: "loss", title: "Loss", series: [["loss", "loss"]]},
  {id: "k3", title: "KL k3, sampler vs trainer", series: [["k3", "k3"]]},
  {id: "clip", title: "Clip fraction", series: [["clip_fraction", "clip fraction"]]},
  {id: "grad", title: "Gradient norm", series: [["grad_norm", "grad norm"]]},
  {id: "sequences", service: true, title: "Sequences per optimizer step", series: [["samples", "sequences"]]},
  {id: "staleness", rl: true, title: "Staleness of trained tokens (versions)", series: [["staleness_mean", "mean"], ["staleness_max", "max"]]},
  {id: "counts", rl: true, title: "Ungraded samples, zero-variance groups (run total)", series: [["samples_ungraded", "ungraded samples"], ["groups_zero_variance", "zero-variance groups"]]},
  {id: "delta", rl: true, title: "Published delta (bytes)", series: [["delta_bytes", "delta"], ["keyframe_bytes", "keyframe"]]},
  {id: "density", rl: true, title: "Delta density (changed words)", series: [["delta_density", "density"]]},
  {id: "sync", rl: true, title: "Publish → all workers swapped (ms)", series: [["sync_ms", "sync"]]},
  {id: "rate", rl: true, title: "Samples/s", series: [["samples_per_s", "samples/s"]]},
];
const COLORS = ["#2f6fdf", "#e0662f", "#2a9d60", "#9b51e0"];
const fw = window.fw = {steps: [], charts: {}, polls: 0, errors: 0, fleet: [], rollouts: [], last: null, chartjs: typeof Chart !== "undefined"};

function readToken() {
  const match = /(?:^#|&)token=([^&]+)/.exec(location.hash);
  if (match) {
    sessionStorage.setItem("flywheel-token", decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search);  // the token leaves the address bar
  }
  return sessionStorage.getItem("flywheel-token") || "";
}
const token = readToken();

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}
function fmt(v, digits) {
  if (v === null || v === undefined) return "—";
  if (typeof v !== "number") return String(v);
  if (Math.abs(v) >= 1e9) return (v / 1e9).toFixed(2) + " G";
  if (Math.abs(v) >= 1e6) return (v / 1e6).toFixed(2) + " M";
  if (Math.abs(v) >= 1e4) return (v / 1e3).toFixed(1) + " k";
  return Number.isInteger(v) ? String(v) : v.toFixed(digits === undefined ? 3 : digits);
}

function makeCharts(source) {
  const root = document.getElementById("charts");
  const service = source === "service";
  for (const curve of CURVES) {
    if ((curve.rl && service) || (curve.service && !service)) continue;
    const card = el("div", null, "chart");
    card.id = "chart-" + curve.id;
    card.appendChild(el("h3", curve.title));
    const box = el("div", null, "box");
    const canvas = document.createElement("canvas");
    box.appendChild(canvas);
    card.appendChild(box);
    root.appendChild(card);
    if (!fw.chartjs) continue;
    fw.charts[curve.id] = new Chart(canvas, {
      type: "line",
      data: {datasets: curve.series.map(([key, label], i) => ({label, data: [], key, borderColor: COLORS[i], backgroundColor: COLORS[i], pointRadius: 1.5, borderWidth: 1.5, spanGaps: true}))},
      options: {animation: false, maintainAspectRatio: false, parsing: false, normalized: true,
                scales: {x: {type: "linear", title: {display: true, text: "step"}}},
                plugins: {legend: {labels: {boxWidth: 10}}}},
    });
  }
}

function addSteps(steps) {
  for (const row of steps) {
    fw.steps.push(row);
    for (const curve of CURVES) {
      const chart = fw.charts[curve.id];
      if (!chart) continue;
      for (const set of chart.data.datasets) {
        const y = row[set.key];
        if (y !== undefined) set.data.push({x: row.step, y: y === null ? null : Number(y)});
      }
    }
  }
  if (steps.length) for (const chart of Object.values(fw.charts)) chart.update("none");
}

function renderSummary(doc) {
  const root = document.getElementById("summary");
  root.replaceChildren();
  const last = fw.steps.length ? fw.steps[fw.steps.length - 1] : {};
  const status = doc.live ? doc.live.status || {} : {};
  const summary = doc.run.summary || {};
  if (doc.run.source === "service") {
    const service = [["optimizer steps", last.step], ["version", status.version], ["sessions", status.sessions],
                     ["calls", status.calls], ["failed calls", status.calls_failed], ["queued calls", status.queued_calls]];
    for (const [label, value] of service) {
      if (value === undefined) continue;
      const stat = el("div", null, "stat");
      stat.appendChild(el("b", fmt(value)));
      stat.appendChild(el("span", label));
      root.appendChild(stat);
    }
    return;
  }
  const items = [
    ["step", status.step !== undefined ? status.step : last.step],
    ["version", status.version !== undefined ? status.version : last.version],
    ["phase", status.phase || (doc.live ? "" : "finished")],
    ["mean reward", last.mean_reward],
    ["held-out score", status.accuracy !== undefined ? status.accuracy : summary.final_accuracy],
    ["samples", status.samples_graded !== undefined ? status.samples_graded : summary.samples],
    ["ungraded", status.samples_ungraded !== undefined ? status.samples_ungraded : summary.samples_ungraded],
    ["zero-variance groups", status.groups_zero_variance !== undefined ? status.groups_zero_variance : summary.groups_zero_variance],
    ["dropped stale", last.dropped_stale],
  ];
  for (const [label, value] of items) {
    if (value === undefined || value === "") continue;
    const stat = el("div", null, "stat");
    stat.appendChild(el("b", fmt(value)));
    stat.appendChild(el("span", label));
    root.appendChild(stat);
  }
}

// Samples/s per worker from the coordinator's accepted-group counters between polls.
const rates = {};
function workerRate(name, groups, groupSize, now) {
  const before = rates[name];
  rates[name] = {groups, now, rate: before ? before.rate : null};
  if (before && now > before.now && groups >= before.groups) {
    rates[name].rate = (groups - before.groups) * groupSize / ((now - before.now) / 1000);
    if (groups === before.groups && now - before.now < 5000) rates[name].rate = before.rate;
  }
  return rates[name].rate;
}

function renderFleet(doc) {
  const body = document.querySelector("#fleet tbody");
  body.replaceChildren();
  fw.fleet = [];
  if (!doc.live) {
    const row = el("tr");
    const cell = el("td", "the run has ended: no fleet to show");
    cell.colSpan = 7;
    row.appendChild(cell);
    body.appendChild(row);
    return;
  }
  const status = doc.live.status || {};
  const publisher = doc.live.publisher || {};
  const byWorker = status.groups_by_worker || {};
  const errors = status.last_error_by_worker || {};
  const groupSize = doc.run.group_size || 1;
  const now = Date.now();
  const nodes = [{node_id: publisher.node_id || "trainer", region: publisher.region || "home", role: "publisher",
                  version: publisher.version, staleness: 0, last_error: publisher.last_error}]
      .concat(publisher.nodes || []);
  for (const node of nodes) {
    const rate = node.role === "worker" ? workerRate(node.node_id, byWorker[node.node_id] || 0, groupSize, now) : null;
    const lag = node.staleness !== undefined ? node.staleness : Math.max(0, (publisher.version || 0) - (node.version || 0));
    const error = node.last_error || errors[node.node_id] || "";
    const entry = {node: node.node_id, region: node.region, role: node.role, version: node.version, lag, samples_per_s: rate, last_error: error};
    fw.fleet.push(entry);
    const row = el("tr");
    row.dataset.node = node.node_id;
    for (const value of [entry.node, entry.region, entry.role, fmt(entry.version), fmt(lag), rate === null ? "—" : fmt(rate, 1), error || "—"]) {
      row.appendChild(el("td", value));
    }
    if (lag > 0) row.children[4].className = "lag";
    body.appendChild(row);
  }
}

// The training service: its sessions and their newest calls.
function renderSessions(doc) {
  const live = doc.live || {};
  const service = Array.isArray(live.sessions);
  document.getElementById("sessions-section").hidden = !service;
  document.getElementById("rollouts-section").hidden = service;
  if (!service) return;
  fw.sessions = live.sessions;
  fw.calls = live.calls || [];
  const body = document.querySelector("#sessions tbody");
  body.replaceChildren();
  for (const s of live.sessions) {
    const row = el("tr");
    for (const value of [s.name || s.id, s.mode, s.step, s.last_version, s.calls, fmt(s.idle_s, 1)]) row.appendChild(el("td", value));
    body.appendChild(row);
  }
  const calls = document.querySelector("#calls tbody");
  calls.replaceChildren();
  for (const c of fw.calls.slice(0, 30)) {
    const row = el("tr");
    for (const value of [c.session, c.call, c.seq, c.status, fmt(c.ms, 1), c.version]) row.appendChild(el("td", value));
    calls.appendChild(row);
  }
}

function renderRollouts(doc) {
  fw.rollouts = doc.rollouts;
  const body = document.querySelector("#rollouts tbody");
  body.replaceChildren();
  for (const r of doc.rollouts.slice(0, 24)) {
    const row = el("tr");
    row.appendChild(el("td", r.step));
    row.appendChild(el("td", r.version));
    row.appendChild(el("td", r.worker));
    row.appendChild(el("td", fmt(r.reward)));
    row.appendChild(el("td", r.prompt, "text"));
    row.appendChild(el("td", r.completion, "text"));
    body.appendChild(row);
  }
}

let inflight = false;
async function poll() {
  if (inflight) return;
  inflight = true;
  try { await pollOnce(); } finally { inflight = false; }
}
async function pollOnce() {
  const since = fw.steps.length ? fw.steps[fw.steps.length - 1].step : 0;
  try {
    const response = await fetch("/v1/dashboard?since=" + since, {headers: token ? {Authorization: "Bearer " + token} : {}, cache: "no-store"});
    if (response.status === 401 || response.status === 403) {
      document.getElementById("error").textContent = response.status === 401
          ? "this link carries no valid token: open the URL the run printed"
          : "this token may not read the dashboard (it lacks the read scope)";
      fw.errors++;
      return;
    }
    if (!response.ok) throw new Error("HTTP " + response.status);
    const doc = await response.json();
    fw.last = doc;
    fw.polls++;
    document.getElementById("title").textContent = doc.run.title || "flywheel run";
    document.title = "flywheel: " + (doc.run.title || "run");
    document.getElementById("state").textContent = (doc.live ? "live" : "finished run") + " · updated " + new Date().toLocaleTimeString();
    document.getElementById("error").textContent = fw.chartjs ? "" : "charts unavailable (this build has no Chart.js): tables only";
    if (!fw.made) {
      makeCharts(doc.run.source);
      fw.made = true;
    }
    addSteps(doc.steps);
    renderSummary(doc);
    renderFleet(doc);
    renderRollouts(doc);
    renderSessions(doc);
  } catch (e) {
    fw.errors++;
    document.getElementById("state").textContent = "cannot reach the run (" + e.message + "); retrying";
  }
}

poll();
setInterval(poll, 1000);
</script>
</body>
</html>
)fwhtml";

}  // namespace

const std::string& DashboardPage() {
  static const std::string page = kPage;
  return page;
}

}  // namespace flywheel::pipeline
