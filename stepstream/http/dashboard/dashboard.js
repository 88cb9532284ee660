// The stepstream console: reads the JSON API of the process that served this page, and redraws what changed
// every few seconds (?refresh=SECONDS, default 3). No build step, no dependencies.
//
// The view is in the URL, so it can be shared: the task list's filters in the query (?state=compensated&q=order-1),
// ?view=dlq for dead letters, ?view=deps for the agents' dependencies, and a task in the fragment (#task=ID).
// Data is only ever written with textContent.
"use strict";

const STATES = JSON.parse(document.body.dataset.taskStates);  // the server's list (schemas/states.py)
const REFRESH_S = Number(new URLSearchParams(location.search).get("refresh")) || 3;
const FILTERS = ["state", "workflow", "version", "q", "submitter", "since", "until"];
const PAGE = 25;
const SVG = "http://www.w3.org/2000/svg";
// The operator commands a task in each state may take; the scheduler still decides (and says why it refuses).
const ACTIONS = {
  accepted: ["cancel"], running: ["cancel"], waiting: ["try-now", "cancel"],
  error: ["resubmit", "compensate"], compensation_failed: ["retry-compensation"],
};
const ACTION_WORDS = {
  cancel: "Cancel this task, undoing every step it may have applied?",
  "try-now": "Start the waiting step's next attempt now, without waiting for its timer?",
  resubmit: "Run the failed step again, with a fresh failure count and budget?",
  compensate: "Undo every step this task may have applied?",
  "retry-compensation": "Try the failed compensation again, then the steps it did not reach?",
};

// ---- small helpers ---------------------------------------------------------------------------------

async function get(path) {
  const response = await fetch(path, {headers: {accept: "application/json"}});
  if (!response.ok) {
    let detail = "";
    try { detail = JSON.stringify((await response.json()).detail); } catch (_) { /* not JSON */ }
    throw new Error(`${path}: HTTP ${response.status} ${detail}`);
  }
  return response.json();
}

function el(tag, text, attrs = {}) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function svgEl(tag, attrs = {}, title = null) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (title !== null) node.append(Object.assign(document.createElementNS(SVG, "title"), {textContent: title}));
  return node;
}

const $ = id => document.getElementById(id);
const when = ms => ms ? new Date(ms).toISOString().replace("T", " ").slice(0, 19) : "";
const seconds = ms => ms === null || ms === undefined ? "" : ms < 1000 ? `${ms} ms` : `${(ms / 1000).toFixed(1)} s`;
const cls = text => String(text).replace(/[^a-z0-9]+/gi, "-");

function setText(id, text) {
  const node = $(id);
  if (node.textContent !== String(text)) node.textContent = String(text);
}

// ---- tables drawn from column definitions, updated in place ------------------------------------------
//
// A table is given its columns once: [{name, value: row => text or Node, cls?: row => class}]; the header is
// drawn from the same list, so a header and its cells cannot drift apart. Each refresh updates the rows by key:
// a row that is still there keeps its element (and its hover, focus, text selection), only changed cells are
// written, and rows move only when the order changed.

class Table {
  constructor(id, columns, key, onPick = null, rowClass = null) {
    this.rowClass = rowClass;
    this.table = $(id);
    this.columns = columns;
    this.key = key;
    this.onPick = onPick;
    this.rows = new Map();
    const head = el("tr");
    for (const column of columns) head.append(el("th", column.name, {"data-col": column.name}));
    this.head = el("thead");
    this.head.append(head);
    this.body = el("tbody");
    this.table.replaceChildren(this.head, this.body);
  }

  draw(items) {
    const seen = new Set();
    const order = [];
    for (const item of items) {
      const key = this.key(item);
      seen.add(key);
      let tr = this.rows.get(key);
      if (!tr) {
        tr = this.create(item, key);
        this.rows.set(key, tr);
      }
      this.update(tr, item);
      order.push(tr);
    }
    for (const [key, tr] of this.rows) {
      if (!seen.has(key)) {
        tr.remove();
        this.rows.delete(key);
      }
    }
    if (!order.length) {
      if (this.body.children.length !== 1 || !this.body.querySelector("td.empty")) {
        const tr = el("tr");
        tr.append(el("td", "none", {colspan: this.columns.length, class: "empty"}));
        this.body.replaceChildren(tr);
      }
      return;
    }
    for (const tr of [...this.body.children]) if (!tr.dataset.key) tr.remove();  // "none", or an error
    order.forEach((tr, i) => {
      if (this.body.children[i] !== tr) this.body.insertBefore(tr, this.body.children[i] || null);
    });
  }

