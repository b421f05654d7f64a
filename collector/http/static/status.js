// forewarn status page: polls the collector's read API every 2 s and redraws in place.
// No build step, no CDN: this file ships in the package.
"use strict";

const REFRESH_MS = 2000;
const FLEET_PAGE = 60;  // node tiles per page of the grid
const JOBS_PAGE = 25;   // rows per page of the jobs table
const EVENT_ROWS = 30;  // rows of each event table (findings, actions, orders, checkpoints)
const SEVERITY = { healthy: 0, unknown: 1, degraded: 2, unhealthy: 3 };
let token = sessionStorage.getItem("forewarn-token") || "";
// What the person chose (search, filter, page, open job); the 2 s refresh keeps it.
const view = { fleetQuery: "", problemsOnly: false, fleetPage: 0, jobsQuery: "", jobsPage: 0,
               detailJob: null };
let latest = null;  // the last answers, redrawn at once when the view changes

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c ?? ""));
  return e;
}

function when(t) {
  if (t === null || t === undefined) return "";
  return new Date(t * 1000).toLocaleTimeString();
}

function badge(text) {
  return el("span", { class: "badge " + String(text).replace(/[^a-z_]/g, "") }, String(text));
}

async function api(path) {
  const headers = token ? { Authorization: "Bearer " + token } : {};
  const r = await fetch("api/v1/" + path, { headers });
  if (r.status === 401) {
    document.getElementById("token-form").hidden = false;
    throw new Error("the collector wants an API token");
  }
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return r.json();
}

// Routes of the predictor and goodput services: absent when the collector runs without them.
async function optional(path) {
  try { return await api(path); } catch (err) { return null; }
}

function secs(s) {
  if (s === null || s === undefined) return "";
  if (s >= 3600) return (s / 3600).toFixed(1) + " h";
  if (s >= 60) return (s / 60).toFixed(1) + " min";
  return s.toFixed(0) + " s";
}

function fill(id, rows, render) {
  const body = document.querySelector("#" + id + " tbody");
  const cols = document.querySelectorAll("#" + id + " thead th").length;
  body.replaceChildren(...(rows.length ? rows.map(render)
    : [el("tr", {}, el("td", { class: "empty", colSpan: cols }, "none"))]));
}

// A GPU's health: the collector keeps the worst of its checks' current findings; a GPU
// that stopped answering is unhealthy whatever the checks last said.
function gpuHealth(g) {
  return g.state && g.state !== "ok" ? "unhealthy" : (g.health || "unknown");
}

// The nodes of the fleet, each with its GPUs and its worst GPU's health.
function nodesOf(gpus) {
  const byNode = new Map();
  for (const g of gpus) {
    if (!byNode.has(g.node)) byNode.set(g.node, []);
    byNode.get(g.node).push(g);
  }
  return [...byNode.entries()].map(([node, list]) => ({
    node, gpus: list, worst: Math.max(...list.map((g) => SEVERITY[gpuHealth(g)] ?? 1)) }));
}

// The page's buttons and "page i / n" line of one pager; returns the page, clamped.
function pager(id, page, total, size) {
  const pages = Math.max(1, Math.ceil(total / size));
  page = Math.min(Math.max(0, page), pages - 1);
  const box = document.getElementById(id);
  box.querySelector(".first").disabled = box.querySelector(".prev").disabled = page === 0;
  box.querySelector(".next").disabled = page >= pages - 1;
  box.querySelector(".info").textContent = `page ${page + 1} / ${pages} · ${total}`;
  return page;
}

function onPager(id, move) {
  const box = document.getElementById(id);
  box.querySelector(".first").addEventListener("click", () => move(() => 0));
  box.querySelector(".prev").addEventListener("click", () => move((p) => p - 1));
  box.querySelector(".next").addEventListener("click", () => move((p) => p + 1));
}

