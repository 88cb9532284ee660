// The stepstream dashboard: reads the JSON API of the process that served this page and redraws
// itself every few seconds (?refresh=SECONDS, default 3). No build step, no dependencies.
"use strict";

// The task states, in the order the tiles show them: the server writes them into the page (one list, in
// schemas/states.py), so a state added there gets its tile without a change here.
const STATES = JSON.parse(document.body.dataset.taskStates);
const REFRESH_S = Number(new URLSearchParams(location.search).get("refresh")) || 3;

async function get(path) {
  const response = await fetch(path, {headers: {accept: "application/json"}});
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function el(tag, text, attrs = {}) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function when(ms) {
  return ms ? new Date(ms).toISOString().replace("T", " ").slice(0, 23) : "";
}

function seconds(ms) {
  return ms === null || ms === undefined ? "" : `${(ms / 1000).toFixed(1)} s`;
}

function fill(tableId, rows, columns, onClick) {
  const body = document.querySelector(`#${tableId} tbody`);
  body.replaceChildren();
  if (!rows.length) {
    const width = document.querySelectorAll(`#${tableId} thead th`).length || 2;
    const tr = el("tr", null);  // Element.append returns undefined: build the row, then add it
    tr.append(el("td", "none", {colspan: width, class: "empty"}));
    body.append(tr);
    return;
  }
  for (const row of rows) {
    const tr = el("tr", null, onClick ? {class: "clickable"} : {});
    for (const column of columns) {
      const [value, cls] = column(row);  // a value is text, or a node (the row's buttons)
      const td = el("td", value instanceof Node ? null : value, cls ? {class: cls} : {});
      if (value instanceof Node) td.append(value);
      tr.append(td);
    }
    if (onClick) tr.addEventListener("click", () => onClick(row));
    body.append(tr);
  }
}

function drawCounts(counts) {
  const tiles = document.getElementById("counts");
  tiles.replaceChildren();
  for (const state of STATES) {
    const tile = el("div", null, {class: `tile ${state}`});
    tile.append(el("div", counts.tasks[state] || 0, {class: "n", "data-count": state}), el("div", state));
    tiles.append(tile);
  }
  document.getElementById("total").textContent = `${counts.total} in all`;
  const outcomes = [
    ["tasks compensated", counts.tasks.compensated], ["tasks compensation failed", counts.tasks.compensation_failed],
    ["tasks compensating", counts.tasks.compensating], ["steps compensated", counts.steps.compensated],
    ["steps compensation failed", counts.steps.compensation_failed],
    ["steps compensation skipped", counts.steps.compensation_skipped],
  ];
  fill("compensation", outcomes, [r => [r[0]], r => [r[1] || 0, "n"]]);
}

function drawDlq(summary) {
  document.getElementById("dlq-depth").textContent = summary.depth;
  fill("dlq-kinds", Object.entries(summary.by_kind), [r => [r[0]], r => [r[1]]]);
}

function drawThroughput(data) {
  const svg = document.getElementById("throughput");
  svg.replaceChildren();
  const peak = Math.max(1, ...data.series.map(p => p.events));
  const width = 300 / data.series.length;
  data.series.forEach((point, i) => {
    const height = 58 * point.events / peak;
    const bar = document.createElementNS("http://www.w3.org/2000/svg", "rect");
    for (const [k, v] of Object.entries({x: i * width, y: 60 - height, width: Math.max(width - 0.5, 0.5), height})) {
      bar.setAttribute(k, v);
    }
    bar.append(document.createElementNS("http://www.w3.org/2000/svg", "title"));
    bar.firstChild.textContent = `${when(point.minute)}: ${point.events}`;
    svg.append(bar);
  });
  document.getElementById("throughput-total").textContent = data.total;
}

async function showTimeline(taskId) {
  document.getElementById("timeline-task").value = taskId;
  history.replaceState(null, "", `#task=${encodeURIComponent(taskId)}`);
  const list = document.getElementById("timeline");
  const summary = document.getElementById("timeline-summary");
  try {
    const task = await get(`/api/tasks/${encodeURIComponent(taskId)}`);
    summary.textContent = `${task.task_id}: ${task.status} (workflow ${task.workflow} v${task.workflow_version}, ` +
      `${task.steps.length} steps${task.error ? ", " + task.error : ""}` +
      `${task.quarantine_reason ? ", quarantined: " + task.quarantine_reason : ""})` +
      task.unattended.map(u => `; ${u.step}: ${u.reason}`).join("");
    list.replaceChildren(...task.timeline.map(e => {
      const item = el("li", null, {"data-sequence": e.sequence});
      const detail = e.event.step ? ` ${e.event.step}` : "";
      const waited = e.event.waited_ms === undefined ? "" : `waited ${seconds(e.event.waited_ms)} for an agent`;
      const extra = e.event.error || e.event.reason || waited;
      item.append(el("span", when(e.occurred_at), {class: "when"}), el("span", e.event_type, {class: "type"}),
                  el("span", `${detail}${extra ? " — " + extra : ""}`));
      return item;
    }));
  } catch (err) {
    summary.textContent = String(err.message);
    list.replaceChildren();
  }
}

// An operator command through the API's write side, under the token typed in the header; the API answers
// with the scheduler's decision (or 202 while it has not decided), shown under the waiting steps.
async function command(taskId, action, step) {
  const answer = document.getElementById("command-answer");
  const token = document.getElementById("operator-token").value.trim();
  if (!token) {
    answer.textContent = "enter an operator token (one of STEPSTREAM_API_TOKENS) to act on tasks";
    return;
  }
  if (action === "cancel" && !confirm(`Cancel task ${taskId}, undoing every step it may have applied?`)) return;
  answer.textContent = `${action} ${taskId}: sending…`;
  try {
    const response = await fetch(`/api/tasks/${encodeURIComponent(taskId)}/commands`, {
      method: "POST", body: JSON.stringify(step ? {action, step} : {action}),
      headers: {"content-type": "application/json", accept: "application/json", authorization: `Bearer ${token}`},
    });
    const body = await response.json();
    answer.textContent = [`${action} ${taskId}: HTTP ${response.status}`, body.outcome, body.detail]
      .filter(Boolean).join(" ");
  } catch (err) {
    answer.textContent = `${action} ${taskId}: ${err.message}`;
  }
}

function actions(...buttons) {
  const span = el("span", null, {class: "actions"});
  for (const [label, onClick] of buttons) {
    const button = el("button", label, {type: "button"});
    button.addEventListener("click", event => {
      event.stopPropagation();  // the row's own click opens the timeline
      onClick();
    });
    span.append(button);
  }
  return span;
}

async function refresh() {
  try {
    const [health, counts, stuck, failed, alerts, dlq, tasks, throughput, queued, waiting] = await Promise.all([
      get("/api/health"), get("/api/counts"), get("/api/steps/stuck?limit=20"), get("/api/steps/failed?limit=20"),
      get("/api/alerts?limit=20"), get("/api/dlq/summary"), get("/api/tasks?limit=20"), get("/api/throughput?minutes=60"),
      get("/api/steps/queued?limit=20"), get("/api/steps/waiting?limit=20"),
    ]);
    document.getElementById("store").textContent = health.store;
    drawCounts(counts);
    drawDlq(dlq);
    drawThroughput(throughput);
    const pick = row => showTimeline(row.task_id);
    fill("stuck", stuck.items, [r => [r.task_id], r => [r.step], r => [r.status], r => [r.attempt],
                                r => [when(r.complete_by)]], pick);
    fill("queued", queued.items, [r => [r.task_id], r => [r.step], r => [r.status], r => [r.attempt],
                                  r => [seconds(r.waiting_ms), "n"], r => [when(r.start_by)]], pick);
    const waits = queued.waits;
    document.getElementById("queue-waits").textContent = waits.accepted ?
      `${waits.accepted} steps, waited ${seconds(waits.mean_ms)} on average, ${seconds(waits.max_ms)} at most` : "none";
    fill("waiting", waiting.items, [r => [r.task_id], r => [r.step], r => [r.attempt], r => [when(r.retry_at)],
                                    r => [r.wait_reason, "error"],
                                    r => [actions(["try now", () => command(r.task_id, "try-now", r.step)],
                                                  ["cancel", () => command(r.task_id, "cancel")])]], pick);
    fill("failed", failed.items, [r => [r.task_id], r => [r.step], r => [r.status], r => [r.failure_count],
                                  r => [r.error, "error"], r => [when(r.updated_at)]], pick);
    fill("alerts", alerts.items, [r => [when(r.occurred_at)], r => [r.task_id], r => [r.step], r => [r.reason]], pick);
    fill("tasks", tasks.items, [r => [r.task_id], r => [r.workflow], r => [r.status], r => [r.current_step],
                                r => [r.failure_count], r => [when(r.created_at)]], pick);
    try {
      const agents = await get("/api/agents");
      const missing = agents.items.filter(a => a.members === 0).map(a => a.reason);
      document.getElementById("agents").textContent = missing.length ? missing.join("; ") :
        `every agent has a process running (${agents.items.length})`;
    } catch (err) {
      document.getElementById("agents").textContent = err.message;
    }
    try {
      const lag = await get("/api/lag");
      fill("lag", [...lag.projection, ...lag.groups], [r => [r.group], r => [r.topic], r => [r.partition],
                                                       r => [r.position], r => [r.end], r => [r.lag]]);
    } catch (err) {
      fill("lag", [{message: err.message}], [r => [r.message, "error"]]);
    }
    document.getElementById("refreshed").textContent = `refreshed ${new Date().toLocaleTimeString()}`;
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
  } catch (err) {
    document.getElementById("refreshed").textContent = `refresh failed: ${err.message}`;
  }
}

document.getElementById("timeline-form").addEventListener("submit", event => {
  event.preventDefault();
  const taskId = document.getElementById("timeline-task").value.trim();
  if (taskId) showTimeline(taskId);
});

const chosen = new URLSearchParams(location.hash.slice(1)).get("task");
if (chosen) showTimeline(chosen);
refresh();
setInterval(refresh, REFRESH_S * 1000);
