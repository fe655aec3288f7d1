"""The dashboard's one page (dashboard.py serves it): plain HTML, CSS and script, no external assets;
it reads /fleet.json every 10 seconds and draws the fleet's table and the rounds' charts in SVG."""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>EdgeFL</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.2em;color:#1d2630;background:#fafbfc}
h1{font-size:1.3em;margin:0 0 .2em}h2{font-size:1.05em;margin:1.2em 0 .4em}
.note{color:#5b6670}.bad{color:#a4262c}.good{color:#1e7b34}
table{border-collapse:collapse;background:#fff;width:100%}
th,td{border-bottom:1px solid #e3e7eb;padding:.3em .5em;text-align:left;white-space:nowrap}
th{background:#eef1f4;font-weight:600}td.num{text-align:right}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(340px,1fr));gap:1em}
.chart{background:#fff;border:1px solid #e3e7eb;padding:.5em}svg{width:100%;height:170px}
svg text{font-size:10px;fill:#5b6670}
</style></head><body>
<h1 id="title">EdgeFL</h1><div id="pace" class="note"></div>
<h2>Devices</h2><div id="summary" class="note"></div>
<table><thead><tr><th>device</th><th>state</th><th>release</th><th>machine</th><th>may train</th>
<th>rounds</th><th>folded</th><th>clipped</th><th>left out</th><th>last verdict</th><th>serving</th></tr></thead>
<tbody id="devices"></tbody></table>
<h2>Rounds</h2><div class="charts">
<div class="chart"><div id="score-title">the served model's score</div><svg id="score"></svg></div>
<div class="chart"><div>participants per round</div><svg id="participants"></svg></div>
<div class="chart"><div>kilobytes of updates received per round</div><svg id="bytes"></svg></div>
<div class="chart" id="privacy-box" hidden><div>privacy: epsilon spent</div><svg id="privacy"></svg></div>
</div>
<p class="note" id="stamp"></p>
<script>
"use strict";
const el = id => document.getElementById(id);
function text(node, value) { node.textContent = value == null ? "" : String(value); return node; }
function cell(row, value, cls) { const td = text(document.createElement("td"), value); if (cls) td.className = cls; row.appendChild(td); }
function chart(svg, xs, series, opts) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = 340, H = 170, L = 38, B = 18, ns = "http://www.w3.org/2000/svg";
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const values = series.flatMap(s => s.values).filter(v => v != null);
  if (!xs.length || !values.length) { const t = document.createElementNS(ns, "text"); t.setAttribute("x", L); t.setAttribute("y", H / 2); t.textContent = "no rounds yet"; svg.appendChild(t); return; }
  const lo = opts.zero ? 0 : Math.min(...values), hi = Math.max(...values, lo + 1e-9);
  const x = i => L + (xs.length > 1 ? i * (W - L - 6) / (xs.length - 1) : (W - L) / 2);
  const y = v => H - B - (v - lo) * (H - B - 8) / (hi - lo);
  for (const v of [lo, hi]) { const t = document.createElementNS(ns, "text"); t.setAttribute("x", 2); t.setAttribute("y", y(v) + 3); t.textContent = opts.fmt(v); svg.appendChild(t); }
  for (const i of [0, xs.length - 1]) { const t = document.createElementNS(ns, "text"); t.setAttribute("x", x(i) - 6); t.setAttribute("y", H - 4); t.textContent = xs[i]; svg.appendChild(t); }
  for (const s of series) {
    if (opts.bars) { s.values.forEach((v, i) => { if (v == null) return; const r = document.createElementNS(ns, "rect"); const w = Math.max(1, (W - L) / xs.length - 1);
      r.setAttribute("x", x(i) - w / 2); r.setAttribute("y", y(v)); r.setAttribute("width", w); r.setAttribute("height", H - B - y(v)); r.setAttribute("fill", s.color); svg.appendChild(r); }); continue; }
    const pts = s.values.map((v, i) => v == null ? null : `${x(i)},${y(v)}`).filter(p => p);
    const p = document.createElementNS(ns, "polyline"); p.setAttribute("points", pts.join(" ")); p.setAttribute("fill", "none"); p.setAttribute("stroke", s.color); p.setAttribute("stroke-width", "1.6"); svg.appendChild(p);
  }
}
function render(f) {
  text(el("title"), `EdgeFL: federation ${f.federation}`);
  const pace = f.pacing; text(el("pace"), pace && pace.state !== "running" ? `${pace.state}: ${pace.why}; ${pace.wakes}` : "running");
  const body = el("devices"); while (body.firstChild) body.removeChild(body.firstChild);
  let online = 0, eligible = 0;
  for (const d of f.devices) {
    const row = document.createElement("tr"); online += d.state === "online"; eligible += d.eligible;
    cell(row, d.device); cell(row, d.state, d.state === "online" ? "good" : d.state === "revoked" ? "bad" : "note");
    cell(row, d.version); cell(row, [d.machine, d.cores ? d.cores + (d.cores === 1 ? " core" : " cores") : ""].filter(Boolean).join(", "));
    cell(row, d.state !== "online" ? "" : d.eligible ? "yes" : "no: " + d.why, d.eligible ? "" : "note");
    for (const k of ["rounds", "folded", "clipped", "left_out"]) cell(row, d[k], k === "left_out" && d[k] ? "num bad" : "num");
    cell(row, d.last_verdict); cell(row, d.serving, "num"); body.appendChild(row);
  }
  text(el("summary"), `${online} online of ${f.devices.length}, ${eligible} may train now`);
  const done = f.rounds.filter(r => r.closed === "complete" || r.closed === "deadline");
  const xs = done.map(r => r.round), metric = done.length ? done[done.length - 1].metric : "";
  text(el("score-title"), `the served model's ${metric || "score"}`);
  chart(el("score"), xs, [{values: done.map(r => r.score), color: "#2864a8"}], {fmt: v => v.toFixed(3)});
  chart(el("participants"), xs, [{values: done.map(r => r.participants), color: "#5a8f3d"}], {zero: true, bars: true, fmt: v => v.toFixed(0)});
  chart(el("bytes"), xs, [{values: done.map(r => r.bytes_up == null ? null : r.bytes_up / 1024), color: "#a05a2c"}], {zero: true, fmt: v => v.toFixed(0)});
  const eps = done.map(r => r.epsilon); el("privacy-box").hidden = !eps.some(v => v != null);
  chart(el("privacy"), xs, [{values: eps, color: "#a4262c"}], {zero: true, fmt: v => v.toFixed(2)});
  text(el("stamp"), `read ${new Date(f.generated_at * 1000).toLocaleString()} from the state directory; refreshed every 10 s`);
  document.body.dataset.ready = "1";
}
async function refresh() {
  try { const r = await fetch("fleet.json", {cache: "no-store"}); const f = await r.json(); if (f.error) throw new Error(f.error); render(f); }
  catch (e) { text(el("stamp"), "cannot read the coordinator's state: " + e.message); }
}
refresh(); setInterval(refresh, 10000);
</script></body></html>
"""
