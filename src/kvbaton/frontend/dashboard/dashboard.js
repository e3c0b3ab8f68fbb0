// The cluster page: reads GET /v1/cluster about once a second and shows it (docs/cluster.md).
// - It asks for the API key when the frontend answers 401, keeps it for the tab's session and
//   sends it with its own calls (a navigation cannot carry the header).
// - Numbers are shown as live only while the last call succeeded; otherwise the page says why
//   and since when, and greys out what it shows.
// - Everything shown is set as text (never parsed as HTML).
"use strict";

const POLL_MS = 1000;
const CALL_TIMEOUT_MS = 3000;
const KEY_ITEM = "kvbaton-api-key";

const state = { charts: {}, last: null, lastAt: null, failures: 0 };
window.kvbatonDashboard = state; // for tests and the curious

const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function fill(tableId, rows) {
  const table = $(tableId);
  if (!rows.length) {
    const none = el("td", "none", "none");
    none.colSpan = table.tHead.rows[0].cells.length;
    rows = [row([none])];
  }
  table.tBodies[0].replaceChildren(...rows);
}

function row(cells, attrs) {
  const tr = el("tr");
  for (const cell of cells) tr.append(cell instanceof Node ? cell : el("td", cell));
  for (const [k, v] of Object.entries(attrs || {})) tr.dataset[k] = v;
  return tr;
}

function cellWith(node) {
  const td = el("td");
  td.append(node);
  return td;
}

const num = (v, digits = 0) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));
const pct = (v) => (v === null || v === undefined ? "–" : `${(100 * v).toFixed(1)}%`);
const clock = (t) => new Date(t * 1000).toLocaleTimeString();

function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  const i = Math.min(units.length - 1, Math.floor(Math.log2(n) / 10));
  return `${(n / 2 ** (10 * i)).toFixed(i ? 1 : 0)} ${units[i]}`;
}

function kvBar(load) {
  const td = el("td");
  if (!load || !load.kv_blocks_total) {
    td.textContent = "–";
    return td;
  }
  const bar = el("span", null, "bar");
  const fillSpan = el("span");
  fillSpan.style.width = `${(100 * load.kv_blocks_used) / load.kv_blocks_total}%`;
  bar.append(fillSpan);
  td.append(bar, `${load.kv_blocks_used} / ${load.kv_blocks_total}`);
  return td;
}

function renderModels(models) {
  fill("models", models.map((m) => row(
    [m.name, m.router, m.workers, m.prefill_workers, m.context_length, m.kv_block_size, m.migrations],
    { model: m.name },
  )));
}

function renderWorkers(workers) {
  fill("workers", workers.map((w) => {
    const load = w.load;
    return row([
      w.name,
      w.role || "–",
      w.healthy ? el("td", w.state, `state-${w.state}`) : el("td", `${w.state}, unhealthy`, "state-unhealthy"),
      w.restarts === null ? "–" : w.restarts,
      w.instance || "–",
      w.pid || "–",
      load ? load.running : "–",
      load ? load.waiting : "–",
      kvBar(load),
      load ? pct(load.prefix_cache_hit_rate) : "–",
      w.in_flight,
      load ? `${num(load.age_s, 1)} s` : "–",
    ], { worker: w.name, state: w.state });
  }));
  fill("transfers", workers.filter((w) => w.load && w.load.kv_handoffs).map((w) => row([
    w.name,
    w.role,
    w.load.kv_handoffs,
    bytes(w.load.kv_transfer_bytes),
    `${num(w.load.kv_transfer_seconds, 3)} s`,
    `${num(w.load.kv_handoff_wait_seconds, 3)} s`,
  ])));
  fill("prefills", state.last.models.filter((m) => m.disaggregated).map((m) => row([
    m.name, m.disaggregated.answered, m.disaggregated.fallbacks, m.disaggregated.failures,
    m.disaggregated.unsettled,
  ])));
}

function renderRoutes(routes, workers) {
  const names = Object.fromEntries(workers.filter((w) => w.instance).map((w) => [w.instance, w.name]));
  const named = (id) => (id && names[id] && names[id] !== id ? `${names[id]} (${id})` : id || "–");
  fill("routes", routes.map((r) => {
    const up = r.runner_up || {};
    return row([
      clock(r.at), r.model, r.pool, r.mode, named(r.chosen.worker),
      num(r.chosen.overlap_blocks), num(r.chosen.cost, 1),
      named(up.worker), num(up.overlap_blocks), num(up.cost, 1),
    ]);
  }));
}