// Worst nodes first, then by name; a search matches part of the node's name.
function drawFleet(gpus) {
  const fleet = document.getElementById("fleet");
  const query = view.fleetQuery.toLowerCase();
  const nodes = nodesOf(gpus)
    .filter((n) => (!query || n.node.toLowerCase().includes(query))
      && (!view.problemsOnly || n.worst >= SEVERITY.degraded))
    .sort((a, b) => b.worst - a.worst || (a.node < b.node ? -1 : a.node > b.node ? 1 : 0));
  view.fleetPage = pager("fleet-pager", view.fleetPage, nodes.length, FLEET_PAGE);
  if (!nodes.length) {
    fleet.replaceChildren(el("p", { class: "empty" },
      gpus.length ? "no node matches" : "no GPUs reported yet"));
    return;
  }
  const shown = nodes.slice(view.fleetPage * FLEET_PAGE, (view.fleetPage + 1) * FLEET_PAGE);
  fleet.replaceChildren(...shown.map(({ node, gpus: list }) => {
    const sim = list.some((g) => g.simulated);
    return el("div", { class: "node", "data-node": node },
      el("span", { class: "node-name", title: node }, node,
        sim ? el("span", { class: "sim-badge" }, "SIM") : ""),
      ...list.map((g) => {
        const health = gpuHealth(g);
        const tip = `${node} GPU ${g.gpu} ${g.name || ""}\n${health}: ${g.health_reason || "no findings"}`
          + (g.temperature_c != null ? `\n${g.temperature_c.toFixed(0)} °C` : "")
          + (g.state && g.state !== "ok" ? `\nstate: ${g.state}` : "");
        return el("span", { class: "cell " + health, title: tip, "data-gpu": String(g.gpu),
                            "data-health": health }, String(g.gpu));
      }));
  }));
}

// Live findings: what is wrong now. A healthy finding is shown only as the recovery of an
// older non-healthy one of the same subject and check (the first "all fine" of every rank
// and GPU would otherwise push the problems off the table).
function liveFindings(findings, limit) {
  const bad = new Set();
  const keep = [];
  for (const f of [...findings].reverse()) {  // oldest first
    const key = (f.subject_key || "") + "|" + (f.check_name || f.check || "");
    if (f.health !== "healthy") { bad.add(key); keep.push(f); }
    else if (bad.has(key)) { bad.delete(key); keep.push({ ...f, recovered: true }); }
  }
  return keep.reverse().slice(0, limit);
}

// Repeats of one check about one subject (an XID every second) are one row: the newest,
// with how many of the fetched findings it stands for.
function collapseRepeats(findings) {
  const rows = new Map();
  for (const f of findings) {  // newest first
    const key = [f.subject_key, f.check_name || f.check, f.health, !!f.recovered].join("|");
    if (rows.has(key)) rows.get(key).repeats += 1;
    else rows.set(key, { ...f, repeats: 1 });
  }
  return [...rows.values()];
}

// An action's detail (a JSON object) as a short line; the whole object is in the tooltip.
function detailText(text) {
  let d;
  try { d = JSON.parse(text); } catch { return String(text || ""); }
  if (d === null || typeof d !== "object") return String(text);
  const parts = [];
  if (d.step != null) parts.push(`step ${d.step}`);
  if (Array.isArray(d.nodes)) parts.push(`on ${d.nodes.join(", ")}`);
  if (d.request_id) parts.push(d.request_id);
  if (d.http_status != null) parts.push(`HTTP ${d.http_status}`);
  if (d.attempt != null) parts.push(`attempt ${d.attempt}`);
  if (d.why) parts.push(d.why);
  if (d.detail) parts.push(String(d.detail));
  if (!parts.length && d.target) parts.push(String(d.target));
  return parts.join(" · ");
}

// The risk of a running job: the model's probability (P, what the cost-aware policy weighs),
// coloured by its alarm (score against the model's threshold: the collector says the health),
// unless one of its GPUs is already worse than that (an all-red job is never a green 0.1 %):
// then the GPU's state.
// A scored job whose P is unknown (a model without a calibration) shows its score and
// "P n/a", never a made-up 0 %.
function riskCell(j, r) {
  if (j.state !== "running") return el("td", { class: "risk" }, "—");
  const scored = r != null && !!r.gpu;
  const p = scored ? r.risk : null;
  const model = scored ? r.health || "healthy" : null;
  const pct = !scored ? "" : p == null ? `score ${r.score.toFixed(2)}, P n/a`
    : (p >= 0.01 ? (100 * p).toFixed(1) : (100 * p).toPrecision(2)) + " %";
  const gpu = j.health === "unhealthy" || j.health === "degraded" ? j.health : null;
  if (gpu && (model === null || SEVERITY[gpu] > SEVERITY[model])) {
    return el("td", { class: "risk", title: pct ? `model: ${pct}` : "" },
      el("span", { class: "badge " + gpu }, `${gpu}: GPU ${j.worst_gpu}`));
  }
  if (model === null) return el("td", { class: "risk" }, "—");
  const why = r.alarm ? `alarm score ${r.score.toFixed(2)} on ${r.gpu}` : `highest on ${r.gpu}`;
  return el("td", { class: "risk", title: r.gpu ? why : "" },
    el("span", { class: "badge " + model }, pct));
}

