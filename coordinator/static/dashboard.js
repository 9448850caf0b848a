// The coordinator's dashboard: lists refresh every few seconds; the selected job streams its view and
// its curve over server-sent events (GET /v1/jobs/{id}/events) and is drawn as SVG. Text always goes in
// through textContent: names and reasons come from users and nodes.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const REFRESH_MS = 3000;
const ACTIVE = new Set(["pending", "placing", "running", "recovering"]);
const EXAMPLE_SPEC = {
  name: "digits-cnn",
  model: {name: "cnn", config: {channels: [32, 64]}},
  dataset: {name: "digits", test_fraction: 0.2},
  training: {steps: 360, batch_size: 32, optimizer: {name: "Adam", kwargs: {lr: 0.002}}, eval_every: 60, seed: 0},
  averaging: {strategy: "ring", every: 50},
  placement: {clusters: 2, stages_per_cluster: 2, min_nodes: 4},
};

let nodesById = {};
let mayAct = false;  // a reader key sees everything and changes nothing: no buttons, no form
let selected = null;  // {id, source, view, points}

function el(tag, attrs = {}, text = "") {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== "") node.textContent = text;
  return node;
}

// #status answers what the person did (submit, cancel, resume) and stays until the next action;
// the periodic refresh writes only #updated, and clears #status only where it said the coordinator was gone
const UNREACHABLE = "cannot reach the coordinator";

function say(text, error = false) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.className = error ? "error" : "";
}

// the response and its JSON body; a refusal throws its reason
async function answered(path, options = {}) {
  const response = await fetch(path, {credentials: "same-origin", ...options});
  if (response.status === 401) { window.location = "/login"; throw new Error("log in first"); }
  const body = response.status === 204 ? null : await response.json();
  if (!response.ok) throw new Error(body && body.detail ? body.detail : `${response.status}`);
  return [response, body];
}

const api = async (path, options = {}) => (await answered(path, options))[1];

// a page of a list, and how many the whole list has (the X-Total-Count header)
async function apiPage(path) {
  const [response, body] = await answered(path);
  return [body, Number(response.headers.get("X-Total-Count") || body.length)];
}

// as coordinator/dashboard.py's shown_of: "(12)", or "(200 of 219 shown)" where the page is cut
const shownOf = (count, total) => (count >= total ? `(${count})`
  : `(${count.toLocaleString("en")} of ${total.toLocaleString("en")} shown)`);

const fixed = (value, digits) => (value === null || value === undefined ? "" : Number(value).toFixed(digits));
const ago = (seconds) => (seconds < 90 ? `${Math.round(seconds)} s ago` : `${Math.round(seconds / 60)} min ago`);

// --- lists -----------------------------------------------------------------------------------------

function fillTable(id, rows) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren(...rows);
}

function nodeRow(node) {
  const row = el("tr", {"data-node": node.id});
  const seen = Date.now() / 1000 - node.last_seen;
  const state = el("td", {class: `state-${node.state}`, title: `last heartbeat ${ago(seen)}`},
                   `${node.state} · ${ago(seen)}`);
  const place = node.cluster === null ? node.note : `cluster ${node.cluster} stage ${node.stage}`;
  // the figure the planner uses: its stages' measurements correct the profile's (coordinator/calibration.py)
  const flops = (node.measured_flops || node.profile.flops) / (node.slowdown || 1);
  const address = el("td", {title: node.reachability || "not dialled yet"},
                     node.reachable === false ? `${node.address} (unreachable)`
                       : node.relayed_by ? `${node.address} (relayed)` : node.address);
  const name = el("td", {}, node.name || node.id);
  if ((node.accused_by || []).length) {  // nodes that refused values it sent (failure_rules/accusations.py)
    const by = node.accused_by.map((id) => (nodesById[id] && nodesById[id].name) || id).join(", ");
    name.append(el("span", {class: "accused", title: `sent values that ${by} refused; two accusers convict it`},
                   ` · accused by ${node.accused_by.length}`));
  }
  row.append(name, address, state,
             el("td", {}, fixed(flops / 1e9, 1)), el("td", {}, fixed(node.profile.memory_bytes / 2 ** 30, 1)),
             el("td", {}, fixed(node.profile.bandwidth_bytes_per_s / 1e6, 1)),
             el("td", {}, String(Math.round(1e3 * node.profile.latency_s))), el("td", {}, node.job_id || ""),
             el("td", {}, place || ""));
  return row;
}