function renderPlanner(planner) {
  const box = $("planner");
  if (!planner) {
    box.replaceChildren(el("p", "No planner reports its decisions on this namespace."));
    return;
  }
  const items = planner.decisions.slice(0, 10).map((d) => {
    const div = el("div", null, "decision");
    const pools = d.pools.map((p) => `${p.role} ${p.current} → ${p.wanted}`).join(", ");
    const how = d.dry_run ? "dry run" : d.applied ? "applied" : "not applied";
    div.append(el("b", `${clock(d.at)}: ${pools} (${how}; predicted ${num(d.predicted_request_rate, 2)} requests/s)`));
    if (d.reasons.length) {
      const list = el("ul");
      for (const reason of d.reasons) list.append(el("li", reason));
      div.append(list);
    }
    return div;
  });
  box.replaceChildren(el("p", `Every ${planner.interval_s} s; newest first:`), ...items);
}

function renderFrontends(frontends) {
  fill("frontends", frontends.map((f) => row(
    [f.name, el("td", f.state, `state-${f.state}`), f.restarts, f.pid || "–"],
  )));
}

function chart(id, labels, colors, points) {
  // `points`: mark each value (latencies: a step with few requests is one lone value)
  const series = [{}].concat(labels.map((label, i) => (
    { label, stroke: colors[i], width: 2, points: { show: points, size: 5, fill: colors[i] } })));
  const opts = { width: 420, height: 200, series, scales: { x: { time: true } }, legend: { show: true } };
  const data = [[], ...labels.map(() => [])];
  return new uPlot(opts, data, $(id));
}

function renderCharts(requests) {
  if (!state.charts.rate) {
    state.charts.rate = chart("chart-rate", ["requests/s", "failed/s"], ["#4a7bd0", "#b00020"], false);
    state.charts.ttft = chart("chart-ttft", ["p50", "p90"], ["#2a9d8f", "#e76f51"], true);
    state.charts.itl = chart("chart-itl", ["p50", "p90"], ["#2a9d8f", "#e76f51"], true);
  }
  const p = requests.points;
  const t = p.map((x) => x.t);
  const ms = (key) => p.map((x) => (x[key] === null ? null : 1000 * x[key]));
  state.charts.rate.setData([t, p.map((x) => x.requests_per_s), p.map((x) => x.failed_per_s)]);
  state.charts.ttft.setData([t, ms("ttft_p50_s"), ms("ttft_p90_s")]);
  state.charts.itl.setData([t, ms("itl_p50_s"), ms("itl_p90_s")]);
  $("requests-ended").textContent = state.last.frontend.requests_ended;
  $("span").textContent = `${Math.round(requests.span_s / 60)} minutes`;
  $("step").textContent = `${requests.step_s} s`;
}

function render(cluster) {
  state.last = cluster;
  renderModels(cluster.models);
  renderWorkers(cluster.workers);
  renderCharts(cluster.requests);
  renderRoutes(cluster.routes, cluster.workers);
  renderPlanner(cluster.planner);
  renderFrontends(cluster.frontends);
}

function showLive(live, text) {
  const status = $("status");
  status.dataset.live = String(live);
  status.textContent = text;
  $("content").classList.toggle("stale", !live);
}

async function call() {
  const headers = {};
  const key = sessionStorage.getItem(KEY_ITEM);
  if (key) headers.Authorization = `Bearer ${key}`;
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), CALL_TIMEOUT_MS);
  try {
    return await fetch("/v1/cluster", { headers, cache: "no-store", signal: abort.signal });
  } finally {
    clearTimeout(timer);
  }
}

async function poll() {
  let why = null;
  try {
    const answer = await call();
    if (answer.status === 401) {
      $("key-form").hidden = false;
      $("key-error").textContent = sessionStorage.getItem(KEY_ITEM) ? "that key was refused" : "";
      why = "an API key is needed";
    } else if (!answer.ok) {
      why = `the frontend answered ${answer.status}`;
    } else {
      render(await answer.json());
      state.lastAt = new Date();
      state.failures = 0;
      $("key-form").hidden = true;
      showLive(true, `live · updated ${state.lastAt.toLocaleTimeString()}`);
    }
  } catch (error) {
    why = error.name === "AbortError" ? "no answer within 3 s" : "the frontend cannot be reached";
  }
  if (why !== null) {
    state.failures += 1;
    const since = state.lastAt ? `; the numbers below are from ${state.lastAt.toLocaleTimeString()}, not live` : "";
    showLive(false, `not live: ${why}${since}`);
  }
  setTimeout(poll, POLL_MS);
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_ITEM, $("key").value);
  $("key").value = "";
});

poll();