// running, finished (every rank ended cleanly) or stopped; a running job says how many of
// its ranks are gone.
function stateCell(j) {
  const gone = Number(j.ranks) - Number(j.alive) - Number(j.finished);
  return el("td", { class: "state" }, badge(j.state),
    j.state === "running" && gone > 0 ? ` ${gone} gone` : "");
}

// Jobs: the problems first (running, worst GPUs), then by name; a page at a time.
function drawJobs(jobs, risk, goodput) {
  const riskOf = new Map(((risk && risk.jobs) || []).map((r) => [r.job, r]));
  const goodputOf = new Map((goodput || []).map((g) => [g.job, g]));
  const query = view.jobsQuery.toLowerCase();
  const rank = (j) => (j.state === "running" ? 10 : 0) + (SEVERITY[j.health] ?? 1);
  const rows = jobs.filter((j) => !query || j.job.toLowerCase().includes(query))
    .sort((a, b) => rank(b) - rank(a) || (a.job < b.job ? -1 : a.job > b.job ? 1 : 0));
  view.jobsPage = pager("jobs-pager", view.jobsPage, rows.length, JOBS_PAGE);
  const shown = rows.slice(view.jobsPage * JOBS_PAGE, (view.jobsPage + 1) * JOBS_PAGE);
  fill("jobs", shown, (j) => {
    const g = goodputOf.get(j.job);
    const name = el("button", { type: "button", class: "job-name", title: "ranks and placement" }, j.job);
    name.addEventListener("click", () => openDetail(j.job));
    return el("tr", { "data-job": j.job },
      el("td", {}, name), el("td", {}, `${j.ranks} / ${j.world_size ?? "?"}`), stateCell(j),
      el("td", {}, String(j.last_step ?? "")),
      el("td", {}, j.last_checkpoint_step != null ? `step ${j.last_checkpoint_step} at ${when(j.last_checkpoint_time)}` : "none"),
      riskCell(j, riskOf.get(j.job)),
      el("td", { class: "goodput" }, g ? (100 * g.ratio).toFixed(1) + " %" : "—"),
      el("td", {}, g ? ["checkpoint", "rework", "detection", "restart"]
        .map((c) => secs(g.lost_s[c])).join(" / ") : ""),
      el("td", { class: "advice" }, g?.advice ? secs(g.advice.interval_s) : ""),
      el("td", {}, String(j.nodes)));
  });
}

// One job's ranks, fetched by name as a query parameter: any name the wire accepts (a
// path segment cannot carry "..", "." or a newline).
function openDetail(name) {
  view.detailJob = view.detailJob === name ? null : name;
  drawDetail();
}

async function drawDetail() {
  const box = document.getElementById("job-detail");
  const name = view.detailJob;
  box.hidden = name === null;
  if (name === null) return;
  if (box.dataset.job !== name) {
    box.dataset.job = name;
    box.dataset.loaded = "no";
    box.querySelector(".job-title").textContent = name;
  }
  let j;
  try { j = await api("job?name=" + encodeURIComponent(name)); } catch (err) {
    if (view.detailJob === name) box.querySelector(".job-summary").textContent = String(err.message || err);
    return;
  }
  if (view.detailJob !== name) return;  // another job was opened meanwhile
  const state = (r) => (r.alive ? "alive" : r.finished ? "finished" : "gone");
  box.querySelector(".job-summary").textContent =
    `${j.ranks.length} / ${j.world_size} ranks on ${j.nodes.length} nodes · step ${j.last_step ?? "?"}`
    + ` · ${j.checkpoints.length} checkpoint reports`
    // bad numerics: checkpoints since the onset are suspect; a restart wants the last good one
    + (j.numerics ? ` · state suspect since step ${j.numerics.onset_step}, last good checkpoint: `
      + `${j.numerics.last_good_step != null ? "step " + j.numerics.last_good_step : "none"}` : "");
  box.querySelector(".ranks tbody").replaceChildren(...j.ranks.map((r) => el("tr", {},
    el("td", {}, String(r.rank)), el("td", {}, r.node), el("td", {}, String(r.gpu ?? "?")),
    el("td", {}, String(r.last_step ?? "")), el("td", { class: "rank-state" }, state(r)),
    el("td", { class: "time" }, when(r.last_beat)))));
  box.querySelector(".checkpoints tbody").replaceChildren(...savedSteps(j).map((c) => el("tr",
    { "data-step": String(c.step), "data-suspect": c.suspect ? "yes" : "no" },
    el("td", {}, "step " + c.step), el("td", {}, c.ranks + (c.ranks === 1 ? " rank" : " ranks")),
    el("td", { class: "time" }, when(c.time)),
    el("td", {}, c.suspect ? badge("suspect") : c.lastGood ? badge("last good") : ""))));
  box.dataset.loaded = "yes";
}