  create(item, key) {
    const tr = el("tr", null, {"data-key": key});
    for (const column of this.columns) tr.append(el("td", null, {"data-col": column.name}));
    if (this.onPick) {
      tr.classList.add("clickable");
      tr.addEventListener("click", () => this.onPick(tr.item));
    }
    return tr;
  }

  update(tr, item) {
    tr.item = item;
    if (this.rowClass && tr.className !== `${this.onPick ? "clickable " : ""}${this.rowClass(item)}`.trim()) {
      tr.className = `${this.onPick ? "clickable " : ""}${this.rowClass(item)}`.trim();
    }
    this.columns.forEach((column, i) => {
      const td = tr.children[i];
      const value = column.value(item);
      if (value instanceof Node) {
        if (!td.firstChild) td.append(value);  // controls are made once per row
      } else {
        const text = value === null || value === undefined ? "" : String(value);
        if (td.textContent !== text) td.textContent = text;
      }
      const wanted = column.cls ? column.cls(item) || "" : "";
      if (td.className !== wanted) td.className = wanted;
    });
  }
}

// ---- operator commands -------------------------------------------------------------------------------

function answer(text, bad = false) {
  const node = $("command-answer");
  node.hidden = false;
  node.textContent = text;
  node.classList.toggle("error", bad);
}

function operatorToken() {
  const token = $("operator-token").value.trim();
  if (!token) answer("enter an operator token (one of STEPSTREAM_API_TOKENS) to act", true);
  return token;
}

async function post(path, body, label) {
  const token = operatorToken();
  if (!token) return null;
  answer(`${label}: sending…`);
  try {
    const response = await fetch(path, {
      method: "POST", body: body === null ? null : JSON.stringify(body),
      headers: {"content-type": "application/json", accept: "application/json", authorization: `Bearer ${token}`},
    });
    const reply = await response.json();
    const detail = typeof reply.detail === "string" ? reply.detail : reply.detail && JSON.stringify(reply.detail);
    answer([`${label}: HTTP ${response.status}`, reply.outcome, reply.replayed_to && `to ${reply.replayed_to}`,
            reply.shredded && `data key ${reply.shredded} tombstoned`, detail].filter(Boolean).join(" "),
           !response.ok);
    return reply;
  } catch (err) {
    answer(`${label}: ${err.message}`, true);
    return null;
  }
}

async function command(taskId, action, step) {
  if (!operatorToken()) return;
  if (!confirm(`${action} ${taskId}: ${ACTION_WORDS[action]}`)) return;
  await post(`/api/tasks/${encodeURIComponent(taskId)}/commands`, step ? {action, step} : {action},
             `${action} ${taskId}`);
  if (current.task === taskId) showTask(taskId);
}

function buttons(...specs) {
  const span = el("span", null, {class: "actions"});
  for (const [label, onClick] of specs) {
    const button = el("button", label, {type: "button"});
    button.addEventListener("click", event => {
      event.stopPropagation();  // a button is not a click on its row
      onClick();
    });
    span.append(button);
  }
  return span;
}

// ---- the URL: which view, which filters, which task --------------------------------------------------

const current = {view: "tasks", task: null, filters: {}, cursors: [null], page: 0};

function readLocation() {
  const query = new URLSearchParams(location.search);
  current.view = ["dlq", "deps"].includes(query.get("view")) ? query.get("view") : "tasks";
  current.filters = Object.fromEntries(FILTERS.map(f => [f, query.get(f) || ""]).filter(([, v]) => v));
  current.task = new URLSearchParams(location.hash.slice(1)).get("task");
  current.cursors = [null];
  current.page = 0;
  const form = $("filters");
  for (const name of FILTERS) form.elements[name].value = current.filters[name] || "";
}

function filterUrl(filters) {
  const query = new URLSearchParams(filters);
  const refresh = new URLSearchParams(location.search).get("refresh");
  if (refresh) query.set("refresh", refresh);
  return query.toString() ? `/?${query}` : "/";
}

function applyFilters(filters) {
  history.pushState(null, "", filterUrl(filters));
  readLocation();
  showView();
}

function showView() {
  const view = current.task ? "task" : current.view;
  for (const name of ["tasks", "task", "dlq", "deps"]) $(`view-${name}`).hidden = name !== view;
  for (const link of document.querySelectorAll("nav a")) link.classList.toggle("active", link.dataset.view === view);
  if (view === "task") showTask(current.task);
  else if (view === "tasks") loadTasks().then(refresh);
  else refresh();
}