function jobRow(job) {
  const row = el("tr", {"data-job": job.id, class: selected && selected.id === job.id ? "selected" : ""});
  const link = el("a", {href: `#${job.id}`}, job.id);
  link.addEventListener("click", (event) => { event.preventDefault(); select(job.id); });
  const actions = el("td");
  const action = ACTIVE.has(job.state) ? "cancel" : (job.state === "failed" || job.state === "cancelled") ? "resume" : null;
  if (action && mayAct) {
    const button = el("button", {type: "button"}, action);
    button.addEventListener("click", () => act(job.id, action));
    actions.append(button);
  }
  const id = el("td");
  id.append(link);
  row.append(id, el("td", {}, job.name), el("td", {}, job.model), el("td", {class: `state-${job.state}`}, job.state),
             el("td", {}, job.reason), actions);
  return row;
}

async function refresh() {
  try {
    const search = document.getElementById("node-search").value.trim();
    const named = search ? `&name=${encodeURIComponent(search)}` : "";
    const [[nodes, nodeTotal], [jobs, jobTotal]] = await Promise.all([apiPage(`/v1/nodes?limit=200${named}`),
                                                                     apiPage("/v1/jobs?limit=200")]);
    nodesById = Object.fromEntries(nodes.map((node) => [node.id, node]));
    fillTable("nodes", nodes.map(nodeRow));
    fillTable("jobs", jobs.slice().reverse().map(jobRow));
    document.getElementById("node-count").textContent = shownOf(nodes.length, nodeTotal);
    document.getElementById("job-count").textContent = shownOf(jobs.length, jobTotal);
    if (!selected && jobs.length) {
      const running = jobs.filter((job) => ACTIVE.has(job.state));
      select((running.length ? running : jobs)[running.length ? 0 : jobs.length - 1].id);
    }
    document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    if (document.getElementById("status").textContent.startsWith(UNREACHABLE)) say("");
  } catch (error) {
    say(`${UNREACHABLE}: ${error.message}`, true);
  }
}

async function act(jobId, action) {
  if (action === "cancel" && !window.confirm(`Cancel job ${jobId}? Its nodes stop; it can be resumed later.`)) return;
  try {
    await api(`/v1/jobs/${jobId}/${action}`, {method: "POST"});
    say(`${action}: job ${jobId}`);
    if (action === "resume") select(jobId);
    refresh();
  } catch (error) {
    say(`${action} refused: ${error.message}`, true);
  }
}

async function submit() {
  let spec;
  try {
    spec = JSON.parse(document.getElementById("spec").value);
  } catch (error) {
    say(`the spec is not JSON: ${error.message}`, true);
    return;
  }
  try {
    const created = await api("/v1/jobs", {method: "POST", headers: {"Content-Type": "application/json"},
                                           body: JSON.stringify(spec)});
    say(`submitted job ${created.id}: ${created.state}`);
    select(created.id);
    refresh();
  } catch (error) {
    say(`submit refused: ${error.message}`, true);
  }
}

// --- the selected job ------------------------------------------------------------------------------

