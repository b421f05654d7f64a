// forewarn status page: polls the collector's read API every 2 s and redraws in place.
// No build step, no CDN: this file ships in the package.
"use strict";

const REFRESH_MS = 2000;
let token = sessionStorage.getItem("forewarn-token") || "";

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

function riskCell(r) {
  if (r === undefined || r === null) return el("td", {}, "—");
  const cls = r.risk >= 0.5 ? "unhealthy" : r.risk >= 0.1 ? "degraded" : "healthy";
  return el("td", { class: "risk", title: r.gpu ? `highest on ${r.gpu}` : "" },
    el("span", { class: "badge " + cls }, (100 * r.risk).toFixed(1) + " %"));
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

function drawFleet(gpus) {
  const byNode = new Map();
  for (const g of gpus) {
    if (!byNode.has(g.node)) byNode.set(g.node, []);
    byNode.get(g.node).push(g);
  }
  const fleet = document.getElementById("fleet");
  if (!byNode.size) { fleet.replaceChildren(el("p", { class: "empty" }, "no GPUs reported yet")); return; }
  fleet.replaceChildren(...[...byNode.entries()].map(([node, list]) => {
    const sim = list.some((g) => g.simulated);
    return el("div", { class: "node", "data-node": node },
      el("span", { class: "node-name" }, node, sim ? el("span", { class: "sim-badge" }, "SIM") : ""),
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

async function refresh() {
  try {
    const [gpus, jobs, findings, actions, orders, checkpoints] = await Promise.all([
      api("gpus"), api("jobs"), api("findings?limit=200"), api("actions?limit=30"),
      api("commands/log?limit=30"), api("checkpoints?limit=30"),
    ]);
    drawFleet(gpus);
    const bad = gpus.filter((g) => gpuHealth(g) === "unhealthy").length;
    document.getElementById("summary").textContent =
      `${gpus.length} GPUs · ${bad} unhealthy · ${jobs.length} jobs`;
    // One job's detail failing (a name the URL cannot carry, such as "..") shows that job
    // without its ranks; it never stops the rest of the page from drawing.
    const details = await Promise.all(jobs.slice(0, 20).map(
      async (j) => (await optional("jobs/" + encodeURIComponent(j.job))) || { ...j, ranks: [] }));
    const [risk, goodput] = await Promise.all([optional("risk?limit=1"), optional("goodput")]);
    const riskOf = new Map(((risk && risk.jobs) || []).map((r) => [r.job, r]));
    const goodputOf = new Map((goodput || []).map((g) => [g.job, g]));
    fill("jobs", details, (j) => el("tr", { "data-job": j.job },
      el("td", {}, j.job), el("td", {}, `${(j.ranks || []).length} / ${j.world_size ?? "?"}`),
      el("td", {}, String(j.last_step ?? "")),
      el("td", {}, j.last_checkpoint_step != null ? `step ${j.last_checkpoint_step} at ${when(j.last_checkpoint_time)}` : "none"),
      riskCell(riskOf.get(j.job)),
      el("td", { class: "goodput" }, goodputOf.has(j.job)
        ? (100 * goodputOf.get(j.job).ratio).toFixed(1) + " %" : "—"),
      el("td", {}, goodputOf.has(j.job)
        ? ["checkpoint", "rework", "detection", "restart"]
          .map((c) => secs(goodputOf.get(j.job).lost_s[c])).join(" / ") : ""),
      el("td", { class: "advice" }, goodputOf.get(j.job)?.advice
        ? secs(goodputOf.get(j.job).advice.interval_s) : ""),
      el("td", {}, (j.ranks || []).map((r) => `r${r.rank}@${r.node}/${r.gpu ?? "?"}${r.alive ? "" : " (gone)"}`).join("  "))));
    fill("findings", liveFindings(findings, 30), (f) => el("tr", { class: f.recovered ? "recovered" : "" },
      el("td", { class: "time" }, when(f.time)), el("td", {}, f.subject_key || ""), el("td", {}, f.check_name || f.check || ""),
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
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (err) {
    document.getElementById("updated").textContent = String(err.message || err);
  }
}

document.getElementById("token-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  token = document.getElementById("token").value.trim();
  sessionStorage.setItem("forewarn-token", token);
  document.getElementById("token-form").hidden = true;
  refresh();
});

refresh();
setInterval(refresh, REFRESH_MS);