// ---- the task list ------------------------------------------------------------------------------------

const taskTable = new Table("tasks", [
  {name: "task", value: r => r.task_id, cls: () => "id"},
  {name: "workflow", value: r => `${r.workflow} v${r.workflow_version}`},
  {name: "state", value: r => r.status, cls: r => `state ${r.status}`},
  {name: "step", value: r => r.current_step},
  {name: "failures", value: r => r.failure_count, cls: () => "n"},
  {name: "submitter", value: r => r.submitter},
  {name: "created", value: r => when(r.created_at)},
  {name: "error", value: r => r.error || r.quarantine_reason, cls: () => "error"},
], r => r.task_id, r => openTask(r.task_id));

function isoFilter(local) {  // a datetime-local value is the viewer's local time: the API wants an offset
  return local ? new Date(local).toISOString() : "";
}

let tasksAsked = 0;

async function loadTasks() {
  const asked = ++tasksAsked;  // a page asked for later wins over one still on its way
  const query = new URLSearchParams({limit: PAGE});
  for (const [name, value] of Object.entries(current.filters)) {
    query.set(name, name === "since" || name === "until" ? isoFilter(value) : value);
  }
  const cursor = current.cursors[current.page];
  if (cursor) query.set("cursor", cursor);
  try {
    const page = await get(`/api/tasks?${query}`);
    if (asked !== tasksAsked) return true;
    $("tasks-error").hidden = true;
    taskTable.draw(page.items);
    current.cursors[current.page + 1] = page.next_cursor;
    const first = current.page * PAGE;
    setText("matching", `${page.total} matching`);
    setText("page-info", page.items.length ? `${first + 1}–${first + page.items.length} of ${page.total}` : "");
    $("older").disabled = !page.next_cursor;
    $("newer").disabled = current.page === 0;
    return true;
  } catch (err) {
    $("tasks-error").hidden = false;
    $("tasks-error").textContent = err.message;  // e.g. a 422 naming the filter at fault
    return false;
  }
}

function drawCounts(counts) {
  const tiles = $("counts");
  if (!tiles.children.length) {
    for (const state of STATES) {
      const tile = el("a", null, {class: `tile ${state}`, href: filterUrl({state}), "data-state": state});
      tile.append(el("div", 0, {class: "n", "data-count": state}), el("div", state));
      tile.addEventListener("click", event => {
        event.preventDefault();
        applyFilters(current.filters.state === state ? {} : {state});
      });
      tiles.append(tile);
    }
  }
  for (const node of tiles.querySelectorAll("[data-count]")) {
    const n = String(counts.tasks[node.dataset.count] || 0);
    if (node.textContent !== n) node.textContent = n;
  }
  for (const tile of tiles.children) tile.classList.toggle("chosen", tile.dataset.state === current.filters.state);
  setText("total", `${counts.total} in all`);
}

// ---- charts --------------------------------------------------------------------------------------------

function lineChart(id, series, lines, unit = "") {
  const svg = $(id);
  const width = 300, height = 80, top = 12;
  const peak = Math.max(1, ...series.flatMap(p => lines.map(l => p[l.key] || 0)));
  const step = width / Math.max(1, series.length - 1);
  const y = v => height - (height - top) * v / peak;
  const parts = [svgEl("text", {x: 2, y: 10, class: "axis"}, null)];
  parts[0].textContent = `${unit === "ms" ? seconds(peak) : peak}`;
  for (const line of lines) {
    const points = series.map((p, i) => p[line.key] === null || p[line.key] === undefined ? null :
                                `${(i * step).toFixed(1)},${y(p[line.key]).toFixed(1)}`).filter(Boolean);
    parts.push(svgEl("polyline", {points: points.join(" "), class: `line ${line.cls}`}));
  }
  series.forEach((p, i) => {  // a hover target per minute with every figure of that minute
    const text = `${when(p.minute).slice(11, 16)}  ` +
      lines.map(l => `${l.label}: ${unit === "ms" ? seconds(p[l.key]) || "–" : p[l.key] ?? 0}`).join(", ");
    parts.push(svgEl("rect", {x: i * step - step / 2, y: 0, width: step, height, class: "hover"}, text));
  });
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.replaceChildren(...parts);
}

