// The live graph view: lays the running graph out with dagre, draws apps as boxes and links as
// arrows labelled with their packet rate and drops, and refreshes the numbers every second.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const token = new URLSearchParams(location.hash.slice(1)).get("token");
const headers = token ? { Authorization: "Bearer " + token } : {};
let shapeKey = null;
// What the panel shows: { kind: "app" | "link", name }.
let selected = null;
let lastStats = null;

async function get(path) {
  const r = await fetch(path, { headers });
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

function el(name, attrs, parent) {
  const e = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (parent) parent.appendChild(e);
  return e;
}

function linkSpec(l) {
  return typeof l === "string" ? l : l.link;
}

function ends(spec) {
  const [from, to] = spec.split("->").map((s) => s.trim());
  return [from.split(".")[0], to.split(".")[0], from, to];
}

function human(n) {
  if (n >= 1e9) return (n / 1e9).toFixed(2) + "G";
  if (n >= 1e6) return (n / 1e6).toFixed(2) + "M";
  if (n >= 1e3) return (n / 1e3).toFixed(1) + "k";
  return String(Math.round(n));
}

// Lays out and draws the graph; called only when apps or links change.
function draw(doc) {
  const g = new dagre.graphlib.Graph({ multigraph: true });
  g.setGraph({ rankdir: "LR", nodesep: 40, ranksep: 60, edgesep: 30, marginx: 20, marginy: 20 });
  g.setDefaultEdgeLabel(() => ({}));
  for (const [name, entry] of Object.entries(doc.apps)) {
    const placement = entry.placement || "engine";
    const kind = placement === "engine" ? entry.type : `${entry.type} · ${placement}`;
    const width = Math.max(name.length, kind.length + 2, 12) * 8 + 24;
    g.setNode(name, { width, height: 58, kind, placement });
  }
  for (const l of doc.links) {
    const spec = linkSpec(l);
    const [a, b] = ends(spec);
    g.setEdge(a, b, { width: 150, height: 30, labelpos: "c", spec }, spec);
  }
  dagre.layout(g);

  const svg = document.getElementById("graph");
  svg.replaceChildren();
  const size = g.graph();
  // Scaled to the window's width, never above natural size.
  svg.setAttribute("viewBox", `0 0 ${size.width} ${size.height}`);
  svg.setAttribute("preserveAspectRatio", "xMidYMin meet");
  svg.style.width = "100%";
  svg.style.maxWidth = size.width + "px";
  const defs = el("defs", {}, svg);
  const marker = el("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5,
    markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" }, defs);
  el("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#7a8699" }, marker);

  for (const e of g.edges()) {
    const edge = g.edge(e);
    const group = el("g", { class: "link", "data-link": edge.spec }, svg);
    const d = edge.points.map((p, i) => (i ? "L" : "M") + p.x + " " + p.y).join(" ");
    el("path", { d, class: "hit" }, group);
    el("path", { d, "marker-end": "url(#arrow)", class: "line" }, group);
    const [, , from, to] = ends(edge.spec);
    const ports = el("text", { x: edge.x, y: edge.y - 8, "text-anchor": "middle", class: "ports" }, group);
    ports.textContent = from.split(".")[1] + " → " + to.split(".")[1];
    const label = el("text", { x: edge.x, y: edge.y + 8, "text-anchor": "middle", class: "rate" }, group);
    label.textContent = "…";
    group.addEventListener("click", () => { select("link", edge.spec); });
  }
  for (const name of g.nodes()) {
    const n = g.node(name);
    const group = el("g", { class: `app placement-${n.placement}`, "data-app": name, transform: `translate(${n.x - n.width / 2},${n.y - n.height / 2})` }, svg);
    el("rect", { width: n.width, height: n.height, rx: 6 }, group);
    el("text", { x: n.width / 2, y: 18, "text-anchor": "middle", class: "name" }, group).textContent = name;
    el("text", { x: n.width / 2, y: 33, "text-anchor": "middle", class: "kind" }, group).textContent = "(" + n.kind + ")";
    el("text", { x: n.width / 2, y: 49, "text-anchor": "middle", class: "rate" }, group).textContent = "";
    group.addEventListener("click", () => { select("app", name); });
  }
  markSelected();
}

function select(kind, name) {
  selected = { kind, name };
  showPanel(true);
  markSelected();
}

function markSelected() {
  for (const g of document.querySelectorAll(".app")) {
    g.classList.toggle("selected", selected?.kind === "app" && g.dataset.app === selected.name);
  }
  for (const g of document.querySelectorAll(".link")) {
    g.classList.toggle("selected", selected?.kind === "link" && g.dataset.link === selected.name);
  }
}

// Updates the numbers in place.
function update(stats) {
  for (const l of stats.links) {
    const group = document.querySelector(`.link[data-link="${CSS.escape(l.link)}"]`);
    if (!group) continue;
    group.querySelector(".rate").textContent =
      `${human(l.rate_pps)} pps · ${human(l.tx_drops)} drops`;
    group.classList.toggle("busy", l.rate_pps > 0);
    group.classList.toggle("dropping", l.tx_drops > 0);
  }
  for (const a of stats.apps) {
    const group = document.querySelector(`.app[data-app="${CSS.escape(a.name)}"]`);
    if (!group) continue;
    group.querySelector(".rate").textContent =
      a.rx_rate_pps || a.tx_rate_pps ? `in ${human(a.rx_rate_pps)} · out ${human(a.tx_rate_pps)} pps` : "";
    group.classList.toggle("failed", a.failed);
  }
  const pool = stats.pool;
  document.getElementById("summary").textContent =
    `${stats.apps.length} apps · ${stats.links.length} links · ${stats.workers.length} workers · ` +
    `pool ${human(pool.in_use)}/${human(pool.packets)} buffers in use · up ${Math.round(stats.uptime_s)} s`;
}

function counterTable(rows) {
  const table = document.createElement("table");
  table.id = "counters";
  for (const [k, v] of rows) {
    const tr = table.insertRow();
    tr.insertCell().textContent = k;
    const td = tr.insertCell();
    td.className = "v";
    td.textContent = v;
  }
  return table;
}

// `rebuild`: a new selection (the capture form is made again); otherwise only the numbers.
function showPanel(rebuild) {
  const panel = document.getElementById("panel");
  const hint = '<p class="hint">Click an app to see its counters, a link to capture it.</p>';
  if (!selected || !lastStats) {
    panel.innerHTML = hint;
    return;
  }
  if (selected.kind === "app") {
    const a = lastStats.apps.find((x) => x.name === selected.name);
    if (!a) { panel.innerHTML = hint; return; }
    const h = document.createElement("h2");
    h.textContent = a.name;
    panel.replaceChildren(h, counterTable([
      ["type", a.type], ["worker", a.worker],
      ["rx packets", a.rx_packets], ["rx bytes", a.rx_bytes], ["rx pps", human(a.rx_rate_pps)],
      ["tx packets", a.tx_packets], ["tx bytes", a.tx_bytes], ["tx pps", human(a.tx_rate_pps)],
      ["drops", a.drops], ["failed", a.failed ? "yes" : "no"],
      ...Object.entries(a.counters),
    ]));
    return;
  }
  const l = lastStats.links.find((x) => x.link === selected.name);
  if (!l) { panel.innerHTML = hint; return; }
  const table = counterTable([
    ["size", l.size], ["tx packets", l.tx_packets], ["tx bytes", l.tx_bytes],
    ["tx drops", l.tx_drops], ["rx packets", l.rx_packets], ["queued", l.queued],
    ["pps", human(l.rate_pps)], ["captures now", l.taps],
  ]);
  const old = document.getElementById("capture");
  if (!rebuild && old) {
    document.getElementById("counters").replaceWith(table);
    return;
  }
  const h = document.createElement("h2");
  h.textContent = l.link;
  panel.replaceChildren(h, table, captureForm(l.link));
}

// A form that captures the link for some seconds and downloads the PCAPNG file.
function captureForm(spec) {
  const form = document.createElement("form");
  form.id = "capture";
  form.innerHTML =
    '<label>seconds <input name="seconds" type="number" min="1" max="3600" value="10"></label>' +
    '<label>filter <input name="filter" placeholder="libpcap, e.g. udp port 53"></label>' +
    '<button type="submit">capture 10 s</button><p class="capture-status"></p>';
  const seconds = form.elements.seconds;
  const button = form.querySelector("button");
  const status = form.querySelector(".capture-status");
  seconds.addEventListener("input", () => { button.textContent = `capture ${seconds.value} s`; });
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const q = new URLSearchParams({ duration: seconds.value });
    if (form.elements.filter.value.trim()) q.set("filter", form.elements.filter.value);
    button.disabled = true;
    status.className = "capture-status";
    status.textContent = `capturing for ${seconds.value} s…`;
    try {
      const r = await fetch(`/api/v1/links/${encodeURIComponent(spec)}/capture?${q}`, { headers });
      if (!r.ok) {
        const body = await r.json().catch(() => ({}));
        throw new Error(body.error || r.statusText);
      }
      const blob = await r.blob();
      const name = /filename="([^"]+)"/.exec(r.headers.get("content-disposition") || "");
      const a = document.createElement("a");
      a.href = URL.createObjectURL(blob);
      a.download = name ? name[1] : "stitch-capture.pcapng";
      document.body.appendChild(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(a.href), 60000);
      status.textContent = `saved ${a.download} (${human(blob.size)}B)`;
    } catch (e) {
      status.className = "capture-status error";
      status.textContent = "capture refused: " + e.message;
    } finally {
      button.disabled = false;
    }
  });
  return form;
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const [doc, stats] = await Promise.all([get("/api/v1/graph"), get("/api/v1/stats")]);
    const key = JSON.stringify([Object.entries(doc.apps).map(([n, e]) => [n, e.type, e.placement]), doc.links.map(linkSpec)]);
    if (key !== shapeKey) {
      draw(doc);
      shapeKey = key;
    }
    lastStats = stats;
    update(stats);
    if (selected) showPanel(false);
    status.textContent = "live · " + new Date().toLocaleTimeString();
    status.className = "";
  } catch (e) {
    status.textContent = "cannot reach the instance: " + e.message;
    status.className = "error";
  }
}

refresh();
setInterval(refresh, 1000);
