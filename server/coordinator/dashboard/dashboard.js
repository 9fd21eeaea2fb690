// The Pith dashboard: polls the coordinator's /api/overview every second (jobs, loss
// curves, members, moves) and /api/experts for the selected job (the heat map). Builds
// the page with DOM calls only (every name shown is text, never markup).
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const view = { selected: null, colorBy: "heat", updates: 0 };

window.addEventListener("error", (e) => note(`script error: ${e.message}`));
window.addEventListener("unhandledrejection", (e) => note(`script error: ${e.reason}`));

function note(text) {
  document.getElementById("errors").textContent = text;
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

function svgEl(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function replace(id, node) {
  document.getElementById(id).replaceChildren(node);
}

function words(enumName, prefix) {
  return String(enumName || "").replace(prefix, "").toLowerCase();
}

// A store's disk: "disk full" under its reserve (puts refused), "disk low" while the
// coordinator says so (no new copies), else "ok"; a worker's: "ok".
function diskWord(store, m) {
  const free = Number(m.disk_free_bytes || 0), reserve = Number(m.disk_reserve_bytes || 0);
  if (!store || reserve === 0) return "ok";
  return free < reserve ? "disk full" : m.disk_low ? "disk low" : "ok";
}

function bytes(n) {
  n = Number(n || 0);
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function table(headers, rows) {
  const head = el("tr", {}, ...headers.map((h) => el("th", {}, h)));
  return el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows));
}

async function getJson(url) {
  const response = await fetch(url, { cache: "no-store" });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function renderJobs(jobs) {
  if (!jobs.length) return el("p", { class: "muted" }, "No jobs yet: pith submit SPEC.json");
  const rows = jobs.map((j) => {
    const state = words(j.state, "JOB_STATE_");
    const row = el("tr", { class: "job", "data-job": j.job_id, "data-step": j.committed_step },
      el("td", {}, j.job_id),
      el("td", {}, j.spec.name || ""),
      el("td", { class: `state-${state}` }, state),
      el("td", {}, `${Math.max(0, Number(j.committed_step))} / ${j.spec.train.steps}`),
      el("td", {}, Number(j.last_loss).toFixed(4)),
      el("td", {}, Math.round(j.tokens_per_second)),
      el("td", {}, Number(j.cache_hit_rate).toFixed(2)),
      el("td", {}, j.workers),
      el("td", { class: "muted" }, j.failure_reason || ""));
    if (j.job_id === view.selected) row.classList.add("selected");
    row.addEventListener("click", () => { view.selected = j.job_id; refresh(false); });
    return row;
  });
  return table(["job", "name", "state", "step", "loss", "tokens/s", "cache hit", "workers", ""],
               rows);
}

function renderCurve(all) {
  const points = all.filter((p) => p[1] !== null);  // null: a non-finite loss
  const w = 560, h = 220, pad = 40;
  const svg = svgEl("svg", { viewBox: `0 0 ${w} ${h}`, width: "100%", id: "curve-svg",
                             "data-points": points.length });
  if (points.length < 2) {
    svg.append(svgEl("text", { x: pad, y: h / 2 }, "the curve starts after two steps"));
    return svg;
  }
  const steps = points.map((p) => p[0]), losses = points.map((p) => p[1]);
  const x0 = Math.min(...steps), x1 = Math.max(...steps);
  const y0 = Math.min(...losses), y1 = Math.max(...losses);
  const x = (s) => pad + (w - 2 * pad) * (s - x0) / Math.max(1, x1 - x0);
  const y = (l) => h - pad - (h - 2 * pad) * (l - y0) / Math.max(1e-9, y1 - y0);
  svg.append(svgEl("line", { x1: pad, y1: h - pad, x2: w - pad, y2: h - pad, stroke: "#ccc" }));
  svg.append(svgEl("line", { x1: pad, y1: pad, x2: pad, y2: h - pad, stroke: "#ccc" }));
  svg.append(svgEl("polyline", {
    points: points.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" "),
    fill: "none", stroke: "#c2410c", "stroke-width": 1.5 }));
  svg.append(svgEl("text", { x: 2, y: pad + 4 }, y1.toFixed(3)));
  svg.append(svgEl("text", { x: 2, y: h - pad }, y0.toFixed(3)));
  svg.append(svgEl("text", { x: pad, y: h - pad + 16 }, `step ${x0}`));
  svg.append(svgEl("text", { x: w - pad, y: h - pad + 16, "text-anchor": "end" }, `step ${x1}`));
  return svg;
}

function renderMembers(cluster) {
  const members = [...(cluster.stores || []), ...(cluster.workers || [])];
  if (!members.length) return el("p", { class: "muted" }, "No members registered");
  const rows = members.map((m) => {
    const state = words(m.state, "MEMBER_STATE_");
    const store = m.role === "MEMBER_ROLE_STORE";
    return el("tr", { "data-member": m.member_id },
      el("td", {}, m.member_id),
      el("td", {}, words(m.role, "MEMBER_ROLE_")),
      el("td", { class: `state-${state}` }, state),
      el("td", {}, m.health || diskWord(store, m)),
      el("td", {}, store ? `${bytes(m.ram_bytes)} RAM · ${bytes(m.rocksdb_bytes)} disk · ` +
                           `${bytes(m.disk_free_bytes)} free`
                         : words(m.backend, "BACKEND_")),
      el("td", {}, store ? bytes(m.capacity_bytes) : (m.job_id || "–")));
  });
  return table(["member", "role", "state", "health", "tiers / backend", "capacity / job"], rows);
}

function renderMoves(cluster) {
  const parts = [el("p", {}, `replica deficit ${cluster.replica_deficit} · ` +
    `${cluster.blobs_moved} blobs (${bytes(cluster.bytes_moved)}) moved so far`)];
  const moves = (cluster.moves || []).map((m) => el("tr", {},
    el("td", {}, `${m.from_store_id} → ${m.to_store_id}`),
    el("td", {}, m.key ? `${m.key.job_id} layer ${m.key.layer} expert ${m.key.expert}` : ""),
    el("td", {}, bytes(m.size_bytes)), el("td", { class: "muted" }, m.reason)));
  if (moves.length) parts.push(table(["move", "blob", "size", "why"], moves));
  const drains = (cluster.drains || []).map((d) => el("tr", {},
    el("td", {}, d.store_id), el("td", {}, `${d.groups_left} of ${d.groups_total} groups left`),
    el("td", {}, d.can_stop ? "can be stopped" : "draining")));
  if (drains.length) parts.push(table(["drain", "progress", ""], drains));
  return el("div", {}, ...parts);
}

function renderHeat(heat) {
  const experts = heat.experts || [];
  if (!experts.length) return el("p", { class: "muted" }, "No heat reported yet");
  let layers = 0, width = 0;
  for (const e of experts) {
    layers = Math.max(layers, (e.expert.layer || 0) + 1);
    width = Math.max(width, (e.expert.expert || 0) + 1);
  }
  const cell = Math.max(4, Math.min(28, Math.floor(960 / width)));
  const left = 64, top = 8;
  const value = (e) => Number(view.colorBy === "heat" ? e.heat : e.fetches);
  // A placed expert has a store; an ended job's placement is gone (every count 0), so its
  // cells show how often each expert was fetched instead, as pith experts --svg does.
  const placed = experts.some((e) => Number(e.store_replicas || 0) > 0);
  const layerMax = new Array(layers).fill(0), layerFetches = new Array(layers).fill(0);
  for (const e of experts) {
    const l = e.expert.layer || 0;
    layerMax[l] = Math.max(layerMax[l], value(e));
    layerFetches[l] += Number(e.fetches);
  }
  const svg = svgEl("svg", { width: left + width * cell + 140, height: top + layers * cell + 8,
                             id: "heat-svg", "data-cells": experts.length });
  for (let l = 0; l < layers; l++) {
    svg.append(svgEl("text", { x: 0, y: top + l * cell + cell * 0.7 }, `layer ${l}`));
    svg.append(svgEl("text", { x: left + width * cell + 8, y: top + l * cell + cell * 0.7 },
                     `${layerFetches[l]} fetches`));
  }
  for (const e of experts) {
    const l = e.expert.layer || 0, x = e.expert.expert || 0;
    const v = layerMax[l] > 0 ? value(e) / layerMax[l] : 0;
    const rect = svgEl("rect", { x: left + x * cell, y: top + l * cell, width: cell - 1,
                                 height: cell - 1, fill: `hsl(20, 90%, ${97 - 62 * v}%)` });
    rect.append(svgEl("title", {}, `layer ${l} expert ${x}: heat ${Number(e.heat).toFixed(1)}, ` +
      `${e.fetches} fetches, ${e.store_replicas} store copies, ` +
      `${e.compute_replicas} compute replicas`));
    svg.append(rect);
    if (cell >= 16) {
      svg.append(svgEl("text", { x: left + x * cell + cell / 2, y: top + l * cell + cell * 0.68,
                                 "text-anchor": "middle", style: v > 0.6 ? "fill: #fff" : "" },
                       String(Number((placed ? e.store_replicas : e.fetches) || 0))));
    }
  }
  return svg;
}

async function refresh(schedule = true) {
  try {
    const overview = await getJson("/api/overview");
    const jobs = overview.jobs.jobs || [];
    if (!jobs.some((j) => j.job_id === view.selected)) {
      const running = jobs.find((j) => j.state === "JOB_STATE_RUNNING");
      view.selected = running ? running.job_id : (jobs[0] ? jobs[0].job_id : null);
    }
    replace("jobs", renderJobs(jobs));
    replace("members", renderMembers(overview.cluster));
    replace("moves", renderMoves(overview.cluster));
    document.getElementById("curve-job").textContent = view.selected || "";
    document.getElementById("heat-job").textContent = view.selected || "";
    replace("curve", renderCurve(view.selected ? overview.curves[view.selected] || [] : []));
    if (view.selected) {
      const heat = await getJson(`/api/experts?job=${encodeURIComponent(view.selected)}`);
      replace("heat", renderHeat(heat));
    } else {
      replace("heat", el("p", { class: "muted" }, "No job selected"));
    }
    view.updates++;
    document.body.dataset.updates = String(view.updates);
    document.getElementById("status").textContent =
      `updated ${new Date().toLocaleTimeString()} · ${jobs.length} jobs`;
    note("");
  } catch (e) {
    document.getElementById("status").textContent = "cannot reach the coordinator";
    note(String(e.message || e));
  } finally {
    if (schedule) setTimeout(refresh, 1000);
  }
}

for (const [id, by] of [["by-heat", "heat"], ["by-fetches", "fetches"]]) {
  document.getElementById(id).addEventListener("click", () => {
    view.colorBy = by;
    document.getElementById("by-heat").classList.toggle("on", by === "heat");
    document.getElementById("by-fetches").classList.toggle("on", by === "fetches");
    refresh(false);
  });
}
refresh();