function drawCharts(charts, throughput) {
  const s = charts.series;
  lineChart("chart-finished", s, [{key: "completed", cls: "completed", label: "completed"},
                                  {key: "compensated", cls: "compensated", label: "compensated"}]);
  lineChart("chart-latency", s, [{key: "latency_p50_ms", cls: "p50", label: "p50"},
                                 {key: "latency_p99_ms", cls: "p99", label: "p99"}], "ms");
  lineChart("chart-queue", s, [{key: "queue_depth", cls: "queue", label: "queued"}]);
  lineChart("chart-events", throughput.series, [{key: "events", cls: "events", label: "events"}]);
  setText("throughput-total", throughput.total);
}

// ---- the cards beside the list ---------------------------------------------------------------------------

const pick = r => openTask(r.task_id);
const stepKey = r => `${r.task_id}/${r.step}`;
const waitingTable = new Table("waiting", [
  {name: "task", value: r => r.task_id, cls: () => "id"}, {name: "step", value: r => r.step},
  {name: "attempt", value: r => r.attempt, cls: () => "n"}, {name: "retry at", value: r => when(r.retry_at)},
  {name: "why", value: r => r.wait_reason, cls: () => "error"},
  {name: "act", value: r => buttons(["try now", () => command(r.task_id, "try-now", r.step)],
                                    ["cancel", () => command(r.task_id, "cancel")])},
], stepKey, pick);
const failedTable = new Table("failed", [
  {name: "task", value: r => r.task_id, cls: () => "id"}, {name: "step", value: r => r.step},
  {name: "state", value: r => r.status, cls: r => `state ${r.status}`},
  {name: "failures", value: r => r.status === "compensation_failed" ? r.compensation_failure_count : r.failure_count,
   cls: () => "n"},
  // an undo refused for good keeps its reason in compensation_error; the forward error is the step's own
  {name: "error", value: r => r.status === "compensation_failed" ? r.compensation_error : r.error, cls: () => "error"},
  {name: "when", value: r => when(r.updated_at)},
], stepKey, pick);
const stuckTable = new Table("stuck", [
  {name: "task", value: r => r.task_id, cls: () => "id"}, {name: "step", value: r => r.step},
  {name: "state", value: r => r.status}, {name: "attempt", value: r => r.attempt, cls: () => "n"},
  {name: "deadline", value: r => when(r.complete_by)},
], stepKey, pick);
const queuedTable = new Table("queued", [
  {name: "task", value: r => r.task_id, cls: () => "id"}, {name: "step", value: r => r.step},
  {name: "state", value: r => r.status}, {name: "waiting", value: r => seconds(r.waiting_ms), cls: () => "n"},
  {name: "start by", value: r => when(r.start_by)},
], stepKey, pick);
const alertTable = new Table("alerts", [
  {name: "when", value: r => when(r.occurred_at)}, {name: "task", value: r => r.task_id, cls: () => "id"},
  {name: "step", value: r => r.step}, {name: "reason", value: r => r.reason, cls: () => "error"},
], r => r.id, pick);

// Lag: one line per group (its total, worst partition), its partitions shown under it on demand.
const openGroups = new Set();
const lagTable = new Table("lag", [
  {name: "group", value: r => r.partition === undefined ? `${openGroups.has(r.group) ? "▾" : "▸"} ${r.group}` :
    `    ${r.topic}[${r.partition}]`, cls: r => r.partition === undefined ? "group" : "partition"},
  {name: "partitions", value: r => r.partitions ?? "", cls: () => "n"},
  {name: "lag", value: r => r.lag, cls: r => r.lag > 0 ? "n warn" : "n"},
  {name: "worst partition", value: r => r.worst ?? `${r.position} / ${r.end}`},
], r => r.partition === undefined ? r.group : `${r.group}/${r.topic}/${r.partition}`, r => {
  if (r.partition !== undefined) return;
  if (openGroups.has(r.group)) openGroups.delete(r.group); else openGroups.add(r.group);
  drawLag(lastLag);
});
let lastLag = null;

function drawLag(lag) {
  lastLag = lag;
  const groups = new Map();
  for (const row of [...lag.projection, ...lag.groups]) {
    if (!groups.has(row.group)) groups.set(row.group, []);
    groups.get(row.group).push(row);
  }
  const lines = [];
  for (const [group, rows] of [...groups].sort((a, b) => a[0].localeCompare(b[0]))) {
    const worst = rows.reduce((a, b) => (b.lag > a.lag ? b : a));
    lines.push({group, partitions: rows.length, lag: rows.reduce((n, r) => n + (r.lag || 0), 0),
                worst: `${worst.topic}[${worst.partition}]: ${worst.lag}`});
    if (openGroups.has(group)) lines.push(...rows);
  }
  lagTable.draw(lines);
}