// The job's saved steps, newest first: one row per step (every rank reports its save), those
// of the numerics onset or later suspect (load_latest skips them), the last good one named.
function savedSteps(j) {
  const onset = j.numerics ? j.numerics.onset_step : null;
  const byStep = new Map();
  for (const c of j.checkpoints) {
    if (c.phase !== "done") continue;
    const s = byStep.get(c.step) || { step: c.step, ranks: new Set(), time: c.time };
    s.ranks.add(c.rank);
    s.time = Math.max(s.time, c.time);
    byStep.set(c.step, s);
  }
  return [...byStep.values()].sort((a, b) => b.step - a.step).map((s) => ({
    step: s.step, ranks: s.ranks.size, time: s.time,
    suspect: onset !== null && s.step >= onset,
    lastGood: j.numerics ? s.step === j.numerics.last_good_step : false,
  }));
}

// Incidents: one row per incident (the correlated findings about one GPU, node or job), its
// findings listed inside it; open incidents first, then those that ended recently. Null
// (a collector without its policy): the table says so.
function drawIncidents(incidents) {
  const open = (i) => (i.state === "open" ? 0 : 1);
  const rows = [...(incidents || [])].sort((a, b) => open(a) - open(b) || b.updated - a.updated)
    .slice(0, EVENT_ROWS);
  fill("incidents", rows, (i) => el("tr", { class: i.state === "open" ? "" : "recovered",
                                             "data-incident": i.id, "data-scope": i.scope },
    el("td", { class: "time" }, when(i.opened)), el("td", {}, i.scope),
    el("td", {}, badge(i.state === "open" ? i.health : i.state)),
    el("td", {}, ...(i.findings || []).map(incidentFinding)),
    el("td", {}, String(i.orders ?? 0))));
}

// One finding of an incident: its state (its health while it fires), check and reason.
function incidentFinding(f) {
  return el("div", { class: "finding", "data-check": String(f.check || ""), "data-state": String(f.state || "") },
    badge(f.state === "firing" ? f.health : f.state), " ", el("b", {}, f.check || ""), " ",
    el("span", { class: "reason" }, f.reason || ""));
}

// A node with an open node-wide incident: its name takes the incident's colour.
function markNodes(incidents) {
  const worst = new Map();
  for (const i of incidents || []) {
    if (i.state === "open" && i.kind === "node") worst.set(i.node, i.health);
  }
  for (const n of document.querySelectorAll("#fleet .node")) {
    const health = worst.get(n.dataset.node);
    if (health) n.querySelector(".node-name")?.classList.add("badge", health);
  }
}

function drawEvents(findings, actions, orders, checkpoints) {
  fill("findings", collapseRepeats(liveFindings(findings, findings.length)).slice(0, EVENT_ROWS),
    (f) => el("tr", { class: f.recovered ? "recovered" : "" },
      el("td", { class: "time" }, when(f.time)), el("td", {}, f.subject_key || ""),
      el("td", {}, f.check_name || f.check || "",
        f.repeats > 1 ? el("span", { class: "repeat", title: `${f.repeats} of the newest findings` },
          `×${f.repeats}`) : ""),
      el("td", {}, badge(f.recovered ? "recovered" : f.health)), el("td", { class: "reason" }, f.reason || ""),
      el("td", {}, f.action && f.action !== "none" ? f.action : "")));
  fill("actions", actions, (a) => el("tr", {},
    el("td", { class: "time" }, when(a.time)), el("td", {}, a.kind), el("td", {}, a.subject || a.job || a.node),
    el("td", {}, badge(a.shadow ? "shadow" : a.status)),
    el("td", { class: "reason", title: a.detail || "" }, detailText(a.detail))));
  const ckptOrders = orders.filter((o) => o.kind === "checkpoint");
  fill("orders", ckptOrders, (o) => el("tr", { "data-order": o.id },
    el("td", { class: "time" }, when(o.created)), el("td", {}, o.node), el("td", {}, o.command?.order?.job ?? ""),
    el("td", {}, String(o.command?.order?.step ?? "")), el("td", { class: "reason" }, o.command?.order?.reason ?? ""),
    el("td", {}, badge(o.acked_at ? "ok" : "pending"))));
  fill("checkpoints", checkpoints, (c) => el("tr", {},
    el("td", { class: "time" }, when(c.time)), el("td", {}, c.job), el("td", {}, String(c.rank)), el("td", {}, String(c.step)),
    el("td", {}, badge(c.phase)), el("td", {}, c.seconds != null ? c.seconds.toFixed(2) : ""),
    el("td", {}, c.bytes != null ? String(c.bytes) : "")));
}