function select(jobId) {
  if (selected && selected.id === jobId) return;
  if (selected) selected.source.close();
  const source = new EventSource(`/v1/jobs/${jobId}/events`);
  selected = {id: jobId, source, view: null, points: []};
  source.addEventListener("job", (event) => { selected.view = JSON.parse(event.data); drawJob(); });
  source.addEventListener("curve", (event) => { selected.points.push(...JSON.parse(event.data)); drawCharts(); });
  source.onerror = () => {
    if (selected && selected.view && !ACTIVE.has(selected.view.state)) source.close();  // the stream ended
  };
  document.querySelectorAll("#jobs tr").forEach((row) => row.classList.toggle("selected", row.dataset.job === jobId));
  document.getElementById("job").hidden = false;
}

function drawJob() {
  const job = selected.view;
  const m = job.metrics;
  document.getElementById("job-title").textContent = `Job ${job.name || job.id} (${job.model})`;
  const stateLine = document.getElementById("job-state");
  stateLine.textContent = `${job.state}${job.reason ? `: ${job.reason}` : ""}` +
                          (job.generation ? ` · generation ${job.generation}` : "");
  stateLine.className = `state-${job.state}`;
  document.getElementById("job-progress").style.width = `${Math.round(100 * job.progress.fraction)}%`;
  const figures = [`${Math.round(100 * job.progress.fraction)}% of ${job.progress.steps_total} steps`];
  for (const [key, label, digits] of [["loss", "loss", 4], ["test_accuracy", "test accuracy", 4],
                                       ["samples_per_s", "samples/s", 0], ["tokens_per_s", "tokens/s", 0],
                                       ["mfu", "MFU", 3], ["utilization", "utilization", 2],
                                       ["staleness", "staleness", 2], ["averaging_round_s", "averaging round s", 3]]) {
    if (m[key] !== null && m[key] !== undefined) figures.push(`${label} ${fixed(m[key], digits)}`);
  }
  if (isLanguageModel(job) && m.test_loss !== null && m.test_loss !== undefined) {
    figures.push(`held-out perplexity ${fixed(Math.exp(m.test_loss), 2)}`);
  }
  document.getElementById("perplexity").hidden = !isLanguageModel(job);
  document.getElementById("job-figures").textContent = figures.join(" · ");
  // each re-plan: what was lost, and how long training stood still (intact clusters train on meanwhile)
  document.getElementById("job-recoveries").replaceChildren(...job.recoveries.map((r) => el("li", {},
    `${r.kind}: ${r.reason}` +
    (r.kept_training.length ? ` · clusters ${r.kept_training.join(", ")} trained on (${r.steps_trained_on || 0} steps)` : "") +
    (r.resume_step !== null ? ` · continued from step ${r.resume_step}` : "") +
    (r.recovery_s !== null ? ` · training again after ${fixed(r.recovery_s, 1)} s` : ""))));
  drawPipelines(job);
}