async function panel(promise, draw, onError) {
  try {
    draw(await promise);
    return true;
  } catch (err) {
    onError(err);
    return false;
  }
}

function failedTo(table) {  // the table says what went wrong in place of its rows; the rest of the page stays
  return err => {
    table.rows.clear();
    const tr = el("tr");
    tr.append(el("td", err.message, {colspan: table.columns.length, class: "error"}));
    table.body.replaceChildren(tr);
  };
}

// ---- one refresh: every panel on its own, so one failing endpoint leaves the others drawn -------------------

async function refreshTasks() {
  const results = await Promise.all([
    panel(get("/api/counts"), drawCounts, err => setText("total", err.message)),
    panel(Promise.all([get("/api/charts?minutes=60"), get("/api/throughput?minutes=60")]),
          ([charts, throughput]) => drawCharts(charts, throughput), err => setText("throughput-total", err.message)),
    loadTasks(),
    panel(get("/api/steps/waiting?limit=20"), d => waitingTable.draw(d.items), failedTo(waitingTable)),
    panel(get("/api/steps/failed?limit=20"), d => failedTable.draw(d.items), failedTo(failedTable)),
    panel(get("/api/steps/stuck?limit=20"), d => stuckTable.draw(d.items), failedTo(stuckTable)),
    panel(get("/api/steps/queued?limit=20"), d => {
      queuedTable.draw(d.items);
      const w = d.waits;
      setText("queue-waits", w.accepted ?
        `${w.accepted} steps, waited ${seconds(w.mean_ms)} on average, ${seconds(w.max_ms)} at most` : "none");
    }, failedTo(queuedTable)),
    panel(get("/api/alerts?limit=20"), d => alertTable.draw(d.items), failedTo(alertTable)),
    panel(get("/api/lag"), drawLag, failedTo(lagTable)),
    panel(get("/api/agents"), agents => {
      const missing = agents.items.filter(a => a.members === 0).map(a => a.reason);
      setText("agents", missing.length ? missing.join("; ") : `every agent has a process running (${agents.items.length})`);
      $("agents").classList.toggle("error", missing.length > 0);
    }, err => setText("agents", err.message)),
  ]);
  return results.every(Boolean);
}

let refreshing = null;

async function refresh() {
  if (refreshing) return refreshing;  // one refresh at a time: a slow API is never asked twice at once
  refreshing = (async () => {
    const common = await Promise.all([
      panel(get("/api/health"), h => setText("store", h.store), err => setText("store", err.message)),
      panel(get("/api/dlq/summary"), d => setText("dlq-depth", d.depth), () => setText("dlq-depth", "?")),
      panel(get("/api/dependencies"), drawDependencies, err => {
        failedTo(dependencyTable)(err);
        $("trouble").hidden = true;
      }),
    ]);
    let ok = common.every(Boolean);
    if (current.task) await showTask(current.task);
    if (!current.task && current.view === "tasks") ok = await refreshTasks() && ok;
    if (!current.task && current.view === "dlq") ok = await loadDlq(false) && ok;
    setText("refreshed", `${ok ? "refreshed" : "refreshed, with errors,"} ${new Date().toLocaleTimeString()}`);
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
  })();
  try {
    await refreshing;
  } finally {
    refreshing = null;
  }
}

async function loop() {  // the next refresh is planned when this one ended: refreshes never overlap
  await refresh();
  setTimeout(loop, REFRESH_S * 1000);
}

// ---- a task's page: summary, actions, timeline of its attempts, the attempts, every event ----------------------

function openTask(taskId) {
  history.pushState(null, "", `${location.pathname}${location.search}#task=${encodeURIComponent(taskId)}`);
  current.task = taskId;
  showView();
}

const attemptTable = new Table("attempts", [
  {name: "step", value: a => `${a.step}${a.compensation ? " (undo)" : ""}`},
  {name: "attempt", value: a => a.attempt, cls: () => "n"},
  {name: "agent", value: a => a.agent},
  {name: "handed over", value: a => when(a.handed_at)},
  {name: "queued", value: a => seconds((a.accepted_at ?? a.ended_at ?? Date.now()) - a.handed_at), cls: () => "n"},
  {name: "work", value: a => a.accepted_at ? seconds((a.ended_at ?? Date.now()) - a.accepted_at) : "",
   cls: () => "n"},
  {name: "outcome", value: a => a.outcome, cls: a => `outcome ${cls(a.outcome)}`},
  {name: "error", value: a => a.error, cls: () => "error"},
  {name: "then waited", value: a => a.wait_until ? `${seconds(a.wait_until - (a.ended_at ?? a.handed_at))}: ${a.wait_reason}` : ""},
], a => a.attempt_id);