// Everything from the last answers: called after each refresh and when the view changes.
function draw() {
  if (latest === null) return;
  const { gpus, jobs, findings, actions, orders, checkpoints, risk, goodput } = latest;
  drawFleet(gpus);
  markNodes(latest.incidents);
  drawIncidents(latest.incidents);
  const bad = gpus.filter((g) => gpuHealth(g) === "unhealthy").length;
  document.getElementById("summary").textContent =
    `${gpus.length} GPUs · ${bad} unhealthy · ${jobs.length} jobs`;
  drawJobs(jobs, risk, goodput);
  drawEvents(findings, actions, orders, checkpoints);
  // User Timing mark of the first draw (bench/statuspage_render.py reads it).
  if (!performance.getEntriesByName("first-render").length) performance.mark("first-render");
}

// The grid, jobs and events draw as soon as their answers are in; the risk and goodput
// columns (answered by the policy thread, slower with many jobs) fill in when theirs come.
async function refresh() {
  try {
    const slow = Promise.all([optional("risk?limit=1"), optional("goodput")]);
    const [gpus, jobs, findings, actions, orders, checkpoints, incidents] = await Promise.all([
      api("gpus?limit=100000"), api("jobs"), api("findings?limit=200"),
      api(`actions?limit=${EVENT_ROWS}`), api(`commands/log?limit=${EVENT_ROWS}`),
      api(`checkpoints?limit=${EVENT_ROWS}`), optional("incidents?limit=100"),
    ]);
    latest = { gpus, jobs, findings, actions, orders, checkpoints, incidents,
               risk: latest?.risk ?? null, goodput: latest?.goodput ?? null };
    draw();
    drawDetail();
    const [risk, goodput] = await slow;
    latest = { ...latest, risk, goodput };
    drawJobs(latest.jobs, risk, goodput);
    // User Timing mark of the first draw with every column (bench/statuspage_render.py).
    if (!performance.getEntriesByName("full-render").length) performance.mark("full-render");
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (err) {
    document.getElementById("updated").textContent = String(err.message || err);
  }
}

// The next refresh starts REFRESH_MS after this one ended: a slow collector is never asked
// again before it answered.
async function refreshLoop() {
  await refresh();
  setTimeout(refreshLoop, REFRESH_MS);
}

// The view's controls redraw at once from the last answers (no wait for the next refresh).
function wireControls() {
  const moved = (key, draw1) => (step) => { view[key] = step(view[key]); draw1(); };
  const redraw = () => draw();
  onPager("fleet-pager", moved("fleetPage", redraw));
  onPager("jobs-pager", moved("jobsPage", redraw));
  document.getElementById("fleet-search").addEventListener("input", (ev) => {
    view.fleetQuery = ev.target.value; view.fleetPage = 0; draw();
  });
  document.getElementById("fleet-problems").addEventListener("change", (ev) => {
    view.problemsOnly = ev.target.checked; view.fleetPage = 0; draw();
  });
  document.getElementById("jobs-search").addEventListener("input", (ev) => {
    view.jobsQuery = ev.target.value; view.jobsPage = 0; draw();
  });
  document.querySelector("#job-detail .close").addEventListener("click", () => {
    view.detailJob = null; drawDetail();
  });
  document.getElementById("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    token = document.getElementById("token").value.trim();
    sessionStorage.setItem("forewarn-token", token);
    document.getElementById("token-form").hidden = true;
    refresh();
  });
}

wireControls();
refreshLoop();