function drawPipelines(job) {
  const svg = document.getElementById("pipelines");
  svg.replaceChildren();
  if (!job.plan) {
    svg.setAttribute("height", 30);
    svg.append(el("svg:text", {x: 4, y: 20}, "not placed yet"));
    return;
  }
  const boxW = 200, boxH = 91, gapX = 100, gapY = 34, left = 84;
  const stageFigures = {};
  for (const s of job.metrics.stages) stageFigures[`${s.cluster}/${s.stage}`] = s;
  const centre = {};
  job.plan.clusters.forEach((cluster, row) => {
    const y = 8 + row * (boxH + gapY);
    svg.append(el("svg:text", {x: 0, y: y + boxH / 2 + 4, "font-weight": "bold"}, `cluster ${cluster.cluster}`));
    cluster.stages.forEach((stage, column) => {
      const x = left + column * (boxW + gapX);
      centre[`${cluster.cluster}/${stage.stage}`] = [x + boxW / 2, y, y + boxH];
      const figures = stageFigures[`${cluster.cluster}/${stage.stage}`];
      const utilization = figures && figures.utilization !== null ? figures.utilization : 0;
      const node = nodesById[stage.node_id];
      const group = el("svg:g", {class: "stage", "data-cluster": cluster.cluster, "data-stage": stage.stage});
      group.append(el("svg:rect", {x, y, width: boxW, height: boxH, rx: 6, fill: "#eef4ff", stroke: "#3b7ddd"}),
                   el("svg:rect", {x, y: y + boxH - 6, width: boxW * Math.min(1, utilization), height: 6,
                                   fill: "#3b7ddd"}),
                   el("svg:text", {x: x + 8, y: y + 16, "font-weight": "bold"},
                      `stage ${stage.stage} · blocks [${stage.blocks[0]}, ${stage.blocks[1]})`),
                   el("svg:text", {x: x + 8, y: y + 31}, node ? (node.name || node.id) : stage.node_id),
                   el("svg:text", {x: x + 8, y: y + 46},
                      figures ? `step ${figures.step} · ${fixed(figures.metrics.samples_per_s, 0)} samples/s`
                              : "starting"),
                   // computing vs waiting for a neighbour, and how many steps old its weights are
                   el("svg:text", {x: x + 8, y: y + 61, class: "utilization"},
                      figures ? `utilization ${fixed(utilization, 2)} · bubble ${fixed(figures.bubble, 2)}` : ""),
                   el("svg:text", {x: x + 8, y: y + 76, class: "staleness"},
                      figures ? `staleness ${fixed(figures.staleness, 2)} steps` : ""));
      svg.append(group);
      if (column > 0) {
        const x0 = x - gapX;
        svg.append(el("svg:line", {x1: x0, y1: y + boxH / 2, x2: x - 4, y2: y + boxH / 2, stroke: "#5b6475",
                                   "marker-end": "url(#arrow)"}));
        // the link: its codec, and the share of time the stage before it had activations waiting to cross
        const before = cluster.stages[column - 1];
        const sent = stageFigures[`${cluster.cluster}/${before.stage}`];
        const busy = sent && sent.metrics.next_link_busy !== undefined ? sent.metrics.next_link_busy : null;
        const link = el("svg:g", {class: "link", "data-cluster": cluster.cluster, "data-stage": before.stage});
        // and what the plan priced it at: its bandwidth and the round trip its micro-batches in flight cover
        const priced = before.link_bandwidth_bytes_per_s == null ? ""
          : `${fixed(before.link_bandwidth_bytes_per_s / 1e6, 1)} MB/s · ${Math.round(1e3 * before.round_trip_seconds)} ms`;
        link.append(el("svg:text", {x: x0 + 2, y: y + boxH / 2 - 20, "font-size": 10, class: "priced"}, priced),
                    el("svg:text", {x: x0 + 2, y: y + boxH / 2 - 6, "font-size": 10}, before.codec || "fp32"),
                    el("svg:text", {x: x0 + 2, y: y + boxH / 2 + 14, "font-size": 10, class: "busy"},
                       busy === null ? "" : `${Math.round(100 * busy)}% busy`));
        svg.append(link);
      }
    });
  });
  for (const ring of job.plan.rings) {
    const ends = ring.stages.map((stage, cluster) => centre[`${cluster}/${stage}`]).filter(Boolean);
    for (let i = 1; i < ends.length; i++) {
      svg.append(el("svg:line", {x1: ends[i - 1][0], y1: ends[i - 1][2], x2: ends[i][0], y2: ends[i][1],
                                 stroke: "#a15c00", "stroke-dasharray": "4 3", class: "ring"}));
    }
  }
  const defs = el("svg:defs");
  const marker = el("svg:marker", {id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7,
                                    markerHeight: 7, orient: "auto"});
  marker.append(el("svg:path", {d: "M0,0 L10,5 L0,10 z", fill: "#5b6475"}));
  defs.append(marker);
  svg.prepend(defs);
  const columns = Math.max(...job.plan.clusters.map((cluster) => cluster.stages.length));
  svg.setAttribute("height", 16 + job.plan.clusters.length * (boxH + gapY));
  svg.setAttribute("viewBox", `0 0 ${left + columns * (boxW + gapX)} ${16 + job.plan.clusters.length * (boxH + gapY)}`);
}