function drawTimeline(attempts) {
  const svg = $("task-timeline");
  if (!attempts.length) {
    svg.replaceChildren();
    return;
  }
  const label = 170, width = 1000, row = 22;
  const now = Date.now();
  const start = Math.min(...attempts.map(a => a.handed_at));
  const end = Math.max(...attempts.flatMap(a => [a.ended_at ?? now, a.wait_until ?? 0]));
  const x = t => label + (width - label - 10) * (t - start) / Math.max(1, end - start);
  const parts = [];
  attempts.forEach((a, i) => {
    const y = 4 + i * row;
    const name = svgEl("text", {x: 0, y: y + 13, class: a.compensation ? "label undo" : "label"});
    name.textContent = `${a.step}${a.compensation ? " undo" : ""} #${a.attempt}`;
    parts.push(name);
    const taken = a.accepted_at ?? a.ended_at ?? now;
    const segments = [["queue", a.handed_at, taken, `queued ${seconds(taken - a.handed_at)}`]];
    if (a.accepted_at) {
      segments.push([`work ${cls(a.outcome)}`, a.accepted_at, a.ended_at ?? now,
                     `${a.outcome} after ${seconds((a.ended_at ?? now) - a.accepted_at)}${a.error ? ": " + a.error : ""}`]);
    } else if (a.ended_at) {
      segments.push([`work ${cls(a.outcome)}`, a.ended_at, a.ended_at, `${a.outcome}: ${a.error || ""}`]);
    }
    if (a.wait_until) {
      segments.push(["wait", a.ended_at ?? a.handed_at, a.wait_until, `waited until ${when(a.wait_until)}: ${a.wait_reason}`]);
    }
    for (const [kind, from, to, title] of segments) {
      parts.push(svgEl("rect", {x: x(from), y, width: Math.max(3, x(to) - x(from)), height: row - 6,
                                class: `seg ${kind}`}, `${a.step} #${a.attempt}: ${title}`));
    }
  });
  const axis = svgEl("text", {x: width - 10, y: 4 + attempts.length * row + 12, class: "axis", "text-anchor": "end"});
  axis.textContent = `${when(start)} → ${when(end)} (${seconds(end - start)})`;
  parts.push(axis);
  svg.setAttribute("viewBox", `0 0 ${width} ${attempts.length * row + 22}`);
  svg.replaceChildren(...parts);
}

// What each compensation set out to undo, in its order, and the steps it found nothing to undo in.
function undoPlan(timeline) {
  const skipped = timeline.filter(e => e.event_type === "StepCompensationSkipped").map(e => e.event.step);
  return timeline.filter(e => e.event_type === "CompensationStarted").map(e =>
    `compensation (${e.event.trigger}${e.event.operator ? " by " + e.event.operator : ""}) ${when(e.occurred_at)}: ` +
    `undo ${e.event.steps.filter(s => !skipped.includes(s)).join(", then ") || "nothing"}` +
    (skipped.length ? `; nothing to undo in ${skipped.join(", ")}` : ""));
}

async function showTask(taskId) {
  $("task-id").value = taskId;
  setText("task-title", taskId);
  try {
    const task = await get(`/api/tasks/${encodeURIComponent(taskId)}`);
    if (current.task !== taskId) return;  // another task was opened meanwhile
    const summary = $("task-summary");
    summary.replaceChildren(
      el("span", task.status, {class: `state ${task.status}`, id: "task-status"}),
      el("span", ` workflow ${task.workflow} v${task.workflow_version}, ${task.steps.length} steps, created ` +
                 `${when(task.created_at)}${task.submitter ? " by " + task.submitter : ""}`),
      ...undoPlan(task.timeline).map(text => el("div", text, {class: "plan"})),
      ...[task.error, task.quarantine_reason && `quarantined: ${task.quarantine_reason}`,
          ...task.unattended.map(u => `${u.step}: ${u.reason}`)].filter(Boolean)
        .map(text => el("div", text, {class: "error"})));
    const bar = $("task-actions");  // redrawn when the task's state changes, not under the operator's pointer
    if (bar.dataset.drawn !== `${taskId} ${task.status}`) {
      bar.dataset.drawn = `${taskId} ${task.status}`;
      const actions = (ACTIONS[task.status] || []).map(action => [action, () => command(taskId, action)]);
      bar.replaceChildren(actions.length ? buttons(...actions) :
        el("span", `no operator action for a task ${task.status}`, {class: "muted"}));
    }
    drawTimeline(task.attempts);
    attemptTable.draw(task.attempts);
    setText("event-count", `(${task.timeline.length})`);
    const events = $("events");  // a task's events are only ever appended: redrawn when there are more
    if (events.dataset.task === taskId && events.children.length === task.timeline.length) return;
    events.dataset.task = taskId;
    $("events").replaceChildren(...task.timeline.map(e => {
      const item = el("li", null, {"data-sequence": e.sequence});
      const step = e.event.step ? ` ${e.event.step}` : "";
      const extra = e.event.error || e.event.reason || (e.event.steps ? `plan: ${e.event.steps.join(", ")}` : "");
      item.append(el("span", when(e.occurred_at), {class: "when"}), el("span", e.event_type, {class: "type"}),
                  el("span", `${step}${extra ? " — " + extra : ""}`));
      return item;
    }));
  } catch (err) {
    $("task-summary").replaceChildren(el("span", err.message, {class: "error"}));
    $("task-actions").replaceChildren();
    delete $("task-actions").dataset.drawn;
    $("task-timeline").replaceChildren();
    attemptTable.draw([]);
    $("events").replaceChildren();
  }
}

// ---- dependencies: what each agent process last reported (agents/reporting.py), the ones in trouble first -------

const rate = v => (v ? `${v.toFixed(v < 10 ? 2 : 0)}` : "0");
const dependencyTable = new Table("dependencies", [
  {name: "agent", value: d => d.agent},
  {name: "dependency", value: d => d.dependency, cls: () => "id"},
  {name: "breaker", value: d => d.breaker ?? "none", cls: d => `breaker ${d.breaker || ""}`},
  {name: "calls/s", value: d => rate(d.calls_per_s), cls: () => "n"},
  {name: "throttles/s", value: d => rate(d.throttles_per_s), cls: d => d.throttles_per_s ? "n warn" : "n"},
  {name: "failures/s", value: d => rate(d.failures_per_s), cls: d => d.failures_per_s ? "n bad" : "n"},
  {name: "refused/s", value: d => rate(d.refusals_per_s), cls: () => "n"},
  {name: "budget left", value: d => d.budget_remaining === null ? "none" : Math.floor(d.budget_remaining),
   cls: d => d.budget_remaining !== null && d.budget_remaining < 1 ? "n bad" : "n"},
  {name: "p50", value: d => seconds(d.latency_p50_ms === null ? null : Math.round(d.latency_p50_ms)), cls: () => "n"},
  {name: "p99", value: d => seconds(d.latency_p99_ms === null ? null : Math.round(d.latency_p99_ms)), cls: () => "n"},
  {name: "in use", value: d => `${d.in_use.toFixed(1)}${d.concurrency ? " / " + d.concurrency : ""}`, cls: () => "n"},
  {name: "process", value: d => d.instance, cls: () => "muted"},
  {name: "reported", value: d => `${d.age_s} s ago`, cls: () => "n"},
  {name: "trouble", value: d => d.trouble.join("; "), cls: () => "error"},
], d => `${d.agent}/${d.dependency}/${d.instance}`, null, d => (d.trouble.length ? "trouble" : ""));

function drawDependencies(data) {
  dependencyTable.draw(data.items);
  const troubled = data.items.filter(d => d.trouble.length);
  $("trouble").hidden = !troubled.length || current.view === "deps";
  setText("trouble-text", troubled.slice(0, 3).map(d => `${d.agent} → ${d.dependency}: ${d.trouble[0]}`).join("; ") +
          (troubled.length > 3 ? ` and ${troubled.length - 3} more` : ""));
  setText("deps-count", troubled.length ? `${troubled.length} in trouble` : "");
}

// ---- dead letters -------------------------------------------------------------------------------------------

const dlqState = {cursor: null, items: [], chosen: null};
const dlqTable = new Table("dlq", [
  {name: "entry", value: d => `${d.partition}:${d.dlq_offset}`, cls: () => "id"},
  {name: "dead at", value: d => when(d.dead_at)},
  {name: "origin", value: d => d.origin_topic ? `${d.origin_topic}[${d.origin_partition}]@${d.origin_offset}` : ""},
  {name: "kind", value: d => d.error_kind},
  {name: "reason", value: d => d.reason, cls: () => "error"},
  {name: "replayed", value: d => d.replayed_to ? `to ${d.replayed_to}` : "no"},
  {name: "discarded", value: d => d.discarded_at ? `discarded ${when(d.discarded_at)}` : "no"},
], d => `${d.partition}:${d.dlq_offset}`, d => inspect(d.partition, d.dlq_offset));