const COLOURS = ["#3b7ddd", "#d1495b", "#17803d", "#a15c00", "#6f42c1", "#00798c"];

function isLanguageModel(job) {
  return ["text", "tokens"].includes(job.spec.dataset.name);  // (a dataset of token sequences)
}

function drawChart(id, key, shown = (v) => v) {
  const svg = document.getElementById(id);
  svg.replaceChildren();
  const W = 420, H = 220, pad = {l: 46, r: 10, t: 10, b: 24};
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const points = selected.points.filter((p) => p[key] !== null && p[key] !== undefined);
  if (!points.length) {
    svg.append(el("svg:text", {x: pad.l, y: H / 2}, "no points yet"));
    return;
  }
  const steps = points.map((p) => p.step), values = points.map((p) => shown(p[key]));
  const x0 = Math.min(...steps), x1 = Math.max(...steps, x0 + 1);
  let y0 = Math.min(...values), y1 = Math.max(...values);
  if (y1 - y0 < 1e-9) { y0 -= 0.5; y1 += 0.5; }
  const sx = (s) => pad.l + (s - x0) / (x1 - x0) * (W - pad.l - pad.r);
  const sy = (v) => H - pad.b - (v - y0) / (y1 - y0) * (H - pad.t - pad.b);
  svg.append(el("svg:line", {x1: pad.l, y1: H - pad.b, x2: W - pad.r, y2: H - pad.b, stroke: "#999"}),
             el("svg:line", {x1: pad.l, y1: pad.t, x2: pad.l, y2: H - pad.b, stroke: "#999"}),
             el("svg:text", {x: 2, y: pad.t + 8}, fixed(y1, 3)), el("svg:text", {x: 2, y: H - pad.b}, fixed(y0, 3)),
             el("svg:text", {x: pad.l, y: H - 6}, `step ${x0}`),
             el("svg:text", {x: W - pad.r, y: H - 6, "text-anchor": "end"}, `step ${x1}`));
  const clusters = [...new Set(points.map((p) => p.cluster))].sort((a, b) => a - b);
  for (const cluster of clusters) {
    const mine = points.filter((p) => p.cluster === cluster);
    const colour = COLOURS[cluster % COLOURS.length];
    svg.append(el("svg:polyline", {fill: "none", stroke: colour, "stroke-width": 1.5, class: "series",
                                   "data-cluster": cluster, "data-points": mine.length,
                                   points: mine.map((p) => `${sx(p.step).toFixed(1)},${sy(shown(p[key])).toFixed(1)}`).join(" ")}));
    if (mine.length === 1) svg.append(el("svg:circle", {cx: sx(mine[0].step), cy: sy(shown(mine[0][key])), r: 3, fill: colour}));
  }
}

function drawCharts() {
  drawChart("loss-chart", "loss");
  drawChart("accuracy-chart", "test_accuracy");
  if (selected.view && isLanguageModel(selected.view)) drawChart("perplexity-chart", "test_loss", Math.exp);
}

async function identify() {
  try {
    const me = await api("/v1/whoami");
    mayAct = me.may_submit;
    document.getElementById("who").textContent = `signed in as ${me.role} (${me.name || me.id})`;
    document.getElementById("submit").hidden = !mayAct;
  } catch (error) {
    say(`${UNREACHABLE}: ${error.message}`, true);
  }
}

document.getElementById("spec").value = JSON.stringify(EXAMPLE_SPEC, null, 2);
document.getElementById("submit-button").addEventListener("click", submit);
document.getElementById("node-search").addEventListener("input", refresh);
if (window.location.hash.length > 1) select(window.location.hash.slice(1));
identify().then(refresh);
setInterval(refresh, REFRESH_MS);