async function loadDlq(more) {
  const query = new URLSearchParams({limit: 50});
  if (more && dlqState.cursor) query.set("cursor", dlqState.cursor);
  try {
    const page = await get(`/api/dlq?${query}`);
    if (!more) dlqState.items = page.items;
    else dlqState.items = [...dlqState.items, ...page.items];
    if (!more || page.next_cursor) dlqState.cursor = page.next_cursor;
    dlqTable.draw(dlqState.items);
    $("dlq-more").hidden = !dlqState.cursor;
    return true;
  } catch (err) {
    failedTo(dlqTable)(err);
    return false;
  }
}

async function inspect(partition, offset) {
  $("dlq-detail").hidden = false;
  setText("dlq-entry", `${partition}:${offset}`);
  dlqState.chosen = [partition, offset];
  const fields = $("dlq-fields");
  const show = rows => {
    const body = el("tbody");
    for (const [name, value] of rows) {
      const tr = el("tr");
      tr.append(el("th", name), el("td", value, {class: name === "reason" ? "error" : ""}));
      body.append(tr);
    }
    return body;
  };
  try {
    const d = await get(`/api/dlq/${partition}/${offset}`);
    const origin = d.origin ? `${d.origin.topic}[${d.origin.partition}]@${d.origin.offset}` : "";
    fields.replaceChildren(show([["key", d.key], ["dead at", d.dead_at], ["origin", origin],
                                 ["consumer group", d.consumer_group], ["kind", d.error_kind],
                                 ["error class", d.error_class], ["reason", d.reason], ["size", `${d.size} bytes`]]));
    $("dlq-headers").replaceChildren(show(d.headers.map(h => [h.key, h.text ?? `hex ${h.hex}`])));
    $("dlq-value").textContent = JSON.stringify(d.value, null, 2);
  } catch (err) {
    fields.replaceChildren(show([["error", err.message]]));
    $("dlq-headers").replaceChildren();
    $("dlq-value").textContent = "";
  }
}

$("dlq-replay").addEventListener("click", async () => {
  const [partition, offset] = dlqState.chosen;
  if (!operatorToken()) return;
  if (!confirm(`Replay dead letter ${partition}:${offset} to its origin topic? Its consumer reads it again.`)) return;
  await post(`/api/dlq/${partition}/${offset}/replay`, null, `replay ${partition}:${offset}`);
  loadDlq(false);
});
$("dlq-discard").addEventListener("click", async () => {
  const [partition, offset] = dlqState.chosen;
  if (!operatorToken()) return;
  if (!confirm(`Discard dead letter ${partition}:${offset} for good? It can never be replayed afterwards, and the ` +
               "data key of a sealed submission is destroyed.")) return;
  await post(`/api/dlq/${partition}/${offset}/discard`, null, `discard ${partition}:${offset}`);
  loadDlq(false);
});
$("dlq-more").addEventListener("click", () => loadDlq(true));

// ---- wiring ----------------------------------------------------------------------------------------------------

for (const state of STATES) $("filters").elements.state.append(el("option", state, {value: state}));

$("filters").addEventListener("submit", event => {
  event.preventDefault();
  const form = new FormData(event.target);
  applyFilters(Object.fromEntries(FILTERS.map(f => [f, String(form.get(f) || "").trim()]).filter(([, v]) => v)));
});
$("clear-filters").addEventListener("click", () => applyFilters({}));
$("older").addEventListener("click", () => { current.page += 1; loadTasks(); });
$("newer").addEventListener("click", () => { current.page = Math.max(0, current.page - 1); loadTasks(); });
$("task-form").addEventListener("submit", event => {
  event.preventDefault();
  const taskId = $("task-id").value.trim();
  if (taskId) openTask(taskId);
});
$("back").addEventListener("click", event => {
  event.preventDefault();
  history.pushState(null, "", `${location.pathname}${location.search}`);
  current.task = null;
  showView();
});
for (const link of document.querySelectorAll("nav a, #trouble-link")) {
  link.addEventListener("click", event => {
    event.preventDefault();
    const query = new URLSearchParams(link.getAttribute("href").split("?")[1] || "");
    applyFilters(Object.fromEntries(query));
  });
}
window.addEventListener("popstate", () => { readLocation(); showView(); });
window.addEventListener("hashchange", () => { readLocation(); showView(); });

readLocation();
showView();
setTimeout(loop, REFRESH_S * 1000);
